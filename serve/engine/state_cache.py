"""A host-memory cache of whole-context model states, keyed by tenant, cache salt, exact token ids and model.

A Laplace sequence's context is its fixed-size state, so a cached state of tokens[:n] lets a new request
whose prompt starts with those n tokens skip prefilling them. Every entry belongs to one scope: the
tenant (API key) that produced it and the request's optional `cache_salt` (vLLM's answer to
CVE-2025-46570). Entries are found through a hash chain over BLOCK-token blocks of the ids, seeded with the
model's identity and the scope, then confirmed against the stored scope and ids themselves: a state is
only ever restored for the scope that produced it, and a hash collision can never select one. Eviction is
LRU by bytes.

With a directory, every entry is also a file (header + arrays + SHA-256), written 0600 in a 0700 directory
by a background thread to a temporary name and renamed into place. The directory is not trusted: at start
only regular files are opened (never through a symlink, never a FIFO), each is checked against the model,
the state layout the engine expects and its checksum, and a bad one is skipped with a log line; files past
the byte budget and temporaries left by a crash are removed.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import os
import queue
import stat
import threading
import time
from collections.abc import Sequence

import jax
import numpy as np

from laplace_jax import model as laplace_model
from laplace_jax.model.config import LAYOUT_NEUTRAL
from serve.files import TMP, read_regular, remove_temporaries
from serve.files import atomic_write as _atomic_write  # (a module name: tests slow the disk down)

log = logging.getLogger(__name__)

BLOCK = 64  # tokens per hash-chain block
PREFIX_STATES = 2  # cached prefixes a newly stored state keeps (StateCache's bound per conversation)
MAX_PENDING_WRITES = 64  # files queued for the writer; past it new entries stay in memory only
MAGIC = b"LPLSTATE1\n"
MARKER = "laplace-state-cache.json"
MAX_HEADER = 1 << 16


def model_identity(cfg, params, extra: str = "") -> str:
  """A SHA-256 over the config and every byte of every parameter leaf (with its path, shape and dtype).

  Leaves are copied to the host and hashed by a few threads (hashlib releases the GIL), one at a time
  per thread, so host memory holds a few leaves, never the whole model."""
  leaves = jax.tree_util.tree_leaves_with_path(params)

  def digest(leaf):
    return hashlib.sha256(np.ascontiguousarray(np.asarray(leaf)).view(np.uint8).reshape(-1)).digest()

  with concurrent.futures.ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
    digests = list(pool.map(digest, [leaf for _, leaf in leaves]))
  # The config's repr without its layout-neutral fields (scan_layers: the same states under either value).
  fields = ", ".join(
    f"{f.name}={getattr(cfg, f.name)!r}" for f in dataclasses.fields(cfg) if f.name not in LAYOUT_NEUTRAL
  )
  h = hashlib.sha256(f"{type(cfg).__qualname__}({fields})".encode() + extra.encode())
  for (path, leaf), d in zip(leaves, digests):
    h.update(f"{jax.tree_util.keystr(path)}{leaf.shape}{leaf.dtype}".encode() + d)
  return h.hexdigest()[:32]


def layout_for(cfg, model=None) -> dict:
  """{name: (dtype, shape)} of one sequence's decode state in its stored form (DecodeState.to_dict's keys):
  every leaf of init_state's (GLA states, conv windows, sliding-window rings, pos), without its sequence axis
  (`DecodeState.batch_axes`)."""
  if model is None:
    model = laplace_model
  return layout_of(jax.eval_shape(lambda: model.init_state(cfg, 1)))


def layout_of(state) -> dict:
  """`layout_for` of a given (abstract) DecodeState: the layout of its leaves without their sequence axis."""
  shapes, axes = state.to_dict(), state.batch_axes().to_dict()
  return {
    k: (str(a.dtype), tuple(n for i, n in enumerate(a.shape) if i != axes[k])) for k, a in shapes.items()
  }


def scope_of(tenant: str = "", salt: str | None = None) -> str:
  """The cache scope of a request: '' for the anonymous tenant without a salt, else a digest of both (the
  salt itself is never stored)."""
  if not tenant and salt is None:
    return ""
  return hashlib.sha256(json.dumps([tenant, salt]).encode()).hexdigest()[:32]


def _ids_bytes(ids) -> bytes:
  return np.asarray(ids, np.int32).tobytes()


@dataclasses.dataclass(frozen=True)
class TenantStats:
  """One tenant's counters of its lookups (a snapshot: the cache replaces it as it counts)."""

  hits: int = 0  # lookups that found a cached prefix
  misses: int = 0  # lookups that found none
  tokens_reused: int = 0  # prompt tokens restored from the cache, not prefilled


