"""Causal softmax attention with rotary positions: the second mixer a layer may use (config `mixers`).

Layout as in gla.py: q, k, v, o [B, T, H, hd]. Scores and softmax in fp32, scale hd**-0.5.
  rope(x_BxTxHxd, pos_BxT)                          rotate (first half, second half) pairs by pos·base^(−2i/hd)
  causal_attention(q, k, v)                         a whole sequence from position 0 (training, eval)
  cached_attention(q, k, v, k_cache, v_cache, pos_B, n_B) -> (o, k_cache, v_cache)
      T new tokens per row at positions pos_B … pos_B+T−1, of which the first n_B are real: their keys and
      values are written into the caches [B, S, H, hd] (padding is dropped), then every query attends to
      the cache up to its own position. Prefill chunks and the one-token decode step both use it.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

F32 = jnp.float32


def rope(x_BxTxHxd, pos_BxT, base: float = 10000.0):
  """Rotary position embedding (GPT-NeoX's half-split pairing), computed in fp32."""
  half = x_BxTxHxd.shape[-1] // 2
  freq = base ** (-jnp.arange(half, dtype=F32) / half)
  ang = pos_BxT.astype(F32)[:, :, None, None] * freq                    # [B, T, 1, half]
  x1, x2 = x_BxTxHxd[..., :half].astype(F32), x_BxTxHxd[..., half:].astype(F32)
  cos, sin = jnp.cos(ang), jnp.sin(ang)
  return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).astype(x_BxTxHxd.dtype)


def _attend(q_BxTxHxd, k_BxSxHxd, v_BxSxHxd, visible_BxTxS, kv_layout: str = "bshd"):
  """o [B, T, H, d] fp32; keys and values [B, S, H, d], or [B, H, S, d] with kv_layout="bhsd"."""
  scale = q_BxTxHxd.shape[-1] ** -0.5
  s_BxHxTxS = jnp.einsum(f"bthd,{kv_layout}->bhts", q_BxTxHxd, k_BxSxHxd, preferred_element_type=F32) * scale
  s_BxHxTxS = jnp.where(visible_BxTxS[:, None], s_BxHxTxS, -jnp.inf)
  p = jax.nn.softmax(s_BxHxTxS, axis=-1)
  return jnp.einsum(f"bhts,{kv_layout}->bthd", p.astype(v_BxSxHxd.dtype), v_BxSxHxd, preferred_element_type=F32)


def causal_attention(q_BxTxHxd, k_BxTxHxd, v_BxTxHxd):
  """Softmax attention of each position over positions <= it; returns o [B, T, H, hd] fp32."""
  B, T = q_BxTxHxd.shape[:2]
  visible = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))
  return _attend(q_BxTxHxd, k_BxTxHxd, v_BxTxHxd, visible)


def cached_attention(q_BxTxHxd, k_BxTxHxd, v_BxTxHxd, k_cache_BxSxHxd, v_cache_BxSxHxd, pos_B, n_B):
  """Write the real new keys/values at pos_B + t (t < n_B) and attend over the cache; see the module doc.

  Positions at or past the cache length S are dropped by the scatter: callers check capacity first
  (model.prefill / decode_step raise a ValueError on the host)."""
  B, T = q_BxTxHxd.shape[:2]
  S = k_cache_BxSxHxd.shape[1]
  t_T = jnp.arange(T)
  idx_BxT = jnp.where(t_T[None] < n_B[:, None], pos_B[:, None] + t_T[None], S)  # padding -> out of range
  rows_BxT = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
  write = lambda cache, x: cache.at[rows_BxT, idx_BxT].set(x.astype(cache.dtype), mode="drop")
  k_cache, v_cache = write(k_cache_BxSxHxd, k_BxTxHxd), write(v_cache_BxSxHxd, v_BxTxHxd)
  q_pos_BxT = pos_B[:, None] + t_T[None]
  visible_BxTxS = jnp.arange(S)[None, None, :] <= q_pos_BxT[:, :, None]
  return _attend(q_BxTxHxd.astype(k_cache.dtype), k_cache, v_cache, visible_BxTxS), k_cache, v_cache
