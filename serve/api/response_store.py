"""Stored responses of /v1/responses (serve.api.responses): what `previous_response_id` continues from and
`GET /v1/responses/{id}` returns.

Each record belongs to one tenant (API key): another tenant's id is answered exactly as an unknown one. A
tenant keeps at most `max_per_tenant` records; past that its oldest is dropped (by creation). A record holds
the exact token ids its conversation's state has consumed (its prompt and the reply's kept tokens, 4 bytes
each), the conversation as messages (text), the instructions it was given and the response object.

With a directory (`--state_cache_dir`/responses), every record is also a file `<id>.json`, 0600 in a 0700
directory, written to a temporary name, fsynced and renamed into place before the reply is sent: a kill -9
right after a reply loses nothing. At start the files are loaded: only regular files named as records are
opened (never through a link, never a FIFO), each at most MAX_FILE_BYTES; a damaged one is skipped with a
log line, temporaries left by a crash are removed, and past the budget the oldest are removed.
"""

from __future__ import annotations

import array
import collections
import dataclasses
import json
import logging
import os
import re
import threading

from serve.files import atomic_write as _atomic_write
from serve.files import read_regular, remove_temporaries

log = logging.getLogger(__name__)

ID = re.compile(r"resp_[0-9a-f]{32}")
FILE = re.compile(r"(resp_[0-9a-f]{32})\.json")
MAX_FILE_BYTES = 64 << 20
FORMAT = 1
SUBDIR = "responses"  # under --state_cache_dir; the state cache opens only its own *.state files there


@dataclasses.dataclass
class Record:
  id: str
  tenant: str
  created_at: int
  ids: array.array  # int32: exactly the tokens the conversation's state has consumed after this response
  messages: list  # the conversation so far as {"role", "content"} messages, this response's reply last
  instructions: str | None  # this response's own instructions
  response: dict  # the response object as it was returned

  def to_json(self) -> bytes:
    return json.dumps(
      {
        "format": FORMAT,
        "id": self.id,
        "tenant": self.tenant,
        "created_at": self.created_at,
        "ids": self.ids.tolist(),
        "messages": self.messages,
        "instructions": self.instructions,
        "response": self.response,
      }
    ).encode()

  @classmethod
  def from_json(cls, raw: bytes) -> Record:
    """A record from its file's bytes; ValueError naming what is wrong."""
    try:
      d = json.loads(raw)
    except (ValueError, RecursionError) as e:
      raise ValueError(f"not JSON ({type(e).__name__})") from None
    if not isinstance(d, dict) or d.get("format") != FORMAT:
      raise ValueError(f"not a format-{FORMAT} record")
    ids, msgs = d.get("ids"), d.get("messages")
    ok = (
      isinstance(d.get("id"), str)
      and ID.fullmatch(d["id"])
      and isinstance(d.get("tenant"), str)
      and isinstance(d.get("created_at"), int)
      and isinstance(ids, list)
      and all(isinstance(t, int) and 0 <= t < 2**31 for t in ids)
      and isinstance(msgs, list)
      and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in msgs
      )
      and (d.get("instructions") is None or isinstance(d["instructions"], str))
      and isinstance(d.get("response"), dict)
    )
    if not ok:
      raise ValueError("a field is missing or of the wrong type")
    return cls(
      id=d["id"],
      tenant=d["tenant"],
      created_at=d["created_at"],
      ids=array.array("i", d["ids"]),
      messages=d["messages"],
      instructions=d["instructions"],
      response=d["response"],
    )


@dataclasses.dataclass
class StoreStats:
  """The store's counters since it opened (mutable: each put, drop and delete adds to them)."""

  stored: int = 0  # records put
  dropped: int = 0  # records dropped past --max_stored_responses (a tenant's oldest)
  deleted: int = 0  # records deleted by request
  loaded: int = 0  # records read from the directory at start (those within the budget)
  files_skipped: int = 0  # files in the directory that were no readable record
  files_not_written: int = 0  # records kept in memory only: their file could not be written


