"""Checkpoints: resharding 8 → 4 → 1 devices, optax and iterator state, keep-last-N, plain-Orbax reads,
config checks, and that a crash, a full disk or a corrupt step never costs the last good checkpoint."""

import dataclasses
import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import grain
import helpers
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from laplace_jax.model.config import get_config
from laplace_jax.platform import CPU_DEVICES_ENV
from laplace_jax.sharding import DATA, FSDP, make_mesh
from laplace_jax.training import checkpoint as ckpt

SPECS = {"embed": P(DATA, FSDP), "w": P(None, FSDP), "b": P()}  # by parameter name
REPO = helpers.ROOT


def _spec(path):
  """The PartitionSpec of a state leaf: parameters and their moments by name; the rest replicated."""
  names = [getattr(k, "key", None) for k in path]
  return next((SPECS[n] for n in reversed(names) if n in SPECS), P())


def _train_state(mesh, seed=0):
  """A small state like the trainer's: sharded params, adamw state after one update, step, PRNG key."""
  k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
  params = {
    "embed": jax.random.normal(k1, (16, 8)),
    "w": jax.random.normal(k2, (8, 8)),
    "b": jax.random.normal(k3, (8,)),
  }
  params = {k: jax.device_put(v, NamedSharding(mesh, SPECS[k])) for k, v in params.items()}
  opt = optax.adamw(1e-2)
  opt_state = opt.init(params)
  grads = jax.tree.map(jnp.cos, params)
  updates, opt_state = opt.update(grads, opt_state, params)
  params = optax.apply_updates(params, updates)
  return {"params": params, "opt_state": opt_state, "step": jnp.int32(1), "rng": jax.random.key(seed + 7)}


def _abstract(state, mesh):
  """ShapeDtypeStructs of `state` placed on `mesh` (what a resuming trainer builds with eval_shape)."""

  def leaf(path, x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, _spec(path)))

  return jax.tree_util.tree_map_with_path(leaf, state)


def _host(tree):
  """Host copies, with typed PRNG keys as their raw key data, for value comparisons."""

  def leaf(x):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      x = jax.random.key_data(x)
    return np.asarray(x)

  return jax.tree.map(leaf, tree)


def _assert_tree_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(_host(a)), jax.tree.leaves(_host(b))):
    assert x.dtype == y.dtype
    np.testing.assert_array_equal(x, y)


def _with_key(host_state):
  """`host_state` with its PRNG key typed again, as the trainer's state holds it."""
  return {**host_state, "rng": jax.random.wrap_key_data(host_state["rng"])}


def test_saved_on_8_devices_restores_on_4_and_on_1(tmp_path):
  state = _train_state(make_mesh(4, 2))
  assert len(state["params"]["embed"].sharding.device_set) == 8
  expected = _host(state)
  with ckpt.Checkpointer(tmp_path / "run") as ck:
    assert ck.save(1, state, metadata={"config": {"d_model": 8}})
    for x in jax.tree.leaves(state):  # the trainer donates the state right after save() returns
      x.delete()
    ck.wait_until_finished()
    template = _with_key(expected)
    for mesh in (make_mesh(2, 2), make_mesh(1, 1)):
      restored = ck.restore(abstract_state=_abstract(template, mesh))
      assert restored.step == 1
      _assert_tree_equal(restored.train_state, template)
      got = restored.train_state["params"]["embed"].sharding
      assert got.mesh.devices.size == mesh.devices.size and got.spec == P(DATA, FSDP)
  # The optax state is a working optimizer state again: one more update equals the original's.
  opt = optax.adamw(1e-2)
  grads = jax.tree.map(jnp.sin, restored.train_state["params"])
  upd_restored, _ = opt.update(grads, restored.train_state["opt_state"], restored.train_state["params"])
  original = jax.tree.map(jnp.asarray, expected)
  upd_original, _ = opt.update(
    jax.tree.map(jnp.sin, original["params"]), original["opt_state"], original["params"]
  )
  assert isinstance(restored.train_state["opt_state"][0], optax.ScaleByAdamState)
  for x, y in zip(jax.tree.leaves(upd_restored), jax.tree.leaves(upd_original)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-9)


