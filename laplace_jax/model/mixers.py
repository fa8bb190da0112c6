"""The pieces of one decoder layer as Flax modules, each owning its parameters and its decode state.

Every piece declares, as class methods of the config alone:
  param_specs(cfg) -> {name: (initializer, unstacked shape)}   the parameters it makes, in creation order
  state_field                                                  its table in a DecodeState (conv, gla, kv, ring)
  state_specs(cfg, batch, max_len) -> ShapeDtypeStruct tree    its decode state for ONE layer, [B, ...]
  carried                                                      whether that state rides the training carry
model.Block composes them (norms, ShortConv, a mixer by letter, GluFFN) and model.init_state / init_carry stack
each piece's slices layer-major, [L_x, B, ...], over the layers that run it, into the DecodeState field the
piece names (laplace_jax/model/state.py). A piece's parameters sit at the layer's own level (nn.share_scope), so the
tree is the flat layers/{name: [L, ...]} every checkpoint holds.

At call time a piece takes the layer's whole decode state (a DecodeState, or None: a sequence from position 0)
and its row `idx` in its own table (model.table_row), the row mask, and the packed rows' Segments (None: one
sequence per row; laplace_jax/ops/segments.py), and returns (output, the state with only its own field replaced).
A state whose field is None (a training carry has no attention cache) also means: start from position 0.
Given a state and several tokens, the pieces whose state is not a plain cache also sow their new inputs into
the "intermediates" collection (conv_in, gla_k/gla_v, ring_k/ring_v) when it is collected: model.verify reads
them to commit each row at its own accepted length.
Traced on a span of a row split over the "context" axis (context_parallel.span()), the conv, the GLA and the
window layers take what enters the span from the devices before it (laplace_jax/ops/context_parallel.py).
"""

from __future__ import annotations

from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from laplace_jax import platform
from laplace_jax.model.config import LaplaceConfig, gla_form_for_backend, log_decays
from laplace_jax.model.state import DecodeState, KVCache
from laplace_jax.ops import attention, context_parallel, gla, gla_decode, short_conv, window_attention
from laplace_jax.ops.segments import Segments
from laplace_jax.sharding import BATCH_AXES, CONTEXT

F32 = jnp.float32


def batch_sharded(x):
  """Pin an activation's batch dim to every device when traced under a mesh (`jax.set_mesh`).

  Without it XLA's partitioner may gather whole activations to form FSDP weight gradients (measured on
  laplace-3b: ≈1.5 TB per device per step) instead of reduce-scattering partial gradients."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or not set(BATCH_AXES) <= set(mesh.axis_names) or set(BATCH_AXES) & set(mesh.manual_axes):
    return x  # no mesh, or inside a shard_map (rows are already per device)
  n = int(np.prod([mesh.shape[a] for a in BATCH_AXES]))
  if x.shape[0] % n:
    return x
  return jax.lax.with_sharding_constraint(x, jax.sharding.PartitionSpec(BATCH_AXES))


def matmul(a, w, cfg: LaplaceConfig):
  """a @ w in the compute dtype, batch-sharded."""
  cdt = jnp.dtype(cfg.compute_dtype)
  return batch_sharded(jnp.dot(a.astype(cdt), w.astype(cdt)))


def initializers(cfg: LaplaceConfig):
  """(normal, residual-output normal, ones, zeros): matrices N(0, std²), the residual output projections
  scaled by 1/√(2L) (GPT-2 / Megatron practice)."""
  return (
    nn.initializers.normal(cfg.init_std),
    nn.initializers.normal(cfg.init_std / np.sqrt(2 * cfg.n_layers)),
    nn.initializers.ones,
    nn.initializers.zeros,
  )


def _uniform(bound):
  return lambda key, shape, dtype: jax.random.uniform(key, shape, dtype, -bound, bound)


def lengths(mask_BxT, B: int, T: int):
  """Real tokens per row: T each without a mask."""
  return jnp.full((B,), T, jnp.int32) if mask_BxT is None else mask_BxT.sum(1).astype(jnp.int32)


def make_params(module: nn.Module, specs: dict) -> dict:
  """`specs` ({name: (initializer, shape)}) made as `module`'s parameters in order, in cfg.param_dtype."""
  dt = jnp.dtype(module.cfg.param_dtype)
  return {name: module.param(name, init, shape, dt) for name, (init, shape) in specs.items()}


