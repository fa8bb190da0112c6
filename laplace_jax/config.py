"""Deprecated alias of laplace_jax.model.config (the module moved when the library was split into tiers); import
laplace_jax.model.config instead. Kept so that code written against the old path keeps working."""

import warnings

from laplace_jax.model.config import *  # noqa: F403

warnings.warn(
  "laplace_jax.config moved to laplace_jax.model.config; import it from there",
  DeprecationWarning,
  stacklevel=2,
)
