"""The Laplace decoder as a functional Flax model, and its explicit-state inference functions.

One layer (REFERENCE.md): x → LayerNorm → causal depth-wise conv (k=4) + SiLU → W_qkvg → q, k, v, g →
simple GLA with a fixed geometric decay → + σ(q·(a⊙k))·v → Head RMSNorm per decay tier → ⊙ SiLU(g) → W_out
→ + x; then LayerNorm → GLU(SiLU) FFN → + x (cfg.ffn false: no FFN, a mixer-only layer). Layers run under
`nn.scan` (one compiled body), or the same scan unrolled (`cfg.scan_layers`, the default on Neuron) with the same parameters.
`cfg.mixers` may swap the mixer (W_qkvg … W_out) for causal softmax attention with RoPE ('A', same heads,
W_qkv and W_o of the same parameter budget) or sliding-window attention over the last cfg.window tokens ('S',
the same weights; laplace_jax/ops/window_attention.py) in a pattern repeated over the layers; the scan then runs
over the pattern's repeats, one compiled body holding one block per letter.

A layer's pieces are modules (laplace_jax/model/mixers.py: ShortConv, GLAMixer, AttentionMixer, WindowAttentionMixer,
GluFFN) that declare their parameters ({name: (initializer, shape)}) and their decode state per layer; Block
composes them with its two norms, their parameters at the layer's own level (flat layers/{name}: the
checkpoints' paths). The shape table (layer_param_specs, counts.layer_shapes) and init_state / init_carry are
assembled from those declarations, never written a second time.

Public, all pure functions of pytrees (`cfg` is static):
  init_params(cfg, rng) -> params            forward(params, tokens_BxT, cfg=) -> logits_BxTxY (fp32)
  init_state(cfg, batch[, max_len]) -> state decode_step(params, state, tokens_B, cfg=) -> (logits_BxY, state)
  init_carry(cfg, batch) -> carry            forward_carry(params, tokens_BxT, carry, cfg=) -> (logits, carry)
  prefill_chunk(params, state, tokens_BxC, lengths_B, cfg=) -> (logits_BxY, state)
  prefill(params, state, tokens_BxT, lengths_B=None, cfg=) -> (logits_BxY, state)   host loop, one compile
state and carry are DecodeStates (laplace_jax/model/state.py); table_row(pattern, group, slot, letter) is each
layer's row in them.

Initialisation (GPT-2 / Megatron practice): matrices N(0, 0.02²), the residual output projections (W_out or
W_o, W3) scaled by 1/√(2L); norms 1; conv kernel U(±1/√k) with zero bias (PyTorch's Conv1d range);
aug_balance 0 (a half-strength value skip at start). Parameters are made in the order norms, conv, mixer, FFN:
the init RNG's split follows it.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from laplace_jax import fsdp, platform
from laplace_jax.model import mixers
from laplace_jax.model.config import MIXERS, LaplaceConfig, layers_scanned
from laplace_jax.model.state import DecodeState
from laplace_jax.ops import context_parallel
from laplace_jax.ops.segments import Segments

F32 = jnp.float32


def _layer_norm(x, scale, eps):
  """Weight-only LayerNorm, statistics in fp32."""
  x32 = x.astype(F32)
  mu = x32.mean(-1, keepdims=True)
  var = jnp.square(x32 - mu).mean(-1, keepdims=True)
  return ((x32 - mu) * jax.lax.rsqrt(var + eps) * scale).astype(x.dtype)


# ---- parameter declarations: {name: (initializer, unstacked shape)}, the one table of shapes ------------


def _norm_param_specs(cfg: LaplaceConfig) -> dict:
  _, _, ones, _ = mixers.initializers(cfg)
  return {"ln1_scale": (ones, (cfg.d_model,)), **({"ln2_scale": (ones, (cfg.d_model,))} if cfg.ffn else {})}


def _mixer_module(mixer: str) -> type[mixers.LayerPart]:
  if mixer not in mixers.MIXER_MODULES:
    raise ValueError(f"mixer {mixer!r}: expected one of {sorted(MIXERS)}.")
  return mixers.MIXER_MODULES[mixer]


def layer_param_specs(cfg: LaplaceConfig, mixer: str = "G") -> dict:
  """One layer's parameters in creation order (which the init RNG's split follows: norms, conv, mixer, FFN):
  {name: (initializer, unstacked shape)}, each piece's own declaration. Block makes exactly these;
  counts.layer_shapes reads them."""
  ffn = mixers.GluFFN.param_specs(cfg) if cfg.ffn else {}
  return {
    **_norm_param_specs(cfg),
    **mixers.ShortConv.param_specs(cfg),
    **_mixer_module(mixer).param_specs(cfg),
    **ffn,
  }


def layer_param_shapes(cfg: LaplaceConfig, mixer: str = "G") -> dict[str, tuple[int, ...]]:
  """One layer's parameter shapes (unstacked), keyed by leaf name: counts.layer_shapes."""
  return {name: shape for name, (_, shape) in layer_param_specs(cfg, mixer).items()}


