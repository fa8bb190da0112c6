"""Muon (momentum orthogonalised by Newton–Schulz) as an optax transform, distributed over a mesh.

Per leaf [..., fan_in, fan_out] (x @ W convention; leading dims are independent matrices, e.g. layers):
  mu  <- beta·mu + (1 − beta)·g                         (bias-corrected, Nesterov as optax.contrib.muon)
  O   <- NewtonSchulz5(mu_hat / (‖mu_hat‖_F + eps))      (transposed while rows > cols)
  u   <- −lr · (scale(fan_in, fan_out)·O + wd·W)         (decoupled weight decay)
scale = √max(1, fan_out/fan_in) ("reference") or 0.2·√max(fan_in, fan_out) ("adamw_rms", Moonlight).

Distribution (mesh given, matrices FSDP-sharded as laplace_jax.sharding.matrix_spec says): inside one
shard_map, every device packs its shards of the matrices that device p owns into row p of an [N, C]
buffer; an all_to_all hands each owner whole matrices; the owner runs Newton–Schulz on them; a second
all_to_all returns the shards. Matrices are assigned to owners longest-processing-time first on their
Newton–Schulz FLOPs, and C (the per-pair chunk) is padded to the busiest owner's share, which is what
"pad the count to a multiple of the device count" becomes when owners hold different shapes. A device
runs only its own matrices (a lax.switch on its fsdp index). With fan_in shards (the sharding rule's first
choice) the result is bit-identical to one device: the stages are fenced so XLA fuses them alike on both
(optimization barriers, per-matrix lax.map, no transpose next to the norm; the tests fail without
each). The "gather" variant (all_gather every matrix, orthogonalise all, keep the own shard)
exists to measure the traffic this saves.
"""
from __future__ import annotations

import dataclasses
import heapq
import math
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from laplace_jax.sharding import FSDP, matrix_shard_dim, matrix_spec

NS_COEFFS = (3.4445, -4.7750, 2.0315)
SCALE_MODES = ("reference", "adamw_rms")
DISTRIBUTIONS = ("all_to_all", "gather")
ADAMW_RMS = 0.2  # Moonlight: 0.2·√max(fan_in, fan_out) matches AdamW's typical update RMS


class MuonState(NamedTuple):
  count: jax.Array  # int32 [], steps taken
  mu: optax.Updates  # first moment, same tree and shapes as the params


# ---- the per-matrix math ----------------------------------------------------------------------------

def newton_schulz(x_MxN: jax.Array, *, steps: int = 5, coeffs=NS_COEFFS, eps: float = 1e-7,
                  dtype=None) -> jax.Array:
  """Approximate U Vᵀ of one matrix: Frobenius-normalise, then `steps` quintic Newton–Schulz iterations.

  `dtype` (e.g. bfloat16, as the reference Muon runs it): the iterations' dtype; the norm is taken in the
  input's dtype and the result is returned in it. None iterates in the input's dtype."""
  # The barriers stop XLA fusing the norm's reduction (or the result) with whatever produces (consumes) the
  # matrix, which differs on one device and on a mesh and would change the summation order.
  x_MxN = jax.lax.optimization_barrier(x_MxN)
  out_dtype = x_MxN.dtype
  transpose = x_MxN.shape[0] > x_MxN.shape[1]  # iterate on the wide orientation: A = X Xᵀ is the small side
  x = x_MxN.T if transpose else x_MxN
  x = x / (jnp.linalg.norm(x) + eps)
  if dtype is not None:
    x = x.astype(dtype)
  a, b, c = (jnp.asarray(v, x.dtype) for v in coeffs)
  for _ in range(steps):
    gram = x @ x.T
    x = a * x + (b * gram + c * (gram @ gram)) @ x
  x = x.astype(out_dtype)
  return jax.lax.optimization_barrier(x.T if transpose else x)


def ns_flops(shape: Sequence[int], steps: int = 5) -> int:
  """Matmul FLOPs of Newton–Schulz on one [m, n] matrix: per step 4·s²·l + 2·s³ (s = min, l = max)."""
  s, l = sorted(shape[-2:])
  return steps * (4 * s * s * l + 2 * s ** 3)


