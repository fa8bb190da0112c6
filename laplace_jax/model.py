"""The Laplace decoder as a functional Flax model, and its explicit-state inference functions.

One layer (REFERENCE.md): x → LayerNorm → causal depth-wise conv (k=4) + SiLU → W_qkvg → q, k, v, g →
simple GLA with a fixed geometric decay → + σ(q·(a⊙k))·v → Head RMSNorm per decay tier → ⊙ SiLU(g) → W_out
→ + x; then LayerNorm → GLU(SiLU) FFN → + x (cfg.ffn false: no FFN, a mixer-only layer). Layers run under
`nn.scan` (one compiled body), or the same scan unrolled (`cfg.scan_layers`, the default on Neuron) with the same parameters.
`cfg.mixers` may swap the mixer (W_qkvg … W_out) for causal softmax attention with RoPE ('A', same heads,
W_qkv and W_o of the same parameter budget) or sliding-window attention over the last cfg.window tokens ('S',
the same weights; laplace_jax/window_attention.py) in a pattern repeated over the layers; the scan then runs
over the pattern's repeats, one compiled body holding one block per letter.

Public, all pure functions of pytrees (`cfg` is static):
  init_params(cfg, rng) -> params            forward(params, tokens_BxT, cfg=) -> logits_BxTxV (fp32)
  init_state(cfg, batch[, max_len]) -> state decode_step(params, state, tokens_B, cfg=) -> (logits_BxV, state)
  init_carry(cfg, batch) -> carry            forward_carry(params, tokens_BxT, carry, cfg=) -> (logits, carry)
  prefill_chunk(params, state, tokens_BxC, lengths_B, cfg=) -> (logits_BxV, state)
  prefill(params, state, tokens_BxT, lengths_B=None, cfg=) -> (logits_BxV, state)   host loop, one compile

Initialisation (GPT-2 / Megatron practice): matrices N(0, 0.02²), the two residual output projections
(W_out, W3) scaled by 1/√(2L); norms 1; conv kernel U(±1/√k) with zero bias (PyTorch's Conv1d range);
aug_balance 0 (a half-strength value skip at start).
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from laplace_jax import attention, fsdp, gla, gla_decode, platform, short_conv, window_attention
from laplace_jax.config import MIXERS, LaplaceConfig, gla_form_for_backend, layers_scanned, log_decays
from laplace_jax.sharding import BATCH_AXES

F32 = jnp.float32


def _batch_sharded(x):
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


def _layer_norm(x, scale, eps):
  """Weight-only LayerNorm, statistics in fp32."""
  x32 = x.astype(F32)
  mu = x32.mean(-1, keepdims=True)
  var = jnp.square(x32 - mu).mean(-1, keepdims=True)
  return ((x32 - mu) * jax.lax.rsqrt(var + eps) * scale).astype(x.dtype)


def _uniform(bound):
  return lambda key, shape, dtype: jax.random.uniform(key, shape, dtype, -bound, bound)


def _gla_mixer(cfg: LaplaceConfig, w: dict, u_BxTxD, table, idx, mask_BxT):
  """The Laplace mixer: W_qkvg → simple GLA → self-augmentation → Head RMSNorm → ⊙ SiLU(g) → W_out.
  `table` is every GLA layer's state [L_gla, B, H, K, V] (or None), this layer's at `idx`. Returns (output
  [B, T, D] in the compute dtype, the table with this layer's state updated, or None)."""
  B, T, _ = u_BxTxD.shape
  H, K, V = cfg.n_heads, cfg.d_k, cfg.d_v
  cdt = jnp.dtype(cfg.compute_dtype)
  mm = lambda a, m: _batch_sharded(jnp.dot(a.astype(cdt), m.astype(cdt)))
  qkvg = mm(u_BxTxD, w["w_qkvg"])
  q, k, v, g = jnp.split(qkvg, np.cumsum([cfg.qk_width, cfg.qk_width, cfg.v_width]), axis=-1)
  q_BxTxHxK, k_BxTxHxK = q.reshape(B, T, H, K), k.reshape(B, T, H, K)
  v_BxTxHxV = v.reshape(B, T, H, V)
  g_gamma = jnp.asarray(log_decays(cfg))
  if T == 1 and table is not None and mask_BxT is None:
    # this layer's rows of the state table rewritten in place (a Pallas kernel on GPUs)
    o1, table = gla_decode.gla_decode_layer(q_BxTxHxK[:, 0], k_BxTxHxK[:, 0], v_BxTxHxV[:, 0], g_gamma,
                                            table, idx)
    o_BxTxHxV = o1[:, None]
  else:
    s0 = None if table is None else table[idx]
    form, unroll = gla_form_for_backend(cfg, platform.backend())
    o_BxTxHxV, s_new = gla.chunk_simple_gla(
        q_BxTxHxK, k_BxTxHxK, v_BxTxHxV, g_gamma, initial_state=s0, mask=mask_BxT,
        chunk_size=min(cfg.chunk_size, T), unroll=unroll, form=form)
    if table is not None:
      table = jax.lax.dynamic_update_index_in_dim(table, s_new.astype(table.dtype), idx, 0)

  # Self-augmentation: a gated skip of the value, σ(q·(a⊙k)) = ½ at initialisation.
  gate_BxTxH = jax.nn.sigmoid(jnp.einsum("bthk,hk,bthk->bth", q_BxTxHxK.astype(F32),
                                         w["aug_balance"].astype(F32), k_BxTxHxK.astype(F32)))
  o = o_BxTxHxV.astype(F32) + gate_BxTxH[..., None] * v_BxTxHxV.astype(F32)
  # Head RMSNorm, one weight per decay tier (heads of similar memory length share it).
  tier_scale_HxV = jnp.repeat(w["head_norm_scale"], H // cfg.n_decay_tiers, axis=0)
  o = o * jax.lax.rsqrt(jnp.square(o).mean(-1, keepdims=True) + cfg.norm_eps) * tier_scale_HxV
  o = o.reshape(B, T, H * V).astype(cdt) * nn.silu(g)
  return mm(o, w["w_out"]), table


def _attention_mixer(cfg: LaplaceConfig, w: dict, u_BxTxD, cache, mask_BxT, windowed: bool = False):
  """Causal softmax attention: W_qkv → RoPE(q, k) → attention → W_o, over every earlier position or, if
  `windowed`, the last cfg.window. `cache` is None (a sequence from position 0) or (k_tables, v_tables, idx,
  pos_B): every A layer's KV caches [L_A, B, S, H, hd], or if windowed every S layer's rings [L_S, B, H, W, hd],
  and this layer's index. Returns (output [B, T, D], the updated pair of tables or None)."""
  B, T, _ = u_BxTxD.shape
  H, hd = cfg.attn_n_heads, cfg.attn_head_dim
  cdt = jnp.dtype(cfg.compute_dtype)
  mm = lambda a, m: _batch_sharded(jnp.dot(a.astype(cdt), m.astype(cdt)))
  q, k, v = jnp.split(mm(u_BxTxD, w["w_qkv"]).reshape(B, T, 3 * H, hd), 3, axis=2)
  pos_B = jnp.zeros((B,), jnp.int32) if cache is None else cache[-1]
  pos_BxT = pos_B[:, None] + jnp.arange(T)[None]
  q, k = attention.rope(q, pos_BxT, cfg.rope_base), attention.rope(k, pos_BxT, cfg.rope_base)
  n_B = jnp.full((B,), T, jnp.int32) if mask_BxT is None else mask_BxT.sum(1).astype(jnp.int32)
  if cache is None:
    whole = attention.causal_attention if not windowed else (
        lambda q, k, v: window_attention.window_attention(q, k, v, cfg.window))
    o, new_cache = whole(q, k, v), None
  else:
    k_tables, v_tables, idx = cache[:3]
    if T == 1 and mask_BxT is None:  # decode: one row per sequence written into the tables in place
      decode = window_attention.ring_decode_attention if windowed else attention.cache_decode_attention
      o, k_tables, v_tables = decode(q, k, v, k_tables, v_tables, idx, pos_B)
    else:
      chunk = window_attention.ring_chunk_attention if windowed else attention.cached_attention
      o, k_one, v_one = chunk(q, k, v, k_tables[idx], v_tables[idx], pos_B, n_B)
      put = lambda t, x: jax.lax.dynamic_update_index_in_dim(t, x, idx, 0)
      k_tables, v_tables = put(k_tables, k_one), put(v_tables, v_one)
    new_cache = (k_tables, v_tables)
  return mm(o.reshape(B, T, H * hd), w["w_o"]), new_cache


# ---- parameter declarations: {name: (initializer, unstacked shape)}, the one table of shapes ------------

def _initializers(cfg: LaplaceConfig):
  return (nn.initializers.normal(cfg.init_std), nn.initializers.normal(cfg.init_std / np.sqrt(2 * cfg.n_layers)),
          nn.initializers.ones, nn.initializers.zeros)


def _norm_param_specs(cfg: LaplaceConfig) -> dict:
  _, _, ones, _ = _initializers(cfg)
  return {"ln1_scale": (ones, (cfg.d_model,)), **({"ln2_scale": (ones, (cfg.d_model,))} if cfg.ffn else {})}


def _conv_param_specs(cfg: LaplaceConfig) -> dict:
  D, W = cfg.d_model, cfg.conv_size
  return {"conv_kernel": (_uniform(1 / np.sqrt(W)), (W, D)), "conv_bias": (nn.initializers.zeros, (D,))}


def _mixer_param_specs(cfg: LaplaceConfig, mixer: str) -> dict:
  normal, out_init, ones, zeros = _initializers(cfg)
  D = cfg.d_model
  if mixer == "G":
    return {"w_qkvg": (normal, (D, cfg.qkvg_width)), "aug_balance": (zeros, (cfg.n_heads, cfg.d_k)),
            "head_norm_scale": (ones, (cfg.n_decay_tiers, cfg.d_v)), "w_out": (out_init, (cfg.v_width, D))}
  if mixer in ("A", "S"):  # full and windowed attention: the same weights
    return {"w_qkv": (normal, (D, 3 * cfg.attn_width)), "w_o": (out_init, (cfg.attn_width, D))}
  raise ValueError(f"mixer {mixer!r}: expected one of {sorted(MIXERS)}.")


def _ffn_param_specs(cfg: LaplaceConfig) -> dict:
  if not cfg.ffn:
    return {}
  normal, out_init, _, _ = _initializers(cfg)
  D = cfg.d_model
  return {"w1": (normal, (D, cfg.d_ff)), "w2": (normal, (D, cfg.d_ff)), "w3": (out_init, (cfg.d_ff, D))}


def layer_param_specs(cfg: LaplaceConfig, mixer: str = "G") -> dict:
  """One layer's parameters in creation order (which the init RNG's split follows: norms, conv, mixer, FFN):
  {name: (initializer, unstacked shape)}. Block makes exactly these; config.layer_shapes reads them."""
  return {**_norm_param_specs(cfg), **_conv_param_specs(cfg), **_mixer_param_specs(cfg, mixer),
          **_ffn_param_specs(cfg)}


def layer_param_shapes(cfg: LaplaceConfig, mixer: str = "G") -> dict[str, tuple[int, ...]]:
  """One layer's parameter shapes (unstacked), keyed by leaf name: config.layer_shapes."""
  return {name: shape for name, (_, shape) in layer_param_specs(cfg, mixer).items()}


def model_param_specs(cfg: LaplaceConfig) -> dict:
  """LaplaceLM's own parameters around the layers: {name: (initializer, shape)}."""
  normal, _, ones, _ = _initializers(cfg)
  D, V = cfg.d_model, cfg.vocab_size
  return {"embed": (normal, (V, D)), "final_norm_scale": (ones, (D,)), "lm_head": (normal, (D, V))}


def model_param_shapes(cfg: LaplaceConfig) -> dict[str, tuple[int, ...]]:
  return {name: shape for name, (_, shape) in model_param_specs(cfg).items()}


class Block(nn.Module):
  """One decoder layer whose mixer is GLA ('G'), attention ('A') or windowed attention ('S'), at position
  `slot` of the pattern.

  Sequence mode (T tokens, state optional) and, for T == 1 with a state, the single-token recurrent step.
  The decode state of every layer rides in the carry and this layer updates its slices in place: returning
  per-layer states as scan outputs would build a second full state copy."""
  cfg: LaplaceConfig
  mixer: str = "G"
  slot: int = 0

  @nn.compact
  def __call__(self, carry, group_idx, mask_BxT):
    x_BxTxD, state = carry
    cfg = self.cfg
    pattern = cfg.mixers
    layer_idx = group_idx * len(pattern) + self.slot                     # index into state["conv"]
    mix_idx = group_idx * pattern.count(self.mixer) + pattern[:self.slot].count(self.mixer)
    cdt = jnp.dtype(cfg.compute_dtype)
    # Parameters made in the declared order (the init RNG's): norms, conv, mixer, FFN.
    w = {name: self.param(name, init, shape, jnp.dtype(cfg.param_dtype))
         for name, (init, shape) in layer_param_specs(cfg, self.mixer).items()}
    ln1, ln2, conv_k, conv_b = w["ln1_scale"], w.get("ln2_scale"), w["conv_kernel"], w["conv_bias"]
    mix_w = {name: w[name] for name in _mixer_param_specs(cfg, self.mixer)}
    B, T, _ = x_BxTxD.shape
    mm = lambda a, w: _batch_sharded(jnp.dot(a.astype(cdt), w.astype(cdt)))

    # Causal depth-wise conv (laplace_jax/short_conv.py); the decode state keeps a ring of the last W inputs.
    h = _batch_sharded(_layer_norm(x_BxTxD, ln1, cfg.norm_eps))
    decoding = T == 1 and state is not None and mask_BxT is None
    n_B = jnp.full((B,), T, jnp.int32) if mask_BxT is None else mask_BxT.sum(1).astype(jnp.int32)
    if state is None:
      conv, _ = short_conv.conv_sequence(h, conv_k.astype(cdt), conv_b)
    elif decoding:
      conv, table = short_conv.conv_decode(h, conv_k.astype(cdt), conv_b, state["conv"], layer_idx, state["pos"])
      state = dict(state, conv=table)
    else:
      conv, ring = short_conv.conv_sequence(h, conv_k.astype(cdt), conv_b, state["conv"][layer_idx],
                                            state["pos"], n_B)
      state = dict(state, conv=jax.lax.dynamic_update_index_in_dim(state["conv"], ring, layer_idx, 0))
    u = nn.silu(conv)

    if self.mixer == "G":
      mixed, table = _gla_mixer(cfg, mix_w, u, None if state is None else state["gla"], mix_idx, mask_BxT)
      if state is not None:
        state = dict(state, gla=table)
    elif self.mixer == "S":  # a training carry has no rings either: every segment starts afresh
      rings = None if state is None or "ring_k" not in state else (state["ring_k"], state["ring_v"], mix_idx,
                                                                    state["pos"])
      mixed, kv = _attention_mixer(cfg, mix_w, u, rings, mask_BxT, windowed=True)
      if kv is not None:
        state = dict(state, ring_k=kv[0], ring_v=kv[1])
    else:
      # A training carry (init_carry) has no KV cache: attention layers then start every segment afresh.
      cache = None if state is None or "k" not in state else (state["k"], state["v"], mix_idx, state["pos"])
      mixed, kv = _attention_mixer(cfg, mix_w, u, cache, mask_BxT)
      if kv is not None:
        state = dict(state, k=kv[0], v=kv[1])
    x = x_BxTxD + mixed.astype(x_BxTxD.dtype)

    if cfg.ffn:  # else a mixer-only layer (cfg.ffn false)
      h2 = _layer_norm(x, ln2, cfg.norm_eps)
      x = _batch_sharded(x + mm(nn.silu(mm(h2, w["w1"])) * mm(h2, w["w2"]), w["w3"]).astype(x.dtype))

    return (x, state), None


def _layer(cfg: LaplaceConfig, initializing: bool, scanned: bool = True):
  """Block as the layer scan runs it: inside the train step's shard_map each layer's weights arrive as FSDP
  shards and are gathered here in the compute dtype, per layer and inside remat (laplace_jax/fsdp.py);
  elsewhere they are whole and pass unchanged. Then rematerialised in the backward pass if cfg.remat: inside a
  loop the recomputation cannot be merged with the forward (prevent_cse=False is safe and cheaper); unrolled,
  straight-line code could be, so the barrier stays."""
  cdt = jnp.dtype(cfg.compute_dtype)
  full = {n: s for letter in set(cfg.mixers) for n, s in layer_param_shapes(cfg, letter).items()}
  block = nn.map_variables(Block, "params", lambda v: {c: fsdp.gather_tree(t, full, cdt) for c, t in v.items()},
                           init=initializing)
  return nn.remat(block, prevent_cse=not scanned) if cfg.remat else block


class Group(nn.Module):
  """One repeat of a mixer pattern longer than one letter: its blocks in order (scanned over the groups)."""
  cfg: LaplaceConfig

  @nn.compact
  def __call__(self, carry, group_idx, mask_BxT):
    block = _layer(self.cfg, self.is_initializing(), layers_scanned(self.cfg, platform.backend()))
    for i, letter in enumerate(self.cfg.mixers):
      carry, _ = block(self.cfg, letter, i, name=f"block{i}")(carry, group_idx, mask_BxT)
    return carry, None


class LaplaceLM(nn.Module):
  """Embedding → scanned blocks → final LayerNorm → untied LM head. Returns (logits fp32, new state).

  A one-letter mixer pattern scans its Block over the layers (params layers/{name: [L, ...]}); a longer
  one scans a Group of blocks over the pattern's repeats (params layers/block{i}/{name: [L/len, ...]})."""
  cfg: LaplaceConfig

  @nn.compact
  def __call__(self, tokens_BxT, state=None, mask_BxT=None, last_only=False, positions_BxK=None):
    cfg = self.cfg
    pdt, cdt = jnp.dtype(cfg.param_dtype), jnp.dtype(cfg.compute_dtype)
    top = model_param_specs(cfg)
    embed = self.param("embed", *top["embed"], pdt)
    x = _batch_sharded(embed[tokens_BxT].astype(cdt))
    scan = layers_scanned(cfg, platform.backend())
    if len(cfg.mixers) == 1:
      body, args = _layer(cfg, self.is_initializing(), scan), (cfg, cfg.mixers, 0)
    else:
      body, args = Group, (cfg,)
    # Unrolled (scan_layers false): the same scan fully unrolled (unroll=0: every step, also a single one,
    # which True leaves a loop), so the parameter tree (stacked [L, ...]), the initialisation and the
    # checkpoints are the scanned form's; each layer reads a static slice of the stacked weights.
    scanned = nn.scan(body, variable_axes={"params": 0}, split_rngs={"params": True},
                      in_axes=(0, nn.broadcast), out_axes=0, length=cfg.n_groups,
                      unroll=1 if scan else 0)(*args, name="layers")
    (x, new_state), _ = scanned((x, state), jnp.arange(cfg.n_groups), mask_BxT)
    over_B = None
    if new_state is not None:
      n_B = jnp.full(x.shape[:1], x.shape[1]) if mask_BxT is None else mask_BxT.sum(1)
      new_state = {**new_state, "pos": new_state["pos"] + n_B.astype(jnp.int32)}
      if "k" in new_state:  # full attention: the cache dropped some of this row's keys
        over_B = new_state["pos"] > new_state["k"].shape[2]
    x = _layer_norm(x, self.param("final_norm_scale", *top["final_norm_scale"], pdt), cfg.norm_eps)
    if last_only:  # logits of each row's last real token only: [B, D]
      last_B = (jnp.full(x.shape[:1], x.shape[1]) if mask_BxT is None else mask_BxT.sum(1)) - 1
      x = jnp.take_along_axis(x, jnp.maximum(last_B, 0)[:, None, None], axis=1)[:, 0]
    elif positions_BxK is not None:  # logits at chosen positions only: [B, K, V] (the LM head's cost / T·K)
      x = jnp.take_along_axis(x, positions_BxK[..., None], axis=1)
    head = self.param("lm_head", *top["lm_head"], pdt)
    logits = _batch_sharded(jnp.dot(x.astype(cdt), head.astype(cdt), preferred_element_type=F32))
    if over_B is not None:
      logits = jnp.where(over_B.reshape(-1, *[1] * (logits.ndim - 1)), jnp.nan, logits)
    return logits, new_state


# ---- pure functions -----------------------------------------------------------------------------

def init_params(cfg: LaplaceConfig, rng) -> dict:
  """Parameters as a plain nested dict: embed, final_norm_scale, lm_head, layers/{name: [L, ...]}."""
  tokens = jnp.zeros((1, cfg.chunk_size), jnp.int32)
  return LaplaceLM(cfg).init(rng, tokens)["params"]


def _check_tokens(tokens, cfg):
  dtype = getattr(tokens, "dtype", None) or np.asarray(tokens).dtype
  if not jnp.issubdtype(dtype, jnp.integer):
    raise ValueError(f"tokens have dtype {dtype}: expected integer token ids.")
  if isinstance(tokens, jax.core.Tracer):
    return
  t = np.asarray(tokens)  # a host copy: compiled callers pass tracers and skip this
  if t.size and (t.min() < 0 or t.max() >= cfg.vocab_size):
    raise ValueError(f"token ids span [{t.min()}, {t.max()}]: expected ids in [0, {cfg.vocab_size}) for this "
                     "config's vocabulary. Check the tokenizer matches the model.")


def forward(params, tokens_BxT, *, cfg: LaplaceConfig, positions_BxK=None):
  """Training/eval forward from a zero state: logits [B, T, V] in fp32, or [B, K, V] at `positions_BxK`
  only (tasks scored at a few positions per row skip the LM head elsewhere)."""
  if jnp.ndim(tokens_BxT) != 2:
    raise ValueError(f"tokens have shape {jnp.shape(tokens_BxT)}: expected [B, T].")
  _check_tokens(tokens_BxT, cfg)
  logits, _ = LaplaceLM(cfg).apply({"params": params}, tokens_BxT, positions_BxK=positions_BxK)
  return logits


def init_carry(cfg: LaplaceConfig, batch_size: int) -> dict:
  """Zero training carry for state passing: init_state's GLA states, conv rings and positions, no attention
  cache or window rings (attention layers carry nothing across segments). Same layout as init_state."""
  state = {}
  if "G" in cfg.mixers:
    state["gla"] = jnp.zeros((cfg.n_mixer_layers("G"), batch_size, cfg.n_heads, cfg.d_k, cfg.d_v), F32)
  state["conv"] = jnp.zeros((cfg.n_layers, batch_size, cfg.conv_size, cfg.d_model), F32)
  state["pos"] = jnp.zeros((batch_size,), jnp.int32)
  return state


def forward_carry(params, tokens_BxT, carry, *, cfg: LaplaceConfig):
  """Training forward from a carried state (state passing): (logits [B, T, V] fp32, the carry after the
  last token). `carry` is init_carry's layout; gradients do not flow into it (the segment boundary)."""
  if jnp.ndim(tokens_BxT) != 2:
    raise ValueError(f"tokens have shape {jnp.shape(tokens_BxT)}: expected [B, T].")
  _check_tokens(tokens_BxT, cfg)
  return LaplaceLM(cfg).apply({"params": params}, tokens_BxT, jax.lax.stop_gradient(carry))


def init_state(cfg: LaplaceConfig, batch_size: int, max_len: int | None = None) -> dict:
  """Zero decode state for `batch_size` sequences: pos [B] int32 (tokens consumed), and layer-major, fp32,
  gla [L_gla,B,H,d_k,d_v] (GLA layers) and conv [L,B,conv,D] (every layer: a ring of the last conv_size
  inputs, laplace_jax/short_conv.py). Attention layers add a KV cache k, v [L_attn,B,max_len,H,hd] in the
  compute dtype (its length fixed here, so shapes stay static), sliding-window layers rings of the last
  cfg.window keys and values ring_k, ring_v [L_S,B,H,window,hd]. state_batch_axes gives each leaf's batch axis."""
  B = batch_size
  state = init_carry(cfg, B)
  if "A" in cfg.mixers:
    if not isinstance(max_len, (int, np.integer)) or max_len < 1:
      raise ValueError(f"init_state(max_len={max_len!r}): mixers={cfg.mixers!r} has attention layers, whose "
                       "KV cache length is fixed when the state is made; pass max_len=N, the longest context "
                       "(prompt + generated tokens) the state must hold.")
    kv = (cfg.n_mixer_layers("A"), B, int(max_len), cfg.attn_n_heads, cfg.attn_head_dim)
    state["k"] = jnp.zeros(kv, jnp.dtype(cfg.compute_dtype))
    state["v"] = jnp.zeros(kv, jnp.dtype(cfg.compute_dtype))
  if "S" in cfg.mixers:
    ring = (cfg.n_mixer_layers("S"), B, cfg.attn_n_heads, cfg.window, cfg.attn_head_dim)
    state["ring_k"] = jnp.zeros(ring, jnp.dtype(cfg.compute_dtype))
    state["ring_v"] = jnp.zeros(ring, jnp.dtype(cfg.compute_dtype))
  return state


def state_batch_axes(state) -> dict:
  """Each decode-state leaf's sequence (batch) axis, by the layout contract every consumer relies on (the
  serving engine's slot table, its state cache, the train step's carry): `pos` is [B] (axis 0); every other
  leaf is layer-major [L_x, B, ...] (axis 1)."""
  return {name: 0 if name == "pos" else 1 for name in state}


def check_state(state, cfg: LaplaceConfig, batch_size: int | None = None) -> int:
  """Raise ValueError unless `state` is a decode state of this config; return its batch size."""
  keys = sorted(jax.eval_shape(lambda: init_state(cfg, 1, 1)))
  if not isinstance(state, dict) or sorted(state) != keys:
    raise ValueError(f"state has keys {sorted(state) if isinstance(state, dict) else type(state)}: expected "
                     f"{keys} (mixers={cfg.mixers!r}) from laplace_jax.model.init_state(cfg, batch).")
  B = state["conv"].shape[state_batch_axes(state)["conv"]] if state["conv"].ndim == 4 else -1
  S = state["k"].shape[2] if "k" in state and state["k"].ndim == 5 else 1
  want = jax.eval_shape(lambda: init_state(cfg, max(B, 1), S))
  for name in keys:
    got = state[name]
    if got.shape != want[name].shape or got.dtype != want[name].dtype:
      raise ValueError(f"state['{name}'] is {got.dtype}{list(got.shape)}: expected {want[name].dtype}"
                       f"{list(want[name].shape)} for this config. The state was made for another config; "
                       "build it with init_state(cfg, batch) for the model you run.")
  if batch_size is not None and B != batch_size:
    raise ValueError(f"state holds {B} sequences but tokens have batch {batch_size}.")
  return B


def _check_capacity(state, new_tokens_B) -> None:
  """Attention layers only: raise if a row's context would outgrow the KV cache (host values only;
  under jit such rows get NaN logits instead, see LaplaceLM)."""
  if "k" not in state or isinstance(state["pos"], jax.core.Tracer) or isinstance(new_tokens_B,
                                                                                    jax.core.Tracer):
    return
  need = np.asarray(state["pos"]) + np.asarray(new_tokens_B)
  S = state["k"].shape[2]
  if (need > S).any():
    raise ValueError(f"a context of {int(need.max())} tokens does not fit the attention layers' KV cache of "
                     f"max_len={S} tokens: make the state with init_state(cfg, batch, max_len={int(need.max())}) "
                     "or more (attention state grows with context; GLA layers' does not).")


def decode_step(params, state, tokens_B, *, cfg: LaplaceConfig):
  """One token per sequence: (logits [B, V] fp32, new state). Pure; jit with cfg static."""
  if jnp.ndim(tokens_B) != 1:
    raise ValueError(f"tokens have shape {jnp.shape(tokens_B)}: expected [B], one token per sequence.")
  check_state(state, cfg, jnp.shape(tokens_B)[0])
  _check_tokens(tokens_B, cfg)
  _check_capacity(state, 1)
  logits, state = LaplaceLM(cfg).apply({"params": params}, tokens_B[:, None], state, last_only=True)
  return logits, state


def prefill_chunk(params, state, tokens_BxC, lengths_B, *, cfg: LaplaceConfig):
  """Consume one right-padded chunk: (logits at each row's last real token [B, V], new state).

  A row with length 0 keeps its state exactly (its logits are meaningless)."""
  B, C = jnp.shape(tokens_BxC)
  check_state(state, cfg, B)
  _check_tokens(tokens_BxC, cfg)
  _check_capacity(state, lengths_B)
  mask_BxC = jnp.arange(C)[None, :] < jnp.asarray(lengths_B)[:, None]
  logits, state = LaplaceLM(cfg).apply({"params": params}, tokens_BxC, state, mask_BxC, last_only=True)
  return logits, state


_prefill_chunk_jit = jax.jit(prefill_chunk, static_argnames=("cfg",))


def prefill(params, state, tokens_BxT, lengths_B=None, *, cfg: LaplaceConfig):
  """Any prompt length, walked in fixed cfg.chunk_size chunks through one compiled function.

  tokens [B, T] right-padded with per-row `lengths_B` (default T). Returns (logits [B, V], state)."""
  tokens = np.asarray(tokens_BxT)
  if tokens.ndim != 2:
    raise ValueError(f"tokens have shape {tokens.shape}: expected [B, T].")
  B, T = tokens.shape
  lengths = np.full((B,), T, np.int32) if lengths_B is None else np.asarray(lengths_B, np.int32)
  if lengths.shape != (B,) or (lengths < 0).any() or (lengths > T).any():
    raise ValueError(f"lengths {lengths.tolist()}: expected [B]={B} values in [0, {T}].")
  _check_tokens(tokens, cfg)
  check_state(state, cfg, B)
  _check_capacity(state, lengths)
  C = cfg.chunk_size
  n_chunks = max(1, -(-T // C))
  tokens = np.pad(tokens, [(0, 0), (0, n_chunks * C - T)]).astype(np.int32)
  last_logits = jnp.zeros((B, cfg.vocab_size), F32)
  for c in range(n_chunks):
    n_B = np.clip(lengths - c * C, 0, C).astype(np.int32)
    if not n_B.any():
      break
    logits, state = _prefill_chunk_jit(params, state, tokens[:, c * C:(c + 1) * C], n_B, cfg=cfg)
    last_logits = jnp.where(jnp.asarray(n_B > 0)[:, None], logits, last_logits)
  return last_logits, state