class LayerPart(nn.Module):
  """Base of a layer's pieces: the declarations (none here) and the helpers every piece uses."""

  cfg: LaplaceConfig
  carried: ClassVar[bool] = True
  state_field: ClassVar[str | None] = None  # the DecodeState field holding its table (None: stateless)

  @classmethod
  def param_specs(cls, cfg: LaplaceConfig) -> dict:
    return {}

  @classmethod
  def state_specs(cls, cfg: LaplaceConfig, batch: int, max_len: int | None = None):
    """One layer's decode state for `batch` sequences (ShapeDtypeStructs, [B, ...]); None: stateless."""
    return None

  def make_params(self) -> dict:
    """This piece's declared parameters, made in order in the scope it runs in (the layer's)."""
    return make_params(self, self.param_specs(self.cfg))

  def has_state(self, state: DecodeState | None) -> bool:
    return state is not None and self.state_field is not None and getattr(state, self.state_field) is not None


class ShortConv(LayerPart):
  """Causal depth-wise conv (k = conv_size) in front of every mixer (laplace_jax/ops/short_conv.py): kernel
  U(±1/√k) with zero bias (PyTorch's Conv1d range). State: a ring of the last conv_size inputs, fp32."""

  state_field: ClassVar[str | None] = "conv"

  @classmethod
  def param_specs(cls, cfg):
    D, W = cfg.d_model, cfg.conv_size
    return {"conv_kernel": (_uniform(1 / np.sqrt(W)), (W, D)), "conv_bias": (nn.initializers.zeros, (D,))}

  @classmethod
  def state_specs(cls, cfg, batch, max_len=None):
    return jax.ShapeDtypeStruct((batch, cfg.conv_size, cfg.d_model), F32)

  @nn.compact
  def __call__(self, h_BxTxD, state, idx, mask_BxT, segments: Segments | None = None):
    w = self.make_params()
    kernel, bias = w["conv_kernel"].astype(jnp.dtype(self.cfg.compute_dtype)), w["conv_bias"]
    B, T, _ = h_BxTxD.shape
    offset = None if segments is None else segments.offset
    sp = context_parallel.span()
    if sp is not None:
      return self.on_span(h_BxTxD, kernel, bias, state, idx, offset, sp)
    if not self.has_state(state):
      return short_conv.conv_sequence(h_BxTxD, kernel, bias, offset_BxT=offset)[0], state
    if T == 1:  # decode: one row per sequence written into the ring in place
      # (a masked row's write lands in the slot its next token overwrites before any read: see decode_step)
      out, table = short_conv.conv_decode(h_BxTxD, kernel, bias, state.conv, idx, state.pos)
      return out, state.replace(conv=table)
    self.sow("intermediates", "conv_in", h_BxTxD)  # model.verify's drafted inputs (only when collected)
    out, ring = short_conv.conv_sequence(
      h_BxTxD, kernel, bias, state.conv[idx], state.pos, lengths(mask_BxT, B, T), offset
    )
    return out, state.replace(conv=jax.lax.dynamic_update_index_in_dim(state.conv, ring, idx, 0))

  def on_span(self, h_BxTxD, kernel, bias, state, idx, offset, sp):
    """A span of a row split over devices: the taps before it read the previous span's last inputs (span
    0: the carried ring's, or zeros); the ring after the row comes from the last span."""
    past = context_parallel.previous_tail(h_BxTxD.astype(F32), self.cfg.conv_size, sp)
    if not self.has_state(state):
      return short_conv.conv_sequence(h_BxTxD, kernel, bias, offset_BxT=offset, past_BxWxD=past)[0], state
    B, T, _ = h_BxTxD.shape
    ring = state.conv[idx]
    past = jnp.where(sp.index == 0, short_conv.ring_in_order(ring, state.pos), past)
    pos_B, n_B = state.pos + sp.index * T, jnp.full((B,), T, jnp.int32)
    out, ring = short_conv.conv_sequence(h_BxTxD, kernel, bias, ring, pos_B, n_B, offset, past)
    ring = context_parallel.from_last(ring, sp)
    return out, state.replace(conv=jax.lax.dynamic_update_index_in_dim(state.conv, ring, idx, 0))