@dataclasses.dataclass(frozen=True)
class CacheStats:
  """The whole cache's counters since it started (a snapshot: the cache replaces it as it counts)."""

  hits: int = 0  # lookups that found a cached prefix
  misses: int = 0  # lookups that found none
  evictions: int = (
    0  # states dropped for the byte budget (or, once the engine's layout is known, for another)
  )
  superseded: int = 0  # states dropped as a conversation stored newer ones (StateCache's prefix_states)
  tokens_reused: int = 0  # prompt tokens restored from the cache, not prefilled
  stored: int = 0  # states put since start (those loaded from the directory not counted)
  files_written: int = 0  # state files written to the directory
  files_skipped: int = 0  # files in the directory at start that were not loaded (not regular, bad, foreign)
  files_not_written: int = 0  # states kept in memory only: too many writes were queued
  files_removed: int = 0  # files removed at start, past the byte budget


def _added(record, by: dict[str, int]):
  """The record with each named counter increased by its amount."""
  return dataclasses.replace(record, **{k: getattr(record, k) + n for k, n in by.items()})


@dataclasses.dataclass
class Entry:
  ids: np.ndarray  # int32 [n]: exactly the tokens the state has consumed
  state: dict  # DecodeState.to_dict's form {"gla": [L, ...], "conv": [L, ...], ...} numpy, one sequence
  key: str  # hash of (model, scope, ids): the file name on disk
  scope: str = ""  # scope_of(tenant, salt) of the requests that may restore it
  parent: str | None = None  # key of the longest cached prefix of ids in the scope when it was stored

  @property
  def nbytes(self) -> int:
    return sum(a.nbytes for a in self.state.values())


