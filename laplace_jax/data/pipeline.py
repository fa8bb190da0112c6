"""grain input pipeline over the token shards that `python -m train.prepare` writes.

A prepared data directory holds:
  manifest.json               tokenizer, vocab size, EOS id, token dtype, per-split counts and shards,
                              sha256 of every source
  train-00000.array_record …  one record per document: its token ids as little-endian `dtype`, no EOS
  val-00000.array_record …    the held-out split (documents chosen by a hash of their text)

API (the trainer's side):
  make_train_iterator(data_dir, *, seq_len, global_batch_size, seed=0, process_index=None,
                      process_count=None, split="train", prefetch=2, vocab_size=None,
                      contiguous=False, segment_ids=False) -> TrainIterator
      endless; next() -> Batch(inputs: int32 [B_local, T], targets: int32 [B_local, T]) with
      B_local = global_batch_size // process_count, and with segment_ids=True segment_ids: int32
      [B_local, T], the document of each input (below). `.get_state()` / `.set_state(state)` take JSON-able
      dicts (it is a grain DatasetIterator, so grain's and Orbax's checkpoint handlers accept it);
      `.last_wait_s` is how long the last next() blocked: the "input wait" to log. Use it as a
      context manager or call `.close()` to stop its prefetch thread (it is also stopped at exit).
  make_eval_batches(data_dir, *, seq_len, global_batch_size, process_index=None, process_count=None,
                    split="val", max_batches=None, vocab_size=None, segment_ids=False)
      -> list of the same Batches
      the held-out split in stored order, EOS-joined and packed into full global batches; identical on
      every call and for any process count, so build it once and reuse it.
  load_manifest(data_dir) -> dict;  check_vocab(manifest, vocab_size)

Packing. A global batch has B = global_batch_size rows. The document stream, shuffled by `seed` and
repeated endlessly with a fresh permutation each epoch (grain's `shuffle` + `repeat`), is dealt
round-robin to the rows: row r gets stream documents r, r+B, r+2B, … It concatenates them, each followed
by EOS, and cuts that into consecutive (seq_len+1)-token examples x; inputs = x[:-1], targets = x[1:].
Process p builds only rows [p·B_local, (p+1)·B_local), so processes read disjoint documents and the global
batch does not depend on the process count (1 process × 8 devices sees what 2 × 4 see). The iterator
state is, per row, the index of its current document and the offset inside it.

`contiguous=True` (state passing): consecutive examples of a row overlap by one token, x_n = s[nT : nT+T+1],
so each step's inputs continue exactly where the row's previous inputs stopped (the last target of one step
is the first input of the next) and a state carried across steps has read every token before.

Segment ids (packed rows computed per document: laplace_jax/ops/segments.py). The EOS between two documents is
the first input of the one that follows (its beginning-of-sequence token), so an input's id is the index of
the document it belongs to in its row's stream, counting that EOS as the next document's: every target is
then predicted from its own document only, and no loss position needs masking. Ids increase along a row and
across its examples (a document cut by an example boundary keeps its id on both sides).
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import time
import weakref
from typing import Any

import grain
import numpy as np

from laplace_jax.data.batch import Batch

MANIFEST_NAME = "manifest.json"
FORMAT = "laplace-jax/token-shards/v1"
SPLITS = ("train", "val")


def token_dtype(vocab_size: int) -> str:
  """Storage dtype of token ids: uint16 covers GPT-2's 50,257 ids; larger vocabularies use uint32."""
  return "uint16" if vocab_size <= 2**16 else "uint32"


def shard_name(split: str, index: int) -> str:
  return f"{split}-{index:05d}.array_record"


# ---- manifest ------------------------------------------------------------------------------------


def load_manifest(data_dir) -> dict[str, Any]:
  """The manifest of a prepared data directory, checked for format and shard files."""
  data_dir = os.fspath(data_dir)
  path = os.path.join(data_dir, MANIFEST_NAME)
  if not os.path.isfile(path):
    raise FileNotFoundError(
      f"no {MANIFEST_NAME} in {data_dir!r}: not a prepared data directory. Create one with "
      f"`python -m train.prepare --output {data_dir} [FILES…]` (no files: the built-in KJV corpus)."
    )
  try:
    with open(path) as f:
      manifest = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise ValueError(
      f"{path} is unreadable or not JSON ({e}); re-run `python -m train.prepare "
      f"--output {data_dir} --overwrite`"
    ) from e
  if manifest.get("format") != FORMAT:
    raise ValueError(
      f"{path} has format {manifest.get('format')!r}, expected {FORMAT!r}; re-run "
      f"`python -m train.prepare --output {data_dir} --overwrite` with this version"
    )
  return manifest