class ResponseStore:
  """Records by tenant, oldest first, at most `max_per_tenant` each; optionally persisted in `directory`.
  Thread-safe: records are written from executor threads and read on the event loop."""

  def __init__(self, max_per_tenant: int = 10_000, directory: str | None = None):
    if max_per_tenant < 1:
      raise ValueError(f"--max_stored_responses={max_per_tenant}: expected an integer >= 1.")
    self.max_per_tenant, self.dir = max_per_tenant, directory
    self.by_tenant: dict[str, collections.OrderedDict[str, Record]] = collections.defaultdict(
      collections.OrderedDict
    )
    self.stats = StoreStats()
    self._lock = threading.Lock()
    if directory:
      self._open_dir(directory)

  def __len__(self) -> int:
    with self._lock:
      return sum(len(d) for d in self.by_tenant.values())

  def get(self, tenant: str, rid) -> Record | None:
    """The tenant's record `rid`, or None (unknown, another tenant's, deleted, or dropped)."""
    if not isinstance(rid, str) or not ID.fullmatch(rid):
      return None
    with self._lock:
      mine = self.by_tenant.get(tenant)
      return None if mine is None else mine.get(rid)

  def put(self, rec: Record):
    """Keep `rec` (its file written first, when persisted), dropping the tenant's oldest past the budget.
    Blocking (a file write and fsync): call it off the event loop. A file that cannot be written is logged
    and the record kept in memory only."""
    if self.dir:
      try:
        _atomic_write(self._path(rec.id), rec.to_json())
      except OSError as e:
        log.warning("stored responses: cannot write %s (%s); kept in memory only", self._path(rec.id), e)
        self.stats.files_not_written += 1
    with self._lock:
      mine = self.by_tenant[rec.tenant]
      mine[rec.id] = rec
      self.stats.stored += 1
      dropped = []
      while len(mine) > self.max_per_tenant:
        dropped.append(mine.popitem(last=False)[1])
      self.stats.dropped += len(dropped)
    for old in dropped:
      self._remove_file(old.id)

  def delete(self, tenant: str, rid) -> bool:
    """Remove the tenant's record `rid` and its file; False if it has none of that id. Blocking."""
    if not isinstance(rid, str) or not ID.fullmatch(rid):
      return False
    with self._lock:
      mine = self.by_tenant.get(tenant)
      rec = None if mine is None else mine.pop(rid, None)
      if rec is None:
        return False
      self.stats.deleted += 1
    self._remove_file(rid)
    return True

  # ---- disk ----

  def _path(self, rid: str) -> str:
    assert self.dir is not None
    return os.path.join(self.dir, rid + ".json")

  def _remove_file(self, rid: str):
    if not self.dir:
      return
    try:
      os.unlink(self._path(rid))
    except FileNotFoundError:
      pass
    except OSError as e:
      log.warning("stored responses: cannot remove %s (%s)", self._path(rid), e)

  def _open_dir(self, directory: str):
    try:
      os.makedirs(directory, mode=0o700, exist_ok=True)
      os.chmod(directory, 0o700)  # the records hold conversations
      remove_temporaries(directory, "stored responses")
      names = os.listdir(directory)
    except OSError as e:
      raise ValueError(
        f"{directory} is not a writable directory for stored responses ({e}). Pass a "
        "--state_cache_dir this process can create and write."
      ) from None
    records = []
    for name in names:
      path = os.path.join(directory, name)
      m = FILE.fullmatch(name)
      if m is None:
        continue
      try:
        rec = Record.from_json(read_regular(path, MAX_FILE_BYTES, "a stored response"))
        if rec.id != m.group(1):
          raise ValueError(f"it holds {rec.id}, not {m.group(1)}")
      except (OSError, ValueError) as e:
        log.warning("stored responses: skipping %s (%s)", path, e)
        self.stats.files_skipped += 1
        continue
      records.append(rec)
    records.sort(key=lambda r: (r.created_at, r.id))  # oldest first, as they were stored
    for rec in records:
      self.by_tenant[rec.tenant][rec.id] = rec
    over = []
    for mine in self.by_tenant.values():
      while len(mine) > self.max_per_tenant:
        over.append(mine.popitem(last=False)[1])
    for rec in over:
      self._remove_file(rec.id)
    self.stats.loaded = len(records) - len(over)
    log.info(
      "stored responses: %d loaded from %s, %d over --max_stored_responses removed, %d skipped",
      self.stats.loaded,
      directory,
      len(over),
      self.stats.files_skipped,
    )