def model_param_specs(cfg: LaplaceConfig) -> dict:
  """LaplaceLM's own parameters around the layers: {name: (initializer, shape)}."""
  normal, _, ones, _ = mixers.initializers(cfg)
  D, V = cfg.d_model, cfg.vocab_size
  return {"embed": (normal, (V, D)), "final_norm_scale": (ones, (D,)), "lm_head": (normal, (D, V))}


def model_param_shapes(cfg: LaplaceConfig) -> dict[str, tuple[int, ...]]:
  return {name: shape for name, (_, shape) in model_param_specs(cfg).items()}


class Block(nn.Module):
  """One decoder layer whose mixer is GLA ('G'), attention ('A') or windowed attention ('S'), at position
  `slot` of the pattern: x → LayerNorm → ShortConv → SiLU → mixer → + x; then LayerNorm → GluFFN → + x.

  Its pieces (laplace_jax/model/mixers.py) make their parameters in the layer's own scope (nn.share_scope), in the
  order norms, conv, mixer, FFN. Sequence mode (T tokens, state optional) and, for T == 1 with a state, the
  single-token recurrent step. The decode state of every layer rides in the carry and each piece updates its
  own rows in place: returning per-layer states as scan outputs would build a second full state copy."""

  cfg: LaplaceConfig
  mixer: str = "G"
  slot: int = 0

  @nn.compact
  def __call__(self, carry, group_idx, mask_BxT, segments=None):
    x_BxTxD, state = carry
    cfg, pattern = self.cfg, self.cfg.mixers
    layer_idx = table_row(pattern, group_idx, self.slot)  # its row in the conv table (every layer's)
    mix_idx = table_row(pattern, group_idx, self.slot, self.mixer)  # its row in its mixer's table
    norms = mixers.make_params(self, _norm_param_specs(cfg))
    conv, mixer = mixers.ShortConv(cfg), _mixer_module(self.mixer)(cfg)
    ffn = mixers.GluFFN(cfg) if cfg.ffn else None  # else a mixer-only layer
    for part in (conv, mixer, ffn):
      if part is not None:
        nn.share_scope(self, part)  # its parameters at the layer's level: layers/{name}, as checkpoints hold

    h = mixers.batch_sharded(_layer_norm(x_BxTxD, norms["ln1_scale"], cfg.norm_eps))
    u, state = conv(h, state, layer_idx, mask_BxT, segments)
    mixed, state = mixer(nn.silu(u), state, mix_idx, mask_BxT, segments)
    x = x_BxTxD + mixed.astype(x_BxTxD.dtype)
    if ffn is not None:
      x = mixers.batch_sharded(x + ffn(_layer_norm(x, norms["ln2_scale"], cfg.norm_eps)).astype(x.dtype))
    return (x, state), None


