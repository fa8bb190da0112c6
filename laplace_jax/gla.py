"""Simple Gated Linear Attention (fixed per-head decay) in flash-linear-attention's conventions.

Layout: q, k [B, T, H, K]; v, o [B, T, H, V]; state [B, H, K, V] fp32; g_gamma [H] log decay <= 0;
`scale` (default K**-0.5) multiplies q; the readout uses the state after the update:

    S_t = exp(g_gamma) * S_{t-1} + k_t v_t^T,      o_t = scale * q_t^T S_t

Three forms: `chunk_simple_gla` (training / prefill: intra-chunk work in parallel, a scan over a static
number of chunks for the state), `recurrent_simple_gla_step` (one decode token) and
`naive_recurrent_simple_gla` (the token-by-token reference the tests compare against).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

F32 = jnp.float32


def _check(q, k, v, g_gamma, initial_state, mask):
  """Shape/dtype/sign validation with messages that name the value and the fix."""
  for name, x in (("q", q), ("k", k), ("v", v)):
    if x.ndim != 4:
      raise ValueError(f"{name} has shape {x.shape}: expected rank 4 [B, T, H, {'V' if name == 'v' else 'K'}]"
                       " (fla layout, time before heads).")
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise ValueError(f"{name} has dtype {x.dtype}: expected a floating dtype (float32/bfloat16).")
  B, T, H, K = q.shape
  if k.shape != q.shape:
    raise ValueError(f"k has shape {k.shape}: expected the shape of q, {q.shape}.")
  if v.shape[:3] != (B, T, H):
    raise ValueError(f"v has shape {v.shape}: expected [B, T, H, V] = [{B}, {T}, {H}, V] to match q.")
  if g_gamma.shape != (H,):
    raise ValueError(f"g_gamma has shape {g_gamma.shape}: expected [H] = [{H}], one log decay per head.")
  if not isinstance(g_gamma, jax.core.Tracer) and np.any(np.asarray(g_gamma) > 0):
    raise ValueError(f"g_gamma={np.asarray(g_gamma)} has positive entries: log decays must be <= 0 "
                     "(pass ln(lambda) with 0 < lambda <= 1), else the state grows without bound.")
  if initial_state is not None and initial_state.shape != (B, H, K, v.shape[-1]):
    raise ValueError(f"initial_state has shape {initial_state.shape}: expected [B, H, K, V] = "
                     f"{(B, H, K, v.shape[-1])}.")
  if mask is not None and mask.shape != (B, T):
    raise ValueError(f"mask has shape {mask.shape}: expected [B, T] = {(B, T)}.")


def _chunks_in_scan(q_, k_, v_, b_BxHxNxC, s0, unroll):
  """Every chunk's whole work (intra, readout, state update) inside one scan step: [B,H,N,C,·] -> o, S."""
  C = q_.shape[3]
  causal_CxC = jnp.tril(jnp.ones((C, C), bool))

  def step(s, xs):
    q_c, k_c, v_c, b_c = xs                                                  # [B,H,C,·], b [B,H,C]
    decay = jnp.exp(jnp.where(causal_CxC, b_c[..., :, None] - b_c[..., None, :], -jnp.inf))
    att = jnp.einsum("bhik,bhjk->bhij", q_c, k_c) * decay
    o = (jnp.einsum("bhij,bhjv->bhiv", att, v_c)
         + jnp.einsum("bhik,bhkv->bhiv", q_c * jnp.exp(b_c)[..., None], s))
    b_last = b_c[..., -1:]
    s = jnp.exp(b_last)[..., None] * s + jnp.einsum("bhjk,bhjv->bhkv", k_c * jnp.exp(b_last - b_c)[..., None], v_c)
    return s, o

  n_first = lambda x: jnp.moveaxis(x, 2, 0)
  s, o_NxBxHxCxV = jax.lax.scan(step, s0, tuple(map(n_first, (q_, k_, v_, b_BxHxNxC))),
                                unroll=q_.shape[2] if unroll else 1)
  return jnp.moveaxis(o_NxBxHxCxV, 0, 2), s


