"""The decode state as a typed pytree: what every sequence carries between tokens.

One DecodeState holds the state of B sequences for every layer, each table stacked layer-major over the
layers that own it (row i of a table is the i-th layer of that kind in the layer order):

  pos     [B]                      int32   tokens consumed per sequence
  conv    [L, B, conv_size, D]     fp32    every layer's short-conv ring (laplace_jax/ops/short_conv.py)
  gla     [L_G, B, H, d_k, d_v]    fp32    GLA layers' recurrent matrices, fixed in size
  kv      KVCache [L_A, B, M, H, hd]       attention layers' cache, M = max_len fixed when made
  ring    KVCache [L_S, B, H, W, hd]       sliding-window layers' last W keys and values

A table is None when no layer needs it (a pure-GLA model has no kv or ring; a training carry never has
them: attention starts every training segment afresh). The sequence (batch) axis is 0 for pos and 1 for every
table: `batch_axes()` returns that as a DecodeState of ints, so `jax.tree.map(f, state, state.batch_axes())`
reaches every leaf with its own axis. On disk (Orbax checkpoints, the serving state cache) a state travels as
the flat dict of `to_dict()`, whose key names (gla, conv, k, v, ring_k, ring_v, pos) are the stored format.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
from flax import struct

from laplace_jax.array_types import Array


@struct.dataclass
class KVCache:
  """Keys and values of one kind of attention layer, each [L_x, B, ...] in the compute dtype."""

  k: Array
  v: Array


@struct.dataclass
class DecodeState:
  """Every layer's decode state for B sequences (layout in the module docstring)."""

  pos: Array
  conv: Array
  gla: Array | None = None
  kv: KVCache | None = None
  ring: KVCache | None = None

  if TYPE_CHECKING:  # made by flax.struct.dataclass; declared here for type checkers

    def replace(self, **updates: Any) -> DecodeState: ...

  @property
  def batch_size(self) -> int:
    return self.pos.shape[0]

  @property
  def cache_len(self) -> int | None:
    """The attention KV cache's length in tokens (max_len), or None without attention layers."""
    return None if self.kv is None else self.kv.k.shape[2]

  def batch_axes(self) -> DecodeState:
    """Each leaf's sequence axis, in a DecodeState of the same structure: pos 0, every table 1."""
    return jax.tree.map(lambda _: 1, self).replace(pos=0)

  def to_dict(self) -> dict[str, Array]:
    """The stored form: {pos, conv, gla?, k?, v?, ring_k?, ring_v?} (absent tables left out)."""
    out = {"pos": self.pos, "conv": self.conv}
    if self.gla is not None:
      out["gla"] = self.gla
    if self.kv is not None:
      out["k"], out["v"] = self.kv.k, self.kv.v
    if self.ring is not None:
      out["ring_k"], out["ring_v"] = self.ring.k, self.ring.v
    return out

  @classmethod
  def from_dict(cls, d: dict[str, Array]) -> DecodeState:
    """The inverse of to_dict; a clear error names any key it does not know."""
    known = {"pos", "conv", "gla", "k", "v", "ring_k", "ring_v"}
    if not isinstance(d, dict) or not {"pos", "conv"} <= set(d) or set(d) - known:
      got = sorted(d) if isinstance(d, dict) else type(d).__name__
      raise ValueError(
        f"a stored decode state has keys {got}: expected pos, conv and any of gla, k, v, ring_k, ring_v "
        "(DecodeState.to_dict's format)."
      )
    pair = lambda a, b: KVCache(d[a], d[b]) if a in d else None
    return cls(
      pos=d["pos"], conv=d["conv"], gla=d.get("gla"), kv=pair("k", "v"), ring=pair("ring_k", "ring_v")
    )
