"""Muon (momentum orthogonalised by Newton–Schulz) as an optax transform, distributed over a mesh.

Per leaf [..., fan_in, fan_out] (x @ W convention; leading dims are independent matrices, e.g. layers):
  mu  <- beta·mu + (1 − beta)·g                         (bias-corrected, Nesterov as optax.contrib.muon)
  O   <- NewtonSchulz5(mu_hat / (‖mu_hat‖_F + eps))      (transposed while rows > cols)
  u   <- −lr · (scale(fan_in, fan_out)·O + wd·W)         (decoupled weight decay)
scale = √max(1, fan_out/fan_in) ("reference") or 0.2·√max(fan_in, fan_out) ("adamw_rms", Moonlight).

Distribution (mesh given, matrices FSDP-sharded as laplace_jax.sharding.matrix_spec says): inside one
shard_map, every device packs its shards of the matrices that device p owns into row p of an [N, C]
buffer; an all_to_all hands each owner whole matrices; the owner runs Newton–Schulz on them; a second
all_to_all returns the shards. The program is the same on every device (an SPMD target such as Neuron runs
one program everywhere, and has no lax.switch/cond): every device runs the same fixed-shape slots, slot k
a [S_k, L_k] matrix. Matrices, largest first, fill slot 0 on every device, then slot 1, ...; each is
turned wide and zero-padded to its slot's shape, which leaves its Newton–Schulz iterate unchanged (padded
with zeros; tests/library/training/test_muon.py). The only per-device choice left, whether a slot's matrix arrives as row
or column shards, is an elementwise select. C is the slots' total size over N. A matrix that fills its
slot as row shards gives bit-identical results to one device: the stages are fenced so XLA fuses them
alike on both (optimization barriers, per-matrix lax.map); padded ones, or ones turned wide by their
sender, are equal to rounding. The "gather" variant (all_gather every matrix, orthogonalise all, keep the
own shard) exists to measure the traffic this saves.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from laplace_jax.sharding import FSDP, matrix_shard_dim, matrix_spec
from laplace_jax.training.adamw import bias_corrections

NS_COEFFS = (3.4445, -4.7750, 2.0315)
SCALE_MODES = ("reference", "adamw_rms")
DISTRIBUTIONS = ("all_to_all", "gather")
ADAMW_RMS = 0.2  # Moonlight: 0.2·√max(fan_in, fan_out) matches AdamW's typical update RMS


class MuonState(NamedTuple):
  # Named like optax's states' step counter (key paths and optax.tree_utils.tree_get(state, "count") rely
  # on the name); the field shadows tuple.count, which nothing calls.
  count: jax.Array  # type: ignore[assignment]  # int32 [], steps taken
  mu: optax.Updates  # first moment, same tree and shapes as the params


# ---- the per-matrix math ----------------------------------------------------------------------------


def newton_schulz(
  x_IxO: jax.Array, *, steps: int = 5, coeffs=NS_COEFFS, eps: float = 1e-7, dtype=None
) -> jax.Array:
  """Approximate U Vᵀ of one matrix: Frobenius-normalise, then `steps` quintic Newton–Schulz iterations.

  `dtype` (e.g. bfloat16, as the reference Muon runs it): the iterations' dtype; the norm is taken in the
  input's dtype and the result is returned in it. None iterates in the input's dtype."""
  # The barriers stop XLA fusing the norm's reduction (or the result) with whatever produces (consumes) the
  # matrix, which differs on one device and on a mesh and would change the summation order.
  x_IxO = jax.lax.optimization_barrier(x_IxO)
  out_dtype = x_IxO.dtype
  transpose = x_IxO.shape[0] > x_IxO.shape[1]  # iterate on the wide orientation: A = X Xᵀ is the small side
  x = x_IxO.T if transpose else x_IxO
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
  return steps * (4 * s * s * l + 2 * s**3)


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


# ---- ownership plan: the same fixed-shape slots on every device -------------------------------------


@dataclasses.dataclass(frozen=True)
class _Mat:
  leaf: int  # index in the flattened Muon leaves
  index: int  # index in the leaf's flattened leading dims
  shape: tuple[int, int]
  shard_dim: int  # 0: rows over fsdp, 1: columns over fsdp
  shard_size: int  # elements of one device's shard

  @property
  def tall(self) -> bool:  # Newton–Schulz iterates on the transpose; the sender transposes its shard
    return self.shape[0] > self.shape[1]

  @property
  def wide_shape(self) -> tuple[int, int]:
    return self.shape[::-1] if self.tall else self.shape

  @property
  def wide_shard_dim(self) -> int:  # the sharded dim once the matrix is turned wide
    return self.shard_dim ^ int(self.tall)


@dataclasses.dataclass(frozen=True)
class Plan:
  """Static assignment of whole matrices to (slot, owner device) for the two all_to_alls.

  Every device runs the same slots: slot k is a [S_k, L_k] matrix (wide orientation) on every device, and
  device p's slot k holds matrix slot_mats[k][p] zero-padded to that shape (-1: an all-zero slot)."""

  n_devices: int
  mats: tuple[_Mat, ...]
  slots: tuple[tuple[int, int], ...]  # per slot: its [S, L] shape, the same on every device
  slot_mats: tuple[tuple[int, ...], ...]  # [slot][device]: index into mats, or -1 for an empty slot
  chunk: int  # elements each device sends to each peer: Σ_k S_k·L_k/N

  @property
  def owned(self) -> tuple[tuple[int, ...], ...]:
    """Per device: the indices of the matrices it orthogonalises, ascending."""
    return tuple(tuple(sorted(s[p] for s in self.slot_mats if s[p] >= 0)) for p in range(self.n_devices))

  def col_assembled(self, k: int) -> tuple[bool, ...]:
    """Per device: whether its slot-k matrix arrives as column shards (else row shards)."""
    return tuple(i >= 0 and self.mats[i].wide_shard_dim == 1 for i in self.slot_mats[k])


