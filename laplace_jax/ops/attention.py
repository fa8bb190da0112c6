"""Causal softmax attention with rotary positions: the second mixer a layer may use (config `mixers`).

Layout as in gla.py: q, k, v, o [B, T, H, hd]. Scores and softmax in fp32, scale hd**-0.5.
  rope(x_BxTxHxd, pos_BxT)                          rotate (first half, second half) pairs by pos·base^(−2i/hd)
  causal_attention(q, k, v[, segment])              a whole sequence from position 0 (training, eval)
  cached_attention(q, k, v, k_cache, v_cache, pos_B, n_B) -> (o, k_cache, v_cache)
      T new tokens per row at positions pos_B … pos_B+T−1, of which the first n_B are real: their keys and
      values are written into the caches [B, M, H, hd] (padding is dropped), then every query attends to
      the cache up to its own position. Prefill chunks and the one-token decode step both use it. Every
      write index is in range (padding repeats a real write), as Neuron requires.
  cache_decode_attention(q, k, v, k_table, v_table, layer, pos_B) -> (o, k_table, v_table)
      the one-token decode step over layer `layer` of the layer-stacked caches [L, B, M, H, hd], in place:
      the cache is read where it lies (no copy of the layer's slice), then each row's key and value are
      written at pos_B (one [H, hd] row per sequence). On Neuron the matmul form, elsewhere two-operand
      reduces (`decode_in_place`, shared with window_attention's rings).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from laplace_jax import platform, sharding

F32 = jnp.float32


def rope(x_BxTxHxd, pos_BxT, base: float = 10000.0):
  """Rotary position embedding (GPT-NeoX's half-split pairing), computed in fp32."""
  half = x_BxTxHxd.shape[-1] // 2
  # a constant (numpy, float64 rounded once): a traced arange as the exponent is a runtime power, which
  # Neuron's rules refuse (laplace_jax/analysis/neuron_check.py)
  freq = (base ** (-np.arange(half) / half)).astype(np.float32)
  ang = pos_BxT.astype(F32)[:, :, None, None] * freq  # [B, T, 1, half]
  x1, x2 = x_BxTxHxd[..., :half].astype(F32), x_BxTxHxd[..., half:].astype(F32)
  cos, sin = jnp.cos(ang), jnp.sin(ang)
  return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).astype(x_BxTxHxd.dtype)


def attend(q_BxTxHxd, k_BxMxHxd, v_BxMxHxd, visible_BxTxM, kv_layout: str = "bshd"):
  """o [B, T, H, d] fp32; keys and values [B, M, H, d], or [B, H, M, d] with kv_layout="bhsd"."""
  scale = q_BxTxHxd.shape[-1] ** -0.5
  s_BxHxTxM = jnp.einsum(f"bthd,{kv_layout}->bhts", q_BxTxHxd, k_BxMxHxd, preferred_element_type=F32) * scale
  s_BxHxTxM = jnp.where(visible_BxTxM[:, None], s_BxHxTxM, -jnp.inf)
  p = jax.nn.softmax(s_BxHxTxM, axis=-1)
  return jnp.einsum(
    f"bhts,{kv_layout}->bthd", p.astype(v_BxMxHxd.dtype), v_BxMxHxd, preferred_element_type=F32
  )


def causal_attention(q_BxTxHxd, k_BxTxHxd, v_BxTxHxd, segment_BxT=None):
  """Softmax attention of each position over positions <= it (of its own segment, where `segment_BxT`
  numbers a packed row's segments: laplace_jax/ops/segments.py); returns o [B, T, H, hd] fp32."""
  B, T = q_BxTxHxd.shape[:2]
  visible = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))
  if segment_BxT is not None:
    visible = visible & (segment_BxT[:, :, None] == segment_BxT[:, None, :])
  return attend(q_BxTxHxd, k_BxTxHxd, v_BxTxHxd, visible)


def write_positions(pos_B, n_B, T: int, M: int):
  """(t_BxT, idx_BxT): the new token each of the T writes per row stores and the cache position it goes to,
  every one in [0, M). Real tokens t < n_B go to pos_B + t; padding repeats the row's last real write
  (t = n_B − 1); a row with n_B = 0 points at token 0 (cached_attention writes the cache's own values there)."""
  t_T = jnp.arange(T)
  t_BxT = jnp.where(t_T[None] < n_B[:, None], t_T[None], jnp.maximum(n_B - 1, 0)[:, None])
  return t_BxT, jnp.clip(pos_B[:, None] + t_BxT, 0, M - 1)


