"""laplace_jax.platform: the per-platform PRNG choice."""

import jax
import pytest

from laplace_jax import platform


def test_prng_impl_auto_follows_the_platform():
  assert platform.prng_impl("auto") == ("rbg" if jax.default_backend() == "neuron" else "threefry")
  with platform.lowering_for("neuron"):
    assert platform.prng_impl() == "rbg"
  with platform.lowering_for("cpu"):
    assert platform.prng_impl() == "threefry"
  for impl in platform.PRNG_IMPLS:
    with platform.lowering_for("neuron"):
      assert platform.prng_impl(impl) == impl
  with pytest.raises(ValueError, match="threefry2x32"):
    platform.prng_impl("threefry2x32")


def test_use_prng_sets_the_default_for_new_keys():
  before = jax.config.jax_default_prng_impl
  try:
    assert platform.use_prng("rbg") == "rbg" == platform.current_prng()
    assert jax.random.key_data(jax.random.key(0)).shape == (4,)  # an rbg key: 4 words, threefry's 2
    with platform.lowering_for("neuron"):
      assert platform.use_prng("auto") == "rbg"
    assert platform.use_prng("threefry") == "threefry" == platform.current_prng()
    assert jax.random.key_data(jax.random.key(0)).shape == (2,)
  finally:
    jax.config.update("jax_default_prng_impl", before)