class GLAMixer(LayerPart):
  """The Laplace mixer (letter G): W_qkvg → simple GLA with a fixed geometric decay → + σ(q·(a⊙k))·v → Head
  RMSNorm per decay tier → ⊙ SiLU(g) → W_out. aug_balance starts at 0 (a half-strength value skip). State:
  the GLA matrix [H, d_k, d_v] fp32, carried across training segments."""

  state_field: ClassVar[str | None] = "gla"

  @classmethod
  def param_specs(cls, cfg):
    normal, out_init, ones, zeros = initializers(cfg)
    D = cfg.d_model
    return {
      "w_qkvg": (normal, (D, cfg.qkvg_width)),
      "aug_balance": (zeros, (cfg.n_heads, cfg.d_k)),
      "head_norm_scale": (ones, (cfg.n_decay_tiers, cfg.d_v)),
      "w_out": (out_init, (cfg.v_width, D)),
    }

  @classmethod
  def state_specs(cls, cfg, batch, max_len=None):
    return jax.ShapeDtypeStruct((batch, cfg.n_heads, cfg.d_k, cfg.d_v), F32)

  @nn.compact
  def __call__(self, u_BxTxD, state, idx, mask_BxT, segments: Segments | None = None):
    cfg, w = self.cfg, self.make_params()
    B, T, _ = u_BxTxD.shape
    H, K, V = cfg.n_heads, cfg.d_k, cfg.d_v
    qkvg = matmul(u_BxTxD, w["w_qkvg"], cfg)
    q, k, v, g = jnp.split(qkvg, np.cumsum([cfg.qk_width, cfg.qk_width, cfg.v_width]), axis=-1)
    q_BxTxHxK, k_BxTxHxK = q.reshape(B, T, H, K), k.reshape(B, T, H, K)
    v_BxTxHxV = v.reshape(B, T, H, V)
    g_gamma = jnp.asarray(log_decays(cfg))
    table = state.gla if self.has_state(state) else None  # every GLA layer's state [L_gla, B, H, K, V]
    if T == 1 and table is not None and segments is None:
      # this layer's rows of the state table rewritten in place (a Pallas kernel on GPUs); masked rows kept
      o1, table = gla_decode.gla_decode_layer(
        q_BxTxHxK[:, 0],
        k_BxTxHxK[:, 0],
        v_BxTxHxV[:, 0],
        g_gamma,
        table,
        idx,
        live_B=None if mask_BxT is None else mask_BxT[:, 0],
      )
      o_BxTxHxV = o1[:, None]
    else:
      s0 = None if table is None else table[idx]
      form, unroll = gla_form_for_backend(cfg, platform.backend())
      reset = None if segments is None else segments.start
      chunk = min(cfg.chunk_size, T)
      sp = context_parallel.span()
      if sp is not None:  # a span of a row split over devices: one (decay, state) pair per span crosses
        o_BxTxHxV, s_new = context_parallel.chunk_simple_gla_context(
          q_BxTxHxK,
          k_BxTxHxK,
          v_BxTxHxV,
          g_gamma,
          axis_name=CONTEXT,
          initial_state=s0,
          reset=reset,
          chunk_size=chunk,
          unroll=unroll,
          form=form,
        )
      else:
        o_BxTxHxV, s_new = gla.chunk_simple_gla(
          q_BxTxHxK,
          k_BxTxHxK,
          v_BxTxHxV,
          g_gamma,
          initial_state=s0,
          mask=mask_BxT,
          reset=reset,
          chunk_size=chunk,
          unroll=unroll,
          form=form,
        )
      if table is not None:
        table = jax.lax.dynamic_update_index_in_dim(table, s_new.astype(table.dtype), idx, 0)
        self.sow("intermediates", "gla_k", k_BxTxHxK)  # model.verify's drafted keys and values
        self.sow("intermediates", "gla_v", v_BxTxHxV)

    # Self-augmentation: a gated skip of the value, σ(q·(a⊙k)) = ½ at initialisation.
    gate_BxTxH = jax.nn.sigmoid(
      jnp.einsum(
        "bthk,hk,bthk->bth", q_BxTxHxK.astype(F32), w["aug_balance"].astype(F32), k_BxTxHxK.astype(F32)
      )
    )
    o = o_BxTxHxV.astype(F32) + gate_BxTxH[..., None] * v_BxTxHxV.astype(F32)
    # Head RMSNorm, one weight per decay tier (heads of similar memory length share it).
    tier_scale_HxV = jnp.repeat(w["head_norm_scale"], H // cfg.n_decay_tiers, axis=0)
    o = o * jax.lax.rsqrt(jnp.square(o).mean(-1, keepdims=True) + cfg.norm_eps) * tier_scale_HxV
    o = o.reshape(B, T, H * V).astype(jnp.dtype(cfg.compute_dtype)) * nn.silu(g)
    return matmul(o, w["w_out"], cfg), (state if table is None else state.replace(gla=table))


class AttentionMixer(LayerPart):
  """Causal softmax attention with RoPE (letter A): W_qkv → RoPE(q, k) → attention over every earlier
  position → W_o, W_qkv and W_o spending W_qkvg + W_out's budget. State: a KV cache [max_len, H, hd] in the
  compute dtype, its length fixed when the state is made; not carried (every training segment starts afresh)."""

  carried: ClassVar[bool] = False
  state_field: ClassVar[str | None] = "kv"

  @classmethod
  def param_specs(cls, cfg):
    normal, out_init, _, _ = initializers(cfg)
    return {
      "w_qkv": (normal, (cfg.d_model, 3 * cfg.attn_width)),
      "w_o": (out_init, (cfg.attn_width, cfg.d_model)),
    }

  @classmethod
  def state_specs(cls, cfg, batch, max_len=None):
    if not isinstance(max_len, (int, np.integer)) or max_len < 1:
      raise ValueError(
        f"init_state(max_len={max_len!r}): mixers={cfg.mixers!r} has attention layers, whose "
        "KV cache length is fixed when the state is made; pass max_len=N, the longest context "
        "(prompt + generated tokens) the state must hold."
      )
    kv = jax.ShapeDtypeStruct(
      (batch, int(max_len), cfg.attn_n_heads, cfg.attn_head_dim), jnp.dtype(cfg.compute_dtype)
    )
    return KVCache(k=kv, v=kv)

  @nn.compact
  def __call__(self, u_BxTxD, state, idx, mask_BxT, segments: Segments | None = None):
    cfg, w = self.cfg, self.make_params()
    B, T, _ = u_BxTxD.shape
    H, hd = cfg.attn_n_heads, cfg.attn_head_dim
    q, k, v = jnp.split(matmul(u_BxTxD, w["w_qkv"], cfg).reshape(B, T, 3 * H, hd), 3, axis=2)
    cached = self.has_state(state)
    sp = context_parallel.span()
    if segments is not None:  # packed rows (no cache: model.LaplaceLM refuses one): positions per segment
      assert not cached
      pos_BxT = segments.offset
    else:
      pos_B = state.pos if cached else jnp.zeros((B,), jnp.int32)
      pos_BxT = pos_B[:, None] + jnp.arange(T)[None] + (0 if sp is None else sp.index * T)
    q, k = attention.rope(q, pos_BxT, cfg.rope_base), attention.rope(k, pos_BxT, cfg.rope_base)
    if cached:
      if self.state_field == "ring" and T > 1:  # model.verify's drafted keys and values (window layers)
        self.sow("intermediates", "ring_k", k)
        self.sow("intermediates", "ring_v", v)
      o, state = self.attend_cached(q, k, v, state, idx, lengths(mask_BxT, B, T), decoding=T == 1)
    else:
      o = self.attend_sequence(q, k, v, None if segments is None else segments.index, sp)
    return matmul(o.reshape(B, T, H * hd), w["w_o"], cfg), state

  def attend_sequence(self, q, k, v, segment_BxT=None, sp=None):
    """A sequence from position 0 (its segments apart, if numbered); `sp`: a span of it (refused here,
    model.LaplaceLM says why)."""
    assert sp is None
    return attention.causal_attention(q, k, v, segment_BxT)

  def attend_cached(self, q, k, v, state: DecodeState, idx, n_B, decoding):
    """After state.pos consumed tokens, over this piece's KVCache (row `idx` of its k and v), which it extends."""
    cache = self.cache(state)
    k_tables, v_tables, pos_B = cache.k, cache.v, state.pos
    if decoding:  # one row per sequence written into the tables in place
      o, k_tables, v_tables = self.decode(q, k, v, k_tables, v_tables, idx, pos_B)
    else:
      o, k_one, v_one = self.chunk(q, k, v, k_tables[idx], v_tables[idx], pos_B, n_B)
      put = lambda t, x: jax.lax.dynamic_update_index_in_dim(t, x, idx, 0)
      k_tables, v_tables = put(k_tables, k_one), put(v_tables, v_one)
    return o, self.with_cache(state, KVCache(k=k_tables, v=v_tables))

  def cache(self, state: DecodeState) -> KVCache:
    """This kind of attention layer's KVCache in the state (every such layer's rows)."""
    assert state.kv is not None
    return state.kv

  def with_cache(self, state: DecodeState, cache: KVCache) -> DecodeState:
    return state.replace(kv=cache)

  def decode(self, q, k, v, k_tables, v_tables, idx, pos_B):
    return attention.cache_decode_attention(q, k, v, k_tables, v_tables, idx, pos_B)

  def chunk(self, q, k, v, k_cache, v_cache, pos_B, n_B):
    return attention.cached_attention(q, k, v, k_cache, v_cache, pos_B, n_B)


class WindowAttentionMixer(AttentionMixer):
  """Sliding-window attention (letter S): the same weights, each query over the last cfg.window tokens
  (laplace_jax/ops/window_attention.py). State: rings of the last `window` keys and values [H, window, hd] in the
  compute dtype, constant in size; not carried."""

  state_field: ClassVar[str | None] = "ring"

  @classmethod
  def state_specs(cls, cfg, batch, max_len=None):
    ring = jax.ShapeDtypeStruct(
      (batch, cfg.attn_n_heads, cfg.window, cfg.attn_head_dim), jnp.dtype(cfg.compute_dtype)
    )
    return KVCache(k=ring, v=ring)

  def cache(self, state: DecodeState) -> KVCache:
    assert state.ring is not None
    return state.ring

  def with_cache(self, state: DecodeState, cache: KVCache) -> DecodeState:
    return state.replace(ring=cache)

  def attend_sequence(self, q, k, v, segment_BxT=None, sp=None):
    if sp is not None:
      return context_parallel.window_attention_on_span(q, k, v, self.cfg.window, segment_BxT, sp)
    return window_attention.window_attention(q, k, v, self.cfg.window, segment_BxT)

  def decode(self, q, k, v, k_tables, v_tables, idx, pos_B):
    return window_attention.ring_decode_attention(q, k, v, k_tables, v_tables, idx, pos_B)

  def chunk(self, q, k, v, k_ring, v_ring, pos_B, n_B):
    return window_attention.ring_chunk_attention(q, k, v, k_ring, v_ring, pos_B, n_B)


class GluFFN(LayerPart):
  """The GLU(SiLU) FFN after the mixer: W3(SiLU(h W1) ⊙ h W2), W3 scaled as a residual output. No state."""

  @classmethod
  def param_specs(cls, cfg):
    normal, out_init, _, _ = initializers(cfg)
    D = cfg.d_model
    return {"w1": (normal, (D, cfg.d_ff)), "w2": (normal, (D, cfg.d_ff)), "w3": (out_init, (cfg.d_ff, D))}

  @nn.compact
  def __call__(self, h_BxTxD):
    cfg, w = self.cfg, self.make_params()
    return matmul(nn.silu(matmul(h_BxTxD, w["w1"], cfg)) * matmul(h_BxTxD, w["w2"], cfg), w["w3"], cfg)


MIXER_MODULES: dict[str, type[LayerPart]] = {"G": GLAMixer, "A": AttentionMixer, "S": WindowAttentionMixer}
