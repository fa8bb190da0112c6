"""One decode token of simple GLA for one layer of a layer-stacked state table, in one pass over the state.

    gla_decode_layer(q, k, v, g_gamma, table, layer) -> (o [B,H,V] in v's dtype, table)

`table` is the model's decode state [L, B, H, K, V] fp32 (donated by the caller); only layer `layer` is
rewritten, in place. Same math as `gla.recurrent_simple_gla_step`: S' = exp(g)·S + k vᵀ, o = scale·qᵀS'.

Two implementations:
  "pallas"  a Pallas kernel for GPUs: each program owns a block of slots of one head, reads that block of
            the state once, writes S' once (the table is aliased in place) and takes the readout from the
            same registers. Triton needs power-of-two tiles, so K and V are walked in power-of-two pieces
            (96 = 64 + 32, 192 = 128 + 64); the slot block is a power of two that divides B and keeps the
            largest tile within MAX_TILE values (registers, not local memory).
  "xla"     the pure-XLA step, the fallback on every other backend (CPU, Neuron): the readout from the old
            state, then S' written in place by the fusion that reads the old rows (3 passes over the
            state on XLA:CPU; see `_xla`). On Neuron (`platform.backend() == "neuron"`) the readout is
            the reference's einsum over S' instead (`_xla_einsum`): the CPU form's two-operand reduce is a
            variadic reduction, which jax-neuronx documents as unsupported.
impl="auto" picks "pallas" on GPUs and "xla" elsewhere; "interpret" runs the kernel in Pallas interpret
mode (tests, on the CPU). A kernel asked for where it cannot run (another backend, a compile failure, a
multi-device mesh set with `jax.set_mesh`) falls back to "xla" with one log line per reason. Callers that
shard the table over several devices without setting a mesh must pass impl="xla".
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from laplace_jax import platform

F32 = jnp.float32
IMPLS = ("auto", "pallas", "interpret", "xla")
log = logging.getLogger(__name__)
_logged: set[str] = set()


def _log_once(msg: str):
  if msg not in _logged:
    _logged.add(msg)
    log.warning(msg)


def pow2_pieces(n: int) -> list[tuple[int, int]]:
  """(offset, size) pieces of [0, n) whose sizes are powers of two, largest first: 96 -> (0,64), (64,32)."""
  out, start = [], 0
  for bit in reversed(range(n.bit_length())):
    if n >> bit & 1:
      out.append((start, 1 << bit))
      start += 1 << bit
  return out


def slot_block(batch: int, block_b: int) -> int:
  """The largest power of two <= block_b that divides batch (1 for an odd batch)."""
  bb = 1
  while bb * 2 <= block_b and batch % (bb * 2) == 0:
    bb *= 2
  return bb


MAX_TILE = 16384  # fp32 values of one (slots, K piece, V piece) tile a Triton program holds: 64 KiB


def kernel_slot_block(batch: int, K: int, V: int, block_b: int) -> int:
  """Slots per kernel program: a power of two dividing `batch`, at most block_b, whose largest tile of the
  state fits in MAX_TILE values (laplace-3b: 64 x 128 pieces, so 2 slots)."""
  largest = pow2_pieces(K)[0][1] * pow2_pieces(V)[0][1]
  return slot_block(batch, max(1, min(block_b, MAX_TILE // largest)))


def _kernel(layer_ref, lam_ref, q_ref, k_ref, v_ref, _table_in, o_ref, table_ref, *, bb, K, V, scale):
  i, h = pl.program_id(0), pl.program_id(1)
  layer, lam = layer_ref[0], lam_ref[h]
  b = pl.ds(i * bb, bb)
  for v0, vp in pow2_pieces(V):
    vv = v_ref[b, h, pl.ds(v0, vp)].astype(F32)  # [bb, vp]
    o = jnp.zeros((bb, vp), F32)
    for k0, kp in pow2_pieces(K):
      q = q_ref[b, h, pl.ds(k0, kp)].astype(F32) * scale  # [bb, kp]
      k = k_ref[b, h, pl.ds(k0, kp)].astype(F32)
      idx = (layer, b, h, pl.ds(k0, kp), pl.ds(v0, vp))
      s = lam * table_ref[idx] + k[:, :, None] * vv[:, None, :]  # [bb, kp, vp]
      table_ref[idx] = s
      o = o + jnp.sum(q[:, :, None] * s, axis=1)
    o_ref[b, h, pl.ds(v0, vp)] = o.astype(o_ref.dtype)


def _pallas(q, k, v, g_gamma, table, layer, *, scale, block_b, interpret):
  L, B, H, K, V = table.shape
  bb = kernel_slot_block(B, K, V, block_b)
  kernel = functools.partial(_kernel, bb=bb, K=K, V=V, scale=scale)
  layer_1 = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
  lam_H = jnp.exp(jnp.asarray(g_gamma, F32))
  return pl.pallas_call(
    kernel,
    grid=(B // bb, H),
    out_shape=(jax.ShapeDtypeStruct((B, H, V), v.dtype), jax.ShapeDtypeStruct(table.shape, table.dtype)),
    input_output_aliases={5: 1},
    interpret=interpret,
  )(layer_1, lam_H, q, k, v, table)


def _decays_and_keys(g_gamma, k, live_B):
  """(λ, k in fp32) for S' = λ·S + k vᵀ: λ = exp(g) per head [H], or with live_B per row and head [B, H], 1 for
  a row that is not live, whose keys are zeroed too, so its state stays as it was."""
  lam_H, k = jnp.exp(jnp.asarray(g_gamma, F32)), k.astype(F32)
  if live_B is None:
    return lam_H, k
  return jnp.where(live_B[:, None], lam_H[None, :], F32(1)), jnp.where(live_B[:, None, None], k, F32(0))


def _xla(q, k, v, g_gamma, table, layer, *, scale, live_B=None):
  """The step as XLA:CPU emits it in three passes over the layer's state (two reads, one in-place write).

  o is taken from the old state, o = λ·(q·S) + (q·k)·v, so that S' = λ·S + k vᵀ has one user, the in-place
  dynamic-update-slice, and fuses into it with its read of the old rows (InstructionFusion::ShouldFuseInPlaceOp
  allows a dynamic-slice into a DUS fusion at equal indices, only if every op between them is elementwise:
  no bitcast, so the state keeps its leading layer dim of 1). The readout is one two-input reduce, which XLA
  fuses with the slice; a dot or a one-input sum would go to a library call that reads a materialised copy
  of the slice. The write reads o through a select whose predicate is never true (per row, so no value
  crosses slots, nor devices when they are sharded), so it runs after the readout and the old rows need no
  copy (CopyInsertion otherwise copies the table for the unordered reader). A row that is not live (live_B
  false) keeps its state: decay 1 and no k vᵀ, elementwise in the same fusion.
  """
  out_dtype, (lam, k) = v.dtype, _decays_and_keys(g_gamma, k, live_B)  # λ [H] or [B, H]
  q, v = q.astype(F32) * scale, v.astype(F32)
  s1 = jax.lax.dynamic_slice_in_dim(table, layer, 1, 0)  # [1, B, H, K, V]
  qk = jnp.broadcast_to((q * k)[None, ..., None], s1.shape)
  qs, qk = jax.lax.reduce(
    (q[None, ..., None] * s1, qk), (F32(0), F32(0)), lambda a, b: (a[0] + b[0], a[1] + b[1]), (3,)
  )  # sums over K: [1, B, H, V]
  o = lam[..., None] * qs[0] + qk[0] * v  # = q·(λS + k vᵀ)
  k = jnp.where(o[:, :1, :1] > jnp.inf, F32(0), k)  # never true (nor for NaN): each row's write after its o
  s1 = lam[..., None, None] * s1 + (k[..., None] * v[..., None, :])[None]
  return o.astype(out_dtype), jax.lax.dynamic_update_slice_in_dim(table, s1, layer, 0)


def _xla_einsum(q, k, v, g_gamma, table, layer, *, scale, live_B=None):
  """The step with single-operand reductions only (for Neuron): S' = λ·S + k vᵀ, o = scale·qᵀS' (an einsum)."""
  lam, k = _decays_and_keys(g_gamma, k, live_B)  # λ [H] or [B, H]
  s = jax.lax.dynamic_index_in_dim(table, layer, 0, keepdims=False)  # [B, H, K, V]
  s = lam[..., None, None] * s + jnp.einsum("bhk,bhv->bhkv", k, v.astype(F32))
  o = jnp.einsum("bhk,bhkv->bhv", q.astype(F32) * scale, s)
  return o.astype(v.dtype), jax.lax.dynamic_update_index_in_dim(table, s, layer, 0)


@functools.cache
def _pallas_compiles(shapes: tuple, scale: float, block_b: int) -> str | None:
  """None if the kernel compiles for these shapes on this backend, else the reason (cached per shape)."""
  args = [jax.ShapeDtypeStruct(s, d) for s, d in shapes]
  try:
    jax.jit(functools.partial(_pallas, scale=scale, block_b=block_b, interpret=False)).lower(*args).compile()
  except Exception as e:  # any lowering or compile failure: the caller falls back to XLA
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
  return None


def resolve_impl(impl: str, backend: str | None = None) -> str:
  """The implementation `impl` means on `backend` (default: JAX's default backend)."""
  if impl not in IMPLS:
    raise ValueError(f"impl={impl!r}: expected one of {IMPLS} ('auto' picks the Pallas kernel on GPUs).")
  backend = backend or platform.backend()
  if impl == "auto":
    return "pallas" if backend == "gpu" else "xla"
  if impl == "pallas" and backend != "gpu":
    _log_once(f"gla_decode: the Pallas kernel runs on GPUs, not on backend {backend!r}; using the XLA step.")
    return "xla"
  return impl


def gla_decode_layer(
  q, k, v, g_gamma, table, layer, *, scale=None, impl: str = "auto", block_b: int = 16, live_B=None
):
  """One token for layer `layer` of table [L,B,H,K,V] fp32: (o [B,H,V] in v's dtype, table updated in place).

  q, k [B,H,K], v [B,H,V] (any float dtype; math in fp32); g_gamma [H] log decays; `layer` a scalar int.
  live_B (bool [B], None: all): a row that is not live keeps its state exactly (its o is meaningless); the
  Pallas kernel has no such rows, so with live_B the XLA step runs."""
  if table.ndim != 5 or table.dtype != F32:
    raise ValueError(
      f"table is {table.dtype}{list(table.shape)}: expected float32 [L, B, H, K, V], the "
      "model's layer-stacked decode state (model.init_state(cfg, B).gla)."
    )
  L, B, H, K, V = table.shape
  if q.shape != (B, H, K) or k.shape != (B, H, K) or v.shape != (B, H, V):
    raise ValueError(
      f"q {q.shape}, k {k.shape}, v {v.shape}: expected q, k [B, H, K] = {(B, H, K)} and "
      f"v [B, H, V] = {(B, H, V)} to match the table {table.shape}."
    )
  if not isinstance(block_b, int) or block_b < 1:
    raise ValueError(f"block_b={block_b!r}: expected a positive integer (slots per kernel program).")
  scale = K**-0.5 if scale is None else float(scale)
  impl = resolve_impl(impl)
  mesh = jax.sharding.get_abstract_mesh()
  if impl != "xla" and live_B is not None:
    _log_once("gla_decode: rows that keep their state (live_B) take the XLA step, not the Pallas kernel.")
    impl = "xla"
  if impl != "xla" and not mesh.empty and mesh.size > 1:
    # A pallas_call is one device's program: XLA cannot split it over a mesh's slots.
    _log_once(
      f"gla_decode: the Pallas kernel runs on one device, not over a {mesh.size}-device mesh; "
      "using the XLA step."
    )
    impl = "xla"
  if impl == "pallas":
    shapes = tuple((tuple(x.shape), jnp.dtype(x.dtype)) for x in (q, k, v, jnp.asarray(g_gamma), table))
    shapes += (((), jnp.dtype(jnp.int32)),)
    reason = _pallas_compiles(shapes, scale, block_b)
    if reason:
      _log_once(
        f"gla_decode: the Pallas kernel does not compile for table {list(table.shape)} "
        f"({reason}); using the XLA step."
      )
      impl = "xla"
  if impl == "xla":
    xla_step = _xla_einsum if platform.backend() == "neuron" else _xla
    return xla_step(q, k, v, g_gamma, table, layer, scale=scale, live_B=live_B)
  return _pallas(q, k, v, g_gamma, table, layer, scale=scale, block_b=block_b, interpret=impl == "interpret")
