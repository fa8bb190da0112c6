"""Deprecated alias of laplace_jax.ops.gla (the module moved when the library was split into tiers); import
laplace_jax.ops.gla instead. Kept so that code written against the old path keeps working."""

import warnings

from laplace_jax.ops.gla import *  # noqa: F403

warnings.warn(
  "laplace_jax.gla moved to laplace_jax.ops.gla; import it from there", DeprecationWarning, stacklevel=2
)
