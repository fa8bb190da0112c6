"""Text generation through the explicit-state functions: prefill the prompt, then decode_step + sampling.

The library's path from an export to text (the serving engine, serve/, batches many sequences instead):

  params, cfg = checkpoint.load_export("RUN/export/step_N")
  out = complete(params, cfg, "And God said", 40, temperature=0.8, top_k=40, top_p=0.95)
      -> Completion(text, ids, stop, state): stops at <|endoftext|> (or `stop_ids`); never draws a padded
      vocabulary id (the model's vocab is GPT-2's 50,257 padded to 50,304); out.state has read the prompt and
      every returned id
  save_state("s.npz", out.state, cfg); state = load_state("s.npz", cfg)   # to disk and back
  more = complete(params, cfg, " And", 20, state=state)                  # continue from it later

  generate(params, prompt_ids, n, cfg=) -> new ids (one prompt; sampled, or greedy at temperature 0)
  generate_batch(params, prompts_BxT, n, cfg=) -> ids [B, n] (equal-length prompts, one state for all)
  greedy_next(params, tokens_BxT, positions_BxJ, cfg=) -> ids [B, J]: the greedy next token after each prefix
      tokens[:, :p + 1], all from one causal forward (what generating one token after each prefix would give)
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from laplace_jax import model
from laplace_jax.data import tokenizer
from laplace_jax.model.config import LaplaceConfig
from laplace_jax.model.state import DecodeState


def sample_logits(logits_BxY, key, *, temperature: float, top_k: int, valid_vocab: int, top_p: float = 1.0):
  """Greedy at temperature 0, else softmax(logits / T) over the top-k and then the smallest set of tokens
  whose probability reaches top_p (nucleus); padded vocab rows (ids >= valid_vocab) are never drawn."""
  logits = jnp.where(jnp.arange(logits_BxY.shape[-1]) < valid_vocab, logits_BxY, -jnp.inf)
  if temperature == 0:
    return jnp.argmax(logits, -1).astype(jnp.int32)
  logits = logits / temperature
  if top_k:
    kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
    logits = jnp.where(logits >= kth, logits, -jnp.inf)
  if top_p < 1.0:
    sorted_BxY = jnp.sort(logits, -1)[:, ::-1]
    before_BxY = jnp.cumsum(jax.nn.softmax(sorted_BxY, -1), -1) - jax.nn.softmax(sorted_BxY, -1)
    # the smallest logit kept: the last one whose preceding mass is still below top_p (the first always is)
    cut_B = jnp.min(jnp.where(before_BxY < top_p, sorted_BxY, jnp.inf), -1, keepdims=True)
    logits = jnp.where(logits >= cut_B, logits, -jnp.inf)
  return jax.random.categorical(key, logits).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("cfg", "temperature", "top_k", "valid_vocab", "top_p"))
def _decode_and_sample(params, state, tokens_B, key, *, cfg, temperature, top_k, valid_vocab, top_p=1.0):
  logits, state = model.decode_step(params, state, tokens_B, cfg=cfg)
  tok = sample_logits(logits, key, temperature=temperature, top_k=top_k, valid_vocab=valid_vocab, top_p=top_p)
  return tok, state


@dataclasses.dataclass(frozen=True)
class Completion:
  """What `complete` returns: the new text and ids (the stop id left out), why it stopped ("stop": a stop
  id was drawn; "length": max_new_tokens reached) and the decode state after the prompt and every new id."""

  text: str
  ids: list[int]
  stop: str
  state: DecodeState


def complete(
  params,
  cfg: LaplaceConfig,
  prompt: str | Sequence[int],
  max_new_tokens: int,
  *,
  temperature: float = 0.0,
  top_k: int = 0,
  top_p: float = 1.0,
  seed: int = 0,
  stop_ids: Sequence[int] = (tokenizer.EOS_ID,),
  state: DecodeState | None = None,
  max_len: int | None = None,
) -> Completion:
  """Continue `prompt` (text, GPT-2 BPE, or token ids) by up to `max_new_tokens` tokens: greedy at
  temperature 0, else sampled (top-k, then top-p) with `seed`; stops when it draws one of `stop_ids` (default
  <|endoftext|>). Only GPT-2's 50,257 ids are drawn, never the padded rows. `state` (None: a fresh one)
  continues a sequence: the state of an earlier Completion, or one read back with load_state. `max_len`:
  the KV cache's length for models with attention layers (default: prompt + max_new_tokens; a fresh state
  only)."""
  ids = tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
  if not ids:
    raise ValueError(
      "the prompt is empty: give at least one token (e.g. [tokenizer.EOS_ID] to start a fresh text)."
    )
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens={max_new_tokens}: expected >= 1.")
  if temperature < 0 or top_k < 0 or not 0 < top_p <= 1:
    raise ValueError(
      f"temperature={temperature}, top_k={top_k}, top_p={top_p}: expected temperature >= 0 (0: greedy), "
      "top_k >= 0 (0: off) and 0 < top_p <= 1 (1: off)."
    )
  if state is not None and state.batch_size != 1:
    raise ValueError(f"state holds {state.batch_size} sequences: complete continues one (batch 1).")
  out: list[int] = []
  # One token more than returned: the state that comes with it has read every returned id.
  steps = _continue(
    params,
    [ids],
    max_new_tokens + 1,
    cfg=cfg,
    temperature=float(temperature),
    top_k=int(top_k),
    top_p=float(top_p),
    seed=seed,
    valid_vocab=min(cfg.vocab_size, tokenizer.VOCAB_SIZE),
    state=state,
    max_len=max_len or len(ids) + max_new_tokens,
  )
  for tok, read in steps:
    t = int(tok[0])
    if len(out) == max_new_tokens or t in stop_ids:
      return Completion(tokenizer.decode(out), out, "length" if len(out) == max_new_tokens else "stop", read)
    out.append(t)
  raise AssertionError("unreachable: _continue yields max_new_tokens + 1 steps")


def save_state(path, state: DecodeState, cfg: LaplaceConfig) -> None:
  """Write a decode state (and the model config it belongs to) to `path`, a .npz file; load_state reads
  it back. bfloat16 tables (attention caches) are stored as their uint16 bits."""
  arrays: dict = {k: np.asarray(v) for k, v in jax.device_get(state.to_dict()).items()}
  bf16 = [k for k, v in arrays.items() if v.dtype == jnp.bfloat16]
  arrays.update({k: arrays[k].view(np.uint16) for k in bf16})
  meta = json.dumps({"config": dataclasses.asdict(cfg), "bfloat16": bf16})
  with open(os.fspath(path), "wb") as f:
    np.savez(f, __meta__=np.frombuffer(meta.encode(), np.uint8), **arrays)


def load_state(path, cfg: LaplaceConfig) -> DecodeState:
  """The decode state save_state wrote to `path`, checked to belong to a model of config `cfg`."""
  with np.load(os.fspath(path)) as z:
    arrays = {k: z[k] for k in z.files}
  if "__meta__" not in arrays:
    raise ValueError(f"{path}: not a decode state written by generate.save_state (no __meta__ entry).")
  meta = json.loads(arrays.pop("__meta__").tobytes().decode())
  saved = LaplaceConfig(**meta["config"])
  if saved != cfg:
    diff = {k: (v, getattr(cfg, k)) for k, v in dataclasses.asdict(saved).items() if getattr(cfg, k) != v}
    raise ValueError(
      f"{path}: a decode state of another model (saved vs given config: {diff}); load it with the config "
      "of the export that wrote it (checkpoint.load_export returns it)."
    )
  for k in meta["bfloat16"]:
    arrays[k] = arrays[k].view(jnp.bfloat16)
  return DecodeState.from_dict({k: jnp.asarray(v) for k, v in arrays.items()})


def _continue(
  params,
  prompts_BxT,
  max_new_tokens: int,
  *,
  cfg,
  temperature,
  top_k,
  seed,
  valid_vocab,
  top_p=1.0,
  stop_id=None,
  state=None,
  max_len=None,
):
  """Yield (the next token of every row [B] as host ints, the state that has read everything before it),
  max_new_tokens times; stops after a step whose tokens all equal stop_id. state: the one the prompts
  continue (None: a fresh one whose attention caches hold max_len tokens, default prompt + new)."""
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens={max_new_tokens}: expected >= 1.")
  prompts = np.asarray(prompts_BxT, np.int32)
  how = dict(temperature=temperature, top_k=top_k, top_p=top_p, valid_vocab=valid_vocab or cfg.vocab_size)
  if state is None:
    state = model.init_state(cfg, prompts.shape[0], max_len=max_len or prompts.shape[1] + max_new_tokens)
  logits, state = model.prefill(params, state, prompts, cfg=cfg)
  key = jax.random.key(seed)
  key, sub = jax.random.split(key)
  tok = sample_logits(logits, sub, **how)
  for i in range(max_new_tokens):
    host = np.asarray(tok)
    yield host, state
    if i == max_new_tokens - 1 or (stop_id is not None and (host == stop_id).all()):
      return
    key, sub = jax.random.split(key)
    tok, state = _decode_and_sample(params, state, tok, sub, cfg=cfg, **how)


def generate(
  params,
  prompt_ids,
  max_new_tokens: int,
  *,
  cfg: LaplaceConfig,
  temperature: float = 0.8,
  top_k: int = 40,
  seed: int = 0,
  valid_vocab: int | None = None,
  stop_id: int | None = None,
):
  """Continue one prompt (a list of token ids): returns the new token ids (stops early at stop_id)."""
  if not prompt_ids:
    raise ValueError("prompt_ids is empty: give at least one token (e.g. the EOS id to start fresh).")
  return [
    int(t[0])
    for t, _ in _continue(
      params,
      [prompt_ids],
      max_new_tokens,
      cfg=cfg,
      temperature=temperature,
      top_k=top_k,
      seed=seed,
      valid_vocab=valid_vocab,
      stop_id=stop_id,
    )
  ]


def generate_batch(
  params,
  prompts_BxT,
  max_new_tokens: int,
  *,
  cfg: LaplaceConfig,
  temperature: float = 0.0,
  top_k: int = 0,
  seed: int = 0,
  valid_vocab: int | None = None,
) -> np.ndarray:
  """Continue B prompts of equal length together (greedy by default): the new ids [B, max_new_tokens]."""
  prompts = np.asarray(prompts_BxT)
  if prompts.ndim != 2 or not prompts.size:
    raise ValueError(f"prompts have shape {prompts.shape}: expected [B, T] with B, T >= 1.")
  return np.stack(
    [
      t
      for t, _ in _continue(
        params,
        prompts,
        max_new_tokens,
        cfg=cfg,
        temperature=temperature,
        top_k=top_k,
        seed=seed,
        valid_vocab=valid_vocab,
      )
    ],
    axis=1,
  )


@functools.partial(jax.jit, static_argnames=("cfg",))
def _greedy_at(params, tokens_BxT, positions_BxJ, *, cfg):
  return jnp.argmax(model.forward(params, tokens_BxT, cfg=cfg, positions_BxJ=positions_BxJ), -1).astype(
    jnp.int32
  )


def greedy_next(params, tokens_BxT, positions_BxJ, *, cfg: LaplaceConfig) -> np.ndarray:
  """[B, J] greedy next token after each prefix tokens[b, :positions[b, j] + 1], from one causal forward (the
  model is causal, so each equals greedy generation of one token from that prefix)."""
  return np.asarray(
    _greedy_at(params, jnp.asarray(tokens_BxT, jnp.int32), jnp.asarray(positions_BxJ, jnp.int32), cfg=cfg)
  )