def update_scale(shape: Sequence[int], mode: str) -> float:
  """Shape factor of the orthogonalised update of a [..., fan_in, fan_out] leaf."""
  fan_in, fan_out = shape[-2], shape[-1]
  if mode == "reference":
    return math.sqrt(max(1.0, fan_out / fan_in))
  return ADAMW_RMS * math.sqrt(max(fan_in, fan_out))


def _ns_stack(x: jax.Array, ns: Callable) -> jax.Array:
  """Newton–Schulz on every matrix of a [..., m, n] stack, one at a time (lax.map, not vmap) so each
  matrix sees exactly the computation a distributed owner runs: the two are bit-identical."""
  flat = x.reshape((-1,) + x.shape[-2:])
  return jax.lax.map(ns, flat).reshape(x.shape)


# ---- ownership plan --------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Mat:
  leaf: int   # index in the flattened Muon leaves
  index: int  # index in the leaf's flattened leading dims
  shape: tuple[int, int]
  shard_dim: int  # 0: rows over fsdp, 1: columns over fsdp
  shard_size: int  # elements of one device's shard


@dataclasses.dataclass(frozen=True)
class Plan:
  """Static assignment of whole matrices to owner devices for the two all_to_alls."""
  n_devices: int
  mats: tuple[_Mat, ...]
  owned: tuple[tuple[int, ...], ...]  # per device: indices into mats, in mats order
  chunk: int                          # elements each device sends to each peer (padded)
  signatures: tuple[tuple, ...]  # distinct ((m, n), shard_dim) lists owned; one switch branch each
  branch_of_device: tuple[int, ...]


def assign_owners(costs: Sequence[float], n_devices: int) -> list[list[int]]:
  """Longest-processing-time-first: each item, largest first, to the least-loaded device (lowest id)."""
  heap = [(0.0, d) for d in range(n_devices)]
  owned = [[] for _ in range(n_devices)]
  for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
    load, d = heapq.heappop(heap)
    owned[d].append(i)
    heapq.heappush(heap, (load + costs[i], d))
  return [sorted(o) for o in owned]


