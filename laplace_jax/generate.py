"""Text generation through the explicit-state functions: prefill the prompt, then decode_step + sampling.

A convenience for demos and evaluation; the serving engine (serve/) batches many sequences instead.

  generate(params, prompt_ids, n, cfg=) -> new ids (one prompt; sampled, or greedy at temperature 0)
  generate_batch(params, prompts_BxT, n, cfg=) -> ids [B, n] (equal-length prompts, one state for all)
  greedy_next(params, tokens_BxT, positions_BxK, cfg=) -> ids [B, K]: the greedy next token after each prefix
      tokens[:, :p + 1], all from one causal forward (what generating one token after each prefix would give)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from laplace_jax import model
from laplace_jax.config import LaplaceConfig


def sample_logits(logits_BxV, key, *, temperature: float, top_k: int, valid_vocab: int):
  """Greedy at temperature 0, else softmax(logits / T) over the top-k; padded vocab rows never drawn."""
  logits = jnp.where(jnp.arange(logits_BxV.shape[-1]) < valid_vocab, logits_BxV, -jnp.inf)
  if temperature == 0:
    return jnp.argmax(logits, -1).astype(jnp.int32)
  if top_k:
    kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
    logits = jnp.where(logits >= kth, logits, -jnp.inf)
  return jax.random.categorical(key, logits / temperature).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("cfg", "temperature", "top_k", "valid_vocab"))
def _decode_and_sample(params, state, tokens_B, key, *, cfg, temperature, top_k, valid_vocab):
  logits, state = model.decode_step(params, state, tokens_B, cfg=cfg)
  return sample_logits(logits, key, temperature=temperature, top_k=top_k, valid_vocab=valid_vocab), state


def _continue(
  params, prompts_BxT, max_new_tokens: int, *, cfg, temperature, top_k, seed, valid_vocab, stop_id=None
):
  """Yield the next token of every row [B] (host ints), max_new_tokens times; stops after a step whose
  tokens all equal stop_id."""
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens={max_new_tokens}: expected >= 1.")
  prompts = np.asarray(prompts_BxT, np.int32)
  vv = valid_vocab or cfg.vocab_size
  state = model.init_state(cfg, prompts.shape[0], max_len=prompts.shape[1] + max_new_tokens)  # attention
  logits, state = model.prefill(params, state, prompts, cfg=cfg)
  key = jax.random.key(seed)
  key, sub = jax.random.split(key)
  tok = sample_logits(logits, sub, temperature=temperature, top_k=top_k, valid_vocab=vv)
  for i in range(max_new_tokens):
    host = np.asarray(tok)
    yield host
    if i == max_new_tokens - 1 or (stop_id is not None and (host == stop_id).all()):
      return
    key, sub = jax.random.split(key)
    tok, state = _decode_and_sample(
      params, state, tok, sub, cfg=cfg, temperature=temperature, top_k=top_k, valid_vocab=vv
    )


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
    for t in _continue(
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
    list(
      _continue(
        params,
        prompts,
        max_new_tokens,
        cfg=cfg,
        temperature=temperature,
        top_k=top_k,
        seed=seed,
        valid_vocab=valid_vocab,
      )
    ),
    axis=1,
  )


@functools.partial(jax.jit, static_argnames=("cfg",))
def _greedy_at(params, tokens_BxT, positions_BxK, *, cfg):
  return jnp.argmax(model.forward(params, tokens_BxT, cfg=cfg, positions_BxK=positions_BxK), -1).astype(
    jnp.int32
  )


def greedy_next(params, tokens_BxT, positions_BxK, *, cfg: LaplaceConfig) -> np.ndarray:
  """[B, K] greedy next token after each prefix tokens[b, :positions[b, k] + 1], from one causal forward (the
  model is causal, so each equals greedy generation of one token from that prefix)."""
  return np.asarray(
    _greedy_at(params, jnp.asarray(tokens_BxT, jnp.int32), jnp.asarray(positions_BxK, jnp.int32), cfg=cfg)
  )
