"""Sliding-window attention (mixer 'S') against a naive [T, T]-masked softmax written here in numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.decode_traffic import assert_matmul_form_on_neuron_reduces_elsewhere, passes_over_tables

from laplace_jax import platform
from laplace_jax.ops import window_attention as wa

# Compiled, as the model runs it: one program per test's shapes instead of one per operation run eagerly.
window_attention = jax.jit(wa.window_attention, static_argnums=3)
ring_chunk_attention = jax.jit(wa.ring_chunk_attention)
ring_decode_attention = jax.jit(wa.ring_decode_attention, static_argnums=5)  # the layer: a Python int


def _reference(q, k, v, W):
  """Softmax over keys t−W+1 … t for each query t, from an explicit [T, T] mask (float64)."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  T = q.shape[1]
  t = np.arange(T)
  visible = (t[None, :] <= t[:, None]) & (t[:, None] - t[None, :] < W)
  s = np.einsum("bthd,bshd->bhts", q, k) * q.shape[-1] ** -0.5
  s = np.where(visible, s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  return np.einsum("bhts,bshd->bthd", p, v)


@pytest.mark.parametrize(
  "T, W", [(5, 8), (8, 8), (21, 8), (200, 8), (37, 1)], ids=["T<W", "T=W", "T%W!=0", "T>>W", "W=1"]
)
def test_window_attention_matches_masked_reference(T, W):
  q, k, v = jax.random.normal(jax.random.key(T), (3, 2, T, 3, 4))
  np.testing.assert_allclose(window_attention(q, k, v, W), _reference(q, k, v, W), atol=1e-5)


def test_window_as_long_as_the_sequence_is_causal_attention():
  q, k, v = jax.random.normal(jax.random.key(1), (3, 2, 17, 2, 8))
  want = jax.nn.dot_product_attention(q, k, v, is_causal=True)
  np.testing.assert_allclose(window_attention(q, k, v, 17), want, atol=1e-5)
  np.testing.assert_allclose(window_attention(q, k, v, 1000), want, atol=1e-5)


def test_window_attention_never_builds_a_quadratic_array():
  """Every intermediate of the traced function grows as T·W, not T² (T = 1,024, W = 16)."""
  T, W = 1024, 16
  q = jax.ShapeDtypeStruct((1, T, 1, 4), jnp.float32)
  jaxpr = jax.make_jaxpr(lambda q, k, v: wa.window_attention(q, k, v, W))(q, q, q)
  biggest = max(np.prod(v.aval.shape) for e in jaxpr.jaxpr.eqns for v in e.outvars)
  assert biggest <= 2 * T * W * 4, biggest
  assert T * T > 8 * biggest


def test_ring_chunks_then_decode_equal_whole_sequence():
  """Ragged padded chunks (one row's prompt shorter than W), then one token at a time, match the reference;
  the rings end holding exactly the last W keys at slots position mod W."""
  B, T, H, d, W = 2, 30, 2, 4, 8
  q, k, v = jax.random.normal(jax.random.key(3), (3, B, T, H, d))
  want = _reference(q, k, v, W)
  q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)  # the chunks below are cut on the host
  kr = vr = jnp.zeros((B, H, W, d))
  pos = jnp.zeros((B,), jnp.int32)
  take = lambda x, p, n: jnp.stack(
    [np.pad(x[b, p[b] : p[b] + n], [(0, n - len(x[b, p[b] : p[b] + n])), (0, 0), (0, 0)]) for b in range(B)]
  )
  for n in ([5, 3], [11, 2], [0, 6]):  # chunks of 12 padded tokens, some rows consume fewer or none
    n = jnp.array(n)
    o, kr, vr = ring_chunk_attention(take(q, pos, 12), take(k, pos, 12), take(v, pos, 12), kr, vr, pos, n)
    for b in range(B):
      np.testing.assert_allclose(o[b, : int(n[b])], want[b, int(pos[b]) : int(pos[b] + n[b])], atol=1e-5)
    pos = pos + n
  ktab, vtab = jnp.zeros((2, B, H, W, d)).at[1].set(kr), jnp.zeros((2, B, H, W, d)).at[1].set(vr)
  for _ in range(5):
    o, ktab, vtab = ring_decode_attention(
      take(q, pos, 1), take(k, pos, 1), take(v, pos, 1), ktab, vtab, 1, pos
    )
    for b in range(B):
      np.testing.assert_allclose(o[b, 0], want[b, int(pos[b])], atol=1e-5)
    pos = pos + 1
  assert float(jnp.abs(ktab[0]).max()) == 0.0  # the other layer's ring is untouched
  for b in range(B):
    for p in range(int(pos[b]) - W, int(pos[b])):
      np.testing.assert_allclose(ktab[1, b, :, p % W], k[b, p], atol=1e-6)


