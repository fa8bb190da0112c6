"""The one place that builds device meshes and partition specs.

Mesh axes are ("data", "fsdp"), and "context" after them when a row's sequence is split over devices
(make_mesh(context=N), N > 1: context parallelism, laplace_jax/ops/context_parallel.py). Parameters and optimizer
state are FSDP-sharded over "fsdp" (replicated over "data" and "context"); batches and decode states are split
over ("data", "fsdp") on their batch dim, and a batch's token arrays over "context" on their sequence dim.
Which dimension of a leaf goes over "fsdp":
  - never the stacked layer axis (dim 0 of anything under "layers"), since the model scans over it;
  - Muon matrices (layers/{w_qkvg, w_out, w1, w2, w3}, or any leaf given to `matrix_spec`) always shard
    fan_in (dim −2), or fan_out when fan_in doesn't divide: the distributed Newton–Schulz reassembles whole
    matrices from these shards (bit-identically to one device for fan_in shards);
  - other leaves with fewer than MIN_SHARD_ELEMENTS elements are replicated (norm scales, biases, ...);
  - otherwise the largest eligible dim that the fsdp size divides (the earlier one on a tie). A large
    leaf with no such dim is a ValueError naming it: it is never silently replicated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from laplace_jax.param_names import ATTENTION_MUON_NAMES, MUON_PARAM_NAMES

DATA, FSDP, CONTEXT = "data", "fsdp", "context"
BATCH_AXES = (DATA, FSDP)  # batch dims are split over these axes (every device but the context axis's)
MIN_SHARD_ELEMENTS = 2**16  # 256 KiB of fp32: smaller non-Muon leaves are replicated
_SIMULATE_HINT = (
  "To simulate N CPU devices, call laplace_jax.platform.simulate_cpu_devices(N) (or set JAX_NUM_CPU_DEVICES=N "
  "in the environment) before JAX's first use of a device."
)


def _is_pos_int(v) -> bool:
  return bool(isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= 1)


def make_mesh(
  data: int = 1, fsdp: int | None = None, devices: Sequence[Any] | None = None, context: int = 1
) -> Mesh:
  """A ("data", "fsdp") mesh over the first data·fsdp devices, ("data", "fsdp", "context") over
  data·fsdp·context when context > 1; fsdp=None takes all devices left."""
  devices = list(jax.devices() if devices is None else devices)
  n = len(devices)
  if not _is_pos_int(data):
    raise ValueError(f"make_mesh(data={data!r}): expected a positive integer number of data replicas.")
  if not _is_pos_int(context):
    raise ValueError(f"make_mesh(context={context!r}): expected a positive integer (1: no context axis).")
  if fsdp is None:
    if n % (data * context):
      raise ValueError(
        f"make_mesh(data={data}, context={context}): {n} devices do not split into {data * context} "
        f"groups; pass data and context sizes whose product divides {n}, or fsdp explicitly."
      )
    fsdp = n // (data * context)
  if not _is_pos_int(fsdp):
    raise ValueError(f"make_mesh(fsdp={fsdp!r}): expected a positive integer FSDP size.")
  if data * fsdp * context > n:
    raise ValueError(
      f"make_mesh(data={data}, fsdp={fsdp}, context={context}) needs {data * fsdp * context} devices but "
      f"{n} are present ({jax.default_backend()}). Use a smaller mesh. {_SIMULATE_HINT}"
    )
  shape: tuple[int, ...] = (int(data), int(fsdp))
  names: tuple[str, ...] = (DATA, FSDP)
  if context > 1:
    shape, names = (*shape, int(context)), (*names, CONTEXT)
  axis_types = (jax.sharding.AxisType.Auto,) * len(shape)  # jit propagates shardings (pjit style)
  return jax.make_mesh(shape, names, axis_types, devices=devices[: math.prod(shape)])


def context_size(mesh: Mesh) -> int:
  """Devices each row's sequence is split over (1: the mesh has no context axis)."""
  return mesh.shape.get(CONTEXT, 1)


def replica_axes(mesh) -> tuple[str, ...]:
  """The axes parameters are replicated over and their gradients summed over: "data", and "context" when
  the mesh (a Mesh or the abstract mesh traced under) has it."""
  return (DATA, CONTEXT) if CONTEXT in mesh.axis_names else (DATA,)


