"""BASELINE, NOT LAPLACE: a same-size softmax-attention transformer with a KV cache, for the benchmark only.

It takes a LaplaceConfig and keeps everything but the mixer: the same D, L, GLU FFN, vocabulary, norms and
dtypes; the mixer is standard multi-head attention (H heads of D/H, RoPE) whose W_qkv [D, 3D] and W_o [D, D]
have exactly the parameters of Laplace's W_qkvg and W_out. Decoding appends each token's keys and values to
a cache [B, T_max, H, D/H] per layer and attends over it, so its memory and time grow with the context;
Laplace's state does not. Weights are random: only its cost is measured, never its text.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

F32 = jnp.float32


def head_dim(cfg) -> int:
  return cfg.d_model // cfg.n_heads


def init_params(cfg, rng) -> dict:
  """Random weights, N(0, 0.02²) matrices and unit norms; one dict per layer (the step is unrolled over
  layers, and slicing stacked weights would copy them every step)."""
  D, F, V = cfg.d_model, cfg.d_ff, cfg.vocab_size
  dt = jnp.dtype(cfg.param_dtype)
  shapes = {"w_qkv": (D, 3 * D), "w_o": (D, D), "w1": (D, F), "w2": (D, F), "w3": (F, D)}
  normal = lambda key, shape: (cfg.init_std * jax.random.normal(key, shape)).astype(dt)
  layers = []
  for key in jax.random.split(rng, cfg.n_layers):
    layer = {n: normal(k, s) for (n, s), k in zip(shapes.items(), jax.random.split(key, len(shapes)))}
    layer["ln1"], layer["ln2"] = jnp.ones((D,), dt), jnp.ones((D,), dt)
    layers.append(layer)
  k_embed, k_head = jax.random.split(jax.random.fold_in(rng, 1))
  return {"layers": layers, "embed": normal(k_embed, (V, D)), "lm_head": normal(k_head, (D, V)),
          "final_norm": jnp.ones((D,), dt)}


def kv_cache_bytes_per_sequence(cfg, context: int) -> int:
  """Keys and values of every layer for `context` tokens, in the compute dtype."""
  return 2 * cfg.n_layers * context * cfg.d_model * jnp.dtype(cfg.compute_dtype).itemsize


def init_cache(cfg, batch: int, max_len: int, *, fill_rng=None) -> dict:
  """Per-layer k, v caches [B, max_len, H, D/H]; `fill_rng` fills them with random values (a stand-in
  for a prefilled context of that length: the decode cost does not depend on the values)."""
  H, hd, cdt = cfg.n_heads, head_dim(cfg), jnp.dtype(cfg.compute_dtype)
  shape = (batch, max_len, H, hd)
  if fill_rng is None:
    make = lambda: jnp.zeros(shape, cdt)
  else:  # tile a small random block: drawing GBs of random numbers would dominate the benchmark's set-up
    block = jax.random.normal(fill_rng, (1, min(max_len, 1024), H, hd), cdt)
    reps = -(-max_len // block.shape[1])
    make = lambda: jnp.tile(block, (batch, reps, 1, 1))[:, :max_len]
  return {"k": [make() for _ in range(cfg.n_layers)], "v": [make() for _ in range(cfg.n_layers)]}


def _norm(x, scale, eps):
  x32 = x.astype(F32)
  mu = x32.mean(-1, keepdims=True)
  var = jnp.square(x32 - mu).mean(-1, keepdims=True)
  return ((x32 - mu) * jax.lax.rsqrt(var + eps) * scale.astype(F32)).astype(x.dtype)


def _rope(x_BxHxd, pos_B):
  half = x_BxHxd.shape[-1] // 2
  freq = 10000.0 ** (-jnp.arange(half, dtype=F32) / half)
  ang = pos_B.astype(F32)[:, None, None] * freq  # [B, 1, half]
  x1, x2 = x_BxHxd[..., :half].astype(F32), x_BxHxd[..., half:].astype(F32)
  out = jnp.concatenate([x1 * jnp.cos(ang) - x2 * jnp.sin(ang), x1 * jnp.sin(ang) + x2 * jnp.cos(ang)], -1)
  return out.astype(x_BxHxd.dtype)


def decode_step(params, cache, tokens_B, pos_B, *, cfg):
  """One token per row at positions pos_B (its k, v land at pos_B; attention over 0..pos_B).
  Returns (logits [B, V] fp32, cache). Jit with cfg static and the cache donated."""
  B = tokens_B.shape[0]
  H, hd, cdt = cfg.n_heads, head_dim(cfg), jnp.dtype(cfg.compute_dtype)
  mm = lambda a, w: jnp.dot(a.astype(cdt), w.astype(cdt))
  x = params["embed"][tokens_B].astype(cdt)
  rows = jnp.arange(B)
  new_k, new_v = [], []
  for l, w in enumerate(params["layers"]):
    h = _norm(x, w["ln1"], cfg.norm_eps)
    q, k, v = jnp.split(mm(h, w["w_qkv"]), 3, axis=-1)
    q = _rope(q.reshape(B, H, hd), pos_B)
    k = _rope(k.reshape(B, H, hd), pos_B)
    k_cache = cache["k"][l].at[rows, pos_B].set(k.astype(cdt))
    v_cache = cache["v"][l].at[rows, pos_B].set(v.reshape(B, H, hd).astype(cdt))
    new_k.append(k_cache)
    new_v.append(v_cache)
    s_BxHxT = jnp.einsum("bhd,bthd->bht", q, k_cache, preferred_element_type=F32) / jnp.sqrt(F32(hd))
    visible = jnp.arange(k_cache.shape[1])[None, None, :] <= pos_B[:, None, None]
    p = jax.nn.softmax(jnp.where(visible, s_BxHxT, -jnp.inf), -1)
    o = jnp.einsum("bht,bthd->bhd", p.astype(cdt), v_cache, preferred_element_type=F32)
    x = x + mm(o.reshape(B, H * hd), w["w_o"]).astype(x.dtype)
    h2 = _norm(x, w["ln2"], cfg.norm_eps)
    x = x + mm(jax.nn.silu(mm(h2, w["w1"])) * mm(h2, w["w2"]), w["w3"]).astype(x.dtype)
  x = _norm(x, params["final_norm"], cfg.norm_eps)
  logits = jnp.dot(x.astype(cdt), params["lm_head"].astype(cdt), preferred_element_type=F32)
  return logits, {"k": new_k, "v": new_v}


def decode_flops_per_token(cfg, context: int) -> float:
  """Matmul FLOPs of one decoded token: weights (2 per parameter) plus attention over `context` keys."""
  D, L, F = cfg.d_model, cfg.n_layers, cfg.d_ff
  weights = L * (3 * D * D + D * D + 3 * D * F) + D * cfg.vocab_size
  return 2 * weights + L * 4 * context * D
