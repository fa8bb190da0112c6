"""A host-memory cache of whole-context model states, keyed by exact token ids and the model.

A Laplace sequence's context is its fixed-size state, so a cached state of tokens[:n] lets a new request
whose prompt starts with those n tokens skip prefilling them. Entries are found through a hash chain over
BLOCK-token blocks of the ids (seeded with the model's identity), then confirmed against the stored ids
themselves: a hash collision can never select a state. Eviction is LRU by bytes. With a directory, every
entry is also a file (header + arrays + SHA-256), written by a background thread to a temporary name and
renamed into place; at start the files of this model are loaded (newest first, up to the byte budget) and a
damaged one is skipped with a warning.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import logging
import os
import queue
import threading
from typing import Sequence

import jax
import numpy as np

from laplace_jax.config import LAYOUT_NEUTRAL

log = logging.getLogger(__name__)

BLOCK = 64          # tokens per hash-chain block
MAX_PENDING_WRITES = 64  # files queued for the writer; past it new entries stay in memory only
MAGIC = b"LPLSTATE1\n"
MARKER = "laplace-state-cache.json"


def model_identity(cfg, params, extra: str = "") -> str:
  """A digest of the config and of every parameter leaf's shape, dtype and leading values.

  Reading a few thousand values per leaf (not all 3B) tells models apart in practice: two checkpoints that
  agree there agree everywhere only if they are the same checkpoint."""
  # The config's repr without its layout-neutral fields (scan_layers): the same states under either value,
  # and the identities of directories written before the field existed are kept.
  fields = ", ".join(f"{f.name}={getattr(cfg, f.name)!r}" for f in dataclasses.fields(cfg)
                     if f.name not in LAYOUT_NEUTRAL)
  h = hashlib.sha256(f"{type(cfg).__qualname__}({fields})".encode() + extra.encode())
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    h.update(f"{jax.tree_util.keystr(path)}{leaf.shape}{leaf.dtype}".encode())
    flat = leaf.reshape(-1)
    h.update(np.asarray(flat[:4096]).tobytes())
    h.update(np.asarray(flat[-4096:]).tobytes())
  return h.hexdigest()[:32]


def _ids_bytes(ids) -> bytes:
  return np.asarray(ids, np.int32).tobytes()


@dataclasses.dataclass
class Entry:
  ids: np.ndarray    # int32 [n]: exactly the tokens the state has consumed
  state: dict        # {"gla": [L, ...], "conv": [L, ...]} numpy, one sequence (no slot axis)
  key: str           # hash of (model, ids): the file name on disk

  @property
  def nbytes(self) -> int:
    return sum(a.nbytes for a in self.state.values())


class StateCache:
  """LRU by bytes of `Entry`s, looked up by longest cached prefix. Thread-safe."""

  def __init__(self, model_id: str, budget_bytes: int, directory: str | None = None):
    if budget_bytes < 0:
      raise ValueError(f"--state-cache-gb gives {budget_bytes} bytes: expected >= 0 (0 disables the cache).")
    self.model_id, self.budget = model_id, int(budget_bytes)
    self.entries: collections.OrderedDict[str, Entry] = collections.OrderedDict()  # oldest first
    self.by_block: dict[bytes, set[str]] = collections.defaultdict(set)  # chain hash of floor(n/BLOCK) blocks
    self.bytes = 0
    self.stats = {"hits": 0, "misses": 0, "evictions": 0, "tokens_reused": 0, "stored": 0,
                  "files_written": 0, "files_skipped": 0, "files_not_written": 0}
    self._lock = threading.Lock()
    self.dir = directory
    self._writes: queue.Queue | None = None
    if directory:
      self._open_dir(directory)

  # ---- keys ----

  def _chain(self, ids: np.ndarray, n_blocks: int) -> list[bytes]:
    """h_0 = H(model), h_{j+1} = H(h_j || block j): one hash per block boundary, n_blocks + 1 in all."""
    out = [hashlib.sha256(self.model_id.encode()).digest()]
    for j in range(n_blocks):
      out.append(hashlib.sha256(out[-1] + ids[j * BLOCK:(j + 1) * BLOCK].tobytes()).digest())
    return out

  def _key(self, ids: np.ndarray) -> str:
    return hashlib.sha256(self.model_id.encode() + b"|" + ids.tobytes()).hexdigest()

  # ---- lookup / insert ----

  def lookup(self, prompt_ids: Sequence[int], max_len: int) -> tuple[int, dict | None]:
    """The longest cached prefix of prompt_ids no longer than max_len: (n, state) or (0, None)."""
    ids = np.asarray(prompt_ids, np.int32)
    max_len = min(max_len, len(ids))
    chain = self._chain(ids, max_len // BLOCK)
    with self._lock:
      for j in range(len(chain) - 1, -1, -1):
        best = None
        for key in self.by_block.get(chain[j], ()):
          e = self.entries[key]
          n = len(e.ids)
          if n <= max_len and (best is None or n > len(best.ids)) and np.array_equal(e.ids, ids[:n]):
            best = e
        if best is not None:
          self.entries.move_to_end(best.key)
          self.stats["hits"] += 1
          self.stats["tokens_reused"] += len(best.ids)
          return len(best.ids), best.state
      self.stats["misses"] += 1
    return 0, None

  def put(self, ids: Sequence[int], state: dict, *, write: bool = True) -> bool:
    """Keep `state` as the state after exactly `ids`; False if it cannot fit the budget at all."""
    ids = np.asarray(ids, np.int32)
    e = Entry(ids=ids, state=state, key=self._key(ids))
    if e.nbytes > self.budget or len(ids) == 0:
      return False
    with self._lock:
      if e.key in self.entries:
        self.entries.move_to_end(e.key)
        return True
      self.entries[e.key] = e
      self.by_block[self._chain(ids, len(ids) // BLOCK)[-1]].add(e.key)
      self.bytes += e.nbytes
      self.stats["stored"] += 1
      evicted = []
      while self.bytes > self.budget:
        old = self.entries.popitem(last=False)[1]
        self._unindex(old)
        evicted.append(old)
    if self._writes is not None:
      for old in evicted:
        self._writes.put(("delete", old))
      if write:
        if self._writes.qsize() < MAX_PENDING_WRITES:  # a slow disk must not hold evicted states in memory
          self._writes.put(("write", e))
        else:
          self.stats["files_not_written"] += 1
    return True

  def _unindex(self, e: Entry):
    h = self._chain(e.ids, len(e.ids) // BLOCK)[-1]
    self.by_block[h].discard(e.key)
    if not self.by_block[h]:
      del self.by_block[h]
    self.bytes -= e.nbytes
    self.stats["evictions"] += 1

  def __len__(self):
    return len(self.entries)

  # ---- disk ----

  def _open_dir(self, directory: str):
    marker = os.path.join(directory, MARKER)
    try:
      os.makedirs(directory, exist_ok=True)
      names = os.listdir(directory)
      if names and MARKER not in names:
        raise ValueError(f"--state-cache-dir={directory} holds {len(names)} other files and no {MARKER}: it "
                         "is not a state cache. Pass an empty or new directory.")
      if MARKER in names:
        with open(marker) as f:
          owner = json.load(f).get("model_id")
        if owner != self.model_id:
          raise ValueError(f"--state-cache-dir={directory} holds states of another model ({owner}, this one "
                           f"is {self.model_id}). Use one directory per model.")
      else:
        _atomic_write(marker, json.dumps({"model_id": self.model_id, "format": 1}).encode())
      probe = os.path.join(directory, ".write-probe")
      _atomic_write(probe, b"ok")
      os.remove(probe)
    except OSError as e:
      raise ValueError(f"--state-cache-dir={directory} is not a writable directory ({e}). Pass a directory "
                       "this process can create and write.") from None
    self._load_dir(directory)
    self._writes = queue.Queue()
    threading.Thread(target=self._writer, name="state-cache-writer", daemon=True).start()

  def _load_dir(self, directory: str):
    files = [os.path.join(directory, n) for n in os.listdir(directory) if n.endswith(".state")]
    files.sort(key=lambda p: os.path.getmtime(p))  # oldest first: the newest end up most recently used
    loaded = []
    for path in reversed(files):
      try:
        ids, state = read_entry(path, self.model_id)
      except (OSError, ValueError) as e:
        log.warning("state cache: skipping %s (%s)", path, e)
        self.stats["files_skipped"] += 1
        continue
      loaded.append((ids, state))
      if sum(sum(a.nbytes for a in s.values()) for _, s in loaded) >= self.budget:
        break
    for ids, state in reversed(loaded):
      self.put(ids, state, write=False)
    self.stats["stored"] = 0
    log.info("state cache: %d states (%.1f MB) loaded from %s", len(self), self.bytes / 1e6, directory)

  def _writer(self):
    while True:
      op, e = self._writes.get()
      path = os.path.join(self.dir, e.key + ".state")
      try:
        if op == "write":
          _atomic_write(path, encode_entry(e.ids, e.state, self.model_id))
          self.stats["files_written"] += 1
        elif os.path.exists(path):
          os.remove(path)
      except OSError as err:
        log.warning("state cache: %s of %s failed (%s)", op, path, err)
      finally:
        self._writes.task_done()

  def flush(self):
    """Wait for every queued file write (tests, shutdown)."""
    if self._writes is not None:
      self._writes.join()


def _atomic_write(path: str, data: bytes):
  tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
  with open(tmp, "wb") as f:
    f.write(data)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def encode_entry(ids: np.ndarray, state: dict, model_id: str) -> bytes:
  """MAGIC, a JSON header line (model, arrays' names/dtypes/shapes, SHA-256 of the payload), the payload."""
  names = sorted(state)
  payload = _ids_bytes(ids) + b"".join(np.ascontiguousarray(state[n]).tobytes() for n in names)
  header = {"model_id": model_id, "n_ids": int(len(ids)), "sha256": hashlib.sha256(payload).hexdigest(),
            "arrays": [[n, str(state[n].dtype), list(state[n].shape)] for n in names]}
  return MAGIC + json.dumps(header).encode() + b"\n" + payload


def read_entry(path: str, model_id: str) -> tuple[np.ndarray, dict]:
  """(ids, state) from a file; ValueError if it is damaged or belongs to another model."""
  with open(path, "rb") as f:
    raw = f.read()
  if not raw.startswith(MAGIC):
    raise ValueError("not a state file")
  end = raw.find(b"\n", len(MAGIC))
  try:
    header = json.loads(raw[len(MAGIC):end])
  except ValueError:
    raise ValueError("damaged header") from None
  if header.get("model_id") != model_id:
    raise ValueError(f"state of another model ({header.get('model_id')})")
  payload = raw[end + 1:]
  if hashlib.sha256(payload).hexdigest() != header.get("sha256"):
    raise ValueError("checksum mismatch (damaged or truncated)")
  n = header["n_ids"]
  ids = np.frombuffer(payload[:4 * n], np.int32).copy()
  state, off = {}, 4 * n
  for name, dtype, shape in header["arrays"]:
    size = int(np.prod(shape)) * np.dtype(dtype).itemsize
    state[name] = np.frombuffer(payload[off:off + size], dtype).reshape(shape).copy()
    off += size
  if off != len(payload):
    raise ValueError("payload size does not match the header")
  return ids, state