# ---- parameters and optimizer state -------------------------------------------------------------


def traced_under_auto_mesh() -> bool:
  """True while tracing under a mesh (`jax.set_mesh`) outside any shard_map: arrays may then be split over
  devices by the partitioner, so per-row writes must be expressed as scatters batched over the rows."""
  mesh = jax.sharding.get_abstract_mesh()
  return not mesh.empty and not mesh.manual_axes


def path_names(path) -> tuple[str, ...]:
  """A jax key path as plain strings: (DictKey('layers'), DictKey('w1')) -> ('layers', 'w1')."""
  out = []
  for k in path:
    for attr in ("key", "name", "idx"):
      if hasattr(k, attr):
        out.append(str(getattr(k, attr)))
        break
    else:
      out.append(str(k))
  return tuple(out)


def is_stacked(names: Sequence[str]) -> bool:
  """A per-layer leaf stacked along a leading layer axis (anything under 'layers')."""
  return "layers" in names


def is_muon_leaf(names: Sequence[str]) -> bool:
  """The 2-D hidden matrices that Muon optimizes: layers/[blockN/]{w_qkvg, w_out, w_qkv, w_o, w1, w2, w3}
  (hybrid mixer patterns nest one block per pattern position under 'layers')."""
  return len(names) >= 2 and "layers" in names[:-1] and names[-1] in MUON_PARAM_NAMES + ATTENTION_MUON_NAMES


def _fsdp_size(mesh: Mesh) -> int:
  if FSDP not in mesh.shape:
    raise ValueError(
      f"mesh axes {tuple(mesh.shape)}: expected an '{FSDP}' axis. Build meshes with "
      "laplace_jax.sharding.make_mesh."
    )
  return mesh.shape[FSDP]


def _pick_dim(shape, dims, n: int) -> int | None:
  """The largest of `dims` that n divides (earliest on a tie), or None."""
  ok = [d for d in dims if shape[d] % n == 0]
  return max(ok, key=lambda d: (shape[d], -d)) if ok else None


def _spec_with(ndim: int, dim: int | None) -> P:
  parts: list[str | None] = [None] * ndim
  if dim is not None:
    parts[dim] = FSDP
  return P(*parts)


def matrix_shard_dim(shape: Sequence[int], n: int, name: str = "matrix") -> int | None:
  """Which of the last two dims of a Muon matrix stack goes over n FSDP devices (None when n == 1)."""
  if len(shape) < 2:
    raise ValueError(f"{name}: shape {tuple(shape)} is not a matrix; Muon needs [..., fan_in, fan_out].")
  if n == 1:
    return None
  # fan_in first: each shard is then a contiguous block of rows, so owners reassemble whole matrices by a
  # reshape alone (no transpose for XLA to fuse into the Frobenius-norm reduction).
  for dim in (len(shape) - 2, len(shape) - 1):
    if shape[dim] % n == 0:
      return dim
  raise ValueError(
    f"{name}: shape {tuple(shape)} has neither matrix dim ({shape[-2]}, {shape[-1]}) "
    f"divisible by the '{FSDP}' axis size {n}. Choose an fsdp size that divides one of them."
  )


def matrix_spec(shape: Sequence[int], mesh: Mesh, name: str = "matrix") -> P:
  """Partition spec of a Muon matrix stack [..., fan_in, fan_out]: one of the last two dims over fsdp."""
  return _spec_with(len(shape), matrix_shard_dim(shape, _fsdp_size(mesh), name))


def leaf_spec(
  names: Sequence[str], shape: Sequence[int], mesh: Mesh, *, min_shard_elements: int = MIN_SHARD_ELEMENTS
) -> P:
  """Partition spec of one parameter (or optimizer-state) leaf; see the module docstring for the rule."""
  name = "/".join(names) or "<root>"
  if is_muon_leaf(names):
    return matrix_spec(shape, mesh, name)
  n = _fsdp_size(mesh)
  if n == 1 or math.prod(shape) < min_shard_elements:
    return P(*([None] * len(shape)))
  dims = range(1 if is_stacked(names) else 0, len(shape))
  dim = _pick_dim(shape, dims, n)
  if dim is None:
    where = " after the layer axis" if is_stacked(names) else ""
    raise ValueError(
      f"{name}: shape {tuple(shape)} has no dim{where}"
      f" divisible by the '{FSDP}' axis size {n}, and {math.prod(shape):,} elements is too "
      f"large to replicate (min_shard_elements={min_shard_elements:,}). Choose an fsdp size "
      "that divides one of its dims, or raise min_shard_elements to replicate it."
    )
  return _spec_with(len(shape), dim)