def check_vocab(manifest: dict[str, Any], vocab_size: int) -> None:
  """Raise if a model with `vocab_size` rows cannot embed every token id the data may contain."""
  need = int(manifest["vocab_size"])
  max_id = int(manifest.get("max_token_id", need - 1))
  if vocab_size < max(need, max_id + 1):
    raise ValueError(
      f"model vocab_size={vocab_size} is smaller than the data's: tokenizer {manifest['tokenizer']!r} "
      f"has {need} ids and the shards hold ids up to {max_id}. Use a model with vocab_size >= "
      f"{max(need, max_id + 1)} (the presets use 50,304 = GPT-2 padded to a multiple of 64), or "
      "prepare the data with the model's tokenizer."
    )


def _resolve_processes(process_index, process_count, global_batch_size) -> tuple[int, int]:
  """(process_index, process_count), defaulting to JAX's, checked against the batch size."""
  if process_index is None or process_count is None:
    import jax  # only here: the pipeline itself (and its grain worker processes) runs without JAX

    process_index = jax.process_index() if process_index is None else process_index
    process_count = jax.process_count() if process_count is None else process_count
  if not 0 <= process_index < process_count:
    raise ValueError(f"process_index={process_index} is outside [0, process_count={process_count})")
  if global_batch_size <= 0 or global_batch_size % process_count:
    raise ValueError(
      f"global_batch_size={global_batch_size} must be a positive multiple of "
      f"process_count={process_count}; each process feeds an equal share of the rows"
    )
  return int(process_index), int(process_count)


def split_documents(data_dir, manifest, split: str) -> grain.MapDataset:
  """The split's documents as a grain MapDataset of token arrays (stored dtype, no EOS)."""
  data_dir = os.fspath(data_dir)
  splits = manifest["splits"]
  if split not in splits:
    raise ValueError(f"split {split!r} is not in {data_dir!r}; it has {sorted(splits)}")
  info = splits[split]
  if info["documents"] == 0:
    raise ValueError(
      f"split {split!r} of {data_dir!r} has no documents. Re-run `python -m train.prepare` with more "
      "text" + (" or a larger --val_fraction" if split == "val" else " or a smaller --val_fraction")
    )
  paths = [os.path.join(data_dir, s["path"]) for s in info["shards"]]
  missing = [p for p in paths if not os.path.isfile(p)]
  if missing:
    raise FileNotFoundError(
      f"shards listed in {MANIFEST_NAME} are missing: {missing[:3]}; the data "
      "directory is incomplete, re-run `python -m train.prepare --overwrite`"
    )
  source = grain.sources.ArrayRecordDataSource(paths)
  if len(source) != info["documents"]:
    raise ValueError(
      f"the {split!r} shards of {data_dir!r} hold {len(source)} records but the manifest "
      f"says {info['documents']}; re-run `python -m train.prepare --overwrite`"
    )
  decode = functools.partial(np.frombuffer, dtype=np.dtype(manifest["dtype"]).newbyteorder("<"))
  return grain.MapDataset.source(source).map(decode)


# ---- training stream -----------------------------------------------------------------------------


