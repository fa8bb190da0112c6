"""BASELINE, NOT LAPLACE: the same model with every mixer softmax attention (mixers='A'), for the benchmark.

It is laplace_jax.model with `cfg.replace(mixers="A")`: the same D, L, conv, GLU FFN, vocabulary, norms and
dtypes; each layer's mixer is causal multi-head attention (H heads, RoPE) whose W_qkv and W_o spend
the parameters of Laplace's W_qkvg and W_out (one attention implementation in the project:
laplace_jax/ops/attention.py). Decoding writes each token's keys and values into a KV cache [B, T_max, H, hd]
per layer inside the explicit state and attends over it, so its memory and time grow with the context;
Laplace's state does not. Weights are random: only its cost is measured, never its text.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from laplace_jax import model
from laplace_jax.model.counts import param_counts, state_bytes_per_sequence
from laplace_jax.model.state import DecodeState, KVCache


def attention_config(cfg):
  return cfg.replace(mixers="A")


def head_dim(cfg) -> int:
  return attention_config(cfg).attn_head_dim


def init_params(cfg, rng) -> dict:
  """Random weights, initialised as the model's (N(0, 0.02²) matrices, unit norms)."""
  return model.init_params(attention_config(cfg), rng)


def kv_cache_bytes_per_sequence(cfg, context: int) -> int:
  """The whole decode state for `context` tokens: the KV cache in the compute dtype (plus the conv window)."""
  return state_bytes_per_sequence(attention_config(cfg), context)


def init_cache(cfg, batch: int, max_len: int, *, fill_rng=None) -> DecodeState:
  """The model's decode state with a KV cache of `max_len` tokens; `fill_rng` fills the cache with random
  values (a stand-in for a prefilled context of that length: the decode cost does not depend on them)."""
  acfg = attention_config(cfg)
  state = model.init_state(acfg, batch, max_len)
  if fill_rng is not None:  # tile a small random block: drawing GBs of random numbers would dominate set-up
    assert state.kv is not None  # an attention-only config
    L, B, S, H, hd = state.kv.k.shape
    block = jax.random.normal(fill_rng, (L, 1, min(S, 1024), H, hd), state.kv.k.dtype)
    reps = -(-S // block.shape[2])
    filled = jnp.tile(block, (1, B, reps, 1, 1))[:, :, :S]
    state = state.replace(kv=KVCache(k=filled, v=filled))
  return state


def decode_step(params, cache, tokens_B, pos_B, *, cfg):
  """One token per row at positions pos_B (its k, v land at pos_B; attention over 0..pos_B).
  Returns (logits [B, V] fp32, cache). Jit with cfg static and the cache donated."""
  return model.decode_step(params, cache.replace(pos=pos_B), tokens_B, cfg=attention_config(cfg))


def decode_flops_per_token(cfg, context: int) -> float:
  """Matmul FLOPs of one decoded token: weights (2 per parameter) plus attention over `context` keys."""
  acfg = attention_config(cfg)
  weights = param_counts(acfg)["muon"] + cfg.d_model * cfg.vocab_size
  return 2 * weights + acfg.n_layers * 4 * context * acfg.n_heads * acfg.attn_head_dim
