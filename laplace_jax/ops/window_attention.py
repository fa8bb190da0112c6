"""Causal sliding-window softmax attention (mixer 'S'): each query sees the `window` most recent keys, itself
included — positions t−W+1 … t. Its decode state is a ring of the last W keys and values, constant in size.

Layout as in attention.py: q, k, v, o [B, T, H, hd], RoPE applied by the caller; scores and softmax in fp32.
  window_attention(q, k, v, window[, segment])            a whole sequence from position 0 (training, eval).
      T is cut into blocks of min(W, T) queries; each block attends to its own keys and the previous block's,
      masked causal and to the window: O(T·W) work and memory, never a [T, T] mask.
  ring_chunk_attention(q, k, v, k_ring, v_ring, pos_B, n_B) -> (o, k_ring, v_ring)
      T new tokens per row at positions pos_B … pos_B+T−1, of which the first n_B are real (a prefill chunk):
      queries attend to [ring | the chunk's own keys]; the returned ring holds the last W real keys.
  ring_decode_attention(q, k, v, k_table, v_table, layer, pos_B) -> (o, k_table, v_table)
      one token per row, over ring `layer` of the layer-stacked tables [L_S, B, H, W, hd] and its own key:
      the ring is read in place, once per table, then the token's key and value are written into slot
      pos mod W (an in-range scatter of one row, in place). That slot held position pos − W, outside the
      token's window, so reading the ring before the write loses nothing.

Rings are head-major, [B, H, W, hd] per layer. Slot s holds the newest consumed position p ≡ s (mod W); a slot
whose p would be negative (a context shorter than W) is empty and masked. Every index is in range: no scatter
relies on dropping.
"""

from __future__ import annotations

import jax.numpy as jnp

from laplace_jax import platform
from laplace_jax.ops.attention import attend, decode_in_place, write_rows

F32 = jnp.float32


def _attend_rings(q_BxTxHxd, k_BxHxMxd, v_BxHxMxd, visible_BxTxM):
  return attend(q_BxTxHxd, k_BxHxMxd, v_BxHxMxd, visible_BxTxM, kv_layout="bhsd")


