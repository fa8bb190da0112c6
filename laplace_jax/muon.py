"""Deprecated alias of laplace_jax.training.muon (the module moved when the library was split into tiers); import
laplace_jax.training.muon instead. Kept so that code written against the old path keeps working."""

import warnings

from laplace_jax.training.muon import *  # noqa: F403

warnings.warn(
  "laplace_jax.muon moved to laplace_jax.training.muon; import it from there",
  DeprecationWarning,
  stacklevel=2,
)