def param_specs(tree, mesh: Mesh, *, min_shard_elements: int = MIN_SHARD_ELEMENTS):
  """PartitionSpecs for a parameter or optimizer-state tree (arrays or ShapeDtypeStructs)."""
  return jax.tree_util.tree_map_with_path(
    lambda path, x: leaf_spec(path_names(path), np.shape(x), mesh, min_shard_elements=min_shard_elements),
    tree,
  )


def param_shardings(tree, mesh: Mesh, *, min_shard_elements: int = MIN_SHARD_ELEMENTS):
  """NamedShardings for a parameter or optimizer-state tree."""
  specs = param_specs(tree, mesh, min_shard_elements=min_shard_elements)
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, P))


# ---- batches and decode state -------------------------------------------------------------------


def _batch_axis_spec(shape, mesh: Mesh, dim: int, what: str) -> P:
  n = mesh.shape[DATA] * _fsdp_size(mesh)
  if len(shape) <= dim:
    raise ValueError(f"{what}: shape {tuple(shape)} has no batch dim {dim}.")
  if shape[dim] % n:
    raise ValueError(
      f"{what}: batch size {shape[dim]} (dim {dim} of shape {tuple(shape)}) does not divide "
      f"over the {n} devices of the mesh (data={mesh.shape[DATA]} × fsdp={mesh.shape[FSDP]}). "
      f"Use a batch size that is a multiple of {n}."
    )
  parts: list[tuple[str, ...] | None] = [None] * len(shape)
  parts[dim] = BATCH_AXES
  return P(*parts)


def batch_spec(shape: Sequence[int], mesh: Mesh, *, batch_dim: int = 0) -> P:
  """Batch arrays [B, ...] split over every device along `batch_dim`."""
  return _batch_axis_spec(shape, mesh, batch_dim, "batch")


def token_spec(shape: Sequence[int], mesh: Mesh, what: str = "tokens") -> P:
  """A batch's per-token arrays [B, T]: rows split as batch_spec's, and the sequence over "context" when
  the mesh has that axis (each device a contiguous span of T / context tokens)."""
  spec = _batch_axis_spec(shape, mesh, 0, what)
  n = context_size(mesh)
  if n == 1:
    return spec
  if len(shape) != 2 or shape[1] % n:
    raise ValueError(
      f"{what}: shape {tuple(shape)} does not split its sequence (dim 1) over the {n} devices of the "
      f"'{CONTEXT}' axis. Use a sequence length that is a multiple of {n}."
    )
  return P(spec[0], CONTEXT)


def batch_shardings(tree, mesh: Mesh, *, batch_dim: int = 0):
  """NamedShardings for a batch pytree: each leaf split over all devices along `batch_dim`."""
  return jax.tree_util.tree_map_with_path(
    lambda path, x: NamedSharding(
      mesh, _batch_axis_spec(np.shape(x), mesh, batch_dim, "batch/" + "/".join(path_names(path)))
    ),
    tree,
  )


def decode_state_shardings(state, mesh: Mesh):
  """NamedShardings for a decode state (a DecodeState or its flat dict: layer-major tables [L,B,...], pos [B]):
  split over the batch dim (1 for the layer-major leaves, 0 for pos; DecodeState.batch_axes)."""
  return jax.tree_util.tree_map_with_path(
    lambda path, x: NamedSharding(
      mesh, _batch_axis_spec(np.shape(x), mesh, min(1, np.ndim(x) - 1), "state/" + "/".join(path_names(path)))
    ),
    state,
  )


def replicated(mesh: Mesh) -> NamedSharding:
  """A fully replicated sharding (scalars: step counters, RNG keys, losses)."""
  return NamedSharding(mesh, P())