def window_attention(q_BxTxHxd, k_BxTxHxd, v_BxTxHxd, window: int, segment_BxT=None):
  """Each position attends to positions max(0, t−W+1) … t (of its own segment, where `segment_BxT` numbers
  a packed row's segments: laplace_jax/ops/segments.py); returns o [B, T, H, hd] fp32. Banded by blocks."""
  B, T, H, d = q_BxTxHxd.shape
  if not isinstance(window, int) or window < 1:
    raise ValueError(f"window={window!r}: expected a positive integer number of tokens.")
  C = min(window, T)  # block length: a block's queries reach back at most one block
  N = -(-T // C)
  blocks = lambda x: jnp.pad(x, [(0, 0), (0, N * C - T), (0, 0), (0, 0)]).reshape(B, N, C, *x.shape[2:])
  q, k, v = blocks(q_BxTxHxd), blocks(k_BxTxHxd), blocks(v_BxTxHxd)  # [B, N, C, H, d]
  with_prev = lambda x: jnp.concatenate([jnp.pad(x, [(0, 0), (1, 0)] + [(0, 0)] * 3)[:, :-1], x], axis=2)
  k2, v2 = with_prev(k), with_prev(v)  # [B, N, 2C, H, d]
  q_pos = jnp.arange(C)[:, None]  # positions relative to the block's start
  k_pos = jnp.arange(2 * C)[None, :] - C  # the previous block's keys at −C … −1
  near = (k_pos <= q_pos) & (q_pos - k_pos < window)
  first = jnp.arange(N)[:, None, None] == 0
  visible_NxCx2C = near[None] & ~(first & (k_pos < 0)[None])  # block 0 has no previous block
  visible = jnp.broadcast_to(visible_NxCx2C, (B, N, C, 2 * C))
  if segment_BxT is not None:  # the previous block's segment numbers beside the block's own, as for keys
    seg = jnp.pad(segment_BxT, [(0, 0), (0, N * C - T)], constant_values=-1).reshape(B, N, C)
    seg2 = jnp.concatenate([jnp.pad(seg, [(0, 0), (1, 0), (0, 0)], constant_values=-1)[:, :-1], seg], axis=2)
    visible = visible & (seg[..., :, None] == seg2[..., None, :])
  visible = visible.reshape(B * N, C, 2 * C)
  flat = lambda x: x.reshape(B * N, *x.shape[2:])
  o = attend(flat(q), flat(k2), flat(v2), visible)  # [B·N, C, H, d]
  return o.reshape(B, N * C, H, -1)[:, :T]


def slot_positions(pos_B, W):
  """[B, W]: the position each ring slot holds when pos_B tokens have been consumed (negative: empty)."""
  s = jnp.arange(W)[None, :]
  last = pos_B[:, None] - 1
  return last - jnp.mod(last - s, W)


def ring_chunk_attention(q_BxTxHxd, k_BxTxHxd, v_BxTxHxd, k_ring_BxHxWxd, v_ring_BxHxWxd, pos_B, n_B):
  """A chunk of T tokens (first n_B real) after pos_B consumed ones; see the module doc. Returns (o fp32,
  k_ring, v_ring) with the rings holding the last W real keys/values; a row with n_B = 0 keeps its rings."""
  T = q_BxTxHxd.shape[1]
  W = k_ring_BxHxWxd.shape[2]
  dt = k_ring_BxHxWxd.dtype
  t_T = jnp.arange(T)
  q_pos_BxT = pos_B[:, None] + t_T[None]
  ring_pos_BxW = slot_positions(pos_B, W)
  ring_vis = (ring_pos_BxW[:, None, :] >= 0) & (q_pos_BxT[:, :, None] - ring_pos_BxW[:, None, :] < W)
  own_vis = (t_T[None, :] <= t_T[:, None]) & (t_T[:, None] - t_T[None, :] < W)  # padding keys sit after
  visible_BxTx_WT = jnp.concatenate([ring_vis, jnp.broadcast_to(own_vis, ring_vis.shape[:2] + (T,))], -1)
  heads = lambda x: jnp.swapaxes(x, 1, 2).astype(dt)  # [B, H, T, d]
  k_BxHxTxd, v_BxHxTxd = heads(k_BxTxHxd), heads(v_BxTxHxd)
  keys = jnp.concatenate([k_ring_BxHxWxd, k_BxHxTxd], axis=2)
  values = jnp.concatenate([v_ring_BxHxWxd, v_BxHxTxd], axis=2)
  o = _attend_rings(q_BxTxHxd.astype(dt), keys, values, visible_BxTx_WT)
  k_ring, v_ring = _rings_after(k_ring_BxHxWxd, v_ring_BxHxWxd, pos_B, k_BxHxTxd, v_BxHxTxd, n_B)
  return o, k_ring, v_ring


def _rings_after(k_ring_BxHxWxd, v_ring_BxHxWxd, pos_B, k_BxHxTxd, v_BxHxTxd, n_B):
  """By gather: slot s takes the chunk's token j = p'_s − pos if its newest position p'_s is new."""
  T, W = k_BxHxTxd.shape[2], k_ring_BxHxWxd.shape[2]
  j_BxW = slot_positions(pos_B + n_B, W) - pos_B[:, None]
  fresh = (j_BxW >= 0)[:, None, :, None]
  take = lambda x: jnp.take_along_axis(x, jnp.clip(j_BxW, 0, T - 1)[:, None, :, None], axis=2)
  return jnp.where(fresh, take(k_BxHxTxd), k_ring_BxHxWxd), jnp.where(fresh, take(v_BxHxTxd), v_ring_BxHxWxd)


def rings_after(k_ring_BxHxWxd, v_ring_BxHxWxd, pos_B, k_BxTxHxd, v_BxTxHxd, n_B):
  """The rings after the first n_B (0 … T) of T new keys and values [B, T, H, hd] following pos_B consumed
  tokens: ring_chunk_attention's rings without its attention (speculative decoding's commit)."""
  dt = k_ring_BxHxWxd.dtype
  heads = lambda x: jnp.swapaxes(x, 1, 2).astype(dt)
  n_B = jnp.asarray(n_B, jnp.int32)
  return _rings_after(k_ring_BxHxWxd, v_ring_BxHxWxd, pos_B, heads(k_BxTxHxd), heads(v_BxTxHxd), n_B)


def ring_decode_attention(q_Bx1xHxd, k_Bx1xHxd, v_Bx1xHxd, k_table, v_table, layer, pos_B):
  """One token at position pos_B per row over ring `layer` of the tables [L, B, H, W, hd] and its own key;
  then its key and value are written into slot pos_B mod W of that ring. Returns (o [B, 1, H, hd] fp32,
  k_table, v_table). On Neuron the matmul form (decode_matmuls), elsewhere the in-place one (decode_reduces)."""
  decode = decode_matmuls if platform.backend() == "neuron" else decode_reduces
  return decode(q_Bx1xHxd, k_Bx1xHxd, v_Bx1xHxd, k_table, v_table, layer, pos_B)


def _write_rows(k_table, v_table, layer, pos_B, k_BxHxd, v_BxHxd):
  """Each row's key and value into slot pos mod W of ring `layer` (one [H, hd] row per sequence, in range)."""
  slots = jnp.mod(pos_B, k_table.shape[3])
  return write_rows(k_table, layer, slots, k_BxHxd, 3), write_rows(v_table, layer, slots, v_BxHxd, 3)


def decode_matmuls(q_Bx1xHxd, k_Bx1xHxd, v_Bx1xHxd, k_table, v_table, layer, pos_B):
  """Write the token into the ring, then attend over the ring with two batched matmuls. XLA:CPU copies the
  layer's rings out of the stacked tables before each matmul (no fusion takes a dynamic slice into a dot):
  three passes over each ring per step (docs/BENCHMARKS.md, the sliding-window layers)."""
  W = k_table.shape[3]
  k_table, v_table = _write_rows(k_table, v_table, layer, pos_B, k_Bx1xHxd[:, 0], v_Bx1xHxd[:, 0])
  visible_Bx1xW = (slot_positions(pos_B + 1, W) >= 0)[:, None, :]
  o = _attend_rings(q_Bx1xHxd.astype(k_table.dtype), k_table[layer], v_table[layer], visible_Bx1xW)
  return o, k_table, v_table


def decode_reduces(q_Bx1xHxd, k_Bx1xHxd, v_Bx1xHxd, k_table, v_table, layer, pos_B):
  """The same step in one read of each ring, in place (attention.decode_in_place, XLA:CPU's form). The ring is
  read before the new row is written: slot pos mod W held pos − W, outside the window."""
  W = k_table.shape[3]
  held_BxW = slot_positions(pos_B, W)  # before the write
  visible_BxW = (held_BxW >= 0) & (held_BxW > pos_B[:, None] - W)
  return decode_in_place(
    q_Bx1xHxd, k_Bx1xHxd, v_Bx1xHxd, k_table, v_table, layer, visible_BxW, jnp.mod(pos_B, W), 3
  )