def _round_up(x: int, n: int) -> int:
  return -(-x // n) * n


def make_plan(shapes: Sequence[Sequence[int]], n_devices: int, ns_steps: int = 5) -> Plan:
  """Plan for Muon leaves of these global shapes ([..., fan_in, fan_out]) over n FSDP devices.

  Matrices sorted largest first (elements, then wide shape) are cut into tiers of n; tier k becomes slot k,
  shaped to hold every matrix in it (each side the tier's largest, rounded up to a multiple of n along a
  side some member is sharded on). `ns_steps` is accepted for the callers' symmetry; slots need no costs."""
  del ns_steps
  N, mats = n_devices, []
  for leaf, shape in enumerate(shapes):
    dim = matrix_shard_dim(shape, N, f"Muon leaf {leaf}")
    sd = 0 if dim is None else dim - (len(shape) - 2)
    m, n = shape[-2:]
    for index in range(math.prod(shape[:-2])):
      mats.append(_Mat(leaf, index, (m, n), sd, m * n // N))
  order = sorted(
    range(len(mats)), key=lambda i: (-math.prod(mats[i].shape), tuple(-d for d in mats[i].wide_shape), i)
  )
  slots, slot_mats = [], []
  for start in range(0, len(order), N):
    tier = order[start : start + N]
    S = max(mats[i].wide_shape[0] for i in tier)
    L = max(mats[i].wide_shape[1] for i in tier)
    if any(mats[i].wide_shard_dim == 0 for i in tier):
      S = _round_up(S, N)
    if any(mats[i].wide_shard_dim == 1 for i in tier):
      L = _round_up(L, N)
    slots.append((S, L))
    slot_mats.append(tuple(tier) + (-1,) * (N - len(tier)))
  chunk = sum(S * L // N for S, L in slots)
  return Plan(N, tuple(mats), tuple(slots), tuple(slot_mats), chunk)


def ns_flops_per_device(
  shapes: Sequence[Sequence[int]], n_devices: int, *, ns_steps: int = 5, distribution: str = "all_to_all"
) -> dict[str, Any]:
  """Newton–Schulz FLOPs each device runs per step, zero padding included: per_device, max, mean (the even
  split of the matrices' own FLOPs), max/mean, total (the matrices' own) and padding_overhead (the FLOPs
  run on all devices over total, minus 1)."""
  plan = make_plan(shapes, n_devices, ns_steps)
  total = sum(ns_flops(m.shape, ns_steps) for m in plan.mats)
  if distribution == "gather":
    per = [total] * n_devices
  else:
    per = [sum(ns_flops(s, ns_steps) for s in plan.slots)] * n_devices
  mean = total / n_devices
  run = per[0] if distribution == "gather" else sum(per)
  return {
    "per_device": per,
    "max": max(per),
    "mean": mean,
    "max_over_mean": max(per) / mean,
    "total": total,
    "padding_overhead": run / total - 1 if distribution != "gather" else 0.0,
  }


# ---- packing padded shards to and from the [N, C] all_to_all buffers ----------------------------------
# A device's shard of a matrix, turned wide ([s, l]) and split on its wide_shard_dim, is zero-padded to
# the slot's shard shape ([S/N, L] for row shards, [S, L/N] for column shards). The owner stacks the N
# padded shards into an [S, L] matrix: the matrix padded with zeros, its rows (or columns) permuted so that
# each device's zeros follow its own rows. Newton–Schulz commutes with permutations and keeps zero rows and
# columns zero, so the owner's result holds the matrix's own iterate at the same places (test_muon).


def _slot_piece(x_loc: jax.Array, mat: _Mat, slot: tuple[int, int], N: int) -> jax.Array:
  """This device's shard of `mat` ([m_loc, n_loc]) -> its flat padded piece of the slot, S·L/N values."""
  S, L = slot
  x = x_loc.T if mat.tall else x_loc
  rows, cols = (S // N, L) if mat.wide_shard_dim == 0 else (S, L // N)
  return jnp.pad(x, ((0, rows - x.shape[0]), (0, cols - x.shape[1]))).reshape(-1)


def _from_slot_piece(piece: jax.Array, mat: _Mat, slot: tuple[int, int], N: int) -> jax.Array:
  """Inverse of _slot_piece: the flat padded piece -> this device's shard of `mat` ([m_loc, n_loc])."""
  (S, L), (s, l) = slot, mat.wide_shape
  if mat.wide_shard_dim == 0:
    x = piece.reshape(S // N, L)[: s // N, :l]
  else:
    x = piece.reshape(S, L // N)[:s, : l // N]
  return x.T if mat.tall else x


def _pack_for_owners(locals_: Sequence[jax.Array], plan: Plan) -> jax.Array:
  """Send buffer [N, C]: row p holds this device's padded pieces of p's slots, slot after slot."""
  N = plan.n_devices
  flat = [x.reshape((-1,) + x.shape[-2:]) for x in locals_]  # [K_leaf, m_loc, n_loc]
  rows = []
  for p in range(N):
    parts = []
    for k, slot in enumerate(plan.slots):
      i = plan.slot_mats[k][p]
      if i < 0:
        parts.append(jnp.zeros((slot[0] * slot[1] // N,), flat[0].dtype))
      else:
        mat = plan.mats[i]
        parts.append(_slot_piece(flat[mat.leaf][mat.index], mat, slot, N))
    rows.append(jnp.concatenate(parts))
  return jnp.stack(rows)


def _select_by_device(table: Sequence[bool], if_true: Callable, if_false: Callable) -> jax.Array:
  """if_true() where table[this device's fsdp index], else if_false(): static when the table is uniform,
  otherwise both are built and selected elementwise (one program on every device, no lax.switch)."""
  if all(table):
    return if_true()
  if not any(table):
    return if_false()
  me = jax.lax.axis_index(FSDP)
  flag = jax.lax.dynamic_index_in_dim(jnp.asarray(np.asarray(table, np.bool_)), me, keepdims=False)
  return jnp.where(flag, if_true(), if_false())


def _run_slots(recv_NxC: jax.Array, plan: Plan, ns: Callable) -> jax.Array:
  """Owner's work, the same on every device: each slot's N pieces -> [S, L], Newton–Schulz, -> N pieces."""
  N, outs, off = plan.n_devices, [], 0
  for k, (S, L) in enumerate(plan.slots):
    seg = recv_NxC[:, off : off + S * L // N]
    col = plan.col_assembled(k)
    whole = _select_by_device(
      col, lambda: seg.reshape(N, S, L // N).transpose(1, 0, 2).reshape(S, L), lambda: seg.reshape(S, L)
    )
    y = ns(whole)
    outs.append(
      _select_by_device(
        col, lambda: y.reshape(S, N, L // N).transpose(1, 0, 2).reshape(N, -1), lambda: y.reshape(N, -1)
      )
    )
    off += S * L // N
  return jnp.concatenate(outs, axis=1)


def _unpack_from_owners(back_NxC: jax.Array, locals_: Sequence[jax.Array], plan: Plan) -> list[jax.Array]:
  """Row p of the returned buffer holds this device's padded pieces of p's orthogonalised slots."""
  N = plan.n_devices
  pieces: list[list[jax.Array | None]] = [[None] * (x.size // (x.shape[-2] * x.shape[-1])) for x in locals_]
  for p in range(N):
    off = 0
    for k, slot in enumerate(plan.slots):
      size, i = slot[0] * slot[1] // N, plan.slot_mats[k][p]
      if i >= 0:
        mat = plan.mats[i]
        pieces[mat.leaf][mat.index] = _from_slot_piece(back_NxC[p, off : off + size], mat, slot, N)
      off += size
  out = []
  for leaf, (ps, x) in enumerate(zip(pieces, locals_)):
    got = [piece for piece in ps if piece is not None]
    if len(got) != len(ps):  # make_plan places every matrix in exactly one slot
      raise RuntimeError(f"Muon plan: leaf {leaf} has {len(ps) - len(got)} matrices without an owner")
    out.append(jnp.stack(got).reshape(x.shape))
  return out


# ---- orthogonalisation of a list of leaves ------------------------------------------------------------


def _orthogonalize_all_to_all(leaves, mesh: Mesh, ns: Callable, ns_steps: int):
  plan = make_plan([x.shape for x in leaves], mesh.shape[FSDP], ns_steps)
  specs = tuple(matrix_spec(x.shape, mesh) for x in leaves)

  def local(*xs):
    send_NxC = _pack_for_owners(xs, plan)
    recv_NxC = jax.lax.all_to_all(send_NxC, FSDP, 0, 0)
    back_NxC = jax.lax.all_to_all(_run_slots(recv_NxC, plan, ns), FSDP, 0, 0)
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


def orthogonalize(
  tree,
  *,
  mesh: Mesh | None = None,
  distribution: str = "all_to_all",
  ns_steps: int = 5,
  ns_coeffs=NS_COEFFS,
  eps: float = 1e-7,
  ns_dtype=None,
):
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


def _check_settings(
  learning_rate, beta, ns_steps, ns_coeffs, eps, weight_decay, scale_mode, mesh, distribution
):
  if not callable(learning_rate):
    lr = float(learning_rate)
    if not (math.isfinite(lr) and lr >= 0):
      _bad(
        "learning_rate",
        learning_rate,
        "a finite value >= 0 (or a schedule)",
        "Muon descends by itself; pass a positive learning rate.",
      )
  if not (0 <= float(beta) < 1):
    _bad("beta", beta, "a momentum decay in [0, 1)", "The reference value is 0.95.")
  if isinstance(ns_steps, bool) or not isinstance(ns_steps, (int, np.integer)) or ns_steps < 1:
    _bad("ns_steps", ns_steps, "an integer >= 1", "The reference value is 5.")
  if len(tuple(ns_coeffs)) != 3 or not all(math.isfinite(float(c)) for c in ns_coeffs):
    _bad(
      "ns_coeffs", ns_coeffs, "three finite quintic coefficients (a, b, c)", f"The reference is {NS_COEFFS}."
    )
  if not (math.isfinite(float(eps)) and float(eps) >= 0):
    _bad("eps", eps, "a finite value >= 0")
  if not (math.isfinite(float(weight_decay)) and float(weight_decay) >= 0):
    _bad("weight_decay", weight_decay, "a finite value >= 0")
  if scale_mode not in SCALE_MODES:
    _bad("scale_mode", scale_mode, f"one of {SCALE_MODES}")
  if distribution not in DISTRIBUTIONS:
    _bad("distribution", distribution, f"one of {DISTRIBUTIONS}")
  if mesh is not None and FSDP not in mesh.shape:
    _bad(
      "mesh",
      dict(mesh.shape),
      f"a mesh with an '{FSDP}' axis",
      "Build it with laplace_jax.sharding.make_mesh.",
    )


def _check_leaves(tree, mesh):
  for path, x in jax.tree_util.tree_leaves_with_path(tree):
    name = jax.tree_util.keystr(path)
    if np.ndim(x) < 2:
      raise ValueError(
        f"muon got leaf {name} of shape {np.shape(x)}: expected matrices [..., fan_in, fan_out]. "
        "Send vectors and scalars to AdamW (laplace_jax.training.optimizer does)."
      )
    if mesh is not None:
      matrix_shard_dim(np.shape(x), mesh.shape[FSDP], name)


def muon(
  learning_rate: optax.ScalarOrSchedule,
  *,
  beta: float = 0.95,
  nesterov: bool = True,
  ns_steps: int = 5,
  ns_coeffs=NS_COEFFS,
  eps: float = 1e-7,
  weight_decay: float = 0.0,
  scale_mode: str = "reference",
  mu_dtype=None,
  mesh: Mesh | None = None,
  distribution: str = "all_to_all",
  ns_dtype=None,
) -> optax.GradientTransformation:
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
      c_mu, c_g = bias_corrections(beta, count + 1), bias_corrections(beta, count)  # no runtime power
      mu_hat = jax.tree.map(
        lambda m, g: beta * (m / c_mu(m.dtype)) + (1 - beta) * (g / c_g(g.dtype)), mu, updates
      )
    else:
      c_mu = bias_corrections(beta, count)
      mu_hat = jax.tree.map(lambda m: m / c_mu(m.dtype), mu)
    mu, mu_hat = barrier((mu, mu_hat))
    ortho = orthogonalize(
      mu_hat,
      mesh=mesh,
      distribution=distribution,
      ns_steps=ns_steps,
      ns_coeffs=ns_coeffs,
      eps=eps,
      ns_dtype=ns_dtype,
    )
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