def chunk_simple_gla(q, k, v, g_gamma, *, scale=None, initial_state=None, chunk_size=128,
                     mask=None, unroll=False, form="parallel"):
  """Chunked simple GLA: (o [B,T,H,V] in v's dtype, final_state [B,H,K,V] fp32), any T.

  `mask` [B, T] (optional, True = real token) skips positions entirely: no decay, no contribution, so a
  right-padded chunk leaves the state exactly as its valid prefix would (the output there is meaningless).
  `unroll=True` unrolls the chunk scan statically (a fixed graph for ahead-of-time compilers).
  `form`: "parallel" does every chunk's intra-chunk attention at once and scans only the state (fastest on
  GPUs: 2× the "scan" form on an H200); "scan" does each chunk's whole work inside the scan step, keeping the
  working set cache-sized (constant time per token on CPUs, where "parallel" slows as T grows). Same math.
  """
  g_gamma = jnp.asarray(g_gamma)
  _check(q, k, v, g_gamma, initial_state, mask)
  B, T, H, K = q.shape
  V = v.shape[-1]
  C = int(chunk_size)
  if C <= 0:
    raise ValueError(f"chunk_size={chunk_size}: expected a positive integer (128 matches the published port).")
  if form not in ("parallel", "scan"):
    raise ValueError(f"form={form!r}: expected 'parallel' (GPUs) or 'scan' (CPUs).")
  scale = K ** -0.5 if scale is None else scale
  out_dtype = v.dtype

  # Per-token log decay [B, T, H]: g_gamma where real, 0 where masked. Padding T up to a whole number of
  # chunks uses the same trick, so the final state is exact for any T.
  g_BxTxH = jnp.broadcast_to(g_gamma.astype(F32), (B, T, H))
  kz = k
  if mask is not None:
    g_BxTxH = jnp.where(mask[..., None], g_BxTxH, 0.0)
    kz = jnp.where(mask[..., None, None], k, 0)
  N = -(-T // C)
  pad = N * C - T
  if pad:
    padt = lambda x: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    q, kz, v, g_BxTxH = padt(q), padt(kz), padt(v), padt(g_BxTxH)

  # [B, H, N, C, ·]: head-major chunk views, so every contraction below is a plain batched matmul.
  chunks = lambda x: jnp.moveaxis(x.reshape(B, N, C, H, x.shape[-1]), 3, 1).astype(F32)
  q_ = chunks(q) * scale
  k_, v_ = chunks(kz), chunks(v)
  # b_i = cumulative log decay inside the chunk, inclusive; all <= 0. Without a mask it is γ·(number of real
  # tokens up to i in the chunk), written in closed form: a cumsum over a constant would be folded at
  # compile time (seconds at 16K tokens).
  if mask is None:
    pos_NxC = jnp.arange(N * C).reshape(N, C)
    count_NxC = jnp.minimum(pos_NxC + 1, T) - C * jnp.arange(N)[:, None]
    b_BxHxNxC = jnp.broadcast_to(g_gamma.astype(F32)[:, None, None] * count_NxC, (B, H, N, C))
  else:
    b_BxHxNxC = jnp.cumsum(jnp.moveaxis(g_BxTxH.reshape(B, N, C, H), 3, 1), axis=-1)
  b_last_BxHxN = b_BxHxNxC[..., -1]

  s0 = jnp.zeros((B, H, K, V), F32) if initial_state is None else initial_state.astype(F32)
  if form == "scan":
    o, final_state = _chunks_in_scan(q_, k_, v_, b_BxHxNxC, s0, unroll)
    o = jnp.moveaxis(o, 1, 3).reshape(B, N * C, H, V)[:, :T]
    return o.astype(out_dtype), final_state
  # Intra-chunk: o_i += Σ_{j<=i} exp(b_i - b_j) (q_i·k_j) v_j. The exponent is masked *before* exp so the
  # (positive) upper triangle never overflows; nothing is ever divided by a cumulative decay.
  causal_CxC = jnp.tril(jnp.ones((C, C), bool))
  diff = b_BxHxNxC[..., :, None] - b_BxHxNxC[..., None, :]                 # [B,H,N,Ci,Cj]
  decay_BxHxNxCxC = jnp.exp(jnp.where(causal_CxC, diff, -jnp.inf))
  att_BxHxNxCxC = jnp.einsum("bhnik,bhnjk->bhnij", q_, k_) * decay_BxHxNxCxC
  o_intra = jnp.einsum("bhnij,bhnjv->bhniv", att_BxHxNxCxC, v_)

  # Per-chunk state contribution U_n = Σ_j exp(b_last - b_j) k_j v_j^T and the chunk's total decay.
  k_dec = k_ * jnp.exp(b_last_BxHxN[..., None] - b_BxHxNxC)[..., None]
  u_BxHxNxKxV = jnp.einsum("bhnjk,bhnjv->bhnkv", k_dec, v_)
  d_BxHxN = jnp.exp(b_last_BxHxN)

  # The only sequential part: S_n = d_n S_{n-1} + U_n over a static number of chunks; emits S_{n-1}.

  def step(s_prev, xs):
    d_BxH, u = xs
    return d_BxH[..., None, None] * s_prev + u, s_prev

  final_state, s_prev_NxBxHxKxV = jax.lax.scan(
      step, s0, (jnp.moveaxis(d_BxHxN, 2, 0), jnp.moveaxis(u_BxHxNxKxV, 2, 0)),
      unroll=N if unroll else 1)

  # Inter-chunk readout: o_i += exp(b_i) q_i^T S_{n-1}.
  q_dec = q_ * jnp.exp(b_BxHxNxC)[..., None]
  o_inter = jnp.einsum("bhnik,bhnkv->bhniv", q_dec, jnp.moveaxis(s_prev_NxBxHxKxV, 0, 2))
  o = jnp.moveaxis(o_intra + o_inter, 1, 3).reshape(B, N * C, H, V)[:, :T]
  return o.astype(out_dtype), final_state


def recurrent_simple_gla_step(q, k, v, g_gamma, state, *, scale=None):
  """One token: q, k [B,H,K], v [B,H,V], state [B,H,K,V] fp32 -> (o [B,H,V] in v's dtype, new state)."""
  if q.ndim != 3 or k.shape != q.shape or v.shape[:2] != q.shape[:2]:
    raise ValueError(f"q {q.shape}, k {k.shape}, v {v.shape}: expected q, k [B, H, K] and v [B, H, V].")
  B, H, K = q.shape
  if state.shape != (B, H, K, v.shape[-1]):
    raise ValueError(f"state has shape {state.shape}: expected [B, H, K, V] = {(B, H, K, v.shape[-1])}.")
  scale = K ** -0.5 if scale is None else scale
  lam_H = jnp.exp(jnp.asarray(g_gamma, F32))
  s = lam_H[None, :, None, None] * state + jnp.einsum("bhk,bhv->bhkv", k.astype(F32), v.astype(F32))
  o = jnp.einsum("bhk,bhkv->bhv", q.astype(F32) * scale, s)
  return o.astype(v.dtype), s


def naive_recurrent_simple_gla(q, k, v, g_gamma, *, scale=None, initial_state=None):
  """Token-by-token reference (a scan over T of `recurrent_simple_gla_step`): (o, final_state)."""
  g_gamma = jnp.asarray(g_gamma)
  _check(q, k, v, g_gamma, initial_state, None)
  B, T, H, K = q.shape
  s0 = jnp.zeros((B, H, K, v.shape[-1]), F32) if initial_state is None else initial_state.astype(F32)

  def step(s, qkv):
    o, s = recurrent_simple_gla_step(*qkv, g_gamma, s, scale=scale)
    return s, o

  s, o_TxBxHxV = jax.lax.scan(step, s0, tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v)))
  return jnp.moveaxis(o_TxBxHxV, 0, 1), s
