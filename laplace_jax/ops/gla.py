"""Simple Gated Linear Attention (fixed per-head decay) in flash-linear-attention's conventions.

Layout: q, k [B, T, H, K]; v, o [B, T, H, V]; state [B, H, K, V] fp32; g_gamma [H] log decay <= 0;
`scale` (default K**-0.5) multiplies q; the readout uses the state after the update:

    S_t = exp(g_gamma) * S_{t-1} + k_t v_t^T,      o_t = scale * q_t^T S_t

Packed rows: `reset` [B, T] (True where a token begins a new segment) drops the state before that token,
S_t = k_t v_t^T, so each segment of a row is computed exactly as if it ran alone from a zero state.

Three forms: `chunk_simple_gla` (training / prefill: intra-chunk work in parallel, a scan over a static
number of chunks for the state), `recurrent_simple_gla_step` (one decode token) and
`naive_recurrent_simple_gla` (the token-by-token reference the tests compare against). `state_after` is the
state after the first n_B of T tokens in closed form (speculative decoding commits a row at its accepted
length: S_n = λⁿ S_0 + Σ_{i<n} λ^{n−1−i} k_i v_iᵀ, no intermediate state kept).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

F32 = jnp.float32


def _check(q, k, v, g_gamma, initial_state, mask, reset=None):
  """Shape/dtype/sign validation with messages that name the value and the fix."""
  for name, x in (("q", q), ("k", k), ("v", v)):
    if x.ndim != 4:
      raise ValueError(
        f"{name} has shape {x.shape}: expected rank 4 [B, T, H, {'V' if name == 'v' else 'K'}]"
        " (fla layout, time before heads)."
      )
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
    raise ValueError(
      f"g_gamma={np.asarray(g_gamma)} has positive entries: log decays must be <= 0 "
      "(pass ln(lambda) with 0 < lambda <= 1), else the state grows without bound."
    )
  if initial_state is not None and initial_state.shape != (B, H, K, v.shape[-1]):
    raise ValueError(
      f"initial_state has shape {initial_state.shape}: expected [B, H, K, V] = {(B, H, K, v.shape[-1])}."
    )
  if mask is not None and mask.shape != (B, T):
    raise ValueError(f"mask has shape {mask.shape}: expected [B, T] = {(B, T)}.")
  if reset is not None and (reset.shape != (B, T) or reset.dtype != jnp.bool_):
    raise ValueError(f"reset is {reset.dtype}{list(reset.shape)}: expected bool [B, T] = {[B, T]}.")


def _chunk_terms(q_, k_, v_, b, r=None):
  """One chunk's pieces, for any leading dims ([..., C, ·], b [..., C]): the intra-chunk output
  Σ_{j<=i} exp(b_i - b_j)(q_i·k_j) v_j, the state contribution U = Σ_j exp(b_last - b_j) k_j v_j^T, the
  chunk's total decay exp(b_last), and the decayed queries exp(b_i) q_i that read the incoming state.

  `r` [..., C] (int, broadcastable to b): the number of segment starts in the chunk up to each position,
  inclusive. Then j feeds i only within one segment (r_j == r_i), U holds the last segment's tokens only,
  and a chunk with a start neither decays nor passes on the incoming state, which only the positions before
  its first start read: every term is dropped by a select, never by a large negative decay.

  The exponent is masked *before* exp, so the (positive) upper triangle never overflows; nothing is ever
  divided by a cumulative decay."""
  C = b.shape[-1]
  causal = jnp.tril(jnp.ones((C, C), bool))
  if r is not None:
    causal = causal & (r[..., :, None] == r[..., None, :])
  decay = jnp.exp(jnp.where(causal, b[..., :, None] - b[..., None, :], -jnp.inf))
  o_intra = jnp.einsum("...ij,...jv->...iv", jnp.einsum("...ik,...jk->...ij", q_, k_) * decay, v_)
  b_last = b[..., -1:]
  w_j = jnp.exp(b_last - b)
  d = jnp.exp(b_last[..., 0])
  q_dec = q_ * jnp.exp(b)[..., None]
  if r is not None:
    r_last = r[..., -1:]
    w_j = jnp.where(r == r_last, w_j, 0.0)
    d = jnp.where(r_last[..., 0] == 0, d, 0.0)
    q_dec = jnp.where((r == 0)[..., None], q_dec, 0.0)
  u = jnp.einsum("...jk,...jv->...kv", k_ * w_j[..., None], v_)
  return o_intra, u, d, q_dec


def _read(q_dec, s):
  """exp(b_i) q_i^T S for every position of a chunk."""
  return jnp.einsum("...ik,...kv->...iv", q_dec, s)


def _chunks_in_scan(q_, k_, v_, b_BxHxNxC, s0, unroll, r_Bx1xNxC=None):
  """Every chunk's whole work inside one scan step (cache-sized working set): [B,H,N,C,·] -> (o, S)."""

  def step(s, xs):
    o_intra, u, d_BxH, q_dec = _chunk_terms(*xs)  # one chunk: [B, H, C, ·]
    return d_BxH[..., None, None] * s + u, o_intra + _read(q_dec, s)

  n_first = lambda x: jnp.moveaxis(x, 2, 0)
  xs = (q_, k_, v_, b_BxHxNxC) + (() if r_Bx1xNxC is None else (r_Bx1xNxC,))
  s, o_NxBxHxCxV = jax.lax.scan(
    step, s0, tuple(map(n_first, xs)), unroll=0 if unroll else 1
  )  # 0: all chunks (True leaves one chunk a loop)
  return jnp.moveaxis(o_NxBxHxCxV, 0, 2), s


