"""A step's bucket of rows of the slot table: which rows run (`bucket_sizes`, `step_rows`), gathered from the
table by index and written back in place (`take_rows`, `put_rows`), and insert's writes into slots
(`entry_writes`). Over a mesh the slot axis is split into equal runs of slots, one per device, and every
gather and write stays within a device's own run.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np


def bucket_sizes(n_slots: int, n_devices: int = 1) -> tuple[int, ...]:
  """The row counts a step is compiled for: each device's share of the rows doubles from 1 to all its slots
  (1, 2, 4, ... and n_slots / n_devices itself), times n_devices. A step runs the smallest that holds the
  live slots, so it reads and writes their states, not the whole table's."""
  per = n_slots // n_devices
  return tuple(n_devices * b for b in sorted({min(1 << i, per) for i in range(per.bit_length() + 1)}))


def step_rows(live: Iterable[int], n_slots: int, buckets: Sequence[int], n_devices: int = 1) -> np.ndarray:
  """The slots a generate or verify call runs, int32 [B] with B the smallest bucket that holds each
  device's live slots: device d's B / n_devices rows (device-major) are its live slots, then as many of
  its other slots as the bucket has room for. Rows are distinct, so every write back is a slot's own; an
  idle row's slot holds no request (its next input ended it, or it is about to be overwritten by an
  insert), and no request's tokens depend on which rows run beside it."""
  per = n_slots // n_devices
  mine: list[list[int]] = [[] for _ in range(n_devices)]
  for s in live:
    mine[s // per].append(s)
  most = max(len(m) for m in mine)
  B = next(b for b in buckets if b // n_devices >= most)
  if B == n_slots:  # every row: the table as it is, in its own order (nothing gathered, see take_rows)
    return np.arange(n_slots, dtype=np.int32)
  rows = np.empty((n_devices, B // n_devices), np.int32)
  for d, m in enumerate(mine):
    taken = set(m)
    idle = (s for s in range(d * per, (d + 1) * per) if s not in taken)
    rows[d] = sorted(m) + [next(idle) for _ in range(B // n_devices - len(m))]
  return rows.reshape(-1)


def local_rows(rows_B, n_slots: int, n_devices: int):
  """rows_B as [D, B / D] indices into each device's own run of slots."""
  D = n_devices
  return rows_B.reshape(D, -1) - (jnp.arange(D, dtype=rows_B.dtype) * (n_slots // D))[:, None]


def take_rows(tree, axes, rows_B, n_slots: int, n_devices: int = 1):
  """Rows rows_B of every leaf along its slot axis (`axes`: a tree of ints like `tree`). Over a mesh each
  device gathers from its own slots (a gather batched over the devices' runs: no slot crosses a device). A
  bucket of every row is the table itself, rows_B then being 0 … S - 1 (`step_rows`): nothing is gathered or
  written back (a gather and its write back cost XLA:CPU about 6 more passes over the rows' states than the
  in-place step)."""
  if rows_B.shape[0] == n_slots:
    return tree
  D, local = n_devices, local_rows(rows_B, n_slots, n_devices)

  def take(x, axis):
    if D == 1:
      return jnp.take(x, local[0], axis=axis, mode="clip")
    runs = x.reshape(*x.shape[:axis], D, -1, *x.shape[axis + 1 :])
    got = jax.vmap(lambda xd, i: jnp.take(xd, i, axis=axis, mode="clip"), (axis, 0), axis)(runs, local)
    return got.reshape(*x.shape[:axis], -1, *x.shape[axis + 1 :])

  return jax.tree.map(take, tree, axes)


def put_rows(tree, axes, rows_B, new, n_slots: int, n_devices: int = 1):
  """`tree` with rows rows_B of every leaf replaced by `new`'s (distinct rows: a scatter in place)."""
  if rows_B.shape[0] == n_slots:  # every row, in order (take_rows)
    return jax.tree.map(lambda x, v: v.astype(x.dtype), tree, new)
  D, local = n_devices, local_rows(rows_B, n_slots, n_devices)

  def put_one(x, i, v, axis):
    at = (slice(None),) * axis + (i,)
    return x.at[at].set(v.astype(x.dtype), mode="promise_in_bounds", unique_indices=True)

  def put(x, v, axis):
    if D == 1:
      return put_one(x, local[0], v, axis)
    runs = x.reshape(*x.shape[:axis], D, -1, *x.shape[axis + 1 :])
    vs = v.reshape(*v.shape[:axis], D, -1, *v.shape[axis + 1 :])
    done = jax.vmap(lambda xd, i, vd: put_one(xd, i, vd, axis), (axis, 0, axis), axis)(runs, local, vs)
    return done.reshape(x.shape)

  return jax.tree.map(put, tree, new, axes)


def entry_writes(slot_E, n_slots: int):
  """Insert's writes with every index in range (Neuron fails out-of-range scatters at run time; XLA drops
  them): (src_E, slot_w_E, any_real). Write i stores entry src_E[i]'s values into slot slot_w_E[i]: a real entry
  (slot_E < n_slots) its own, a padding entry repeats the first real entry's write (same slot, same values).
  With no real entry (any_real false) every write goes to slot 0 and must store slot 0's own values."""
  real = slot_E < n_slots
  src = jnp.where(real, jnp.arange(slot_E.shape[0]), jnp.argmax(real))
  any_real = real.any()
  return src, jnp.where(any_real, slot_E[src], 0), any_real
