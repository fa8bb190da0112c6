"""chunk_simple_gla against the token-by-token reference, in fla's conventions."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from laplace_jax.model.config import LaplaceConfig, log_decays
from laplace_jax.ops import gla

# The real schedule: 16 heads with half-lives 1 … 2,048 tokens (λ from 0.5 to ≈0.99966).
G_REAL = jnp.asarray(log_decays(LaplaceConfig()))

# Compiled, as the model runs them: one program per test's shapes instead of one per operation run eagerly.
# (test_bad_input_errors calls gla.chunk_simple_gla eagerly: its value checks need concrete inputs.)
chunked_gla = jax.jit(gla.chunk_simple_gla, static_argnames=("scale", "chunk_size", "unroll", "form"))
naive_gla = jax.jit(gla.naive_recurrent_simple_gla, static_argnames="scale")


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4, 6))
def _inputs(B, T, H, K, V, seed=0, dtype=jnp.float32):
  ks = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(ks[0], (B, T, H, K), dtype)
  k = jax.random.normal(ks[1], (B, T, H, K), dtype)
  v = jax.random.normal(ks[2], (B, T, H, V), dtype)
  s0 = jax.random.normal(ks[3], (B, H, K, V), jnp.float32)
  return q, k, v, s0


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.parametrize("T", [256, 200, 1, 130])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("form", ["parallel", "scan"])
def test_chunked_matches_reference_fp32(T, with_state, form):
  q, k, v, s0 = _inputs(2, T, 16, 8, 12)
  s0 = s0 if with_state else None
  o, s = chunked_gla(q, k, v, G_REAL, initial_state=s0, chunk_size=128, form=form)
  o_ref, s_ref = naive_gla(q, k, v, G_REAL, initial_state=s0)
  assert o.shape == o_ref.shape and s.dtype == jnp.float32
  assert _rel(o, o_ref) <= 1e-5
  assert _rel(s, s_ref) <= 1e-5


@pytest.mark.parametrize("T, form", [(256, "parallel"), (77, "parallel"), (200, "scan")])
def test_chunked_gradients_match_reference(T, form):
  q, k, v, s0 = _inputs(1, T, 16, 8, 12, seed=1)
  w_o = jax.random.normal(jax.random.key(9), (1, T, 16, 12))
  w_s = jax.random.normal(jax.random.key(8), s0.shape)

  def loss(fn, q, k, v, s0):
    o, s = fn(q, k, v, G_REAL, initial_state=s0)
    return jnp.sum(o * w_o) + jnp.sum(s * w_s)

  chunked = lambda *a, **kw: chunked_gla(*a, chunk_size=64, form=form, **kw)
  g = jax.jit(jax.grad(lambda *a: loss(chunked, *a), argnums=(0, 1, 2, 3)))(q, k, v, s0)
  g_ref = jax.jit(jax.grad(lambda *a: loss(naive_gla, *a), argnums=(0, 1, 2, 3)))(q, k, v, s0)
  for name, a, b in zip("q k v s0".split(), g, g_ref):
    assert _rel(a, b) <= 1e-5, name


def test_unrolled_equals_scanned_and_chunk_size_is_invisible():
  q, k, v, s0 = _inputs(1, 300, 4, 8, 8, seed=2)
  g = G_REAL[::4]
  o1, s1 = chunked_gla(q, k, v, g, initial_state=s0, chunk_size=128)
  o2, s2 = chunked_gla(q, k, v, g, initial_state=s0, chunk_size=128, unroll=True)
  o3, s3 = chunked_gla(q, k, v, g, initial_state=s0, chunk_size=32)
  np.testing.assert_allclose(o1, o2, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(s1, s2, rtol=1e-6, atol=1e-6)
  assert _rel(o1, o3) <= 1e-5 and _rel(s1, s3) <= 1e-5


def test_split_sequence_with_state_equals_one_pass():
  """A known fla pitfall: two calls passing the state must equal one call."""
  q, k, v, _ = _inputs(2, 384, 16, 8, 12, seed=3)
  o, s = chunked_gla(q, k, v, G_REAL)
  oa, sa = chunked_gla(q[:, :100], k[:, :100], v[:, :100], G_REAL)
  ob, sb = chunked_gla(q[:, 100:], k[:, 100:], v[:, 100:], G_REAL, initial_state=sa)
  assert _rel(jnp.concatenate([oa, ob], 1), o) <= 1e-5 and _rel(sb, s) <= 1e-5


@pytest.mark.parametrize("form", ["parallel", "scan"])
def test_mask_skips_positions_exactly(form):
  """Masked positions neither decay nor feed the state: a right-padded batch row == its prefix alone."""
  q, k, v, s0 = _inputs(2, 128, 16, 8, 12, seed=4)
  n = 37
  mask = jnp.arange(128)[None, :] < jnp.array([[n], [128]])
  o, s = chunked_gla(q, k, v, G_REAL, initial_state=s0, mask=mask, form=form)
  o_ref, s_ref = naive_gla(q[:1, :n], k[:1, :n], v[:1, :n], G_REAL, initial_state=s0[:1])
  assert _rel(o[0, :n], o_ref[0]) <= 1e-5 and _rel(s[0], s_ref[0]) <= 1e-5
  o_full, s_full = naive_gla(q[1:], k[1:], v[1:], G_REAL, initial_state=s0[1:])
  assert _rel(s[1], s_full[0]) <= 1e-5


def test_bf16_inputs_within_tolerance():
  """bf16 q/k/v: internals run in fp32, so the error is the inputs' rounding (documented: rel ≤ 1e-2)."""
  q, k, v, s0 = _inputs(1, 256, 16, 16, 16, seed=5)
  qb, kb, vb = (x.astype(jnp.bfloat16) for x in (q, k, v))
  o, s = chunked_gla(qb, kb, vb, G_REAL, initial_state=s0)
  o_ref, s_ref = naive_gla(q, k, v, G_REAL, initial_state=s0)
  assert o.dtype == jnp.bfloat16 and s.dtype == jnp.float32
  assert _rel(o, o_ref) <= 1e-2 and _rel(s, s_ref) <= 1e-2