def _chunks_in_parallel(q_, k_, v_, b_BxHxNxC, s0, unroll, r_Bx1xNxC=None):
  """Every chunk's intra-chunk work at once, then the only sequential part, S_n = d_n S_{n-1} + U_n over a
  static number of chunks, which emits each chunk's incoming state S_{n-1} for the readout."""
  o_intra, u_BxHxNxKxV, d_BxHxN, q_dec = _chunk_terms(q_, k_, v_, b_BxHxNxC, r_Bx1xNxC)
  d_BxHxN = jnp.broadcast_to(d_BxHxN, u_BxHxNxKxV.shape[:3])

  def step(s_prev, xs):
    d_BxH, u = xs
    return d_BxH[..., None, None] * s_prev + u, s_prev

  final_state, s_prev_NxBxHxKxV = jax.lax.scan(
    step, s0, (jnp.moveaxis(d_BxHxN, 2, 0), jnp.moveaxis(u_BxHxNxKxV, 2, 0)), unroll=0 if unroll else 1
  )  # 0: all chunks (True leaves one chunk a loop)
  return o_intra + _read(q_dec, jnp.moveaxis(s_prev_NxBxHxKxV, 0, 2)), final_state


def chunk_simple_gla(
  q,
  k,
  v,
  g_gamma,
  *,
  scale=None,
  initial_state=None,
  chunk_size=128,
  mask=None,
  reset=None,
  unroll=False,
  form="parallel",
):
  """Chunked simple GLA: (o [B,T,H,V] in v's dtype, final_state [B,H,K,V] fp32), any T.

  `mask` [B, T] (optional, True = real token) skips positions entirely: no decay, no contribution, so a
  right-padded chunk leaves the state exactly as its valid prefix would (the output there is meaningless).
  `reset` [B, T] (optional, True = the token begins a segment; see the module doc) restarts the state there
  from zero, inside a chunk too; a masked position never resets.
  `unroll=True` unrolls the chunk scan statically (a fixed graph for ahead-of-time compilers).
  `form`: "parallel" does every chunk's intra-chunk attention at once and scans only the state (fastest on
  GPUs: 2× the "scan" form on an H200); "scan" does each chunk's whole work inside the scan step, keeping the
  working set cache-sized (constant time per token on CPUs, where "parallel" slows as T grows). Same math.
  """
  g_gamma = jnp.asarray(g_gamma)
  _check(q, k, v, g_gamma, initial_state, mask, reset)
  B, T, H, K = q.shape
  V = v.shape[-1]
  C = int(chunk_size)
  if C <= 0:
    raise ValueError(
      f"chunk_size={chunk_size}: expected a positive integer (128 matches the published port)."
    )
  if form not in ("parallel", "scan"):
    raise ValueError(f"form={form!r}: expected 'parallel' (GPUs) or 'scan' (CPUs).")
  scale = K**-0.5 if scale is None else scale
  out_dtype = v.dtype

  # Masked positions get key 0 and log decay 0: they neither feed nor decay the state. Padding T up to a
  # whole number of chunks works the same way, so the final state is exact for any T.
  kz = k if mask is None else jnp.where(mask[..., None, None], k, 0)
  N = -(-T // C)
  padt = lambda x: jnp.pad(x, [(0, 0), (0, N * C - T)] + [(0, 0)] * (x.ndim - 2))
  q, kz, v = padt(q), padt(kz), padt(v)

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
    g_BxTxH = padt(jnp.where(mask[..., None], g_gamma.astype(F32), 0.0))
    b_BxHxNxC = jnp.cumsum(jnp.moveaxis(g_BxTxH.reshape(B, N, C, H), 3, 1), axis=-1)

  r_Bx1xNxC = None
  if reset is not None:  # segment starts so far in each chunk, inclusive (padding never starts one)
    starts = padt(reset if mask is None else reset & mask).reshape(B, 1, N, C)
    r_Bx1xNxC = jnp.cumsum(starts.astype(jnp.int32), axis=-1)

  s0 = jnp.zeros((B, H, K, V), F32) if initial_state is None else initial_state.astype(F32)
  if form == "scan":
    o, final_state = _chunks_in_scan(q_, k_, v_, b_BxHxNxC, s0, unroll, r_Bx1xNxC)
  else:
    o, final_state = _chunks_in_parallel(q_, k_, v_, b_BxHxNxC, s0, unroll, r_Bx1xNxC)
  o = jnp.moveaxis(o, 1, 3).reshape(B, N * C, H, V)[:, :T]
  return o.astype(out_dtype), final_state


def state_after(state_BxHxKxV, k_BxTxHxK, v_BxTxHxV, g_gamma, n_B):
  """The state after the first n_B (0 … T) of T new tokens per row, from `state` (fp32 [B, H, K, V])."""
  T = k_BxTxHxK.shape[1]
  g_H = jnp.asarray(g_gamma, F32)
  n_B = jnp.asarray(n_B, jnp.int32)
  lag_BxT = (n_B[:, None] - 1 - jnp.arange(T)[None]).astype(F32)  # tokens after t up to the n-th
  w_BxTxH = jnp.where((lag_BxT >= 0)[..., None], jnp.exp(g_H * jnp.maximum(lag_BxT, 0)[..., None]), 0.0)
  decay_BxH = jnp.exp(g_H[None] * n_B[:, None].astype(F32))
  new = jnp.einsum("bth,bthk,bthv->bhkv", w_BxTxH, k_BxTxHxK.astype(F32), v_BxTxHxV.astype(F32))
  return decay_BxH[..., None, None] * state_BxHxKxV.astype(F32) + new


def recurrent_simple_gla_step(q, k, v, g_gamma, state, *, scale=None):
  """One token: q, k [B,H,K], v [B,H,V], state [B,H,K,V] fp32 -> (o [B,H,V] in v's dtype, new state)."""
  if q.ndim != 3 or k.shape != q.shape or v.shape[:2] != q.shape[:2]:
    raise ValueError(f"q {q.shape}, k {k.shape}, v {v.shape}: expected q, k [B, H, K] and v [B, H, V].")
  B, H, K = q.shape
  if state.shape != (B, H, K, v.shape[-1]):
    raise ValueError(f"state has shape {state.shape}: expected [B, H, K, V] = {(B, H, K, v.shape[-1])}.")
  scale = K**-0.5 if scale is None else scale
  lam_H = jnp.exp(jnp.asarray(g_gamma, F32))
  s = lam_H[None, :, None, None] * state + jnp.einsum("bhk,bhv->bhkv", k.astype(F32), v.astype(F32))
  o = jnp.einsum("bhk,bhkv->bhv", q.astype(F32) * scale, s)
  return o.astype(v.dtype), s


def naive_recurrent_simple_gla(q, k, v, g_gamma, *, scale=None, initial_state=None, reset=None):
  """Token-by-token reference (a scan over T of `recurrent_simple_gla_step`; the state zeroed before a
  token whose `reset` is True): (o, final_state)."""
  g_gamma = jnp.asarray(g_gamma)
  _check(q, k, v, g_gamma, initial_state, None, reset)
  B, T, H, K = q.shape
  s0 = jnp.zeros((B, H, K, v.shape[-1]), F32) if initial_state is None else initial_state.astype(F32)
  reset = jnp.zeros((B, T), bool) if reset is None else reset

  def step(s, xs):
    *qkv, r_B = xs
    o, s = recurrent_simple_gla_step(*qkv, g_gamma, jnp.where(r_B[:, None, None, None], 0.0, s), scale=scale)
    return s, o

  s, o_TxBxHxV = jax.lax.scan(step, s0, tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, reset)))
  return jnp.moveaxis(o_TxBxHxV, 0, 1), s
