"""Explicit FSDP collectives for the train step: weights gathered in the compute dtype, gradients
reduce-scattered in fp32, written out (shard_map) rather than left to a partitioner pass.

Inside `jax.shard_map` over the ("data", "fsdp") mesh, each device holds its FSDP shard of every parameter
and its own rows of the batch. `gather(w_shard, dim, dtype)` casts the shard to the compute dtype and
all-gathers it over "fsdp"; its backward casts the full-weight gradient (this device's partial sum) to fp32,
reduce-scatters it over "fsdp" and sums the shard over "data" (and "context", when rows are split there). Per device, a micro-batch with remat then
moves 2 gathers of 2·P bytes and one reduce-scatter of 4·P bytes, each ·(N−1)/N sent and as much received:
the floor of this design (docs/BENCHMARKS.md).

XLA:CPU turns a 2-byte all-gather into a 4-byte one (it converts bf16 collectives to f32), so on the CPU
the bits travel as unsigned integers of the same width, keeping the wire at 2 bytes. Every other platform
(read from laplace_jax.platform.backend(), so `lowering_for("neuron")` chooses as on Trainium) gathers the
compute dtype directly: Trn2 has no uint16, and collectives there take f32/bf16 operands.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from laplace_jax import platform
from laplace_jax.sharding import FSDP, replica_axes

_BITS = {2: jnp.uint16, 4: jnp.uint32}


def _all_gather_bits(x, dim: int):
  """all_gather over "fsdp" along `dim` (tiled); on the CPU x's bits move as same-width unsigned integers."""
  as_int = _BITS.get(x.dtype.itemsize)
  if as_int is None or platform.backend() != "cpu":
    return jax.lax.all_gather(x, FSDP, axis=dim, tiled=True)
  bits = jax.lax.bitcast_convert_type(x, as_int)
  return jax.lax.bitcast_convert_type(jax.lax.all_gather(bits, FSDP, axis=dim, tiled=True), x.dtype)


@partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def gather(w_shard, dim: int, dtype):
  """The whole weight in `dtype` from this device's "fsdp" shard (split along `dim`)."""
  return _all_gather_bits(w_shard.astype(dtype), dim)


def _gather_fwd(w_shard, dim, dtype):
  return gather(w_shard, dim, dtype), jnp.zeros((0,), w_shard.dtype)  # the residual carries the dtype


def _gather_bwd(dim, dtype, residual, g_full):
  g = jax.lax.psum_scatter(g_full.astype(jnp.float32), FSDP, scatter_dimension=dim, tiled=True)
  # summed over the devices holding the same shard: "data", and "context" (each device saw a span of the rows)
  return (jax.lax.psum(g, replica_axes(jax.sharding.get_abstract_mesh())).astype(residual.dtype),)


gather.defvjp(_gather_fwd, _gather_bwd)


def split_dim(local_shape, full_shape) -> int | None:
  """The dim along which a local shard was split from `full_shape` (None: it is whole)."""
  if tuple(local_shape) == tuple(full_shape):
    return None
  dims = [d for d, (a, b) in enumerate(zip(local_shape, full_shape)) if a != b]
  if len(local_shape) != len(full_shape) or len(dims) != 1 or full_shape[dims[0]] % local_shape[dims[0]]:
    raise ValueError(
      f"a parameter shard of shape {tuple(local_shape)} is not one dim's split of its shape "
      f"{tuple(full_shape)}: FSDP shards exactly one dim (laplace_jax.sharding)."
    )
  return dims[0]


def gather_tree(tree, full_shapes: dict, dtype):
  """Gather every leaf of a {name: array} dict whose local shape differs from full_shapes[name]; whole
  leaves pass unchanged. Outside a shard_map every leaf is whole, so this is the identity there."""
  out = {}
  for name, x in tree.items():
    dim = split_dim(x.shape, full_shapes[name]) if name in full_shapes else None
    out[name] = x if dim is None else gather(x, dim, jnp.dtype(dtype))
  return out