def test_long_sequence_stays_finite_and_matches():
  """Strong decays (λ=0.5) over many chunks underflow, never overflow (no division by cumulative decay)."""
  q, k, v, _ = _inputs(1, 1024, 16, 4, 4, seed=6)
  o, s = chunked_gla(q, k, v, G_REAL)
  o_ref, s_ref = naive_gla(q, k, v, G_REAL)
  assert np.isfinite(np.asarray(o)).all()
  assert _rel(o, o_ref) <= 1e-5 and _rel(s, s_ref) <= 1e-5


def test_scale_multiplies_q():
  q, k, v, _ = _inputs(1, 64, 2, 8, 8, seed=7)
  g = jnp.array([-0.1, -0.01])
  o1, _ = chunked_gla(q, k, v, g, scale=0.5)
  o2, _ = chunked_gla(q * 0.5, k, v, g, scale=1.0)
  np.testing.assert_allclose(o1, o2, rtol=1e-5, atol=1e-6)


def test_bad_input_errors():
  q, k, v, s0 = _inputs(1, 16, 2, 4, 4)
  g = jnp.array([-0.1, -0.2])
  with pytest.raises(ValueError, match="rank 4"):
    gla.chunk_simple_gla(q[0], k, v, g)
  with pytest.raises(ValueError, match="positive"):
    gla.chunk_simple_gla(q, k, v, jnp.array([0.1, -0.2]))
  with pytest.raises(ValueError, match=r"g_gamma has shape"):
    gla.chunk_simple_gla(q, k, v, jnp.array([-0.1]))
  with pytest.raises(ValueError, match="floating"):
    gla.chunk_simple_gla(q.astype(jnp.int32), k, v, g)
  with pytest.raises(ValueError, match="initial_state"):
    gla.chunk_simple_gla(q, k, v, g, initial_state=s0[:, :1])
  with pytest.raises(ValueError, match="k has shape"):
    gla.chunk_simple_gla(q, k[:, :8], v, g)
  with pytest.raises(ValueError, match="form"):
    gla.chunk_simple_gla(q, k, v, g, form="fused")
