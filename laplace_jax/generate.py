"""Deprecated alias of laplace_jax.inference.generate (the module moved when the library was split into tiers); import
laplace_jax.inference.generate instead. Kept so that code written against the old path keeps working."""

import warnings

from laplace_jax.inference.generate import *  # noqa: F403

warnings.warn(
  "laplace_jax.generate moved to laplace_jax.inference.generate; import it from there",
  DeprecationWarning,
  stacklevel=2,
)