def test_iterator_state_round_trips_and_resumes_a_grain_pipeline(tmp_path):
  def make_iter():
    return iter(grain.MapDataset.range(40).shuffle(seed=3).batch(4).to_iter_dataset())

  it = make_iter()
  for _ in range(3):
    next(it)
  saved_state = it.get_state()
  uninterrupted = [next(it).tolist() for _ in range(3)]
  state = {"step": jnp.int32(3)}
  with ckpt.Checkpointer(tmp_path / "run") as ck:
    ck.save(3, state, data_state=saved_state)
    ck.save(4, state, data_state=b'{"loader": 7}')  # a DataLoaderIterator's state is bytes
    ck.save(5, state, data_state={"pos": np.int64(11), "nested": {"seen": [1, 2]}})
    ck.wait_until_finished()
    resumed_iter = make_iter()
    resumed_iter.set_state(ck.restore(3).data_state)
    assert [next(resumed_iter).tolist() for _ in range(3)] == uninterrupted
    assert ck.restore(4).data_state == b'{"loader": 7}'
    assert ck.restore(5).data_state == {"pos": 11, "nested": {"seen": [1, 2]}}
    assert ck.restore(5, restore_data=False).data_state is None
  # grain's own Orbax handler reads the same files onto a live iterator.
  mngr = ocp.CheckpointManager(
    tmp_path / "run", item_handlers={"data_state": grain.checkpoint.CheckpointHandler()}
  )
  direct = mngr.restore(
    3, args=ocp.args.Composite(data_state=grain.checkpoint.CheckpointRestore(make_iter()))
  )
  assert [next(direct.data_state).tolist() for _ in range(3)] == uninterrupted
  mngr.close()


def test_keep_last_n_interval_and_forced_final_save(tmp_path):
  state = {"x": jnp.arange(4.0)}
  with ckpt.Checkpointer(tmp_path / "run", max_to_keep=2, save_interval_steps=2) as ck:
    saved = [s for s in range(8) if ck.save(s, {"x": state["x"] + s})]
    assert saved == [0, 2, 4, 6]
    assert ck.save(7, {"x": state["x"] + 7}, force=True)  # the final save ignores the interval
    assert not ck.save(7, state, force=True)  # ... and is a no-op when that step is already saved
    ck.wait_until_finished()
    assert ck.all_steps() == [6, 7] and ck.latest_step() == 7
    np.testing.assert_array_equal(ck.restore().train_state["x"], np.arange(4.0) + 7)
  assert sorted(p.name for p in (tmp_path / "run").iterdir() if p.name.isdigit()) == ["6", "7"]


_PLAIN_ORBAX = textwrap.dedent("""
  import json, sys
  import jax, numpy as np
  import orbax.checkpoint as ocp
  directory, out = sys.argv[1], sys.argv[2]
  mngr = ocp.CheckpointManager(directory, item_handlers={
      "train_state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()})
  step = mngr.latest_step()
  saved = mngr.item_metadata(step)["train_state"].tree
  one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=one), saved)
  got = mngr.restore(step, args=ocp.args.Composite(train_state=ocp.args.StandardRestore(target),
                                                  meta=ocp.args.JsonRestore()))
  def host(x):  # orbax brings the PRNG key back typed; compare its raw data
    return np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x)
  flat = {jax.tree_util.keystr(p): host(x)
          for p, x in jax.tree_util.tree_flatten_with_path(got["train_state"])[0]}
  np.savez(out, **flat)
  print(json.dumps({"step": step, "config": got["meta"]["config"], "devices": jax.device_count()}))
""")


