"""Text generation through the explicit-state functions: prefill the prompt, then decode_step + sampling.

A convenience for demos and evaluation; the serving engine (serve/) batches many sequences instead.
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


def generate(params, prompt_ids, max_new_tokens: int, *, cfg: LaplaceConfig, temperature: float = 0.8,
             top_k: int = 40, seed: int = 0, valid_vocab: int | None = None, stop_id: int | None = None):
  """Continue one prompt (a list of token ids): returns the new token ids (stops early at stop_id)."""
  if not prompt_ids:
    raise ValueError("prompt_ids is empty: give at least one token (e.g. the EOS id to start fresh).")
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens={max_new_tokens}: expected >= 1.")
  vv = valid_vocab or cfg.vocab_size
  state = model.init_state(cfg, 1, max_len=len(prompt_ids) + max_new_tokens)  # max_len: attention layers
  logits, state = model.prefill(params, state, np.asarray([prompt_ids], np.int32), cfg=cfg)
  key = jax.random.key(seed)
  key, sub = jax.random.split(key)
  tok = sample_logits(logits, sub, temperature=temperature, top_k=top_k, valid_vocab=vv)
  out = []
  for _ in range(max_new_tokens):
    t = int(tok[0])
    out.append(t)
    if stop_id is not None and t == stop_id:
      break
    key, sub = jax.random.split(key)
    tok, state = _decode_and_sample(params, state, tok, sub, cfg=cfg, temperature=temperature, top_k=top_k,
                                    valid_vocab=vv)
  return out