def _layer(cfg: LaplaceConfig, initializing: bool, scanned: bool = True):
  """Block as the layer scan runs it: inside the train step's shard_map each layer's weights arrive as FSDP
  shards and are gathered here in the compute dtype, per layer and inside remat (laplace_jax/fsdp.py);
  elsewhere they are whole and pass unchanged. Then rematerialised in the backward pass if cfg.remat: inside a
  loop the recomputation cannot be merged with the forward (prevent_cse=False is safe and cheaper); unrolled,
  straight-line code could be, so the barrier stays."""
  cdt = jnp.dtype(cfg.compute_dtype)
  full = {n: s for letter in set(cfg.mixers) for n, s in layer_param_shapes(cfg, letter).items()}
  block = nn.map_variables(
    Block, "params", lambda v: {c: fsdp.gather_tree(t, full, cdt) for c, t in v.items()}, init=initializing
  )
  return nn.remat(block, prevent_cse=not scanned) if cfg.remat else block


class Group(nn.Module):
  """One repeat of a mixer pattern longer than one letter: its blocks in order (scanned over the groups)."""

  cfg: LaplaceConfig

  @nn.compact
  def __call__(self, carry, group_idx, mask_BxT, segments=None):
    block = _layer(self.cfg, self.is_initializing(), layers_scanned(self.cfg, platform.backend()))
    for i, letter in enumerate(self.cfg.mixers):
      carry, _ = block(self.cfg, letter, i, name=f"block{i}")(carry, group_idx, mask_BxT, segments)
    return carry, None


class LaplaceLM(nn.Module):
  """Embedding → scanned blocks → final LayerNorm → untied LM head. Returns (logits fp32, new state).

  A one-letter mixer pattern scans its Block over the layers (params layers/{name: [L, ...]}); a longer
  one scans a Group of blocks over the pattern's repeats (params layers/block{i}/{name: [L/len, ...]})."""

  cfg: LaplaceConfig

  @nn.compact
  def __call__(
    self,
    tokens_BxT,
    state=None,
    mask_BxT=None,
    last_only=False,
    positions_BxJ=None,
    segment_ids_BxT=None,
    first_start_B=None,
  ):
    cfg = self.cfg
    segments = None
    sp = context_parallel.span()  # a span of each row, the row split over the "context" axis
    if sp is not None:
      _check_span(cfg, state, mask_BxT, last_only, positions_BxJ)
    if segment_ids_BxT is not None:
      if state is not None and (state.kv is not None or state.ring is not None):
        raise ValueError(
          "segment_ids with a decode state that holds attention caches: packed rows are for training and "
          "evaluation (model.forward, forward_carry); serve each sequence in its own slot instead."
        )
      if jnp.shape(segment_ids_BxT) != jnp.shape(tokens_BxT):
        raise ValueError(
          f"segment_ids have shape {list(jnp.shape(segment_ids_BxT))}: expected the tokens' shape "
          f"{list(jnp.shape(tokens_BxT))}, one id per token (the document it belongs to)."
        )
      pos_B = None if state is None else state.pos
      if sp is None:
        segments = Segments.from_ids(segment_ids_BxT, pos_B, first_start_B)
      else:
        segments = context_parallel.span_segments(segment_ids_BxT, pos_B, first_start_B, sp)
    pdt, cdt = jnp.dtype(cfg.param_dtype), jnp.dtype(cfg.compute_dtype)
    top = model_param_specs(cfg)
    embed = self.param("embed", *top["embed"], pdt)
    x = mixers.batch_sharded(embed[tokens_BxT].astype(cdt))
    scan = layers_scanned(cfg, platform.backend())
    if len(cfg.mixers) == 1:
      body, args = _layer(cfg, self.is_initializing(), scan), (cfg, cfg.mixers, 0)
    else:
      body, args = Group, (cfg,)
    # Unrolled (scan_layers false): the same scan fully unrolled (unroll=0: every step, also a single one,
    # which True leaves a loop), so the parameter tree (stacked [L, ...]), the initialisation and the
    # checkpoints are the scanned form's; each layer reads a static slice of the stacked weights.
    scanned = nn.scan(
      body,
      variable_axes={"params": 0, "intermediates": 0},  # intermediates: model.verify's, per layer
      split_rngs={"params": True},
      in_axes=(0, nn.broadcast, nn.broadcast),
      out_axes=0,
      length=cfg.n_groups,
      unroll=1 if scan else 0,
    )(*args, name="layers")
    (x, new_state), _ = scanned((x, state), jnp.arange(cfg.n_groups), mask_BxT, segments)
    over_B = None
    if new_state is not None:
      n_B = (
        jnp.full(x.shape[:1], x.shape[1] * (1 if sp is None else sp.count))
        if mask_BxT is None
        else mask_BxT.sum(1)
      )
      new_state = new_state.replace(pos=new_state.pos + n_B.astype(jnp.int32))
      if new_state.kv is not None:  # full attention: the cache dropped some of this row's keys
        over_B = new_state.pos > new_state.cache_len
    x = _layer_norm(x, self.param("final_norm_scale", *top["final_norm_scale"], pdt), cfg.norm_eps)
    if last_only:  # logits of each row's last real token only: [B, D]
      last_B = (jnp.full(x.shape[:1], x.shape[1]) if mask_BxT is None else mask_BxT.sum(1)) - 1
      x = jnp.take_along_axis(x, jnp.maximum(last_B, 0)[:, None, None], axis=1)[:, 0]
    elif positions_BxJ is not None:  # logits at chosen positions only: [B, J, Y] (the LM head's cost · J/T)
      x = jnp.take_along_axis(x, positions_BxJ[..., None], axis=1)
    if over_B is not None:  # NaN into the head's input, not its output: the dot carries it to every logit
      x = jnp.where(over_B.reshape(-1, *[1] * (x.ndim - 1)), jnp.nan, x)  # of the row, at no extra pass
    head = self.param("lm_head", *top["lm_head"], pdt)
    logits = mixers.batch_sharded(jnp.dot(x.astype(cdt), head.astype(cdt), preferred_element_type=F32))
    return logits, new_state


