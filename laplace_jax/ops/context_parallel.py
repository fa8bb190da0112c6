"""Context parallelism: one row's sequence split over the devices of the mesh's "context" axis.

Inside `jax.shard_map` over a mesh with that axis (sharding.make_mesh(context=N), the train step's), each
device holds a contiguous span of every row's tokens (device i: tokens i·T_l … (i+1)·T_l − 1), and the layer
pieces (laplace_jax/model/mixers.py) exchange only what crosses a span's edge:
  - the GLA: one (decay, state) pair per span and head, scanned across the devices (below);
  - the short conv: the previous span's last conv_size inputs (`previous_tail`, a ppermute);
  - sliding-window layers: the previous span's last `window` keys and values (window ≤ T_l);
  - packed rows: each span's last segment id and last segment start (`span_segments`), so that documents,
    their positions (RoPE) and their starts are the whole row's;
  - the training carry leaves from the last span (`from_last`).
Full attention would need every earlier key: it is refused. `span()` says whether the code being traced runs
on such a span.

The GLA, `chunk_simple_gla_context` (axis `axis_name`). The recurrence S_t = λ S_{t−1} + k_t v_tᵀ is linear in
the state, so a span's effect on what enters it is one pair per head: its total decay D = λ^{T_l} (0 if a
segment starts in the span: laplace_jax/ops/segments.py) and the state U it builds from zero. Pairs compose
associatively, (D₁, U₁) then (D₂, U₂) = (D₁D₂, D₂U₁ + U₂). Then

    1. every device runs gla.chunk_simple_gla on its span from a zero state: (o_local, U), and D;
    2. an exclusive scan of the pairs over the devices (shift by one span, then Hillis–Steele rounds at
       distances 1, 2, 4, …: one ppermute of one pair each) gives span i the composition of spans 0 … i−1,
       so S_in_i = D_{<i}·S_0 + U_{<i}, the state entering it;
    3. each position adds what the incoming state contributes, exp(b_t)·scale·q_tᵀ S_in (b_t: the log decay
       from the span's start to t, the same closed form as gla's), up to the span's first segment start,
       and the final state is D·S_in + U on the last span (sent to all only when a carry keeps it).

Each device sends and receives 1 + ⌈log₂ N⌉ states per layer (N devices on the axis), and the backward pass
as many; no activation crosses devices.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from laplace_jax.ops import gla, window_attention
from laplace_jax.ops.segments import Segments
from laplace_jax.sharding import CONTEXT

F32 = jnp.float32
SCOPE = "context_parallel"  # the named scope of every exchange here (benchmarks count its collectives)


def _scoped(f):
  """f traced under the SCOPE name (a scope object per call: one jax.named_scope instance, entered again
  while open, would leave the scope on every op traced after it)."""

  @functools.wraps(f)
  def scoped(*args, **kwargs):
    with jax.named_scope(SCOPE):
      return f(*args, **kwargs)

  return scoped


_NONE = jnp.iinfo(jnp.int32).min // 2  # "no segment starts here": below any start position


@dataclasses.dataclass(frozen=True)
class Span:
  """Where this device's tokens sit in the row: span `index` (traced) of `count` (static), T_l tokens each."""

  count: int
  index: jax.Array


def span() -> Span | None:
  """This device's span when traced inside a shard_map whose manual axes include a "context" axis of more
  than one device; None otherwise (a whole row per device)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or CONTEXT not in mesh.manual_axes or mesh.shape[CONTEXT] == 1:
    return None
  return Span(mesh.shape[CONTEXT], jax.lax.axis_index(CONTEXT))


def _moved(collective, x):
  """collective(x) for pure data movement; 32-bit integers travel as float32 bits (Trainium's collectives
  take floating operands only, laplace_jax/analysis/neuron_check.py)."""
  if x.dtype not in (jnp.int32, jnp.uint32):
    return collective(x)
  return jax.lax.bitcast_convert_type(collective(jax.lax.bitcast_convert_type(x, F32)), x.dtype)


@_scoped
def previous_tail(x, n: int, sp: Span):
  """The previous span's last `n` rows of x [B, T_l, ...] (along dim 1); zeros on span 0."""
  if n > x.shape[1]:
    raise ValueError(
      f"context parallelism needs the last {n} tokens of the previous span, but a span holds "
      f"{x.shape[1]}: use a sequence of at least {n} × {sp.count} tokens, or a smaller context axis."
    )
  perm = [(i, i + 1) for i in range(sp.count - 1)]
  return _moved(lambda y: jax.lax.ppermute(y, CONTEXT, perm), x[:, x.shape[1] - n :])


@_scoped
def from_last(x, sp: Span, axis_name: str = CONTEXT):
  """The last span's x on every device (the row's end: what a training carry keeps). Floats by a sum with
  the other spans' zeros (exact: x + 0 = x), integers gathered (their bits as floats would be denormals)."""
  if jnp.issubdtype(x.dtype, jnp.floating):
    return jax.lax.psum(jnp.where(sp.index == sp.count - 1, x, jnp.zeros_like(x)), axis_name)
  return _moved(lambda y: jax.lax.all_gather(y, axis_name)[sp.count - 1], x)