class _PackedRows(grain.DatasetIterator):
  """B_local rows, each packing its own document stream into (seq_len+1)-token examples."""

  def __init__(
    self,
    rows: list[grain.MapDataset],
    seq_len: int,
    eos_id: int,
    layout: dict,
    contiguous: bool = False,
    segment_ids: bool = False,
  ):
    super().__init__()
    self._rows, self._width, self._eos, self._layout = rows, seq_len + 1, eos_id, layout
    self._contiguous, self._segment_ids = contiguous, segment_ids
    self._pos = [[0, 0] for _ in rows]  # per row: [document index within the row, offset in doc+EOS]
    self._cache: list[tuple[int, np.ndarray] | None] = [None] * len(rows)

  def _doc(self, r: int, k: int) -> np.ndarray:
    """Row r's k-th document followed by EOS (the current one is cached)."""
    cached = self._cache[r]
    if cached is None or cached[0] != k:
      tokens = self._rows[r][k]
      cached = (k, np.concatenate([tokens.astype(np.int32), np.array([self._eos], np.int32)]))
      self._cache[r] = cached
    return cached[1]

  def __next__(self) -> Batch:
    examples = np.empty((len(self._rows), self._width), np.int32)  # [B, T + 1]: inputs, then the last target
    example_ids = np.empty_like(examples) if self._segment_ids else None  # [B, T + 1]: their documents
    for r, pos in enumerate(self._pos):
      filled = 0
      while filled < self._width:
        doc = self._doc(r, pos[0])
        take = min(len(doc) - pos[1], self._width - filled)
        examples[r, filled : filled + take] = doc[pos[1] : pos[1] + take]
        if example_ids is not None:
          example_ids[r, filled : filled + take] = pos[0]
          if pos[1] + take == len(doc):  # its closing EOS opens the next document
            example_ids[r, filled + take - 1] = pos[0] + 1
        filled += take
        pos[1] += take
        if pos[1] == len(doc):
          pos[0], pos[1] = pos[0] + 1, 0
      if self._contiguous:  # step back one token: this example's last token starts the next one
        if pos[1] > 0:
          pos[1] -= 1
        else:
          pos[0], pos[1] = pos[0] - 1, len(self._doc(r, pos[0] - 1)) - 1
    return Batch(
      inputs=np.ascontiguousarray(examples[:, :-1]),
      targets=np.ascontiguousarray(examples[:, 1:]),
      segment_ids=None if example_ids is None else np.ascontiguousarray(example_ids[:, :-1]),
    )

  def get_state(self) -> dict[str, Any]:
    return {"layout": dict(self._layout), "rows": [list(p) for p in self._pos]}

  def set_state(self, state: dict[str, Any]) -> None:
    saved = state.get("layout", {})
    diff = {
      k: (saved.get(k), self._layout.get(k))
      for k in set(saved) | set(self._layout)
      if saved.get(k) != self._layout.get(k)
    }
    if diff or len(state.get("rows", ())) != len(self._rows):
      raise ValueError(
        f"data iterator state does not fit this pipeline: (saved, now) differ in {diff}. Restore with "
        "the same data, seed, seq_len, global_batch_size and process layout, or start a fresh stream."
      )
    self._pos = [[int(k), int(o)] for k, o in state["rows"]]
    self._cache = [None] * len(self._rows)


class _ThreadPrefetch(grain.experimental.ThreadPrefetchDatasetIterator):
  """grain's thread prefetch, made idempotent on close (its close fails during interpreter teardown)."""

  def close(self) -> None:
    if not self._closed:
      super().close()


_LIVE_ITERATORS: weakref.WeakSet[TrainIterator] = weakref.WeakSet()


@atexit.register
def _close_live_iterators() -> None:
  # A prefetch thread still reading shards while the interpreter finalises aborts the process
  # ("terminate called without an active exception"); stop them first.
  for it in list(_LIVE_ITERATORS):
    it.close()


class TrainIterator(grain.DatasetIterator):
  """The training batches; records how long each next() waited (`last_wait_s`, `total_wait_s`).

  Closes its prefetch thread on `close()`, at the end of a `with` block, or at interpreter exit.
  """

  def __init__(self, parent: grain.DatasetIterator):
    super().__init__(parent)
    self.last_wait_s = 0.0
    self.total_wait_s = 0.0
    _LIVE_ITERATORS.add(self)

  def __enter__(self) -> TrainIterator:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def __next__(self) -> Batch:
    t0 = time.perf_counter()
    batch = next(self._parent)
    self.last_wait_s = time.perf_counter() - t0
    self.total_wait_s += self.last_wait_s
    return batch

  def get_state(self) -> dict[str, Any]:
    return self._parent.get_state()

  def set_state(self, state: dict[str, Any]) -> None:
    self._parent.set_state(state)


