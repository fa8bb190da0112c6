"""Packed rows: where each row's documents (segments) begin, in the forms the layer pieces read.

A training row packs several documents; `segment_ids_BxT` (any integers) gives each token's document, and a
segment begins wherever the id differs from the previous token's. Every piece then computes each segment
exactly as if it ran alone from position 0 (laplace_jax/model/mixers.py): the GLA state restarts from zero at a
start (gla.chunk_simple_gla's `reset`), the short conv reads no input from before it, attention and window
layers see keys of their own segment only, and RoPE counts positions from the segment's start.

The data pipeline's convention (laplace_jax/data/pipeline.py): the EOS that separates two documents belongs to the
one that follows (it is that document's first input, its beginning-of-sequence token), so no target is
predicted across a boundary and no loss position needs masking.

The row's first segment continues whatever came before the row: the incoming state of a prefill or of a
training carry (state passing), `pos_B` tokens long.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from flax import struct

from laplace_jax.array_types import Array


@struct.dataclass
class Segments:
  """A packed row's segment structure, every field [B, T]."""

  start: Array  # bool: the token begins a segment (the row's first token only if told: it continues)
  index: Array  # int32: segment starts up to the token, inclusive; equal exactly within one segment
  offset: Array  # int32: tokens before it in its segment (pos_B + t in the row's first segment)

  if TYPE_CHECKING:

    def replace(self, **updates: Any) -> Segments: ...

  @classmethod
  def from_ids(cls, segment_ids_BxT, pos_B=None, first_start_B=None) -> Segments:
    """From per-token segment ids [B, T] (integers); `pos_B`: tokens the row's first segment has already
    consumed (0 without); `first_start_B` (bool [B]): the row's first token begins a new segment, dropping
    what came before the row (state passing, where the previous step's last id decides)."""
    ids = jnp.asarray(segment_ids_BxT)
    if ids.ndim != 2 or not jnp.issubdtype(ids.dtype, jnp.integer):
      raise ValueError(
        f"segment_ids is {ids.dtype}{list(ids.shape)}: expected integer ids [B, T], one per token "
        "(the document each token belongs to; a change of id starts a new document)."
      )
    B, T = ids.shape
    first = jnp.zeros((B, 1), bool) if first_start_B is None else jnp.asarray(first_start_B)[:, None]
    start = jnp.concatenate([first, ids[:, 1:] != ids[:, :-1]], axis=1)
    t_BxT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    first_B = jnp.zeros((B,), jnp.int32) if pos_B is None else jnp.asarray(pos_B, jnp.int32)
    # the position (row-relative) of the segment's start; −pos for the row's first, which began earlier
    began = jax.lax.cummax(jnp.where(start, t_BxT, -first_B[:, None]), axis=1)
    return cls(start=start, index=jnp.cumsum(start.astype(jnp.int32), axis=1), offset=t_BxT - began)
