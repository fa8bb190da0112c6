"""Deprecated alias of laplace_jax.data.tokenizer (the module moved when the library was split into tiers); import
laplace_jax.data.tokenizer instead. Kept so that code written against the old path keeps working."""

import warnings

from laplace_jax.data.tokenizer import *  # noqa: F403

warnings.warn(
  "laplace_jax.tokenizer moved to laplace_jax.data.tokenizer; import it from there",
  DeprecationWarning,
  stacklevel=2,
)
