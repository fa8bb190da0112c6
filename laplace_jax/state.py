"""Deprecated alias of laplace_jax.model.state (the module moved when the library was split into tiers); import
laplace_jax.model.state instead. Kept so that code written against the old path keeps working."""

import warnings

from laplace_jax.model.state import *  # noqa: F403

warnings.warn(
  "laplace_jax.state moved to laplace_jax.model.state; import it from there", DeprecationWarning, stacklevel=2
)
