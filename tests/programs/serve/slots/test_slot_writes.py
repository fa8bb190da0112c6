"""Inserting a prefilled sequence writes only its slot's rows of the donated slot table: no instruction of
the compiled insert reads or writes as much as one layer of the state table."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from helpers.hlo_compile import compile_as_benchmarks

from laplace_jax import model
from laplace_jax.analysis import hlo_bytes
from laplace_jax.model.config import get_config
from serve.slots.slot_functions import (
  N_TOP,
  SlotFunctions,
  SlotSettings,
  StepOutput,
  StepsOutput,
  bucket_sizes,
  entry_writes,
  host_settings,
  step_rows,
  table_axes,
)


def test_insert_moves_the_slot_rows_not_the_table():
  cfg = get_config("tiny")
  slots, prefill_batch = 2048, 2
  fns = SlotFunctions(
    model, cfg, n_slots=slots, prefill_batch=prefill_batch, n_stop=4, valid_vocab=cfg.vocab_size
  )
  params = jax.eval_shape(lambda: model.init_params(cfg, jax.random.key(0)))
  table, pf = fns.table_shape, fns.prefill_shape
  compiled = compile_as_benchmarks(
    fns.programs.insert.lower(
      params,
      table,
      pf,
      np.array([0, 1], np.int32),
      np.array([3, slots], np.int32),
      host_settings([], prefill_batch, 4),
      fns.mask_shape((prefill_batch,), split=False),
    )
  )
  layer_bytes = sum(x.size * 4 for x in jax.tree.leaves(table.model)) // cfg.n_layers
  ops = hlo_bytes.memory_traffic(compiled.as_text())
  biggest = max(ops, key=lambda o: max(o.read_bytes, o.written_bytes))
  assert max(biggest.read_bytes, biggest.written_bytes) < layer_bytes / 4, biggest
  assert compiled.memory_analysis().temp_size_in_bytes < layer_bytes  # sampling temporaries, no state copy
  assert compiled.memory_analysis().alias_size_in_bytes >= 2 * layer_bytes  # the state is updated in place


def test_decode_over_a_serving_mesh_leaves_the_kernel_to_xla(monkeypatch, caplog):
  import logging

  from laplace_jax import sharding
  from laplace_jax.ops import gla_decode

  cfg = get_config("tiny")
  monkeypatch.setattr(gla_decode, "resolve_impl", lambda impl, backend=None: "interpret")  # as on a GPU
  gla_decode._logged.clear()
  fns = SlotFunctions(
    model,
    cfg,
    n_slots=8,
    prefill_batch=1,
    n_stop=2,
    valid_vocab=cfg.vocab_size,
    mesh=sharding.make_mesh(fsdp=8),
  )
  params = model.init_params(cfg, jax.random.key(0))
  with caplog.at_level(logging.WARNING, logger="laplace_jax.ops.gla_decode"):
    table, out = fns.generate(params, fns.empty_table())
  step = StepOutput.unpack(np.asarray(out))  # tokens, finished flags, logprobs, for the 8 slots
  assert step.token.shape == step.done.shape == step.logprob.shape == (8,)
  assert step.top_ids.shape == step.top_logprobs.shape == (8, N_TOP)
  assert [r.getMessage() for r in caplog.records if "8-device mesh" in r.getMessage()]


def test_insert_write_indices_are_in_range():
  """Neuron fails out-of-range scatters: padding entries (slot >= S) repeat the first real entry's write; with
  none real, every write goes to slot 0 (where insert stores slot 0's own values)."""
  src, slot, any_real = entry_writes(jnp.array([8, 3, 8, 5, 9]), 8)
  np.testing.assert_array_equal(src, [1, 1, 1, 3, 1])
  np.testing.assert_array_equal(slot, [3, 3, 3, 5, 3])
  assert bool(any_real)
  src, slot, any_real = entry_writes(jnp.array([8, 8]), 8)
  np.testing.assert_array_equal(slot, [0, 0])
  assert not bool(any_real)


def test_insert_writes_the_real_entries_and_nothing_else():
  """The table after insert, against numpy: real entries' prefill rows and settings land in their slots (one row
  may feed two slots), every other slot keeps its values, also when no entry is real."""
  cfg = get_config("tiny", n_layers=2)
  S, P = 6, 4
  fns = SlotFunctions(model, cfg, n_slots=S, prefill_batch=P, n_stop=2, valid_vocab=cfg.vocab_size)
  rng = np.random.default_rng(0)
  rand = lambda x: jnp.asarray(
    rng.integers(1, 100, x.shape) if x.dtype.kind in "iu" else rng.normal(size=x.shape), x.dtype
  )
  pf = jax.tree.map(rand, fns.empty_prefill())
  rows = [
    SlotSettings(
      temperature=0.0,
      top_k=i,
      top_p=0.5 + i / 10,
      seed=10 + i,
      seed_hi=i,
      max_tokens=5 + i,
      logprobs=-1,
      stop_ids=[i],
    )
    for i in range(P)
  ]
  settings = host_settings(rows, P, 2)
  for row_E, slot_E in (([0, 1, 2, 1], [6, 4, 7, 1]), ([3, 0, 1, 2], [6, 9, 6, 6])):
    table = jax.tree.map(rand, fns.empty_table())
    want = jax.tree.map(np.array, table)
    table, out = fns.insert(
      None, table, pf, jnp.asarray(row_E, jnp.int32), jnp.asarray(slot_E, jnp.int32), settings
    )
    out = StepOutput.unpack(np.asarray(out))
    for e, (r, s) in enumerate(zip(row_E, slot_E)):
      if s >= S:
        continue
      axes = jax.tree.leaves(pf.model.batch_axes())  # each leaf's sequence axis
      for w, p, a in zip(jax.tree.leaves(want.model), jax.tree.leaves(pf.model), axes):
        np.moveaxis(w, a, 0)[s] = np.moveaxis(np.asarray(p), a, 0)[r]
      want.tokens[s], want.last_output_index[s] = out.token[e], 0
      for column, values in zip(jax.tree.leaves(want.settings), jax.tree.leaves(settings)):
        column[s] = values[e]
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, table), want)


