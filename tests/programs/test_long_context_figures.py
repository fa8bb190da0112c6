"""benchmarks/long_context_figures.py: docs/eval/long-context.json rebuilt from result files alone."""

import importlib.util
import json

import helpers

spec = importlib.util.spec_from_file_location(
  "long_context_figures", helpers.ROOT / "benchmarks" / "long_context_figures.py"
)
figs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(figs)


def test_records_come_from_the_result_files(tmp_path):
  rec = tmp_path / "sp"
  rec.mkdir()
  cell = {
    "task": "passkey:256",
    "pattern": "G",
    "steps": 40,
    "batch": 16,
    "state_passing": True,
    "final_loss": 1.5,
    "losses": [(10, 2.3), (1000, 2.0), (2000, 1.5)],
    "train_s": 9.6,
    "eval_s": 1.2,
    "passkey": {"256": {"0.0": 0.25, "1.0": 1.0}},
    "passkey_distance": {"1024": {"256": 0.5, "64": 0.75}, "256": {"64": 1.0}},
  }
  (rec / "results.json").write_text(
    json.dumps({"grid": "longctx", "sets": ["state_passing=true"], "cells": [cell]})
  )
  run = tmp_path / "sp"
  (run / "checkpoints" / "7" / "meta").mkdir(parents=True)
  (run / "checkpoints" / "12" / "meta").mkdir(parents=True)
  train = {
    "preset": "tiny",
    "data_dir": str(tmp_path / "d"),
    "out_dir": str(run),
    "steps": 12,
    "global_batch": 4,
    "seq_len": 0,
    "state_passing": True,
  }
  (run / "checkpoints" / "12" / "meta" / "metadata").write_text(
    json.dumps({"run_config": {"train": train, "model": {"max_seq_len": 256}}})
  )
  (run / "checkpoints" / "7" / "meta" / "metadata").write_text("{}")  # older: not read
  data = tmp_path / "d"
  data.mkdir()
  (data / "manifest.json").write_text(json.dumps({"corpus": "kjv-books", "val_fraction": 0.17}))
  bp = tmp_path / "bp.json"
  bp.write_text(
    json.dumps(
      {
        "checkpoint": str(run / "export" / "step_12"),
        "data_dir": str(data),
        "buckets": [
          {"position_lo": 0, "position_hi": 2, "loss": 9.0, "tokens": 10},
          {"position_lo": 2, "position_hi": 4, "loss": None, "tokens": 0},
          {"position_lo": 4, "position_hi": 8, "loss": 7.5, "tokens": 20},
        ],
      }
    )
  )
  cost = tmp_path / "cost.txt"
  cost.write_text(
    "$ python benchmarks/state_passing_cost.py --rounds 4\n"
    "tiny at 16 x 256 on cpu: plain 100.0 ms, state passing 103.0 ms, ratio 1.030 (median)\n"
  )
  out = tmp_path / "lc.json"
  assert (
    figs.main(["--passkey", str(rec), "--by-position", str(bp), "--cost", str(cost), "-o", str(out)]) == 0
  )
  got = json.loads(out.read_text())
  assert got["passkey_commands"] == [
    f"python -m train.recall --grid longctx --sections passkey --patterns G --set state_passing=true -o {rec}"
  ]
  assert [(r["context"], r["distance"], r["accuracy"]) for r in got["passkey"]] == [
    (256, 64, 1.0),
    (1024, 64, 0.75),
    (1024, 256, 0.5),
  ]
  assert got["passkey"][0] == {
    "pattern": "G",
    "state_passing": True,
    "train_len": 256,
    "steps": 40,
    "context": 256,
    "distance": 64,
    "accuracy": 1.0,
    "n": 4,
  }
  assert [(r["depth"], r["accuracy"]) for r in got["passkey_depth"]] == [(0.0, 0.25), (1.0, 1.0)]
  assert got["passkey_training"][0]["loss_every_1000"] == {"1000": 2.0, "2000": 1.5}
  assert (got["passkey_training"][0]["final_loss"], got["passkey_training"][0]["train_s"]) == (1.5, 10)
  assert got["loss_by_position"] == [
    {
      "run": "tiny-sp",
      "state_passing": True,
      "train_len": 256,
      "position_lo": 0,
      "position_hi": 2,
      "loss": 9.0,
      "tokens": 10,
    },
    {
      "run": "tiny-sp",
      "state_passing": True,
      "train_len": 256,
      "position_lo": 4,
      "position_hi": 8,
      "loss": 7.5,
      "tokens": 20,
    },
  ]
  assert got["loss_by_position_commands"][:2] == [
    f"python -m train.prepare --corpus kjv-books -o {data} --val_fraction 0.17",
    f"python -m train --preset tiny --data_dir {data} --out_dir {run} --steps 12 --global_batch 4 --state_passing",
  ]
  assert got["state_passing_cost"] == [{"plain_ms": 100.0, "state_passing_ms": 103.0, "ratio": 1.03}]
  assert got["state_passing_cost_commands"] == ["python benchmarks/state_passing_cost.py --rounds 4"]
  longest = got["head_reach"]["heads"][-1]
  assert longest["half_life"] == 2048.0
  assert longest["kept"]["4096"] == 0.25 and longest["reach_1pct"] == 13607
  md = figs.markdown(got)
  assert "| 64 | 100% | 75% |" in md and "| 256 |  | 50% |" in md
  assert "| [4, 8) | 7.500 | 20 |" in md