def test_checkpoint_restores_with_plain_orbax_and_no_laplace_jax(tmp_path):
  state = _train_state(make_mesh(4, 2))
  with ckpt.Checkpointer(tmp_path / "run") as ck:
    ck.save(9, state, data_state={"pos": 3}, metadata={"config": {"d_model": 8, "n_layers": 2}})
  env = {k: v for k, v in os.environ.items() if k not in (CPU_DEVICES_ENV, "PYTHONPATH")}
  env["JAX_PLATFORMS"] = "cpu"  # one device: the saved 8-device layout must not be needed
  out = subprocess.run(
    [sys.executable, "-c", _PLAIN_ORBAX, str(tmp_path / "run"), str(tmp_path / "o.npz")],
    env=env,
    cwd=tmp_path,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert out.returncode == 0, out.stderr[-3000:]
  info = json.loads(out.stdout.strip().splitlines()[-1])
  assert info == {"step": 9, "config": {"d_model": 8, "n_layers": 2}, "devices": 1}
  got = np.load(tmp_path / "o.npz")
  host = _host(state)
  expected = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(host)[0]}
  assert len(got.files) == len(expected)
  for flat_name, x in zip(sorted(got.files), sorted(expected)):
    np.testing.assert_array_equal(got[flat_name], expected[x])
  proc_file = tmp_path / "run" / "9" / "data_state" / "process_0-of-1.json"
  assert json.loads(proc_file.read_text()) == {"pos": 3}


def test_config_mismatch_names_the_differing_fields(tmp_path):
  cfg = get_config("tiny")
  state = {"x": jnp.zeros(3)}
  with ckpt.Checkpointer(tmp_path / "run") as ck:
    ck.save(1, state, metadata={"config": cfg, "note": "hello"})
    ck.wait_until_finished()
    assert ck.restore(config=cfg).metadata["note"] == "hello"
    assert ck.metadata()["config"]["d_model"] == cfg.d_model
    other = cfg.replace(d_model=cfg.d_model * 2, n_layers=cfg.n_layers + 1)
    with pytest.raises(ValueError, match=r"d_model: saved .*n_layers: saved") as e:
      ck.restore(config=other)
    assert "vocab_size" not in str(e.value)
    with pytest.raises(ValueError, match=r"x: saved shape \(3,\), expected \(4,\)"):
      ck.restore(abstract_state={"x": jax.ShapeDtypeStruct((4,), jnp.float32)})


def test_write_error_during_save_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
  with ckpt.Checkpointer(tmp_path / "run", max_to_keep=1) as ck:
    ck.save(1, {"x": jnp.ones(4)})
    ck.wait_until_finished()

    async def disk_full(self, x, directory):
      raise OSError(errno.ENOSPC, "No space left on device", str(directory))

    monkeypatch.setattr(ocp.JsonCheckpointHandler, "_save_fn", disk_full)
    assert ck.save(2, {"x": jnp.full(4, 2.0)})  # async: the write fails in the background ...
    with pytest.raises(ckpt.CheckpointSaveError, match=r"step 2 .*step 1\) is untouched.*disk is full"):
      ck.save(3, {"x": jnp.full(4, 3.0)})  # ... and surfaces at the next save
    assert ck.save(4, {"x": jnp.full(4, 4.0)})
    with pytest.raises(ckpt.CheckpointSaveError, match=r"step 4 .*step 1\) is untouched"):
      ck.wait_until_finished()  # (or here, or at close())
    assert ck.all_steps() == [1]
    assert not list((tmp_path / "run").glob("*.orbax-checkpoint-tmp*"))  # partial files freed
    np.testing.assert_array_equal(ck.restore().train_state["x"], np.ones(4))
    monkeypatch.undo()
    ck.save(5, {"x": jnp.full(4, 5.0)})  # space again: saving resumes, then keep-last-1 applies
    ck.wait_until_finished()
    assert ck.all_steps() == [5]


_KILLED_MID_SAVE = textwrap.dedent("""
  import asyncio, sys
  import jax.numpy as jnp
  import orbax.checkpoint as ocp
  from laplace_jax.training import checkpoint as ckpt

  async def stall(self, x, directory):  # hold the background write open so the kill lands mid-save
    await asyncio.sleep(600)
  ck = ckpt.Checkpointer(sys.argv[1], max_to_keep=1)
  ck.save(1, {"x": jnp.ones(4)}, metadata={"note": "good"})
  ck.wait_until_finished()
  ocp.JsonCheckpointHandler._save_fn = stall
  ck.save(2, {"x": jnp.full(4, 2.0)}, metadata={"note": "partial"})
  print("saving", flush=True)
  sys.stdin.read()
""")