class StateCache:
  """LRU by bytes of `Entry`s, looked up by longest cached prefix within a scope. Thread-safe.

  A conversation keeps a bounded number of states: when a state is stored, its cached prefixes in the scope
  beyond the `prefix_states` longest are dropped, with the states that branched off them and are not
  prefixes of the new one (an earlier turn's reply its client re-sent as other ids). So a chain of turns
  holds the newest state, `prefix_states` prefixes of it and the branches off those (the last replies).

  `layout` ({name: (dtype str, shape)}, one sequence's state) is what the engine restores; states and
  files of another layout are refused. The engine sets it (`check_layout`) when the caller did not."""

  def __init__(
    self,
    model_id: str,
    budget_bytes: int,
    directory: str | None = None,
    layout: dict | None = None,
    prefix_states: int = PREFIX_STATES,
  ):
    if budget_bytes < 0:
      raise ValueError(f"--state_cache_gb gives {budget_bytes} bytes: expected >= 0 (0 disables the cache).")
    self.model_id, self.budget = model_id, int(budget_bytes)
    self.prefix_states = prefix_states
    self.children: dict[str, set[str]] = collections.defaultdict(set)  # Entry.parent's inverse
    self.layout = None if layout is None else _norm_layout(layout)
    self.entries: collections.OrderedDict[str, Entry] = collections.OrderedDict()  # oldest first
    self.by_block: dict[bytes, set[str]] = collections.defaultdict(set)  # chain hash of floor(n/BLOCK) blocks
    self.bytes = 0
    self.stats = CacheStats()  # replaced, never changed in place: a reader holds a consistent snapshot
    self.tenant_stats: dict[str, TenantStats] = {}  # per tenant that looked up a prompt, as stats
    self._lock = threading.Lock()
    self._count_lock = threading.Lock()  # the writer thread counts too
    self.dir = directory
    self._writes: queue.Queue | None = None
    if directory:
      self._open_dir(directory)

  def _count(self, tenant: str | None = None, **by: int):
    """Add to the counters named (CacheStats' fields), and to the tenant's when given."""
    with self._count_lock:
      self.stats = _added(self.stats, by)
      if tenant is not None:
        self.tenant_stats[tenant] = _added(self.tenant_stats.get(tenant, TenantStats()), by)

  # ---- keys ----

  def _chain(self, ids: np.ndarray, n_blocks: int, scope: str) -> list[bytes]:
    """h_0 = H(model, scope), h_{j+1} = H(h_j || block j): one hash per block boundary, n_blocks + 1 in all."""
    out = [hashlib.sha256(f"{self.model_id}|{scope}".encode()).digest()]
    for j in range(n_blocks):
      out.append(hashlib.sha256(out[-1] + ids[j * BLOCK : (j + 1) * BLOCK].tobytes()).digest())
    return out

  def _key(self, ids: np.ndarray, scope: str) -> str:
    return hashlib.sha256(f"{self.model_id}|{scope}|".encode() + ids.tobytes()).hexdigest()

  # ---- lookup / insert ----

  def lookup(
    self, prompt_ids: Sequence[int], max_len: int, *, tenant: str = "", salt: str | None = None
  ) -> tuple[int, dict | None]:
    """The longest prefix of prompt_ids no longer than max_len cached in the scope (tenant, salt):
    (n, state) or (0, None)."""
    scope = scope_of(tenant, salt)
    ids = np.asarray(prompt_ids, np.int32)
    max_len = min(max_len, len(ids))
    chain = self._chain(ids, max_len // BLOCK, scope)
    with self._lock:
      found = self._prefixes(ids, scope, chain, max_len)
      if found:
        best = found[0]
        self.entries.move_to_end(best.key)
        self._count(tenant, hits=1, tokens_reused=len(best.ids))
        return len(best.ids), best.state
      self._count(tenant, misses=1)
    return 0, None

  def put(
    self, ids: Sequence[int], state: dict, *, tenant: str = "", salt: str | None = None, write: bool = True
  ) -> bool:
    """Keep `state` as the state after exactly `ids` in the scope (tenant, salt); False if it cannot fit
    the budget at all."""
    return self._put(ids, state, scope_of(tenant, salt), write)

  def _put(self, ids, state: dict, scope: str, write: bool) -> bool:
    ids = np.asarray(ids, np.int32)
    e = Entry(ids=ids, state=state, key=self._key(ids, scope), scope=scope)
    if e.nbytes > self.budget or len(ids) == 0:
      return False
    if self.layout is not None and _layout_of(state) != self.layout:
      raise ValueError(f"a state of layout {_layout_of(state)} in a cache of layout {self.layout}")
    chain = self._chain(ids, len(ids) // BLOCK, scope)
    with self._lock:
      if e.key in self.entries:
        self.entries.move_to_end(e.key)
        return True
      prefixes = self._prefixes(ids, scope, chain, len(ids) - 1)
      evicted = self._supersede(prefixes, e)
      e.parent = prefixes[0].key if prefixes else None
      if e.parent is not None:
        self.children[e.parent].add(e.key)
      self.entries[e.key] = e
      self.by_block[chain[-1]].add(e.key)
      self.bytes += e.nbytes
      self._count(stored=1)
      while self.bytes > self.budget:
        old = self.entries.popitem(last=False)[1]
        self._unindex(old)
        self._count(evictions=1)
        evicted.append(old)
    if self._writes is not None:
      for old in evicted:
        self._writes.put(("delete", old))
      if write:
        if self._writes.qsize() < MAX_PENDING_WRITES:  # a slow disk must not hold evicted states in memory
          self._writes.put(("write", e))
        else:
          self._count(files_not_written=1)
    return True

  def _prefixes(self, ids: np.ndarray, scope: str, chain: list[bytes], max_len: int) -> list[Entry]:
    """The scope's cached states whose ids are a prefix of `ids` no longer than max_len, longest first
    (under the lock; `chain`: `_chain` of ids over at least max_len // BLOCK blocks)."""
    out = []
    for h in chain[: max_len // BLOCK + 1]:
      for key in self.by_block.get(h, ()):
        e = self.entries[key]
        n = len(e.ids)
        if e.scope == scope and n <= max_len and np.array_equal(e.ids, ids[:n]):
          out.append(e)
    return sorted(out, key=lambda e: -len(e.ids))

  def _supersede(self, prefixes: list[Entry], new: Entry) -> list[Entry]:
    """Drop the prefixes of `new` past the `prefix_states` longest, and every state that grew from them
    and is not one of the kept prefixes (under the lock); returns the dropped entries."""
    keep = {e.key for e in prefixes[: self.prefix_states]}
    todo = [e.key for e in prefixes[self.prefix_states :]]
    dropped = []
    while todo:
      key = todo.pop()
      if key in keep or key not in self.entries:
        continue
      todo += self.children.get(key, ())
      e = self.entries.pop(key)
      self._unindex(e)
      self._count(superseded=1)
      dropped.append(e)
    return dropped

  def _unindex(self, e: Entry):
    """Forget an entry that left self.entries: its hash-chain slot, its bytes and its place among parents
    and children (its children now hang from its parent). Under the lock."""
    h = self._chain(e.ids, len(e.ids) // BLOCK, e.scope)[-1]
    self.by_block[h].discard(e.key)
    if not self.by_block[h]:
      del self.by_block[h]
    self.bytes -= e.nbytes
    kids = self.children.pop(e.key, set())
    if e.parent is not None:
      siblings = self.children.get(e.parent)
      if siblings is not None:
        siblings.discard(e.key)
        if not siblings:
          del self.children[e.parent]
    for k in kids:
      child = self.entries.get(k)
      if child is not None:
        child.parent = e.parent
        if e.parent is not None:
          self.children[e.parent].add(k)

  def check_layout(self, layout: dict):
    """The engine's state layout: set it, or refuse a cache built for another one. Entries of another
    layout (loaded before it was known) are dropped."""
    layout = _norm_layout(layout)
    if self.layout is not None:
      if self.layout != layout:
        raise ValueError(f"the state cache was built for states {self.layout}, the engine's are {layout}")
      return
    self.layout = layout
    with self._lock:
      bad = [e for e in self.entries.values() if _layout_of(e.state) != layout]
      for e in bad:
        log.warning(
          "state cache: dropping a state of layout %s (the engine's is %s)", _layout_of(e.state), layout
        )
        del self.entries[e.key]
        self._unindex(e)
        self._count(evictions=1)

  def __len__(self):
    return len(self.entries)

  # ---- disk ----

  def _open_dir(self, directory: str):
    marker = os.path.join(directory, MARKER)
    try:
      os.makedirs(directory, mode=0o700, exist_ok=True)
      names = os.listdir(directory)
      if names and MARKER not in names:
        raise ValueError(
          f"--state_cache_dir={directory} holds {len(names)} other files and no {MARKER}: it "
          "is not a state cache. Pass an empty or new directory."
        )
      os.chmod(directory, 0o700)  # the files hold prompts' token ids
      if MARKER in names:
        try:
          owner = json.loads(read_regular(marker, MAX_HEADER, "a marker")).get("model_id")
        except (ValueError, AttributeError) as e:
          raise ValueError(
            f"--state_cache_dir={directory}: {MARKER} is damaged ({e}). Remove the directory "
            "(it only holds cached states) or pass another one."
          ) from None
        if owner != self.model_id:
          raise ValueError(
            f"--state_cache_dir={directory} holds states of another model ({owner}, this one "
            f"is {self.model_id}). Use one directory per model."
          )
      else:
        _atomic_write(marker, json.dumps({"model_id": self.model_id, "format": 1}).encode())
      remove_temporaries(directory, "state cache")
      probe = os.path.join(directory, ".write-probe")
      _atomic_write(probe, b"ok")
      os.remove(probe)
    except OSError as e:
      raise ValueError(
        f"--state_cache_dir={directory} is not a writable directory ({e}). Pass a directory "
        "this process can create and write."
      ) from None
    self._load_dir(directory)
    self._writes = queue.Queue()
    threading.Thread(target=self._writer, name="state-cache-writer", daemon=True).start()

  def _load_dir(self, directory: str):
    """Newest files first while they fit the budget; the rest are removed. Only regular files named
    *.state are opened; anything else (links, FIFOs, directories) is skipped unopened."""
    files = []
    for name in os.listdir(directory):
      if not name.endswith(".state") or TMP in name:
        continue
      path = os.path.join(directory, name)
      try:
        st = os.lstat(path)
      except OSError:
        continue
      if not stat.S_ISREG(st.st_mode):
        log.warning("state cache: skipping %s (not a regular file)", path)
        self._count(files_skipped=1)
        continue
      files.append((st.st_mtime, path))
    files.sort(reverse=True)  # newest first: they end up most recently used
    loaded, total, over = [], 0, []
    for _, path in files:
      if total >= self.budget:
        over.append(path)
        continue
      try:
        ids, state, scope = read_entry(path, self.model_id, self.layout)
      except (OSError, ValueError) as e:
        log.warning("state cache: skipping %s (%s)", path, e)
        self._count(files_skipped=1)
        continue
      size = sum(a.nbytes for a in state.values())
      if total + size > self.budget:
        over.append(path)
        continue
      total += size
      loaded.append((ids, state, scope))
    for ids, state, scope in reversed(loaded):
      self._put(ids, state, scope, write=False)
    for path in over:  # past the budget at start: the oldest go, as LRU eviction would have removed them
      try:
        os.unlink(path)
        self._count(files_removed=1)
      except OSError as e:
        log.warning("state cache: cannot remove %s (%s)", path, e)
    self.stats = dataclasses.replace(self.stats, stored=0)  # (the loaded states are not new)
    log.info(
      "state cache: %d states (%.1f MB) loaded from %s, %d over the budget removed",
      len(self),
      self.bytes / 1e6,
      directory,
      len(over),
    )

  def _writer(self):
    while True:
      op, e = self._writes.get()
      path = os.path.join(self.dir, e.key + ".state")
      try:
        if op == "write":
          _atomic_write(path, encode_entry(e.ids, e.state, self.model_id, e.scope))
          self._count(files_written=1)
        elif os.path.lexists(path):
          os.remove(path)
      except OSError as err:
        log.warning("state cache: %s of %s failed (%s)", op, path, err)
      finally:
        self._writes.task_done()

  def flush(self, timeout: float | None = None) -> bool:
    """Wait for every queued file write (tests, shutdown); False if some are still pending at `timeout`."""
    if self._writes is None:
      return True
    if timeout is None:
      self._writes.join()
      return True
    deadline = time.monotonic() + timeout
    with self._writes.all_tasks_done:
      while self._writes.unfinished_tasks:
        left = deadline - time.monotonic()
        if left <= 0:
          return False
        self._writes.all_tasks_done.wait(left)
    return True


def _norm_layout(layout: dict) -> dict:
  return {str(k): (str(np.dtype(d)), tuple(int(x) for x in s)) for k, (d, s) in layout.items()}


def _layout_of(state: dict) -> dict:
  return {str(k): (str(a.dtype), tuple(a.shape)) for k, a in state.items()}


def encode_entry(ids: np.ndarray, state: dict, model_id: str, scope: str = "") -> bytes:
  """MAGIC, a JSON header line (model, scope, arrays' names/dtypes/shapes, SHA-256 of the payload), the payload."""
  names = sorted(state)
  payload = _ids_bytes(ids) + b"".join(np.ascontiguousarray(state[n]).tobytes() for n in names)
  header = {
    "model_id": model_id,
    "scope": scope,
    "n_ids": int(len(ids)),
    "sha256": hashlib.sha256(payload).hexdigest(),
    "arrays": [[n, str(state[n].dtype), list(state[n].shape)] for n in names],
  }
  return MAGIC + json.dumps(header).encode() + b"\n" + payload


def _max_file_bytes(layout: dict | None) -> int:
  if layout is None:
    return 1 << 40
  state = sum(int(np.prod(s)) * np.dtype(d).itemsize for d, s in layout.values())
  return len(MAGIC) + MAX_HEADER + 4 * (1 << 24) + state  # ids: up to 16M tokens


def read_entry(path: str, model_id: str, layout: dict | None = None) -> tuple[np.ndarray, dict, str]:
  """(ids, state, scope) from a file; ValueError if it is damaged, belongs to another model or holds a
  state of another layout than `layout`; OSError if it cannot be opened as a regular file."""
  raw = read_regular(path, _max_file_bytes(layout), "a state of this model")
  if not raw.startswith(MAGIC):
    raise ValueError("not a state file")
  end = raw.find(b"\n", len(MAGIC), len(MAGIC) + MAX_HEADER)
  try:
    header = json.loads(raw[len(MAGIC) : end]) if end > 0 else None
  except ValueError:
    header = None
  if not isinstance(header, dict):
    raise ValueError("damaged header")
  if header.get("model_id") != model_id:
    raise ValueError(f"state of another model ({str(header.get('model_id'))[:40]})")
  payload = raw[end + 1 :]
  if hashlib.sha256(payload).hexdigest() != header.get("sha256"):
    raise ValueError("checksum mismatch (damaged or truncated)")
  n, scope, arrays = header.get("n_ids"), header.get("scope", ""), header.get("arrays")
  try:
    if not isinstance(n, int) or n < 1 or not isinstance(scope, str) or not isinstance(arrays, list):
      raise TypeError
    spec = {str(name): (str(np.dtype(dt)), tuple(int(x) for x in shape)) for name, dt, shape in arrays}
    if (
      len(spec) != len(arrays)
      or any(x < 0 for _, s in spec.values() for x in s)
      or any(np.dtype(d).kind not in "fiu" for d, _ in spec.values())
    ):
      raise TypeError
  except (TypeError, ValueError):
    raise ValueError("damaged header (arrays)") from None
  if layout is not None and spec != _norm_layout(layout):
    raise ValueError(f"a state of layout {spec}, not this engine's {_norm_layout(layout)}")
  ids = np.frombuffer(payload[: 4 * n], np.int32).copy()
  state, off = {}, 4 * n
  for name, (dtype, shape) in spec.items():
    size = int(np.prod(shape)) * np.dtype(dtype).itemsize
    if off + size > len(payload):
      raise ValueError("payload size does not match the header")
    state[name] = np.frombuffer(payload[off : off + size], dtype).reshape(shape).copy()
    off += size
  if off != len(payload) or len(ids) != n:
    raise ValueError("payload size does not match the header")
  return ids, state, scope
