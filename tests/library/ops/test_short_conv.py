"""The short conv and its ring state (laplace_jax/ops/short_conv.py) against a direct numpy convolution."""

import jax.numpy as jnp
import numpy as np

from laplace_jax.ops import short_conv

B, W, D = 3, 4, 5


def _reference(x_BxTxD, kernel_WxD, bias_D):
  """out_t = bias + Σ_i kernel[i] · x_{t−(W−1)+i}, zeros before position 0."""
  pad = np.concatenate([np.zeros((x_BxTxD.shape[0], W - 1, D), np.float32), x_BxTxD], 1)
  return bias_D + sum(pad[:, i : i + x_BxTxD.shape[1]] * kernel_WxD[i] for i in range(W))


def test_pieces_of_any_length_and_decode_equal_one_convolution():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(B, 23, D)).astype(np.float32)
  kernel, bias = rng.normal(size=(W, D)).astype(np.float32), rng.normal(size=(D,)).astype(np.float32)
  want = _reference(x, kernel, bias)
  # per-row piece lengths (right-padded pieces of 7 columns; a row with 0 real tokens keeps its ring)
  lengths = np.array([[7, 1, 0, 5], [3, 7, 6, 0], [0, 2, 7, 7]])
  ring, pos = jnp.zeros((B, W, D)), jnp.zeros((B,), jnp.int32)
  outs = [[] for _ in range(B)]
  for n_B in lengths.T:
    chunk = np.zeros((B, 7, D), np.float32)
    for b in range(B):
      chunk[b, : n_B[b]] = x[b, int(pos[b]) : int(pos[b]) + n_B[b]]
    before = np.asarray(ring)
    out, ring = short_conv.conv_sequence(jnp.asarray(chunk), kernel, bias, ring, pos, jnp.asarray(n_B))
    for b in range(B):
      outs[b].append(np.asarray(out[b, : n_B[b]]))
      if n_B[b] == 0:
        np.testing.assert_array_equal(ring[b], before[b])  # exactly kept
    pos = pos + n_B
  table = jnp.zeros((2, B, W, D)).at[1].set(ring)  # decode the rest from layer 1 of a stacked table
  for _ in range(3):
    tok = np.stack([x[b, int(pos[b])] for b in range(B)])[:, None]
    out, table = short_conv.conv_decode(jnp.asarray(tok), kernel, bias, table, 1, pos)
    for b in range(B):
      outs[b].append(np.asarray(out[b]))
    pos = pos + 1
  assert not np.asarray(table[0]).any()  # the other layer's ring is untouched
  for b in range(B):
    got = np.concatenate(outs[b])
    np.testing.assert_allclose(got, want[b, : len(got)], rtol=1e-5, atol=1e-5)
