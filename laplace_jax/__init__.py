"""laplace-jax: the Laplace simple-GLA language model in JAX/Flax."""
from laplace_jax.config import LaplaceConfig, get_config, PRESETS  # noqa: F401

__version__ = "0.1.0"