def test_a_step_output_comes_back_from_its_one_packed_array():
  """StepOutput.pack (on the device) and unpack (on the host) are inverses, field by field, bit for bit."""
  rng = np.random.default_rng(0)
  E = 3
  step = StepOutput(
    token=jnp.asarray([5, 0, 50_256], jnp.int32),
    done=jnp.asarray([True, False, True]),
    logprob=jnp.asarray(-rng.exponential(size=E), jnp.float32),
    top_ids=jnp.asarray(rng.integers(0, 1000, (E, N_TOP)), jnp.int32),
    top_logprobs=jnp.asarray(-rng.exponential(size=(E, N_TOP)), jnp.float32).at[1, 2].set(-jnp.inf),
  )
  packed = np.asarray(jax.jit(StepOutput.pack)(step))
  assert packed.dtype == np.int32 and packed.ndim == 2 and packed.shape[1] == E  # one array, one copy
  back = StepOutput.unpack(packed)
  for name in ("token", "done", "logprob", "top_ids", "top_logprobs"):
    got, want = getattr(back, name), np.asarray(getattr(step, name))
    assert got.dtype == want.dtype and got.shape == want.shape, name
    np.testing.assert_array_equal(got, want, err_msg=name)
  assert back.logprobs_of(1) == (
    float(step.logprob[1]),
    [(int(t), float(v)) for t, v in zip(step.top_ids[1], step.top_logprobs[1])],
  )


def test_step_rows_pick_the_smallest_bucket_and_each_devices_own_slots():
  assert bucket_sizes(64) == (1, 2, 4, 8, 16, 32, 64) and bucket_sizes(6) == (1, 2, 4, 6)
  assert bucket_sizes(1280, 64) == (64, 128, 256, 512, 1024, 1280)  # 20 slots a device
  np.testing.assert_array_equal(step_rows([5], 64, bucket_sizes(64)), [5])
  np.testing.assert_array_equal(step_rows([9, 3, 40], 64, bucket_sizes(64)), [3, 9, 40, 0])
  # two devices of 4 slots: device 0 runs slots 0-3, device 1 slots 4-7; each its live slots, then idle ones
  rows = step_rows([1, 2, 6], 8, bucket_sizes(8, 2), 2)
  np.testing.assert_array_equal(rows, [1, 2, 6, 4])
  rows = step_rows([0, 1, 2, 9], 16, bucket_sizes(16, 2), 2)
  np.testing.assert_array_equal(rows, [0, 1, 2, 3, 9, 8, 10, 11])  # device 0's three: 4 rows a device