def test_kill_mid_save_leaves_the_last_good_checkpoint(tmp_path):
  run = tmp_path / "run"
  proc = subprocess.Popen(
    [sys.executable, "-c", _KILLED_MID_SAVE, str(run)],
    stdin=subprocess.PIPE,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
    cwd=REPO,
  )
  try:
    assert proc.stdout.readline().strip() == "saving", proc.stderr.read()[-3000:]
    # the kill lands with step 2 half written: its temporary directory exists (made by orbax's background
    # thread, which may start after save() returns) and the write never finishes
    deadline = time.monotonic() + 60
    while not list(run.glob("2.orbax-checkpoint-tmp*")) and time.monotonic() < deadline:
      time.sleep(0.02)
    assert list(run.glob("2.orbax-checkpoint-tmp*"))
    os.kill(proc.pid, signal.SIGKILL)
  finally:
    proc.kill()
    proc.wait(timeout=30)
  with ckpt.Checkpointer(run, max_to_keep=1) as ck:
    assert ck.latest_step() == 1 and ck.all_steps() == [1]
    restored = ck.restore(abstract_state={"x": jax.ShapeDtypeStruct((4,), jnp.float32)})
    assert restored.step == 1 and restored.metadata == {"note": "good"}
    np.testing.assert_array_equal(restored.train_state["x"], np.ones(4))
    ck.save(2, {"x": jnp.full(4, 2.0)})
    ck.wait_until_finished()
    assert ck.all_steps() == [2]
  assert not list(run.glob("*.orbax-checkpoint-tmp*"))  # the leftover was cleaned on open


def test_corrupt_latest_step_is_reported_skipped_and_set_aside(tmp_path):
  run = tmp_path / "run"
  with ckpt.Checkpointer(run) as ck:
    for s in (1, 2, 3):
      ck.save(s, {"x": jnp.full(4, float(s))}, data_state={"pos": s})
    ck.wait_until_finished()
    for f in (run / "3" / "train_state").rglob("d/*"):  # step 3 loses its array data
      f.unlink()
    (run / "2" / "meta" / "metadata").write_text("{not json")  # step 2: torn metadata
    (run / "4.orbax-checkpoint-tmp-17" / "train_state").mkdir(parents=True)  # a save cut short
    assert ck.latest_step() == 3  # the unfinished step 4 is not a step
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"step 3 .*'train_state'.*delete"):
      ck.restore(3)
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"step 2 .*'meta'"):
      ck.restore(2)
    restored = ck.restore()  # "latest" falls back to the newest good step ...
    assert restored.step == 1 and restored.data_state == {"pos": 1}
    np.testing.assert_array_equal(restored.train_state["x"], np.ones(4))
    assert ck.all_steps() == [1]  # ... and moves the damaged ones aside, so a resumed run can save them
    assert (run / "2.corrupt").is_dir() and (run / "3.corrupt").is_dir()
    assert ck.save(2, {"x": jnp.full(4, 2.0)})
    ck.wait_until_finished()
    assert ck.restore().step == 2
    with pytest.raises(FileNotFoundError, match=r"step 7 is not in .*\[1, 2\]"):
      ck.restore(7)


def test_restore_reports_a_missing_checkpoint(tmp_path):
  with ckpt.Checkpointer(tmp_path / "empty") as ck:
    assert ck.latest_step() is None
    with pytest.raises(FileNotFoundError, match="No finished checkpoint.*from scratch"):
      ck.restore()


def test_a_config_saved_before_a_field_existed_loads_with_its_default(tmp_path):
  cfg = get_config("tiny")
  old = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "window"}  # written before `window` existed
  params = {"x": np.zeros(3, np.float32)}
  ckpt.export_params(params, tmp_path / "export", config=old)
  assert ckpt.export_config(tmp_path / "export") == cfg
  ckpt.load_params(tmp_path / "export", config=cfg)
  with pytest.raises(ValueError, match=r"window: saved 2048, given 64"):  # the default stands in for it
    ckpt.load_params(tmp_path / "export", config=cfg.replace(window=64))


