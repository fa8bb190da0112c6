"""`python -m train.eval` against the training loop's own held-out eval, and its refusals."""

import json

import numpy as np
import pytest

from train import eval as train_eval
from train import prepare
from train.config import load_config
from train.loop import run

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
      "0.2",
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
