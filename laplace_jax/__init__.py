"""laplace-jax: the Laplace simple-GLA language model in JAX/Flax."""

from laplace_jax.config import PRESETS, LaplaceConfig, get_config  # noqa: F401

__version__ = "0.1.0"
