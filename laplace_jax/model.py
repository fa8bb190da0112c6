"""The Laplace decoder as a functional Flax model, and its explicit-state inference functions.

One layer (REFERENCE.md): x → LayerNorm → causal depth-wise conv (k=4) + SiLU → W_qkvg → q, k, v, g →
simple GLA with a fixed geometric decay → + σ(q·(a⊙k))·v → Head RMSNorm per decay tier → ⊙ SiLU(g) → W_out
→ + x; then LayerNorm → GLU(SiLU) FFN → + x. Layers run under `nn.scan` (one compiled body).

Public, all pure functions of pytrees (`cfg` is static):
  init_params(cfg, rng) -> params            forward(params, tokens_BxT, cfg=) -> logits_BxTxV (fp32)
  init_state(cfg, batch) -> state            decode_step(params, state, tokens_B, cfg=) -> (logits_BxV, state)
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

from laplace_jax import fsdp, gla, gla_decode
from laplace_jax.config import LaplaceConfig, gla_form_for_backend, log_decays, param_shapes
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


class Block(nn.Module):
  """One decoder layer. Sequence mode (T tokens, state optional) and, for T == 1 with a state, the
  single-token recurrent step. The decode state of every layer rides in the carry and this layer updates
  its slice in place: returning per-layer states as scan outputs would build a second full state copy."""
  cfg: LaplaceConfig

  @nn.compact
  def __call__(self, carry, layer_idx, mask_BxT):
    x_BxTxD, state = carry
    layer_state = None if state is None else jax.tree.map(lambda s: s[layer_idx], state)
    cfg = self.cfg
    D, H, K, V, W = cfg.d_model, cfg.n_heads, cfg.d_k, cfg.d_v, cfg.conv_size
    pdt, cdt = jnp.dtype(cfg.param_dtype), jnp.dtype(cfg.compute_dtype)
    normal = nn.initializers.normal(cfg.init_std)
    out_init = nn.initializers.normal(cfg.init_std / np.sqrt(2 * cfg.n_layers))
    ones, zeros = nn.initializers.ones, nn.initializers.zeros
    p = lambda name, init, shape: self.param(name, init, shape, pdt)
    ln1, ln2 = p("ln1_scale", ones, (D,)), p("ln2_scale", ones, (D,))
    conv_k = p("conv_kernel", _uniform(1 / np.sqrt(W)), (W, D))
    conv_b = p("conv_bias", zeros, (D,))
    w_qkvg = p("w_qkvg", normal, (D, cfg.qkvg_width))
    aug_a = p("aug_balance", zeros, (H, K))
    head_norm = p("head_norm_scale", ones, (cfg.n_decay_tiers, V))
    w_out = p("w_out", out_init, (cfg.v_width, D))
    w1, w2 = p("w1", normal, (D, cfg.d_ff)), p("w2", normal, (D, cfg.d_ff))
    w3 = p("w3", out_init, (cfg.d_ff, D))
    B, T, _ = x_BxTxD.shape
    mm = lambda a, w: _batch_sharded(jnp.dot(a.astype(cdt), w.astype(cdt)))

    # Causal depth-wise conv over [previous W-1 inputs | this segment]; the decode state keeps the last W.
    h = _batch_sharded(_layer_norm(x_BxTxD, ln1, cfg.norm_eps))
    win_BxWxD = (jnp.zeros((B, W, D), F32) if layer_state is None else layer_state["conv"])
    decoding = T == 1 and layer_state is not None and mask_BxT is None
    if decoding:
      # One token: the conv reads exactly the new window. Written in place first and read back after, so
      # nothing reads the old window once it is overwritten (else XLA copies every layer's windows twice).
      new_win = jnp.concatenate([win_BxWxD[:, 1:], h.astype(F32)], axis=1)  # [B, W, D]
      state = dict(state, conv=jax.lax.dynamic_update_index_in_dim(state["conv"], new_win, layer_idx, 0))
      ext = state["conv"][layer_idx].astype(cdt)
      conv = sum(ext[:, i:i + 1] * conv_k[i].astype(cdt) for i in range(W)) + conv_b.astype(cdt)
    else:
      ext = jnp.concatenate([win_BxWxD.astype(cdt), h], axis=1)            # [B, W+T, D]
      conv = sum(ext[:, 1 + i:1 + i + T] * conv_k[i].astype(cdt) for i in range(W)) + conv_b.astype(cdt)
    u = nn.silu(conv)

    qkvg = mm(u, w_qkvg)
    q, k, v, g = jnp.split(qkvg, np.cumsum([cfg.qk_width, cfg.qk_width, cfg.v_width]), axis=-1)
    q_BxTxHxK, k_BxTxHxK = q.reshape(B, T, H, K), k.reshape(B, T, H, K)
    v_BxTxHxV = v.reshape(B, T, H, V)
    g_gamma = jnp.asarray(log_decays(cfg))
    s0 = None if layer_state is None else layer_state["gla"]
    if decoding:  # this layer's rows of the state table rewritten in place (a Pallas kernel on GPUs)
      o1, table = gla_decode.gla_decode_layer(q_BxTxHxK[:, 0], k_BxTxHxK[:, 0], v_BxTxHxV[:, 0], g_gamma,
                                              state["gla"], layer_idx)
      state = dict(state, gla=table)
      o_BxTxHxV = o1[:, None]
    else:
      form, unroll = gla_form_for_backend(cfg, jax.default_backend())
      o_BxTxHxV, s_new = gla.chunk_simple_gla(
          q_BxTxHxK, k_BxTxHxK, v_BxTxHxV, g_gamma, initial_state=s0, mask=mask_BxT,
          chunk_size=min(cfg.chunk_size, T), unroll=unroll, form=form)

    # Self-augmentation: a gated skip of the value, σ(q·(a⊙k)) = ½ at initialisation.
    gate_BxTxH = jax.nn.sigmoid(jnp.einsum("bthk,hk,bthk->bth", q_BxTxHxK.astype(F32), aug_a.astype(F32),
                                           k_BxTxHxK.astype(F32)))
    o = o_BxTxHxV.astype(F32) + gate_BxTxH[..., None] * v_BxTxHxV.astype(F32)
    # Head RMSNorm, one weight per decay tier (heads of similar memory length share it).
    tier_scale_HxV = jnp.repeat(head_norm, H // cfg.n_decay_tiers, axis=0)
    o = o * jax.lax.rsqrt(jnp.square(o).mean(-1, keepdims=True) + cfg.norm_eps) * tier_scale_HxV
    o = o.reshape(B, T, H * V).astype(cdt) * nn.silu(g)
    x = x_BxTxD + mm(o, w_out).astype(x_BxTxD.dtype)

    h2 = _layer_norm(x, ln2, cfg.norm_eps)
    x = _batch_sharded(x + mm(nn.silu(mm(h2, w1)) * mm(h2, w2), w3).astype(x.dtype))

    if state is None:
      return (x, None), None
    if not decoding:  # new conv window: the last W real inputs (rows are right-padded: real tokens first)
      n_B = jnp.full((B,), T) if mask_BxT is None else mask_BxT.sum(1).astype(jnp.int32)
      ext32 = jnp.concatenate([win_BxWxD, h.astype(F32)], axis=1)
      new_win = jax.vmap(lambda e, n: jax.lax.dynamic_slice_in_dim(e, n, W, axis=0))(ext32, n_B)
    new = {} if decoding else {"gla": s_new, "conv": new_win}
    state = dict(state, **{k: jax.lax.dynamic_update_index_in_dim(state[k], n.astype(state[k].dtype), layer_idx, 0)
                           for k, n in new.items()})
    return (x, state), None


class LaplaceLM(nn.Module):
  """Embedding → scanned blocks → final LayerNorm → untied LM head. Returns (logits fp32, new state)."""
  cfg: LaplaceConfig

  @nn.compact
  def __call__(self, tokens_BxT, state=None, mask_BxT=None, last_only=False):
    cfg = self.cfg
    pdt, cdt = jnp.dtype(cfg.param_dtype), jnp.dtype(cfg.compute_dtype)
    embed = self.param("embed", nn.initializers.normal(cfg.init_std), (cfg.vocab_size, cfg.d_model), pdt)
    x = _batch_sharded(embed[tokens_BxT].astype(cdt))
    # Inside the train step's shard_map each layer's weights arrive as FSDP shards and are gathered here,
    # per layer and inside remat (laplace_jax/fsdp.py); elsewhere they are whole and pass unchanged.
    shapes = param_shapes(cfg)["layer"]
    block = nn.map_variables(Block, "params", lambda v: {c: fsdp.gather_tree(t, shapes, cdt)
                                                          for c, t in v.items()}, init=self.is_initializing())
    block = nn.remat(block, prevent_cse=False) if cfg.remat else block
    blocks = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True},
                     in_axes=(0, nn.broadcast), out_axes=0, length=cfg.n_layers)
    (x, new_state), _ = blocks(cfg, name="layers")((x, state), jnp.arange(cfg.n_layers), mask_BxT)
    x = _layer_norm(x, self.param("final_norm_scale", nn.initializers.ones, (cfg.d_model,), pdt),
                    cfg.norm_eps)
    if last_only:  # logits of each row's last real token only: [B, D]
      last_B = (jnp.full(x.shape[:1], x.shape[1]) if mask_BxT is None else mask_BxT.sum(1)) - 1
      x = jnp.take_along_axis(x, jnp.maximum(last_B, 0)[:, None, None], axis=1)[:, 0]
    head = self.param("lm_head", nn.initializers.normal(cfg.init_std), (cfg.d_model, cfg.vocab_size), pdt)
    logits = _batch_sharded(jnp.dot(x.astype(cdt), head.astype(cdt), preferred_element_type=F32))
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


def forward(params, tokens_BxT, *, cfg: LaplaceConfig):
  """Training/eval forward from a zero state: logits [B, T, V] in fp32."""
  if jnp.ndim(tokens_BxT) != 2:
    raise ValueError(f"tokens have shape {jnp.shape(tokens_BxT)}: expected [B, T].")
  _check_tokens(tokens_BxT, cfg)
  logits, _ = LaplaceLM(cfg).apply({"params": params}, tokens_BxT)
  return logits


def init_state(cfg: LaplaceConfig, batch_size: int) -> dict:
  """Zero decode state for `batch_size` sequences: gla [L,B,H,d_k,d_v] and conv [L,B,conv,D], fp32."""
  L = cfg.n_layers
  return {"gla": jnp.zeros((L, batch_size, cfg.n_heads, cfg.d_k, cfg.d_v), F32),
          "conv": jnp.zeros((L, batch_size, cfg.conv_size, cfg.d_model), F32)}


def check_state(state, cfg: LaplaceConfig, batch_size: int | None = None) -> int:
  """Raise ValueError unless `state` is a decode state of this config; return its batch size."""
  if not isinstance(state, dict) or set(state) != {"gla", "conv"}:
    raise ValueError(f"state has keys {sorted(state) if isinstance(state, dict) else type(state)}: expected "
                     "a dict with 'gla' and 'conv' from laplace_jax.model.init_state(cfg, batch).")
  B = state["gla"].shape[1] if state["gla"].ndim == 5 else -1
  want = jax.eval_shape(lambda: init_state(cfg, max(B, 1)))
  for name in ("gla", "conv"):
    got = state[name]
    if got.shape != want[name].shape or got.dtype != want[name].dtype:
      raise ValueError(f"state['{name}'] is {got.dtype}{list(got.shape)}: expected {want[name].dtype}"
                       f"{list(want[name].shape)} for this config. The state was made for another config; "
                       "build it with init_state(cfg, batch) for the model you run.")
  if batch_size is not None and B != batch_size:
    raise ValueError(f"state holds {B} sequences but tokens have batch {batch_size}.")
  return B


def decode_step(params, state, tokens_B, *, cfg: LaplaceConfig):
  """One token per sequence: (logits [B, V] fp32, new state). Pure; jit with cfg static."""
  if jnp.ndim(tokens_B) != 1:
    raise ValueError(f"tokens have shape {jnp.shape(tokens_B)}: expected [B], one token per sequence.")
  check_state(state, cfg, jnp.shape(tokens_B)[0])
  _check_tokens(tokens_B, cfg)
  logits, state = LaplaceLM(cfg).apply({"params": params}, tokens_B[:, None], state, last_only=True)
  return logits, state


def prefill_chunk(params, state, tokens_BxC, lengths_B, *, cfg: LaplaceConfig):
  """Consume one right-padded chunk: (logits at each row's last real token [B, V], new state).

  A row with length 0 keeps its state exactly (its logits are meaningless)."""
  B, C = jnp.shape(tokens_BxC)
  check_state(state, cfg, B)
  _check_tokens(tokens_BxC, cfg)
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
