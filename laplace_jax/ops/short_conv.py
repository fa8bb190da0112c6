"""The causal depth-wise short convolution in front of every mixer (k = conv_size taps, W below), and its
decode state: a ring of the last W inputs per layer, written one row per token in place.

    out_t = bias + Σ_i kernel[i] ⊙ x_{t−(W−1)+i}        (kernel [W, D]: tap W−1 applies to the newest input)

Ring layout (fp32): [B, W, D] per layer, stacked [L, B, W, D] in the decode state. After pos_B tokens, slot s
holds the input of the newest consumed position p ≡ s (mod W) (window_attention.slot_positions); slots whose
p would be negative hold zeros (a fresh state), which is the zero padding a sequence starts with.
  conv_sequence(h, kernel, bias, ring, pos_B, n_B, offset_BxT, past_BxWxD) -> (out [B, T, D], ring)
      T tokens per row after pos_B consumed ones, the first n_B real (a right-padded prefill chunk; a row with
      n_B = 0 keeps its ring exactly). ring None: a sequence from position 0 (training), no ring returned.
      offset_BxT (packed rows, laplace_jax/ops/segments.py): tokens before each one in its segment; a tap never
      reaches further back, and the returned ring holds zeros for inputs before the last segment's start.
      past_BxWxD: the W inputs before the row, oldest first, in place of the ring's (context parallelism:
      the previous span's last inputs, laplace_jax/ops/context_parallel.py); the ring, if given, is still returned.
  conv_decode(h, kernel, bias, table, layer, pos_B) -> (out [B, 1, D], table)
      one token per row: written into slot pos mod W of ring `layer` of the table (an in-range one-row
      scatter), then the ring read once with the taps rotated by pos per row (selects on the [W, D] kernel:
      the window itself is never shifted nor copied).
"""

from __future__ import annotations

import jax.numpy as jnp

from laplace_jax.ops import attention
from laplace_jax.ops.window_attention import slot_positions

F32 = jnp.float32


def conv_sequence(
  h_BxTxD, kernel_WxD, bias_D, ring_BxWxD=None, pos_B=None, n_B=None, offset_BxT=None, past_BxWxD=None
):
  """See the module doc. Output in h's dtype; the returned ring is fp32 (the ring's dtype)."""
  B, T, D = h_BxTxD.shape
  W = kernel_WxD.shape[0]
  dt = h_BxTxD.dtype
  if past_BxWxD is not None:
    past_BxWxD = past_BxWxD.astype(F32)
  elif ring_BxWxD is None:
    past_BxWxD = jnp.zeros((B, W, D), F32)
  else:
    past_BxWxD = ring_in_order(ring_BxWxD, pos_B)
  ext = jnp.concatenate([past_BxWxD.astype(dt), h_BxTxD], axis=1)  # [B, W+T, D]; pos p at p−pos+W
  tap = lambda i: ext[:, 1 + i : 1 + i + T]  # the input W−1−i tokens back
  if offset_BxT is not None:  # within its segment only: lag W−1−i at most the token's offset
    tap = lambda i, tap=tap: jnp.where((offset_BxT >= W - 1 - i)[..., None], tap(i), 0)
  out = sum(tap(i) * kernel_WxD[i].astype(dt) for i in range(W)) + bias_D.astype(dt)
  if ring_BxWxD is None:
    return out, None
  ring, p_BxW = _ring_from(past_BxWxD, h_BxTxD, pos_B, n_B)
  if offset_BxT is not None:  # inputs from before the last real token's segment read as a fresh state's
    last_B = jnp.maximum(n_B - 1, 0)
    began_B = last_B - jnp.take_along_axis(offset_BxT, last_B[:, None], axis=1)[:, 0]
    ring = jnp.where((p_BxW >= began_B[:, None])[..., None], ring, 0.0)
  return out, ring.astype(ring_BxWxD.dtype)


def _ring_from(past_BxWxD, h_BxTxD, pos_B, n_B):
  """The ring after the first n_B of the T inputs h that follow `past` (the W before them, oldest first), fp32,
  and each slot's row-relative position. By gather: slot s takes the newest real position p'_s ≡ s (mod W),
  at index p'_s − pos + W."""
  W = past_BxWxD.shape[1]
  p_BxW = slot_positions(pos_B + n_B, W) - pos_B[:, None]  # row-relative
  ext32 = jnp.concatenate([past_BxWxD.astype(F32), h_BxTxD.astype(F32)], axis=1)
  return jnp.take_along_axis(ext32, (p_BxW + W)[:, :, None], axis=1), p_BxW


def ring_after(ring_BxWxD, pos_B, h_BxTxD, n_B):
  """The ring after the first n_B (0 … T) of T new inputs h following pos_B consumed ones: conv_sequence's
  ring without its outputs (speculative decoding commits each row at its accepted length)."""
  ring, _ = _ring_from(ring_in_order(ring_BxWxD, pos_B), h_BxTxD, pos_B, jnp.asarray(n_B, jnp.int32))
  return ring.astype(ring_BxWxD.dtype)


def ring_in_order(ring_BxWxD, pos_B):
  """The ring's inputs in position order, oldest first: position pos − W + j sits in slot (pos + j) mod W."""
  W = ring_BxWxD.shape[1]
  order_BxW = jnp.mod(pos_B[:, None] + jnp.arange(W)[None], W)
  return jnp.take_along_axis(ring_BxWxD, order_BxW[:, :, None], axis=1)


def conv_decode(h_Bx1xD, kernel_WxD, bias_D, table, layer, pos_B):
  """See the module doc. `table` is every layer's ring [L, B, W, D]; only ring `layer` changes."""
  W = table.shape[2]
  dt = h_Bx1xD.dtype
  # One row per sequence written in place at slot pos mod W, first, and read back after, so nothing reads the
  # old ring once it is overwritten (a reader of the old rows unordered with the in-place write makes XLA copy
  # the table).
  table = attention.write_rows(table, layer, jnp.mod(pos_B, W), h_Bx1xD[:, 0], seq_axis=2)
  ring = table[layer]
  # Position pos − (W−1) + i sits in slot (pos + 1 + i) mod W, so slot s takes tap (s − pos − 1) mod W.
  tap_BxW = jnp.mod(jnp.arange(W)[None] - pos_B[:, None] - 1, W)
  out = bias_D.astype(dt)
  for s in range(W):
    kernel_s_BxD = sum(jnp.where(tap_BxW[:, s, None] == i, kernel_WxD[i].astype(dt), 0) for i in range(W))
    out = out + ring[:, s].astype(dt) * kernel_s_BxD
  return out[:, None], table