def _check_span(cfg: LaplaceConfig, state, mask_BxT, last_only, positions_BxJ) -> None:
  """What a row split over the "context" axis supports: training and evaluation forwards of G and S layers."""
  if "A" in cfg.mixers:
    raise ValueError(
      f"mixers={cfg.mixers!r} has full attention layers ('A'), which need every earlier key of the row: "
      "context parallelism (a 'context' mesh axis) splits the row over devices, so it runs G and S layers "
      "only. Train this pattern without --mesh_context, or use sliding-window layers ('S')."
    )
  if mask_BxT is not None or last_only or positions_BxJ is not None:
    raise ValueError(
      "a row split over the 'context' axis runs whole training rows: no padding mask, last-token logits or "
      "scored positions (recall tasks' `positions`); run those without a context axis."
    )
  if state is not None and (state.kv is not None or state.ring is not None):
    raise ValueError("a row split over the 'context' axis takes a training carry only, not a decode state.")


# ---- pure functions -----------------------------------------------------------------------------


def init_params(cfg: LaplaceConfig, rng) -> dict:
  """Parameters as a plain nested dict: embed, final_norm_scale, lm_head, layers/{name: [L, ...]}.

  Compiled, as the trainer's and the server's initialisations are: one program draws the values (run op by
  op instead, the normals' last bits differ from the compiled draw's) and draws them in one call."""
  return _init_params_jit(cfg, platform.backend(), rng)


# The module-level jits below take the platform whose choices they trace (platform.backend(), which
# `platform.lowering_for` sets) as a static argument: a program traced for the CPU is never reused for a
# lowering under another target.
@functools.partial(jax.jit, static_argnums=(0, 1))
def _init_params_jit(cfg: LaplaceConfig, backend: str, rng) -> dict:
  del backend  # the cache key
  tokens = jnp.zeros((1, cfg.chunk_size), jnp.int32)
  return LaplaceLM(cfg).init(rng, tokens)["params"]


def check_tokens(tokens, cfg):
  dtype = getattr(tokens, "dtype", None) or np.asarray(tokens).dtype
  if not jnp.issubdtype(dtype, jnp.integer):
    raise ValueError(f"tokens have dtype {dtype}: expected integer token ids.")
  if isinstance(tokens, jax.core.Tracer):
    return
  t = np.asarray(tokens)  # a host copy: compiled callers pass tracers and skip this
  if t.size and (t.min() < 0 or t.max() >= cfg.vocab_size):
    raise ValueError(
      f"token ids span [{t.min()}, {t.max()}]: expected ids in [0, {cfg.vocab_size}) for this "
      "config's vocabulary. Check the tokenizer matches the model."
    )