def make_plan(shapes: Sequence[Sequence[int]], n_devices: int, ns_steps: int = 5) -> Plan:
  """Plan for Muon leaves of these global shapes ([..., fan_in, fan_out]) over n FSDP devices."""
  mats = []
  for leaf, shape in enumerate(shapes):
    dim = matrix_shard_dim(shape, n_devices, f"Muon leaf {leaf}")
    sd = 0 if dim is None else dim - (len(shape) - 2)
    m, n = shape[-2:]
    for index in range(math.prod(shape[:-2])):
      mats.append(_Mat(leaf, index, (m, n), sd, m * n // n_devices))
  owned = assign_owners([ns_flops(m.shape, ns_steps) for m in mats], n_devices)
  chunk = max((sum(mats[i].shard_size for i in o) for o in owned), default=0)
  sigs, branch = [], []
  for o in owned:
    sig = tuple((mats[i].shape, mats[i].shard_dim) for i in o)
    if sig not in sigs:
      sigs.append(sig)
    branch.append(sigs.index(sig))
  return Plan(n_devices, tuple(mats), tuple(tuple(o) for o in owned), chunk, tuple(sigs), tuple(branch))


def ns_flops_per_device(shapes: Sequence[Sequence[int]], n_devices: int, *, ns_steps: int = 5,
                        distribution: str = "all_to_all") -> dict[str, Any]:
  """Newton–Schulz FLOPs each device runs per step (padding runs nothing): per_device, max, mean, max/mean."""
  plan = make_plan(shapes, n_devices, ns_steps)
  total = sum(ns_flops(m.shape, ns_steps) for m in plan.mats)
  if distribution == "gather":
    per = [total] * n_devices
  else:
    per = [sum(ns_flops(plan.mats[i].shape, ns_steps) for i in o) for o in plan.owned]
  mean = total / n_devices
  return {"per_device": per, "max": max(per), "mean": mean, "max_over_mean": max(per) / mean,
          "total": total}


# ---- packing whole matrices to and from the [N, C] all_to_all buffers --------------------------------

def _assemble(rows_NxS: jax.Array, shape: tuple[int, int], shard_dim: int) -> jax.Array:
  """N shards (row j from device j) -> the whole [m, n] matrix."""
  (m, n), N = shape, rows_NxS.shape[0]
  if shard_dim == 0:
    return rows_NxS.reshape(m, n)
  return rows_NxS.reshape(N, m, n // N).transpose(1, 0, 2).reshape(m, n)


def _split(x_MxN: jax.Array, shard_dim: int, N: int) -> jax.Array:
  """The whole [m, n] matrix -> N flattened shards [N, m·n/N] (inverse of _assemble)."""
  m, n = x_MxN.shape
  if shard_dim == 0:
    return x_MxN.reshape(N, m * n // N)
  return x_MxN.reshape(m, N, n // N).transpose(1, 0, 2).reshape(N, m * n // N)


def _pad_cols(x_NxK: jax.Array, width: int) -> jax.Array:
  return jnp.pad(x_NxK, ((0, 0), (0, width - x_NxK.shape[1])))


def _pack_for_owners(locals_: Sequence[jax.Array], plan: Plan) -> jax.Array:
  """Send buffer [N, C]: row p holds this device's shards of the matrices device p owns."""
  flat = [x.reshape(-1, x.shape[-2] * x.shape[-1]) for x in locals_]  # [K_leaf, shard elements]
  rows = []
  for o in plan.owned:
    parts = [flat[plan.mats[i].leaf][plan.mats[i].index] for i in o]
    row = jnp.concatenate(parts) if parts else jnp.zeros((0,), flat[0].dtype)
    rows.append(jnp.pad(row, (0, plan.chunk - row.shape[0])))
  return jnp.stack(rows)


def _owner_branch(sig, ns: Callable, chunk: int) -> Callable:
  """Owner's work for one signature: whole matrices from the [N, C] buffer, NS each, back to shards."""
  def run(recv_NxC):
    N, outs, off = recv_NxC.shape[0], [], 0
    for shape, shard_dim in sig:
      size = shape[0] * shape[1] // N
      whole = _assemble(recv_NxC[:, off:off + size], shape, shard_dim)
      outs.append(_split(ns(whole), shard_dim, N))
      off += size
    if not outs:
      return jnp.zeros_like(recv_NxC)
    return _pad_cols(jnp.concatenate(outs, axis=1), chunk)
  return run


def _unpack_from_owners(back_NxC: jax.Array, locals_: Sequence[jax.Array], plan: Plan) -> list[jax.Array]:
  """Row p of the returned buffer holds this device's shards of p's orthogonalised matrices."""
  pieces = [[None] * (x.size // (x.shape[-2] * x.shape[-1])) for x in locals_]
  for p, o in enumerate(plan.owned):
    off = 0
    for i in o:
      mat = plan.mats[i]
      pieces[mat.leaf][mat.index] = back_NxC[p, off:off + mat.shard_size]
      off += mat.shard_size
  return [jnp.stack(ps).reshape(x.shape) for ps, x in zip(pieces, locals_)]


# ---- orthogonalisation of a list of leaves ------------------------------------------------------------

def _orthogonalize_all_to_all(leaves, mesh: Mesh, ns: Callable, ns_steps: int):
  plan = make_plan([x.shape for x in leaves], mesh.shape[FSDP], ns_steps)
  specs = tuple(matrix_spec(x.shape, mesh) for x in leaves)
  branches = [_owner_branch(sig, ns, plan.chunk) for sig in plan.signatures]
  branch_of_device = np.asarray(plan.branch_of_device, np.int32)

  def local(*xs):
    send_NxC = _pack_for_owners(xs, plan)
    recv_NxC = jax.lax.all_to_all(send_NxC, FSDP, 0, 0)
    me = jax.lax.axis_index(FSDP)
    done_NxC = jax.lax.switch(jnp.asarray(branch_of_device)[me], branches, recv_NxC)
    back_NxC = jax.lax.all_to_all(done_NxC, FSDP, 0, 0)
    return tuple(_unpack_from_owners(back_NxC, xs, plan))

  return list(jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=specs)(*leaves))


def _orthogonalize_gather(leaves, mesh: Mesh, ns: Callable):
  dims = [matrix_shard_dim(x.shape, mesh.shape[FSDP]) for x in leaves]
  specs = tuple(matrix_spec(x.shape, mesh) for x in leaves)

  def local(*xs):
    me = jax.lax.axis_index(FSDP)
    outs = []
    for x, dim in zip(xs, dims):
      # Gather along a new leading axis and reassemble (like an owner does), keeping default layouts.
      parts = jax.lax.all_gather(x, FSDP, axis=0)  # [N, *x.shape]: every matrix on every device
      whole = jnp.concatenate(list(parts), axis=dim)
      y = _ns_stack(whole, ns)
      outs.append(jax.lax.dynamic_slice_in_dim(y, me * x.shape[dim], x.shape[dim], axis=dim))
    return tuple(outs)

  return list(jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=specs)(*leaves))


def orthogonalize(tree, *, mesh: Mesh | None = None, distribution: str = "all_to_all", ns_steps: int = 5,
                  ns_coeffs=NS_COEFFS, eps: float = 1e-7, ns_dtype=None):
  """Newton–Schulz of every matrix in a tree of [..., fan_in, fan_out] leaves, on one device or a mesh."""
  leaves, treedef = jax.tree.flatten(tree)
  if not leaves:
    return tree
  ns = lambda x: newton_schulz(x, steps=ns_steps, coeffs=ns_coeffs, eps=eps, dtype=ns_dtype)
  with jax.named_scope("muon_orthogonalize"):
    if mesh is None or mesh.shape[FSDP] == 1:
      out = [_ns_stack(x, ns) for x in leaves]
    elif distribution == "gather":
      out = _orthogonalize_gather(leaves, mesh, ns)
    else:
      out = _orthogonalize_all_to_all(leaves, mesh, ns, ns_steps)
  return jax.tree.unflatten(treedef, out)


# ---- the optax transform --------------------------------------------------------------------------

def _bad(name, value, expect, fix=""):
  raise ValueError(f"muon({name}={value!r}): expected {expect}. {fix}".rstrip())


def _check_settings(learning_rate, beta, ns_steps, ns_coeffs, eps, weight_decay, scale_mode, mesh,
                    distribution):
  if not callable(learning_rate):
    lr = float(learning_rate)
    if not (math.isfinite(lr) and lr >= 0):
      _bad("learning_rate", learning_rate, "a finite value >= 0 (or a schedule)",
           "Muon descends by itself; pass a positive learning rate.")
  if not (0 <= float(beta) < 1):
    _bad("beta", beta, "a momentum decay in [0, 1)", "The reference value is 0.95.")
  if isinstance(ns_steps, bool) or not isinstance(ns_steps, (int, np.integer)) or ns_steps < 1:
    _bad("ns_steps", ns_steps, "an integer >= 1", "The reference value is 5.")
  if len(tuple(ns_coeffs)) != 3 or not all(math.isfinite(float(c)) for c in ns_coeffs):
    _bad("ns_coeffs", ns_coeffs, "three finite quintic coefficients (a, b, c)", f"The reference is {NS_COEFFS}.")
  if not (math.isfinite(float(eps)) and float(eps) >= 0):
    _bad("eps", eps, "a finite value >= 0")
  if not (math.isfinite(float(weight_decay)) and float(weight_decay) >= 0):
    _bad("weight_decay", weight_decay, "a finite value >= 0")
  if scale_mode not in SCALE_MODES:
    _bad("scale_mode", scale_mode, f"one of {SCALE_MODES}")
  if distribution not in DISTRIBUTIONS:
    _bad("distribution", distribution, f"one of {DISTRIBUTIONS}")
  if mesh is not None and FSDP not in mesh.shape:
    _bad("mesh", dict(mesh.shape), f"a mesh with an '{FSDP}' axis",
         "Build it with laplace_jax.sharding.make_mesh.")


def _check_leaves(tree, mesh):
  for path, x in jax.tree_util.tree_leaves_with_path(tree):
    name = jax.tree_util.keystr(path)
    if np.ndim(x) < 2:
      raise ValueError(f"muon got leaf {name} of shape {np.shape(x)}: expected matrices [..., fan_in, fan_out]. "
                       "Send vectors and scalars to AdamW (laplace_jax.optimizer does).")
    if mesh is not None:
      matrix_shard_dim(np.shape(x), mesh.shape[FSDP], name)


def muon(learning_rate: optax.ScalarOrSchedule, *, beta: float = 0.95, nesterov: bool = True,
         ns_steps: int = 5, ns_coeffs=NS_COEFFS, eps: float = 1e-7, weight_decay: float = 0.0,
         scale_mode: str = "reference", mu_dtype=None, mesh: Mesh | None = None,
         distribution: str = "all_to_all", ns_dtype=None) -> optax.GradientTransformation:
  """Muon on every leaf it is given (each a stack of [fan_in, fan_out] matrices); see the module doc.
  `ns_dtype="bfloat16"` runs the Newton–Schulz iterations in bf16 (the reference Muon's choice)."""
  _check_settings(learning_rate, beta, ns_steps, ns_coeffs, eps, weight_decay, scale_mode, mesh, distribution)
  if ns_dtype is not None and jnp.dtype(ns_dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
    _bad("ns_dtype", ns_dtype, "None, float32 or bfloat16")
  ns_coeffs = tuple(float(c) for c in ns_coeffs)

  def init_fn(params):
    _check_leaves(params, mesh)
    mu = jax.tree.map(lambda p: jnp.zeros(p.shape, mu_dtype or p.dtype), params)
    return MuonState(count=jnp.zeros([], jnp.int32), mu=mu)

  def update_fn(updates, state, params=None):
    if weight_decay and params is None:
      raise ValueError("muon(weight_decay>0).update needs params: call update(grads, state, params).")
    # Optimization barriers fence the elementwise stages into the same fusions on one device and on a mesh:
    # otherwise XLA fuses them with different neighbours and contracts different mul+adds into FMAs.
    barrier = jax.lax.optimization_barrier
    updates, mu_prev = barrier((updates, state.mu))
    count = optax.safe_int32_increment(state.count)
    mu = jax.tree.map(lambda g, m: (1 - beta) * g + beta * m, updates, mu_prev)
    if nesterov:  # optax.contrib.muon's form: both terms bias-corrected
      c_mu, c_g = 1 - beta ** (count + 1), 1 - beta ** count
      mu_hat = jax.tree.map(
          lambda m, g: beta * (m / c_mu.astype(m.dtype)) + (1 - beta) * (g / c_g.astype(g.dtype)), mu, updates)
    else:
      c_mu = 1 - beta ** count
      mu_hat = jax.tree.map(lambda m: m / c_mu.astype(m.dtype), mu)
    mu, mu_hat = barrier((mu, mu_hat))
    ortho = orthogonalize(mu_hat, mesh=mesh, distribution=distribution, ns_steps=ns_steps,
                          ns_coeffs=ns_coeffs, eps=eps, ns_dtype=ns_dtype)
    ortho, params = barrier((ortho, params if weight_decay else None))
    lr = learning_rate(state.count) if callable(learning_rate) else learning_rate
    # One scalar factor per term: no constant chain for XLA to refold differently on each path.
    new = jax.tree.map(lambda o: o * jnp.asarray(-lr * update_scale(o.shape, scale_mode), o.dtype), ortho)
    if weight_decay:
      new = jax.tree.map(lambda u, p: u + p * jnp.asarray(-lr * weight_decay, p.dtype), new, params)
    if mu_dtype is not None:
      mu = jax.tree.map(lambda m: m.astype(mu_dtype), mu)
    return barrier(new), MuonState(count=count, mu=mu)

  return optax.GradientTransformation(init_fn, update_fn)