def cached_attention(q_BxTxHxd, k_BxTxHxd, v_BxTxHxd, k_cache_BxMxHxd, v_cache_BxMxHxd, pos_B, n_B):
  """Write the real new keys/values at pos_B + t (t < n_B) and attend over the cache; see the module doc.

  Every write index is in range (Neuron fails out-of-range scatters at run time; XLA drops them): a padding
  token (t >= n_B) repeats its row's last real write, same position and values; a row with no real token
  writes its cache's own values back. Real positions must be < M: callers check capacity first
  (model.prefill / decode_step raise a ValueError on the host); positions are clamped to M - 1 regardless."""
  B, T = q_BxTxHxd.shape[:2]
  M = k_cache_BxMxHxd.shape[1]
  t_T = jnp.arange(T)
  t_BxT, idx_BxT = write_positions(pos_B, n_B, T, M)
  rows_BxT = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
  some_B = (n_B > 0)[:, None, None, None]

  def write(cache, x):
    new = jnp.take_along_axis(x, t_BxT[:, :, None, None], 1).astype(cache.dtype)
    new = jnp.where(some_B, new, cache[rows_BxT, idx_BxT])
    return cache.at[rows_BxT, idx_BxT].set(new, mode="promise_in_bounds")

  k_cache, v_cache = write(k_cache_BxMxHxd, k_BxTxHxd), write(v_cache_BxMxHxd, v_BxTxHxd)
  q_pos_BxT = pos_B[:, None] + t_T[None]
  visible_BxTxM = jnp.arange(M)[None, None, :] <= q_pos_BxT[:, :, None]
  return attend(q_BxTxHxd.astype(k_cache.dtype), k_cache, v_cache, visible_BxTxM), k_cache, v_cache


def write_rows(table, layer, index_B, x_BxHxd, seq_axis: int):
  """Row b of x into table[layer, b] at index_B[b] along the sequence axis: 2 for a cache [L, B, M, H, hd] (or
  short_conv's rings [L, B, W, D]), 3 for a head-major ring [L, B, H, W, hd]. One row per sequence, in place;
  indices must be in range. Unsharded, an explicit row index (the batched form makes XLA:CPU transpose the
  table)."""
  at = lambda i: (i,) if seq_axis == 2 else (slice(None), i)
  if sharding.traced_under_auto_mesh():
    # Rows split over devices: a scatter batched over the rows stays per device (an explicit row index
    # all-gathers every row's indices and updates), as in short_conv.conv_decode.
    # The index tuple is built before subscripting: a starred item in a subscript needs Python 3.11.
    row = lambda t, x_Hxd, i: t.at[(layer,) + at(i)].set(x_Hxd.astype(t.dtype), mode="promise_in_bounds")
    return jax.vmap(row, in_axes=(1, 0, 0), out_axes=1)(table, x_BxHxd, index_B)
  rows = jnp.arange(table.shape[1])
  return table.at[(layer, rows) + at(index_B)].set(x_BxHxd.astype(table.dtype), mode="promise_in_bounds")


def _sum_pairs(a, b):
  return a[0] + b[0], a[1] + b[1]


