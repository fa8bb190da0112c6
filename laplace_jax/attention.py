"""Causal softmax attention with rotary positions: the second mixer a layer may use (config `mixers`).

Layout as in gla.py: q, k, v, o [B, T, H, hd]. Scores and softmax in fp32, scale hd**-0.5.
  rope(x_BxTxHxd, pos_BxT)                          rotate (first half, second half) pairs by pos·base^(−2i/hd)
  causal_attention(q, k, v)                         a whole sequence from position 0 (training, eval)
  cached_attention(q, k, v, k_cache, v_cache, pos_B, n_B) -> (o, k_cache, v_cache)
      T new tokens per row at positions pos_B … pos_B+T−1, of which the first n_B are real: their keys and
      values are written into the caches [B, S, H, hd] (padding is dropped), then every query attends to
      the cache up to its own position. Prefill chunks and the one-token decode step both use it. Every
      write index is in range (padding repeats a real write), as Neuron requires.
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


def write_positions(pos_B, n_B, T: int, S: int):
  """(t_BxT, idx_BxT): the new token each of the T writes per row stores and the cache position it goes to,
  every one in [0, S). Real tokens t < n_B go to pos_B + t; padding repeats the row's last real write
  (t = n_B − 1); a row with n_B = 0 points at token 0 (cached_attention writes the cache's own values there)."""
  t_T = jnp.arange(T)
  t_BxT = jnp.where(t_T[None] < n_B[:, None], t_T[None], jnp.maximum(n_B - 1, 0)[:, None])
  return t_BxT, jnp.clip(pos_B[:, None] + t_BxT, 0, S - 1)


def cached_attention(q_BxTxHxd, k_BxTxHxd, v_BxTxHxd, k_cache_BxSxHxd, v_cache_BxSxHxd, pos_B, n_B):
  """Write the real new keys/values at pos_B + t (t < n_B) and attend over the cache; see the module doc.

  Every write index is in range (Neuron fails out-of-range scatters at run time; XLA drops them): a padding
  token (t >= n_B) repeats its row's last real write, same position and values; a row with no real token
  writes its cache's own values back. Real positions must be < S: callers check capacity first
  (model.prefill / decode_step raise a ValueError on the host); positions are clamped to S - 1 regardless."""
  B, T = q_BxTxHxd.shape[:2]
  S = k_cache_BxSxHxd.shape[1]
  t_T = jnp.arange(T)
  t_BxT, idx_BxT = write_positions(pos_B, n_B, T, S)
  rows_BxT = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
  some_B = (n_B > 0)[:, None, None, None]

  def write(cache, x):
    new = jnp.take_along_axis(x, t_BxT[:, :, None, None], 1).astype(cache.dtype)
    new = jnp.where(some_B, new, cache[rows_BxT, idx_BxT])
    return cache.at[rows_BxT, idx_BxT].set(new, mode="promise_in_bounds")

  k_cache, v_cache = write(k_cache_BxSxHxd, k_BxTxHxd), write(v_cache_BxSxHxd, v_BxTxHxd)
  q_pos_BxT = pos_B[:, None] + t_T[None]
  visible_BxTxS = jnp.arange(S)[None, None, :] <= q_pos_BxT[:, :, None]
  return _attend(q_BxTxHxd.astype(k_cache.dtype), k_cache, v_cache, visible_BxTxS), k_cache, v_cache