def test_ring_of_a_short_prompt_masks_its_empty_slots():
  """A 3-token prompt into a ring of 8: decode sees only those 3 (+ itself), whatever the empty slots hold."""
  B, H, d, W = 1, 1, 4, 8
  q, k, v = jax.random.normal(jax.random.key(4), (3, B, 4, H, d))
  junk = jnp.full((B, H, W, d), 1e3)
  _, kr, vr = ring_chunk_attention(
    q[:, :3], k[:, :3], v[:, :3], junk, junk, jnp.zeros((B,), jnp.int32), jnp.array([3])
  )
  o, *_ = ring_decode_attention(q[:, 3:], k[:, 3:], v[:, 3:], kr[None], vr[None], 0, jnp.array([3]))
  np.testing.assert_allclose(o[0, 0], _reference(q, k, v, W)[0, 3], atol=1e-5)


def test_bad_window_is_a_clear_error():
  x = jnp.zeros((1, 4, 1, 2))
  with pytest.raises(ValueError, match="window"):
    wa.window_attention(x, x, x, 0)


def test_window_attention_gradients_match_masked_reference():
  """The banded form's gradients equal those of one [T, T]-masked softmax (no NaN from the padded blocks)."""
  T, W = 21, 8
  q, k, v = jax.random.normal(jax.random.key(5), (3, 1, T, 2, 4))
  r = jax.random.normal(jax.random.key(6), (1, T, 2, 4))
  t = jnp.arange(T)
  mask = (t[None, :] <= t[:, None]) & (t[:, None] - t[None, :] < W)
  naive = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=mask[None, None])
  loss = lambda f: jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v) * r), argnums=(0, 1, 2)))(q, k, v)
  for got, want in zip(loss(lambda q, k, v: wa.window_attention(q, k, v, W)), loss(naive)):
    np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_decode_forms_agree_on_short_and_full_rings(dtype):
  """The in-place reduce form (CPU, GPU) equals the matmul form (Neuron): rings partly filled (pos < W), just
  full and wrapped, other layers untouched; the tables they return are identical."""
  L, B, H, W, d = 2, 3, 2, 8, 4
  q, k, v = jax.random.normal(jax.random.key(7), (3, B, 1, H, d), dtype)
  kt, vt = jax.random.normal(jax.random.key(8), (2, L, B, H, W, d), dtype)
  pos = jnp.array([2, 7, 29])
  got, want = (
    jax.jit(f, static_argnums=5)(q, k, v, kt, vt, 1, pos) for f in (wa.decode_reduces, wa.decode_matmuls)
  )
  # bf16: the matmul form rounds the softmax weights to bf16 before the sum, the reduce form keeps them fp32
  np.testing.assert_allclose(got[0], want[0], atol=1e-2 if dtype == jnp.bfloat16 else 1e-5)
  for g, w in zip(got[1:], want[1:]):
    np.testing.assert_array_equal(g, w)
  assert_matmul_form_on_neuron_reduces_elsewhere(
    lambda *a: wa.ring_decode_attention(*a, 1, pos), (q, k, v, kt, vt)
  )


def test_compiled_decode_reads_each_ring_once_in_place():
  """Scanned over the layers with the tables donated, a decode step moves each ring about once (read once,
  one row written): the matmul form copies the layer's slice out first (≈ 3 passes)."""
  L, B, H, W, d = 2, 4, 2, 256, 64
  moved = lambda decode: passes_over_tables(decode, (L, B, H, W, d), (B, 1, H, d))

  with platform.lowering_for("cpu"):
    assert moved(wa.ring_decode_attention) < 1.2
  assert moved(wa.decode_matmuls) > 2.5  # the check can tell the two apart
