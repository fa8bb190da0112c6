"""Speculative decoding's model half: verify T tokens per sequence in one pass, then commit each sequence's
state at its own accepted length, exactly, with no copy of the state kept to roll back to.

    logits_BxTxY, drafted = verify(params, state, tokens_BxT, cfg=cfg)
    state = commit(state, drafted, n_B, cfg=cfg)

`tokens_BxT` is each sequence's next input (its last sampled token) followed by T − 1 drafted tokens;
logits[:, j] are the logits after tokens[:, : j + 1], the same as decode_step's after feeding them one by
one (up to the chunked form's rounding). A caller that accepts the first a_B drafts of a row has consumed its
first n_B = a_B + 1 tokens, and `commit(state, drafted, n_B)` is then the state decode_step would have
reached after those n_B tokens (n_B = 0 keeps a row's state as it was: a slot with nothing to verify).

One pass reads the weights once for all T tokens. It leaves, per layer, only what each piece needs to
commit (`Drafted`): the conv's T new inputs, the GLA layers' T keys and values (the state after n tokens
is λⁿ S₀ + Σ_{i<n} λ^{n−1−i} k_i v_iᵀ: gla.state_after), the window layers' T keys and values (the ring takes
the accepted ones), and the attention layers' cache with all T rows written: a row past the accepted length
sits at a position the sequence has not reached, so no query reads it before it is overwritten. The GLA
state, the largest piece, is never held twice.

Compose both in one jit (the choice of n_B from the logits in between) so that XLA keeps only `Drafted`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from laplace_jax import model
from laplace_jax.array_types import Array
from laplace_jax.model.config import LaplaceConfig, log_decays
from laplace_jax.model.state import DecodeState, KVCache
from laplace_jax.ops import gla, short_conv, window_attention


@struct.dataclass
class Drafted:
  """A verify pass's new inputs per layer, layer-major as the state's tables (T tokens per row)."""

  conv_in: Array  # [L, B, T, D] the short conv's inputs (every layer)
  gla_k: Array | None = None  # [L_G, B, T, H, d_k] GLA layers' keys
  gla_v: Array | None = None  # [L_G, B, T, H, d_v] and values
  ring_k: Array | None = None  # [L_S, B, T, H, hd] window layers' keys (RoPE applied)
  ring_v: Array | None = None  # [L_S, B, T, H, hd] and values
  kv: KVCache | None = None  # attention layers' caches with all T rows written

  if TYPE_CHECKING:

    def replace(self, **updates: Any) -> Drafted: ...


def _table(layers: dict, cfg: LaplaceConfig, name: str, letter: str | None = None):
  """A sown value stacked layer-major over the layers that own its table (model.table_row's order)."""
  if len(cfg.mixers) == 1:  # one Block scanned over the layers: [L, ...]
    return layers[name][0] if name in layers else None
  slots = [i for i, m in enumerate(cfg.mixers) if letter is None or m == letter]
  if not slots:
    return None
  parts = [layers[f"block{i}"][name][0] for i in slots]  # each [n_groups, ...]
  return jnp.stack(parts, axis=1).reshape(-1, *parts[0].shape[1:])


def verify(params, state: DecodeState, tokens_BxT, *, cfg: LaplaceConfig):
  """(logits [B, T, Y] fp32 after each of the T tokens, Drafted); see the module doc. T >= 2."""
  if jnp.ndim(tokens_BxT) != 2 or jnp.shape(tokens_BxT)[1] < 2:
    raise ValueError(
      f"tokens have shape {list(jnp.shape(tokens_BxT))}: expected [B, T] with T >= 2, each row's next "
      "input followed by its drafted tokens (one token alone is model.decode_step's)."
    )
  B, T = jnp.shape(tokens_BxT)
  model.check_state(state, cfg, B)
  model.check_tokens(tokens_BxT, cfg)
  model.check_capacity(state, T)
  (logits, after), sown = model.LaplaceLM(cfg).apply(
    {"params": params}, tokens_BxT, state, mutable=["intermediates"]
  )
  layers = sown["intermediates"]["layers"]
  drafted = Drafted(
    conv_in=_table(layers, cfg, "conv_in"),
    gla_k=_table(layers, cfg, "gla_k", "G"),
    gla_v=_table(layers, cfg, "gla_v", "G"),
    ring_k=_table(layers, cfg, "ring_k", "S"),
    ring_v=_table(layers, cfg, "ring_v", "S"),
    kv=after.kv,
  )
  return logits, drafted


def commit(state: DecodeState, drafted: Drafted, n_B, *, cfg: LaplaceConfig) -> DecodeState:
  """The state after each row's first n_B (0 … T) verified tokens: what decode_step would have reached."""
  T = drafted.conv_in.shape[2]
  if not isinstance(n_B, jax.core.Tracer):
    n = np.asarray(n_B)
    if n.shape != (state.batch_size,) or (n < 0).any() or (n > T).any():
      raise ValueError(
        f"n_B={n.tolist()}: expected [B]={state.batch_size} accepted lengths in [0, {T}], the tokens of "
        "each row's verified T that it consumes (its accepted drafts + 1; 0 keeps the row's state)."
      )
  n_B = jnp.asarray(n_B, jnp.int32)
  pos = state.pos
  conv = jax.vmap(lambda r, h: short_conv.ring_after(r, pos, h, n_B))(state.conv, drafted.conv_in)
  new = state.replace(pos=pos + n_B, conv=conv, kv=drafted.kv)
  if state.gla is not None:
    g = jnp.asarray(log_decays(cfg))
    advance = lambda s, k, v: gla.state_after(s, k, v, g, n_B).astype(s.dtype)
    new = new.replace(gla=jax.vmap(advance)(state.gla, drafted.gla_k, drafted.gla_v))
  if state.ring is not None:
    rings = lambda rk, rv, k, v: window_attention.rings_after(rk, rv, pos, k, v, n_B)
    k_ring, v_ring = jax.vmap(rings)(state.ring.k, state.ring.v, drafted.ring_k, drafted.ring_v)
    new = new.replace(ring=KVCache(k=k_ring, v=v_ring))
  return new