@_scoped
def span_segments(segment_ids_BxT, pos_B, first_start_B, sp: Span) -> Segments:
  """Segments.from_ids for this span as part of the whole row: a span's first token starts a segment when
  its id differs from the previous span's last (span 0: when `first_start_B` says so); `index` counts the
  row's starts and `offset` the tokens since the segment began, wherever it began (before the row:
  `pos_B` tokens, as in Segments.from_ids)."""
  ids = jnp.asarray(segment_ids_BxT)
  B, T = ids.shape
  prev_last = previous_tail(ids, 1, sp)[:, 0]
  row_first = jnp.zeros((B,), bool) if first_start_B is None else jnp.asarray(first_start_B, bool)
  first = jnp.where(sp.index == 0, row_first, ids[:, 0] != prev_last)
  start = jnp.concatenate([first[:, None], ids[:, 1:] != ids[:, :-1]], axis=1)
  t_BxT = sp.index * T + jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))  # positions in the row
  last_start_B = jnp.max(jnp.where(start, t_BxT, _NONE), axis=1)
  starts_B = jnp.sum(start.astype(jnp.int32), axis=1)
  last_all = _moved(lambda y: jax.lax.all_gather(y, CONTEXT), last_start_B)  # [count, B]
  starts_all = _moved(lambda y: jax.lax.all_gather(y, CONTEXT), starts_B)
  earlier = (jnp.arange(sp.count) < sp.index)[:, None]
  before_B = jnp.zeros((B,), jnp.int32) if pos_B is None else jnp.asarray(pos_B, jnp.int32)
  entering_B = jnp.maximum(-before_B, jnp.max(jnp.where(earlier, last_all, _NONE), axis=0))
  began = jax.lax.cummax(jnp.where(start, t_BxT, entering_B[:, None]), axis=1)
  index = jnp.sum(jnp.where(earlier, starts_all, 0), axis=0)[:, None] + jnp.cumsum(start.astype(jnp.int32), 1)
  return Segments(start=start, index=index, offset=t_BxT - began)


@_scoped
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
  unroll=False,
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
    q, k, v, g_gamma, scale=scale, reset=reset, chunk_size=chunk_size, unroll=unroll, form=form
  )
  # this span's total decay per row and head, and which of its positions still read the incoming state
  reads_BxT = jnp.ones((B, T_l), bool) if reset is None else jnp.cumsum(reset.astype(jnp.int32), axis=1) == 0
  d_local_BxH = jnp.where(reads_BxT[:, -1:], jnp.exp(g_H * T_l)[None], 0.0)

  n, me = jax.lax.axis_size(axis_name), jax.lax.axis_index(axis_name)
  s0 = jnp.zeros_like(u_local) if initial_state is None else initial_state.astype(F32)
  shifted = lambda x, by: jax.lax.ppermute(x, axis_name, [(j, j + by) for j in range(n - by)])
  # exclusive scan: span i starts from span i−1's pair (span 0 from the identity: decay 1, no state) ...
  d_BxH = jnp.where(me == 0, 1.0, shifted(d_local_BxH, 1))
  u = shifted(u_local, 1)
  by = 1
  while by < n:  # ... and composes, at distance 1, 2, 4, …, the pair `by` spans earlier with its own
    d_in, u_in = shifted(d_BxH, by), shifted(u, by)
    has = me >= by
    u = jnp.where(has, d_BxH[..., None, None] * u_in + u, u)
    d_BxH = jnp.where(has, d_in * d_BxH, d_BxH)
    by *= 2
  s_in = d_BxH[..., None, None] * s0 + u  # the state entering this span
  s_end = from_last(d_local_BxH[..., None, None] * s_in + u_local, Span(n, me), axis_name)

  # exp(b_t) for t = 0 … T_l − 1 of the span: γ·(t + 1), zero from the span's first segment start on
  decay_TxH = jnp.exp(g_H[None] * (jnp.arange(T_l, dtype=F32)[:, None] + 1))
  q_dec = q.astype(F32) * scale * decay_TxH[None, :, :, None] * reads_BxT[:, :, None, None]
  o = o_local.astype(F32) + jnp.einsum("bthk,bhkv->bthv", q_dec, s_in)
  return o.astype(v.dtype), s_end


@_scoped
def window_attention_on_span(q, k, v, window: int, segment_BxT, sp: Span):
  """window_attention.window_attention for this span of the row: its queries also see the previous span's
  last `window` keys and values (none on span 0); q, k, v [B, T_l, H, hd] with RoPE applied at the row's
  positions, `segment_BxT` the row's segment numbers (span_segments' index) or None."""
  B, T = q.shape[:2]
  seg = jnp.zeros((B, T), jnp.int32) if segment_BxT is None else segment_BxT
  seg_prev = jnp.where(sp.index == 0, -1, previous_tail(seg, window, sp))  # -1: no keys before the row
  ext = lambda prev, x: jnp.concatenate([prev, x], axis=1)
  o = window_attention.window_attention(
    ext(jnp.zeros_like(q[:, :window]), q),  # the previous keys' own query rows are computed and dropped
    ext(previous_tail(k, window, sp), k),
    ext(previous_tail(v, window, sp), v),
    window,
    ext(seg_prev, seg),
  )
  return o[:, window:]