def test_export_params_for_serving_and_load_on_any_sharding(tmp_path):
  cfg = get_config("tiny")
  params = _train_state(make_mesh(4, 2))["params"]
  expected = _host(params)
  ckpt.export_params(params, tmp_path / "export", config=cfg)
  _assert_tree_equal(ckpt.load_params(tmp_path / "export", config=cfg), expected)  # host numpy
  mesh4 = make_mesh(2, 2)
  on_mesh = ckpt.load_params(tmp_path / "export", shardings=NamedSharding(mesh4, P()))
  assert on_mesh["embed"].sharding == NamedSharding(mesh4, P())
  _assert_tree_equal(on_mesh, expected)
  abstract = _abstract(expected, mesh4)
  sharded = ckpt.load_params(tmp_path / "export", abstract)
  assert sharded["embed"].sharding == NamedSharding(mesh4, P(DATA, FSDP))
  _assert_tree_equal(sharded, expected)
  with pytest.raises(ValueError, match="n_layers: saved"):
    ckpt.load_params(tmp_path / "export", config=cfg.replace(n_layers=cfg.n_layers + 1))
  with pytest.raises(FileExistsError, match="never overwritten"):
    ckpt.export_params(params, tmp_path / "export")
  with pytest.raises(FileNotFoundError, match="export_params"):
    ckpt.load_params(tmp_path / "nothing")
  plain = ocp.StandardCheckpointer().restore(tmp_path / "export" / "params", _abstract(expected, mesh4))
  _assert_tree_equal(plain, expected)


_TWO_PROCESSES = textwrap.dedent("""
  import os, sys
  pid, port, directory = int(sys.argv[1]), sys.argv[2], sys.argv[3]
  os.environ["JAX_PLATFORMS"] = "cpu"
  import jax, jax.numpy as jnp, numpy as np
  from laplace_jax.platform import simulate_cpu_devices
  simulate_cpu_devices(4)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)
  from jax.sharding import NamedSharding, PartitionSpec as P
  from laplace_jax.training import checkpoint as ckpt
  from laplace_jax.sharding import DATA, FSDP, make_mesh
  mesh = make_mesh(2, 4)
  sharded, replicated = NamedSharding(mesh, P(DATA, FSDP)), NamedSharding(mesh, P())
  state = {"w": jax.jit(lambda: jnp.arange(64.0).reshape(8, 8), out_shardings=sharded)(),
           "step": jax.jit(lambda: jnp.int32(5), out_shardings=replicated)()}
  with ckpt.Checkpointer(directory) as ck:
    ck.save(5, state, data_state={"pos": 100 + pid}, metadata={"config": {"d_model": 8}})
  with ckpt.Checkpointer(directory) as ck:
    got = ck.restore(abstract_state=jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state))
  assert got.data_state == {"pos": 100 + pid}, got.data_state
  for a, b in zip(got.train_state["w"].addressable_shards, state["w"].addressable_shards):
    np.testing.assert_array_equal(np.asarray(a.data), np.asarray(b.data))
  print("ok", flush=True)
""")


def test_two_processes_save_their_own_data_state_and_one_process_reshards(tmp_path):
  import socket

  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  env = {k: v for k, v in os.environ.items() if k != CPU_DEVICES_ENV}
  procs = [
    subprocess.Popen(
      [sys.executable, "-c", _TWO_PROCESSES, str(i), str(port), str(tmp_path / "run")],
      cwd=REPO,
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for i in range(2)
  ]
  outs = [p.communicate(timeout=120) for p in procs]
  for p, (out, err) in zip(procs, outs):
    assert p.returncode == 0 and out.strip().endswith("ok"), err[-3000:]
  step_dir = tmp_path / "run" / "5"
  assert sorted(p.name for p in (step_dir / "data_state").glob("*.json")) == [
    "process_0-of-2.json",
    "process_1-of-2.json",
  ]
  mesh = make_mesh(1, 8)  # one process, 8 devices: the parameters reshard, the data position cannot
  abstract = {
    "w": jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=NamedSharding(mesh, P(DATA, FSDP))),
    "step": jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P())),
  }
  with ckpt.Checkpointer(tmp_path / "run") as ck:
    with pytest.raises(ValueError, match=r"2.json.*1 process.*restore_data=False"):
      ck.restore(abstract_state=abstract)
    got = ck.restore(abstract_state=abstract, restore_data=False)
  np.testing.assert_array_equal(got.train_state["w"], np.arange(64.0).reshape(8, 8))
  assert int(got.train_state["step"]) == 5 and got.data_state is None