def make_train_iterator(
  data_dir,
  *,
  seq_len: int,
  global_batch_size: int,
  seed: int = 0,
  process_index: int | None = None,
  process_count: int | None = None,
  split: str = "train",
  prefetch: int = 2,
  vocab_size: int | None = None,
  contiguous: bool = False,
  segment_ids: bool = False,
) -> TrainIterator:
  """This process's endless stream of packed batches (see the module docstring); `prefetch` batches
  are built ahead on a background thread (0: build on demand); `contiguous`: rows continue across steps;
  `segment_ids`: each batch also holds its inputs' document ids (the stream itself is the same)."""
  if seq_len <= 0:
    raise ValueError(f"seq_len={seq_len} must be a positive number of tokens")
  if not 0 <= seed < 2**32:
    raise ValueError(f"seed={seed} must be in [0, 2**32): grain's shuffle takes a 32-bit seed")
  if prefetch < 0:
    raise ValueError(f"prefetch={prefetch} must be >= 0 batches (0 disables the background thread)")
  p, n = _resolve_processes(process_index, process_count, global_batch_size)
  manifest = load_manifest(data_dir)
  if vocab_size is not None:
    check_vocab(manifest, vocab_size)
  docs = split_documents(data_dir, manifest, split)
  stream = docs.shuffle(seed=seed).repeat()  # a new permutation every epoch
  b_local = global_batch_size // n
  rows = [stream[r::global_batch_size] for r in range(p * b_local, (p + 1) * b_local)]
  layout = {
    "split": split,
    "documents": len(docs),
    "seed": seed,
    "seq_len": seq_len,
    "global_batch_size": global_batch_size,
    "process_index": p,
    "process_count": n,
  }
  if contiguous:  # a layout key only when set, so states saved before the option still restore
    layout["contiguous"] = True
  packed = _PackedRows(rows, seq_len, int(manifest["eos_id"]), layout, contiguous, segment_ids)
  return TrainIterator(_ThreadPrefetch(packed, prefetch))


# ---- held-out evaluation -------------------------------------------------------------------------


def joined_documents(docs, eos_id: int, max_tokens: int | None = None) -> tuple[np.ndarray, np.ndarray]:
  """(tokens, document ids) of `docs` in order, each followed by EOS (the held-out packing), stopping once
  `max_tokens` are reached; an id counts each closing EOS as the next document's (the module docstring's
  convention), so ids[i] is the document of tokens[i] read as an input."""
  pieces, ids, have = [], [], 0
  for i in range(len(docs)):
    if max_tokens is not None and have >= max_tokens:
      break
    doc = np.asarray(docs[i]).astype(np.int32)
    pieces += [doc, np.array([eos_id], np.int32)]
    ids += [np.full(len(doc), i, np.int32), np.array([i + 1], np.int32)]
    have += len(doc) + 1
  return np.concatenate(pieces), np.concatenate(ids)


def make_eval_batches(
  data_dir,
  *,
  seq_len: int,
  global_batch_size: int,
  process_index: int | None = None,
  process_count: int | None = None,
  split: str = "val",
  max_batches: int | None = None,
  vocab_size: int | None = None,
  segment_ids: bool = False,
) -> list[Batch]:
  """The held-out split in stored order, EOS-joined, packed into full global batches; this process's rows.
  `segment_ids`: each batch also holds its inputs' document ids (the module docstring's convention)."""
  p, n = _resolve_processes(process_index, process_count, global_batch_size)
  manifest = load_manifest(data_dir)
  if vocab_size is not None:
    check_vocab(manifest, vocab_size)
  docs = split_documents(data_dir, manifest, split)
  width = seq_len + 1
  want = None if max_batches is None else max_batches * global_batch_size * width
  tokens, doc_ids = joined_documents(docs, int(manifest["eos_id"]), want)
  n_batches = len(tokens) // (global_batch_size * width)
  if max_batches is not None:
    n_batches = min(n_batches, max_batches)
  if n_batches == 0:
    raise ValueError(
      f"split {split!r} holds {len(tokens)} tokens (with EOS), fewer than one eval batch of "
      f"{global_batch_size} × {width}; use a smaller eval batch or seq_len, or re-run "
      "`python -m train.prepare` with a larger --val_fraction"
    )
  b_local = global_batch_size // n
  cut = lambda a: a[: n_batches * global_batch_size * width].reshape(n_batches, global_batch_size, width)[
    :, p * b_local : (p + 1) * b_local
  ]
  ids = cut(doc_ids) if segment_ids else [None] * n_batches
  return [
    Batch(
      inputs=np.ascontiguousarray(x[:, :-1]),
      targets=np.ascontiguousarray(x[:, 1:]),
      segment_ids=None if s is None else np.ascontiguousarray(s[:, :-1]),
    )
    for x, s in zip(cut(tokens), ids)
  ]