def test_a_bucket_step_is_the_whole_table_step_for_its_rows_and_leaves_the_rest():
  """Generate over a bucket of rows (single steps and a call of several): the live slots' tokens and states
  are those of the step over the whole table, and rows outside the bucket are not written."""
  cfg = get_config("tiny", n_layers=2)
  S = 8
  fns = SlotFunctions(model, cfg, n_slots=S, prefill_batch=S, n_stop=2, valid_vocab=cfg.vocab_size)
  params = model.init_params(cfg, jax.random.key(0))
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (S, 16)).astype(np.int32)
  pf = fns.prefill_chunk(params, fns.empty_prefill(), tokens, np.full((S,), 16, np.int32))
  rows = [
    SlotSettings(
      temperature=0.8, top_k=0, top_p=0.9, seed=i, seed_hi=0, max_tokens=100, stop_ids=[], logprobs=-1
    )
    for i in range(S)
  ]
  every = jnp.arange(S, dtype=jnp.int32)
  table, _ = fns.insert(params, fns.empty_table(), pf, every, every, host_settings(rows, S, 2))
  live = [1, 5, 6]
  bucket = step_rows(live, S, fns.buckets)
  assert bucket.tolist() == [1, 5, 6, 0]
  full, part = jax.tree.map(jnp.copy, table), jax.tree.map(jnp.copy, table)
  for _ in range(2):
    full, a = fns.generate(params, full)
    part, b = fns.generate(params, part, rows_B=bucket)
    np.testing.assert_array_equal(
      StepOutput.unpack(np.asarray(a)).token[live], StepOutput.unpack(np.asarray(b)).token[:3]
    )
  full, a = fns.generate(params, full, 3)
  part, b = fns.generate(params, part, 3, rows_B=bucket)
  a, b = (StepsOutput.unpack(np.asarray(x), 3) for x in (a, b))
  np.testing.assert_array_equal(a.steps.token[live], b.steps.token[:3])
  np.testing.assert_array_equal(a.emitted[live], b.emitted[:3])
  full, part, table = (jax.tree.map(np.asarray, t) for t in (full, part, table))
  axes = dataclasses.replace(table_axes(fns.axes), settings=jax.tree.map(lambda _: 0, table.settings))
  for f, p, t, axis in zip(*(jax.tree.leaves(x) for x in (full, part, table, axes))):
    f, p, t = (np.moveaxis(x, axis, 0) for x in (f, p, t))
    np.testing.assert_allclose(p[live], f[live], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(p[[2, 3, 4, 7]], t[[2, 3, 4, 7]])  # outside the bucket: untouched


def test_a_bucket_step_moves_the_bucket_state_not_the_table():
  """The compiled bucket step's bytes (HLO counter) do not depend on the table's size: a 1- or 8-row step of a
  2,048-slot table moves what it moves in a 64-slot one, and no more than the bare decode step at that batch
  plus four passes (a read and a write) over its rows' states: the gather into the bucket, the write back in
  place, and the two copies XLA's CPU layout adds around the layer loop (docs/SERVING.md)."""
  cfg = get_config("tiny")
  params = jax.eval_shape(lambda: model.init_params(cfg, jax.random.key(0)))

  def moved(S, B):
    fns = SlotFunctions(model, cfg, n_slots=S, prefill_batch=2, n_stop=2, valid_vocab=cfg.vocab_size)
    table = fns.table_shape
    compiled = compile_as_benchmarks(
      fns.programs.decode.lower(params, table, jax.ShapeDtypeStruct((B,), jnp.int32))
    )
    return hlo_bytes.total_bytes(hlo_bytes.memory_traffic(compiled.as_text())), fns.state_bytes_per_slot

  for B in (1, 8):
    small, per_slot = moved(64, B)
    big, _ = moved(2048, B)
    assert abs(big - small) <= 0.01 * small, (B, small, big)
    state = jax.eval_shape(lambda: model.init_state(cfg, B))
    bare = compile_as_benchmarks(
      jax.jit(lambda p, s, t: model.decode_step(p, s, t, cfg=cfg), donate_argnums=1).lower(
        params, state, jax.ShapeDtypeStruct((B,), jnp.int32)
      )
    )
    bare_bytes = hlo_bytes.total_bytes(hlo_bytes.memory_traffic(bare.as_text()))
    assert small <= bare_bytes + 8 * B * per_slot + 16384, (B, small, bare_bytes, per_slot)