def decode_in_place(
  q_Bx1xHxd, k_Bx1xHxd, v_Bx1xHxd, k_table, v_table, layer, visible_BxM, index_B, seq_axis: int
):
  """One query per row over layer `layer` of the stacked key/value tables where `visible_BxM`, and over its own
  new key; then its key and value written at index_B (write_rows). Returns (o [B, 1, H, hd] fp32, k_table,
  v_table). `seq_axis` as in write_rows: 2 for caches [L, B, M, H, hd], 3 for head-major rings [L, B, H, W, hd].
  The layer is read once where it lies (XLA:CPU; the idiom of gla_decode._xla), before the write.

  Scores and the weighted sum of values are elementwise products summed by two-operand reduces: XLA:CPU fuses
  the dynamic slice of the table into such a reduce and reads the layer in place, where a dot (or a
  one-operand sum, which XLA:CPU splits into a reduce-window over a materialised product) reads a copy. The
  second operands are used: the new key's score q·k (broadcast over the sequence, read at index 0) and the
  softmax weights (their sum, the denominator). The write reads o through a select that is never true, so it
  is ordered after the reads and the tables need no copy (a reader unordered with an in-place write makes XLA
  copy the table). Scores, softmax and sums in fp32; q, k, v rounded to the tables' dtype first, as the
  matmul form and prefill see them. Neuron has no variadic reductions: callers keep a matmul form there."""
  dt = k_table.dtype
  as_table = lambda x: x[:, 0].astype(dt).astype(F32)  # [B, H, hd]
  q, k_new, v_new = as_table(q_Bx1xHxd), as_table(k_Bx1xHxd), as_table(v_Bx1xHxd)
  q = q * q.shape[-1] ** -0.5
  k1 = jax.lax.dynamic_slice_in_dim(k_table, layer, 1, 0)  # [1, B, ...]
  v1 = jax.lax.dynamic_slice_in_dim(v_table, layer, 1, 0)
  at_seq = lambda x: jnp.expand_dims(x, (0, seq_axis))  # [B, H, hd] -> the table's rank
  qk_new = jnp.broadcast_to(at_seq(q * k_new), k1.shape)
  s, s_new = jax.lax.reduce(
    (at_seq(q) * k1.astype(F32), qk_new), (F32(0), F32(0)), _sum_pairs, (4,)
  )  # over hd
  head_major = lambda x: x if seq_axis == 3 else jnp.swapaxes(x, 1, 2)  # [B, M, H] <-> [B, H, M]
  s_BxHxM, s_new_BxH = head_major(s[0]), jnp.take(s_new[0], 0, axis=seq_axis - 1)
  s_BxHxM = jnp.where(visible_BxM[:, None, :], s_BxHxM, -jnp.inf)
  m_BxH = jnp.maximum(s_BxHxM.max(-1), s_new_BxH)
  p_BxHxM, p_new_BxH = jnp.exp(s_BxHxM - m_BxH[..., None]), jnp.exp(s_new_BxH - m_BxH)
  p = jnp.broadcast_to(head_major(p_BxHxM)[None, ..., None], v1.shape)
  pv, p_sum = jax.lax.reduce(
    (p * v1.astype(F32), p), (F32(0), F32(0)), _sum_pairs, (seq_axis,)
  )  # [1, B, H, hd]
  o_BxHxd = (pv[0] + p_new_BxH[..., None] * v_new) / (p_sum[0] + p_new_BxH[..., None])
  never = o_BxHxd[:, :1, :1] > jnp.inf  # false, also for NaN
  k_table = write_rows(k_table, layer, index_B, jnp.where(never, 0, k_Bx1xHxd[:, 0]), seq_axis)
  v_table = write_rows(v_table, layer, index_B, jnp.where(never, 0, v_Bx1xHxd[:, 0]), seq_axis)
  return o_BxHxd[:, None], k_table, v_table


def cache_decode_attention(q_Bx1xHxd, k_Bx1xHxd, v_Bx1xHxd, k_table, v_table, layer, pos_B):
  """One token per row at position pos_B over layer `layer` of the caches [L, B, M, H, hd] (positions < pos_B
  and its own key), its key and value written at pos_B (clamped to M − 1, as cached_attention: callers check
  capacity). Returns (o [B, 1, H, hd] fp32, k_table, v_table); equals cached_attention on the layer's slice
  with n_B = 1. On Neuron the matmul form, elsewhere the in-place reduces."""
  decode = cache_decode_matmuls if platform.backend() == "neuron" else cache_decode_reduces
  return decode(q_Bx1xHxd, k_Bx1xHxd, v_Bx1xHxd, k_table, v_table, layer, pos_B)


def cache_decode_matmuls(q_Bx1xHxd, k_Bx1xHxd, v_Bx1xHxd, k_table, v_table, layer, pos_B):
  """Write the row, then attend over the layer with two batched matmuls (XLA:CPU copies the layer's slice out
  for each: no fusion takes a dynamic slice into a dot)."""
  M = k_table.shape[2]
  pos_B = jnp.clip(pos_B, 0, M - 1)
  k_table = write_rows(k_table, layer, pos_B, k_Bx1xHxd[:, 0], 2)
  v_table = write_rows(v_table, layer, pos_B, v_Bx1xHxd[:, 0], 2)
  visible_Bx1xM = (jnp.arange(M)[None, :] <= pos_B[:, None])[:, None, :]
  return (
    attend(q_Bx1xHxd.astype(k_table.dtype), k_table[layer], v_table[layer], visible_Bx1xM),
    k_table,
    v_table,
  )


def cache_decode_reduces(q_Bx1xHxd, k_Bx1xHxd, v_Bx1xHxd, k_table, v_table, layer, pos_B):
  """The same step reading the layer once, in place: positions < pos from the cache, the new key and value
  from the token itself (decode_in_place), then the row written at pos."""
  M = k_table.shape[2]
  pos_B = jnp.clip(pos_B, 0, M - 1)
  visible_BxM = jnp.arange(M)[None, :] < pos_B[:, None]
  return decode_in_place(q_Bx1xHxd, k_Bx1xHxd, v_Bx1xHxd, k_table, v_table, layer, visible_BxM, pos_B, 2)
