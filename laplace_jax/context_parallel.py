"""Context parallelism for the chunked GLA: one row's sequence split over the devices of a mesh axis.

Called inside `jax.shard_map`, where each device of axis `axis_name` holds a contiguous span of every row's
tokens (device i: tokens i·T_l … (i+1)·T_l − 1). The recurrence S_t = λ S_{t−1} + k_t v_tᵀ is linear in the
state, so a span's effect on what enters it is one pair per head: its total decay D = λ^{T_l} (0 if a segment
starts in the span: laplace_jax/segments.py) and the state U it builds from zero. Then

    1. every device runs gla.chunk_simple_gla on its span from a zero state: (o_local, U), and D;
    2. the pairs are all-gathered over the axis and combined by the exclusive scan
       S_in_i = Σ_{j<i} (Π_{j<m<i} D_m) U_j  (the state entering span i), O(devices) states per device;
    3. each position adds what the incoming state contributes, exp(b_t)·scale·q_tᵀ S_in (b_t: the log decay
       from the span's start to t, the same closed form as gla's), up to the span's first segment start,
       and the final state is D·S_in + U.

The collective moves (devices − 1) states per device and layer; no activation crosses devices.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from laplace_jax import gla

F32 = jnp.float32


def chunk_simple_gla_context(
  q,
  k,
  v,
  g_gamma,
  *,
  axis_name: str,
  scale=None,
  initial_state=None,
  reset=None,
  chunk_size=128,
  form="parallel",
):
  """gla.chunk_simple_gla over a sequence split along `axis_name` (call inside shard_map; every argument is
  this device's span, [B, T_l, ...]): (o [B, T_l, H, V] in v's dtype, the final state of the whole sequence
  [B, H, K, V] fp32, the same on every device). `initial_state` enters the first span; `reset` [B, T_l] as in
  gla.chunk_simple_gla."""
  B, T_l, H, K = q.shape
  scale = K**-0.5 if scale is None else scale
  g_H = jnp.asarray(g_gamma, F32)
  o_local, u_local = gla.chunk_simple_gla(
    q, k, v, g_gamma, scale=scale, reset=reset, chunk_size=chunk_size, form=form
  )
  # this span's total decay per row and head, and which of its positions still read the incoming state
  reads_BxT = jnp.ones((B, T_l), bool) if reset is None else jnp.cumsum(reset.astype(jnp.int32), axis=1) == 0
  d_BxH = jnp.where(reads_BxT[:, -1:], jnp.exp(g_H * T_l)[None], 0.0)

  # every span's (D, U), in axis order: [n, B, H] and [n, B, H, K, V]
  d_all = jax.lax.all_gather(d_BxH, axis_name)
  u_all = jax.lax.all_gather(u_local, axis_name)
  n, me = d_all.shape[0], jax.lax.axis_index(axis_name)
  s0 = jnp.zeros_like(u_local) if initial_state is None else initial_state.astype(F32)

  def enter(s_in, du):  # the state entering span j+1 from the one entering span j
    d, u = du
    return d[..., None, None] * s_in + u, s_in

  s_end, s_in_all = jax.lax.scan(enter, s0, (d_all, u_all), length=n)  # s_in_all[j]: entering span j
  s_in = jax.lax.dynamic_index_in_dim(s_in_all, me, 0, keepdims=False)

  # exp(b_t) for t = 0 … T_l − 1 of the span: γ·(t + 1), zero from the span's first segment start on
  decay_TxH = jnp.exp(g_H[None] * (jnp.arange(T_l, dtype=F32)[:, None] + 1))
  q_dec = q.astype(F32) * scale * decay_TxH[None, :, :, None] * reads_BxT[:, :, None, None]
  o = o_local.astype(F32) + jnp.einsum("bthk,bhkv->bthv", q_dec, s_in)
  return o.astype(v.dtype), s_end
