"""--state-cache-dir is not trusted: files are private, whatever else lies in the
directory (links, FIFOs, directories, damaged or foreign files) is skipped without blocking start-up,
interrupted writes leave nothing behind, the byte budget holds at start, and the model fingerprint covers
every parameter byte. No engine here: StateCache alone, on tiny states."""

import hashlib
import json
import os
import stat
import threading

import jax
import numpy as np
from helpers import serve_fixtures as sf

from serve.engine import state_cache
from serve.engine.state_cache import MAGIC, StateCache, encode_entry

LAYOUT = {"gla": ("float32", (2, 3, 4)), "conv": ("float32", (2, 2))}


def _state(fill):
  return {k: np.full(shape, fill, dtype) for k, (dtype, shape) in LAYOUT.items()}


ENTRY = sum(a.nbytes for a in _state(0).values())


def _open(d, budget=1 << 20, timeout=20.0):
  """StateCache(d) built in a thread: a blocking open (a FIFO) fails the test instead of hanging it."""
  out = []
  t = threading.Thread(
    target=lambda: out.append(StateCache("m", budget, directory=d, layout=LAYOUT)), daemon=True
  )
  t.start()
  t.join(timeout)
  assert out, "StateCache blocked at start"
  return out[0]


def test_files_are_private(tmp_path):
  d = str(tmp_path / "c")
  c = StateCache("m", 1 << 20, directory=d)
  c.put(list(range(70)), _state(1))
  c.flush()
  assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
  for name in os.listdir(d):
    assert stat.S_IMODE(os.stat(os.path.join(d, name)).st_mode) == 0o600, name


def test_planted_and_odd_files_are_skipped_and_start_up_goes_on(tmp_path, caplog):
  d = str(tmp_path / "c")
  c = StateCache("m", 1 << 20, directory=d, layout=LAYOUT)
  c.put(list(range(70)), _state(1))
  c.flush()
  plant = lambda name, data: (tmp_path / "c" / name).write_bytes(data)
  plant(
    "shape.state",
    encode_entry(
      np.arange(5, dtype=np.int32),
      {"gla": np.ones((3, 5), np.float32), "conv": np.ones((2, 2), np.float32)},
      "m",
    ),
  )
  plant(
    "dtype.state",
    encode_entry(np.arange(5, dtype=np.int32), {k: v.astype(np.float64) for k, v in _state(2).items()}, "m"),
  )
  plant(
    "object.state",
    encode_entry(np.arange(5, dtype=np.int32), _state(3), "m").replace(b'"float32"', b'"object"'),
  )
  plant("model.state", encode_entry(np.arange(5, dtype=np.int32), _state(4), "another-model"))
  plant("noline.state", MAGIC + b"{" * 100)
  plant("list.state", MAGIC + b"[1, 2]\n")
  payload = b"\0" * 8
  plant(
    "fields.state",
    MAGIC
    + json.dumps(
      {"model_id": "m", "n_ids": "two", "arrays": 5, "sha256": hashlib.sha256(payload).hexdigest()}
    ).encode()
    + b"\n"
    + payload,
  )
  os.symlink(str(tmp_path / "nowhere"), os.path.join(d, "dangling.state"))
  os.symlink(os.path.join(d, os.listdir(d)[0]), os.path.join(d, "link.state"))  # even to a good file
  os.mkfifo(os.path.join(d, "fifo.state"))
  os.mkdir(os.path.join(d, "dir.state"))
  again = _open(d)
  assert len(again) == 1 and again.stats.files_skipped == 11
  assert again.lookup(list(range(71)), 70)[0] == 70
  for name in ("shape", "dtype", "object", "model", "noline", "list", "fields", "dangling", "fifo", "dir"):
    assert f"{name}.state" in caplog.text


def test_failed_writes_leave_no_temporary_files(tmp_path, monkeypatch):
  d = str(tmp_path / "c")
  c = StateCache("m", 1 << 20, directory=d)

  def broken(fd):
    raise OSError(28, "No space left on device")

  monkeypatch.setattr(os, "fsync", broken)
  c.put(list(range(70)), _state(1))
  c.flush()
  assert [n for n in os.listdir(d) if n.endswith(".state") or ".tmp" in n] == []


def test_temporaries_of_a_crash_are_removed_at_start(tmp_path):
  d = str(tmp_path / "c")
  StateCache("m", 1 << 20, directory=d)
  (tmp_path / "c" / "abc.state.tmp-123-456").write_bytes(b"half a state")
  os.mkfifo(os.path.join(d, "def.state.tmp-1-2"))
  _open(d)
  assert sorted(os.listdir(d)) == [state_cache.MARKER]


def test_files_past_the_budget_at_start_are_removed(tmp_path):
  d = str(tmp_path / "c")
  c = StateCache("m", 1 << 20, directory=d)
  for i in range(4):
    c.put([i] * 70, _state(i))
    c.flush()
    path = os.path.join(d, c._key(np.full(70, i, np.int32), "") + ".state")
    os.utime(path, (1000 + i, 1000 + i))  # file i is the i-th newest from the end
  small = StateCache("m", 2 * ENTRY, directory=d)
  assert len(small) == 2 and small.stats.files_removed == 2
  assert [small.lookup([i] * 71, 70)[0] for i in range(4)] == [0, 0, 70, 70]  # the newest kept
  assert len([n for n in os.listdir(d) if n.endswith(".state")]) == 2


def test_the_fingerprint_covers_every_parameter_byte():
  cfg, params = sf.tiny(0)
  base = state_cache.model_identity(cfg, params)
  leaves, treedef = jax.tree_util.tree_flatten(params)
  big = max(range(len(leaves)), key=lambda i: leaves[i].size)
  flat = np.array(leaves[big]).reshape(-1)
  flat[flat.size // 2] += 1e-3  # one value in the middle of the largest leaf
  edited = list(leaves)
  edited[big] = flat.reshape(leaves[big].shape)
  assert flat.size > 100_000
  assert state_cache.model_identity(cfg, jax.tree_util.tree_unflatten(treedef, edited)) != base