def forward(params, tokens_BxT, *, cfg: LaplaceConfig, positions_BxJ=None, segment_ids_BxT=None):
  """Training/eval forward from a zero state: logits [B, T, Y] in fp32, or [B, J, Y] at `positions_BxJ`
  only (tasks scored at a few positions per row skip the LM head elsewhere). `segment_ids_BxT` (integers):
  a packed row's documents, each computed exactly as if alone in its row (laplace_jax/ops/segments.py)."""
  if jnp.ndim(tokens_BxT) != 2:
    raise ValueError(f"tokens have shape {jnp.shape(tokens_BxT)}: expected [B, T].")
  check_tokens(tokens_BxT, cfg)
  return _forward_jit(params, tokens_BxT, cfg, platform.backend(), positions_BxJ, segment_ids_BxT)


@functools.partial(jax.jit, static_argnums=(2, 3))
def _forward_jit(params, tokens_BxT, cfg: LaplaceConfig, backend: str, positions_BxJ, segment_ids_BxT):
  # Compiled once per config and shape (inlined when forward is traced inside a caller's jit); the checks
  # above run on the host first, where the tokens are concrete.
  del backend  # the cache key
  logits, _ = LaplaceLM(cfg).apply(
    {"params": params}, tokens_BxT, positions_BxJ=positions_BxJ, segment_ids_BxT=segment_ids_BxT
  )
  return logits


def table_row(pattern: str, group_idx, slot: int, letter: str | None = None):
  """The row of a layer in a state table: the layer at `slot` of the pattern's repeat `group_idx` (layer
  group_idx·len(pattern) + slot). Every table is stacked layer-major over the layers that own it, in layer
  order: conv over every layer (letter None), gla / kv / ring over the layers whose mixer is `letter`."""
  if letter is None:
    return group_idx * len(pattern) + slot
  return group_idx * pattern.count(letter) + pattern[:slot].count(letter)


def _state_tables(cfg: LaplaceConfig) -> list[tuple[type[mixers.LayerPart], int]]:
  """Each piece of the layers that holds decode state, with its table's row count (the layers that run it,
  the rows table_row numbers)."""
  return [(mixers.ShortConv, cfg.n_layers)] + [
    (mixers.MIXER_MODULES[letter], cfg.n_mixer_layers(letter)) for letter in dict.fromkeys(cfg.mixers)
  ]


def _zero_state(cfg: LaplaceConfig, batch_size: int, max_len, carried_only: bool) -> DecodeState:
  """Each piece's declared per-layer state, stacked layer-major [L_x, B, ...] into its DecodeState field,
  zero; and pos [B] int32 (tokens consumed)."""
  tables = {}
  for part, n_rows in _state_tables(cfg):
    if part.state_field is not None and (part.carried or not carried_only):
      one = part.state_specs(cfg, batch_size, max_len)
      tables[part.state_field] = jax.tree.map(lambda a, n=n_rows: jnp.zeros((n, *a.shape), a.dtype), one)
  return DecodeState(pos=jnp.zeros((batch_size,), jnp.int32), **tables)


def init_carry(cfg: LaplaceConfig, batch_size: int) -> DecodeState:
  """Zero training carry for state passing: init_state's GLA states, conv rings and positions, no attention
  cache or window rings (pieces not `carried`: attention layers start every segment afresh). Same layout as
  init_state."""
  return _zero_state(cfg, batch_size, None, carried_only=True)


def forward_carry(params, tokens_BxT, carry, *, cfg: LaplaceConfig, segment_ids_BxT=None, first_start_B=None):
  """Training forward from a carried state (state passing): (logits [B, T, Y] fp32, the carry after the
  last token). `carry` is init_carry's DecodeState; gradients do not flow into it (the segment boundary).
  With `segment_ids_BxT` every segment after the row's first starts afresh, and the first continues the
  carry unless `first_start_B` (bool [B]) says a new document begins at the row's first token."""
  if jnp.ndim(tokens_BxT) != 2:
    raise ValueError(f"tokens have shape {jnp.shape(tokens_BxT)}: expected [B, T].")
  check_tokens(tokens_BxT, cfg)
  return LaplaceLM(cfg).apply(
    {"params": params},
    tokens_BxT,
    jax.lax.stop_gradient(carry),
    segment_ids_BxT=segment_ids_BxT,
    first_start_B=first_start_B,
  )


