"""Deprecated alias of laplace_jax.training.checkpoint (the module moved when the library was split into tiers); import
laplace_jax.training.checkpoint instead. Kept so that code written against the old path keeps working."""

import warnings

from laplace_jax.training.checkpoint import *  # noqa: F403

warnings.warn(
  "laplace_jax.checkpoint moved to laplace_jax.training.checkpoint; import it from there",
  DeprecationWarning,
  stacklevel=2,
)
