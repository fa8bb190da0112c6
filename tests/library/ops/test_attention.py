"""The attention mixer against plain-jnp references (jax.nn.dot_product_attention, complex-number RoPE)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.decode_traffic import assert_matmul_form_on_neuron_reduces_elsewhere, passes_over_tables

from laplace_jax import platform
from laplace_jax.ops import attention


def _rope_reference(x_BxTxHxd, pos_BxT, base=10000.0):
  """RoPE as a complex rotation of the pairs (x_i, x_{i+half})."""
  x = np.asarray(x_BxTxHxd, np.float64)
  half = x.shape[-1] // 2
  z = x[..., :half] + 1j * x[..., half:]
  theta = base ** (-np.arange(half) / half)
  z = z * np.exp(1j * np.asarray(pos_BxT, np.float64)[:, :, None, None] * theta)
  return np.concatenate([z.real, z.imag], -1)


def test_rope_matches_complex_rotation_and_is_relative():
  x = jax.random.normal(jax.random.key(0), (2, 5, 3, 8))
  pos = jnp.array([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]])
  np.testing.assert_allclose(attention.rope(x, pos), _rope_reference(x, pos), atol=1e-5)
  q, k = jax.random.normal(jax.random.key(1), (2, 1, 1, 1, 8))
  dot = lambda a, b: float(jnp.sum(attention.rope(q, jnp.array([[a]])) * attention.rope(k, jnp.array([[b]]))))
  np.testing.assert_allclose(dot(3, 1), dot(103, 101), rtol=1e-4)  # scores depend on the offset only


def test_causal_attention_matches_dot_product_attention():
  q, k, v = jax.random.normal(jax.random.key(2), (3, 2, 17, 4, 8))
  want = jax.nn.dot_product_attention(q, k, v, is_causal=True)
  np.testing.assert_allclose(attention.causal_attention(q, k, v), want, atol=1e-5)


def test_cached_attention_in_pieces_equals_whole_sequence():
  """A prompt fed as a ragged padded chunk, then one token at a time, matches causal attention on it."""
  B, T, H, d, S = 2, 12, 2, 8, 16
  q, k, v = jax.random.normal(jax.random.key(3), (3, B, T, H, d))
  want = jax.nn.dot_product_attention(q, k, v, is_causal=True)
  kc = vc = jnp.zeros((B, S, H, d))
  pos = jnp.zeros((B,), jnp.int32)
  n = jnp.array([5, 3])  # rows consume 5 and 3 tokens of a 6-token padded chunk
  got0, kc, vc = attention.cached_attention(q[:, :6], k[:, :6], v[:, :6], kc, vc, pos, n)
  np.testing.assert_allclose(got0[0, :5], want[0, :5], atol=1e-5)
  np.testing.assert_allclose(got0[1, :3], want[1, :3], atol=1e-5)
  pos = n
  for _ in range(4):
    idx = pos[:, None, None, None]
    take = lambda x: jnp.take_along_axis(x, jnp.broadcast_to(idx, (B, 1, H, d)), axis=1)
    o, kc, vc = attention.cached_attention(take(q), take(k), take(v), kc, vc, pos, jnp.ones((B,), jnp.int32))
    np.testing.assert_allclose(o[:, 0], take(want)[:, 0], atol=1e-5)
    pos = pos + 1
  # padding never landed in the cache: rows hold keys 0..pos-1 and zeros after
  np.testing.assert_allclose(kc[1, :7], k[1, :7], atol=1e-6)
  assert float(jnp.abs(kc[1, 7:]).max()) == 0.0


def test_cache_writes_are_in_range_and_repeat_a_real_write():
  """Neuron fails out-of-range scatters: padding tokens repeat their row's last real write, rows with no real
  token point at a real position (where cached_attention writes the cache's own values), all within [0, S)."""
  T, S = 4, 8
  pos, n = jnp.array([0, 2, 5, 7, 8]), jnp.array([4, 1, 3, 0, 0])
  t, idx = (np.asarray(x) for x in attention.write_positions(pos, n, T, S))
  assert ((idx >= 0) & (idx < S)).all()
  np.testing.assert_array_equal(t, [[0, 1, 2, 3], [0, 0, 0, 0], [0, 1, 2, 2], [0, 0, 0, 0], [0, 0, 0, 0]])
  np.testing.assert_array_equal(idx[:3], [[0, 1, 2, 3], [2, 2, 2, 2], [5, 6, 7, 7]])


def test_cached_attention_writes_only_real_tokens():
  """The caches after a ragged chunk: real tokens at pos + t, every other entry as it was (rows with no real
  token, padding, a row ending at the last position), against a numpy reference."""
  B, T, H, d, S = 4, 3, 2, 4, 6
  q, k, v, kc, vc = (
    jax.random.normal(jax.random.key(i), shape)
    for i, shape in enumerate([(B, T, H, d)] * 3 + [(B, S, H, d)] * 2)
  )
  pos, n = jnp.array([0, 3, 2, 5]), jnp.array([3, 3, 0, 1])
  _, got_k, got_v = attention.cached_attention(q, k, v, kc, vc, pos, n)
  for got, new, old in ((got_k, k, kc), (got_v, v, vc)):
    want = np.array(old)
    for b in range(B):
      for t in range(int(n[b])):
        want[b, int(pos[b]) + t] = new[b, t]
    np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_cache_decode_forms_equal_cached_attention_on_the_layer(dtype):
  """One decode token per row over layer 1 of stacked caches: the in-place reduce form (CPU, GPU) and the matmul
  form (Neuron) equal cached_attention on that layer's slice (an empty row, a part-filled one, one at the last
  position); the tables they return are identical, one row written, other layers untouched."""
  L, B, H, d, S = 2, 3, 2, 8, 6
  q, k, v = jax.random.normal(jax.random.key(9), (3, B, 1, H, d), dtype)
  kt, vt = jax.random.normal(jax.random.key(10), (2, L, B, S, H, d), dtype)
  pos = jnp.array([0, 3, S - 1])
  want_o, want_k, want_v = attention.cached_attention(q, k, v, kt[1], vt[1], pos, jnp.ones((B,), jnp.int32))
  tol = 1e-2 if dtype == jnp.bfloat16 else 1e-5  # bf16: the matmul forms round the softmax weights to bf16
  for form in (attention.cache_decode_reduces, attention.cache_decode_matmuls):
    o, got_k, got_v = form(q, k, v, kt, vt, 1, pos)
    np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(want_o, np.float32), atol=tol)
    for got, want, old in ((got_k, want_k, kt), (got_v, want_v, vt)):
      np.testing.assert_array_equal(got[1], want)
      np.testing.assert_array_equal(got[0], old[0])
  assert_matmul_form_on_neuron_reduces_elsewhere(
    lambda *a: attention.cache_decode_attention(*a, 1, pos), (q, k, v, kt, vt)
  )


def test_compiled_cache_decode_reads_each_cache_once_in_place():
  """Scanned over the layers with the caches donated, a decode step moves each layer's cache about once (read
  once, one row written). The previous form (the layer's slice taken, cached_attention, the slice put back)
  moved it ≈ 7 times: copied out, transposed for the scatter, read by two dots, written back."""
  L, B, S, H, d = 2, 4, 256, 2, 64
  moved = lambda decode: passes_over_tables(decode, (L, B, S, H, d), (B, 1, H, d))

  def sliced(q, k, v, kt, vt, i, pos):
    o, k1, v1 = attention.cached_attention(q, k, v, kt[i], vt[i], pos, jnp.ones_like(pos))
    put = lambda t, x: jax.lax.dynamic_update_index_in_dim(t, x, i, 0)
    return o, put(kt, k1), put(vt, v1)

  with platform.lowering_for("cpu"):
    assert moved(attention.cache_decode_attention) < 1.2
  assert moved(sliced) > 2.5  # the check can tell the two apart