def init_state(cfg: LaplaceConfig, batch_size: int, max_len: int | None = None) -> DecodeState:
  """Zero decode state for `batch_size` sequences (laplace_jax/model/state.py): pos [B] int32 (tokens consumed),
  and layer-major, fp32, gla [L_gla,B,H,d_k,d_v] (GLA layers) and conv [L,B,conv,D] (every layer: a ring of the
  last conv_size inputs, laplace_jax/ops/short_conv.py). Attention layers add a KV cache kv [L_attn,B,max_len,H,hd]
  in the compute dtype (its length fixed here, so shapes stay static), sliding-window layers rings of the last
  cfg.window keys and values, ring [L_S,B,H,window,hd]. state.batch_axes() gives each leaf's batch axis.
  Each piece declares its slice of one layer (laplace_jax/model/mixers.py, state_specs); this stacks them."""
  return _zero_state(cfg, batch_size, max_len, carried_only=False)


def _field_name(path) -> str:
  return "state." + ".".join(str(getattr(k, "name", k)) for k in path)


def check_state(state, cfg: LaplaceConfig, batch_size: int | None = None) -> int:
  """Raise ValueError unless `state` is a decode state of this config; return its batch size."""
  if isinstance(state, dict):
    raise ValueError(
      f"state is a dict with keys {sorted(state)}: expected a DecodeState. A stored (flat) state converts "
      "with laplace_jax.model.state.DecodeState.from_dict(d); a new one comes from model.init_state(cfg, batch)."
    )
  fields = lambda s: [f for f in ("gla", "kv", "ring") if getattr(s, f) is not None]
  expect = jax.eval_shape(lambda: init_state(cfg, 1, 1))
  if not isinstance(state, DecodeState) or fields(state) != fields(expect):
    got = fields(state) if isinstance(state, DecodeState) else type(state).__name__
    raise ValueError(
      f"state holds tables {got}: expected pos, conv and {fields(expect)} (mixers={cfg.mixers!r}), "
      "a DecodeState from laplace_jax.model.init_state(cfg, batch)."
    )
  B = state.conv.shape[1] if state.conv.ndim == 4 else -1
  S = state.cache_len if state.kv is not None and state.kv.k.ndim == 5 else 1
  want = jax.eval_shape(lambda: init_state(cfg, max(B, 1), S))
  for (path, got), w in zip(jax.tree_util.tree_leaves_with_path(state), jax.tree.leaves(want)):
    if got.shape != w.shape or got.dtype != w.dtype:
      raise ValueError(
        f"{_field_name(path)} is {got.dtype}{list(got.shape)}: expected {w.dtype}{list(w.shape)} for this "
        "config. The state was made for another config; build it with init_state(cfg, batch) for the "
        "model you run."
      )
  if batch_size is not None and B != batch_size:
    raise ValueError(f"state holds {B} sequences but tokens have batch {batch_size}.")
  return B


def check_capacity(state: DecodeState, new_tokens_B) -> None:
  """Attention layers only: raise if a row's context would outgrow the KV cache (host values only;
  under jit such rows get NaN logits instead, see LaplaceLM)."""
  S = state.cache_len
  if S is None or isinstance(state.pos, jax.core.Tracer) or isinstance(new_tokens_B, jax.core.Tracer):
    return
  need = np.asarray(state.pos) + np.asarray(new_tokens_B)
  if (need > S).any():
    raise ValueError(
      f"a context of {int(need.max())} tokens does not fit the attention layers' KV cache of "
      f"max_len={S} tokens: make the state with init_state(cfg, batch, max_len={int(need.max())}) "
      "or more (attention state grows with context; GLA layers' does not)."
    )


