"""`python -m train.eval` against the training loop's own held-out eval, and its refusals."""

import json

import numpy as np
import pytest

from train import eval as train_eval
from train import prepare
from train.loop import run
from train.run_config import load_config

COMMON = [
  "--preset",
  "tiny",
  "--global_batch",
  "8",
  "--seq_len",
  "64",
  "--mesh_data",
  "2",
  "--mesh_fsdp",
  "4",
  "--log_every",
  "1",
  "--no-progress",
  "--steps",
  "3",
  "--save_every",
  "100",
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """A 3-step run with a held-out eval of 2 batches, on a split of 11 documents (12,612 tokens): 24 full
  batches and a padded one for the whole-split eval, each batch a forward that dominates the file's run time."""
  root = tmp_path_factory.mktemp("eval")
  data_dir = root / "kjv"
  prepare.main(
    [
      "--corpus",
      "kjv",
      "-o",
      str(data_dir),
      "--max-documents",
      "80",
      "--val-fraction",
      "0.1",
      "--no-progress",
    ]
  )
  out = root / "run"
  summary = run(
    load_config(
      COMMON
      + ["--data_dir", str(data_dir), "--out_dir", str(out), "--eval_batches", "2", "--model.mixers", "GA"]
    )
  )
  return data_dir, summary


def test_eval_cli_equals_the_loops_held_out_loss(trained, tmp_path, capsys):
  data_dir, summary = trained
  out = tmp_path / "res.json"
  assert (
    train_eval.main(
      [
        "--checkpoint",
        summary["export"],
        "--data_dir",
        str(data_dir),
        "--seq_len",
        "64",
        "--global_batch",
        "8",
        "--max_batches",
        "2",
        "--json",
        str(out),
      ]
    )
    == 0
  )
  res = json.loads(out.read_text())
  np.testing.assert_allclose(res["loss"], summary["eval_loss"], rtol=1e-5)
  assert res["tokens"] == 2 * 8 * 64 and res["mixers"] == "GA"
  np.testing.assert_allclose(res["perplexity"], np.exp(res["loss"]), rtol=1e-9)
  # the whole split, on another mesh: every token once, bits per byte from the decoded text
  whole = train_eval.evaluate(summary["export"], data_dir, seq_len=64, global_batch=8, mesh_fsdp=8)
  assert whole["tokens"] > res["tokens"] and whole["bytes"] > whole["tokens"]
  np.testing.assert_allclose(
    whole["bits_per_byte"], whole["loss"] * whole["tokens"] / np.log(2) / whole["bytes"], rtol=1e-9
  )
  # documents apart (the default) or a window read as one stream: the same for each window's first document,
  # which has nothing before it either way; the later ones differ
  later = whole["tokens_later_documents"]
  assert 0 < later < whole["tokens"] and whole["segment_ids"]
  n_first = whole["tokens"] - later
  mean = (whole["loss_first_document"] * n_first + whole["loss_later_documents"] * later) / whole["tokens"]
  np.testing.assert_allclose(mean, whole["loss"], rtol=1e-6)
  part = dict(seq_len=64, global_batch=8, mesh_fsdp=8, max_batches=6)
  apart = train_eval.evaluate(summary["export"], data_dir, **part)
  stream = train_eval.evaluate(summary["export"], data_dir, **part, segment_ids=False)
  assert stream["tokens_later_documents"] == apart["tokens_later_documents"] > 0
  np.testing.assert_allclose(stream["loss_first_document"], apart["loss_first_document"], rtol=1e-5)
  assert abs(stream["loss_later_documents"] - apart["loss_later_documents"]) > 1e-3
  assert (
    train_eval.main(["--checkpoint", summary["export"], "--data_dir", str(data_dir), "--json", str(out)]) == 2
  )
  assert "never overwritten" in capsys.readouterr().err


def test_eval_refuses_missing_split_and_other_config(trained, capsys):
  data_dir, summary = trained
  with pytest.raises(ValueError, match="no such split"):
    train_eval.evaluate(summary["export"], data_dir, split="test")
  with pytest.raises(ValueError, match="mixers"):
    train_eval.evaluate(summary["export"], data_dir, preset="tiny")
  assert train_eval.main(["--checkpoint", str(data_dir), "--data_dir", str(data_dir)]) == 2
  assert "no exported params" in capsys.readouterr().err


def test_init_from_an_export_fine_tunes_its_params(trained, tmp_path):
  """`--init_from EXPORT`: a fresh run (the step compiled by the fixture's run is reused) starts from the
  export's params, so its first loss is the trained model's, not a random init's; an export of another model
  config is refused before anything compiles, naming the field."""
  data_dir, summary = trained
  flags = COMMON + ["--data_dir", str(data_dir), "--eval_batches", "0", "--model.mixers", "GA"]
  fine = run(load_config(flags + ["--out_dir", str(tmp_path / "fine"), "--init_from", summary["export"]]))
  assert fine["first_loss"] < summary["first_loss"] - 0.1, (fine["first_loss"], summary)
  with pytest.raises(ValueError, match="mixers"):
    run(
      load_config(
        COMMON
        + [
          "--data_dir",
          str(data_dir),
          "--out_dir",
          str(tmp_path / "other"),
          "--init_from",
          summary["export"],
        ]
      )
    )