def decode_step(params, state: DecodeState, tokens_B, *, cfg: LaplaceConfig, live_B=None):
  """One token per sequence: (logits [B, Y] fp32, new state). Pure; jit with cfg static.

  live_B (bool [B], None: every row): a row that is not live does not advance: its GLA state and position are
  kept exactly and its logits are meaningless. Its conv ring, window ring or attention cache takes the token
  in the slot its next token overwrites before anything reads it, so whatever follows is as if the step had
  not happened (a batch whose finished sequences must keep their states, at no extra pass over them). A row
  whose attention cache is full, which can take no next token, has that write clamped onto its last row."""
  if jnp.ndim(tokens_B) != 1:
    raise ValueError(f"tokens have shape {jnp.shape(tokens_B)}: expected [B], one token per sequence.")
  B = jnp.shape(tokens_B)[0]
  if live_B is not None and jnp.shape(live_B) != (B,):
    raise ValueError(f"live_B has shape {jnp.shape(live_B)}: expected [B] = [{B}], one flag per sequence.")
  check_state(state, cfg, B)
  check_tokens(tokens_B, cfg)
  check_capacity(state, 1)
  mask = None if live_B is None else jnp.asarray(live_B, bool)[:, None]
  return LaplaceLM(cfg).apply({"params": params}, tokens_B[:, None], state, mask, last_only=True)


def prefill_chunk(params, state: DecodeState, tokens_BxC, lengths_B, *, cfg: LaplaceConfig):
  """Consume one right-padded chunk: (logits at each row's last real token [B, Y], new state).

  A row with length 0 keeps its state exactly (its logits are meaningless); in a one-token chunk, which is
  a decode step, as decode_step keeps a row that is not live."""
  B, C = jnp.shape(tokens_BxC)
  check_state(state, cfg, B)
  check_tokens(tokens_BxC, cfg)
  check_capacity(state, lengths_B)
  mask_BxC = jnp.arange(C)[None, :] < jnp.asarray(lengths_B)[:, None]
  return LaplaceLM(cfg).apply({"params": params}, tokens_BxC, state, mask_BxC, last_only=True)


@functools.partial(jax.jit, static_argnames=("cfg", "backend"))
def _prefill_chunk_jit(params, state, tokens_BxC, lengths_B, *, cfg: LaplaceConfig, backend: str):
  del backend  # the cache key (see _init_params_jit)
  return prefill_chunk(params, state, tokens_BxC, lengths_B, cfg=cfg)


def prefill(params, state: DecodeState, tokens_BxT, lengths_B=None, *, cfg: LaplaceConfig):
  """Any prompt length, walked in fixed cfg.chunk_size chunks through one compiled function.

  tokens [B, T] right-padded with per-row `lengths_B` (default T). Returns (logits [B, Y], state)."""
  tokens = np.asarray(tokens_BxT)
  if tokens.ndim != 2:
    raise ValueError(f"tokens have shape {tokens.shape}: expected [B, T].")
  B, T = tokens.shape
  lengths = np.full((B,), T, np.int32) if lengths_B is None else np.asarray(lengths_B, np.int32)
  if lengths.shape != (B,) or (lengths < 0).any() or (lengths > T).any():
    raise ValueError(f"lengths {lengths.tolist()}: expected [B]={B} values in [0, {T}].")
  check_tokens(tokens, cfg)
  check_state(state, cfg, B)
  check_capacity(state, lengths)
  C = cfg.chunk_size
  n_chunks = max(1, -(-T // C))
  tokens = np.pad(tokens, [(0, 0), (0, n_chunks * C - T)]).astype(np.int32)
  last_logits = jnp.zeros((B, cfg.vocab_size), F32)
  for c in range(n_chunks):
    n_B = np.clip(lengths - c * C, 0, C).astype(np.int32)
    if not n_B.any():
      break
    logits, state = _prefill_chunk_jit(
      params, state, tokens[:, c * C : (c + 1) * C], n_B, cfg=cfg, backend=platform.backend()
    )
    last_logits = jnp.where(jnp.asarray(n_B > 0)[:, None], logits, last_logits)
  return last_logits, state
