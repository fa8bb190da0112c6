"""`python -m train` end to end: exact resume after a real kill, 2 processes == 1, the config system."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import helpers
import numpy as np
import pytest

from laplace_jax.platform import CPU_DEVICES_ENV
from train import prepare
from train.hooks import TB_TAGS
from train.loop import run
from train.run_config import build_parser, load_config

ROOT = helpers.ROOT
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
  "--eval_batches",
  "1",
  "--log_every",
  "1",
  "--no-progress",
]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  d = tmp_path_factory.mktemp("data") / "kjv"
  prepare.main(
    ["--corpus", "kjv", "-o", str(d), "--max-documents", "80", "--val-fraction", "0.1", "--no-progress"]
  )
  return d


STEPS = 8  # every run below is a prefix of this one: the same LR schedule (total_steps 8) whatever --steps is
SCHEDULE = ["--optimizer.total_steps", str(STEPS)]


@pytest.fixture(scope="module")
def reference_dir(data_dir, tmp_path_factory):
  """The run directory of one uninterrupted in-process run, the reference of the program tests (one compile)."""
  ref = tmp_path_factory.mktemp("ref")
  run(
    load_config(
      COMMON
      + SCHEDULE
      + ["--data_dir", str(data_dir), "--out_dir", str(ref), "--steps", str(STEPS), "--save_every", "100"]
    )
  )
  return ref


@pytest.fixture(scope="module")
def reference(reference_dir):
  """step -> loss of the reference run."""
  want = _losses(reference_dir)
  assert sorted(want) == list(range(1, STEPS + 1))
  return want


def test_tensorboard_reads_the_runs_scalars(reference_dir, reference):
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

  events = EventAccumulator(str(reference_dir / "tensorboard"))
  events.Reload()
  assert set(TB_TAGS.values()) <= set(events.Tags()["scalars"])
  loss = {e.step: e.value for e in events.Scalars("train/loss")}
  assert sorted(loss) == sorted(reference)
  np.testing.assert_allclose([loss[s] for s in sorted(reference)], [reference[s] for s in sorted(reference)])
  rows = [json.loads(l) for l in (reference_dir / "metrics.jsonl").read_text().splitlines()]
  held_out = [r["eval_loss"] for r in rows if "eval_loss" in r]
  assert [e.value for e in events.Scalars("eval/loss")] == pytest.approx(held_out)


def _losses(out_dir):
  """step -> loss, the last row for a step winning (a resumed run rewrites the steps after its checkpoint)."""
  rows = [json.loads(l) for l in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]
  return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _cli(*args, **popen):
  env = dict(os.environ, PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu")
  env.pop(CPU_DEVICES_ENV, None)
  return subprocess.Popen(
    [sys.executable, "-m", "train", *args],
    cwd=ROOT,
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
    **popen,
  )


def test_kill_then_resume_equals_uninterrupted_run(data_dir, reference, tmp_path):
  steps, want = STEPS, reference
  out = tmp_path / "killed"
  args = (
    COMMON
    + SCHEDULE
    + [
      "--data_dir",
      str(data_dir),
      "--out_dir",
      str(out),
      "--steps",
      str(steps),
      "--save_every",
      "2",
      "--simulate_devices",
      "8",
    ]
  )
  proc = _cli(*args)
  ckpts = out / "checkpoints"
  deadline = time.time() + 300
  while time.time() < deadline and proc.poll() is None:  # kill as soon as step 4 is on disk
    if (ckpts / "4").exists():
      break
    time.sleep(0.05)
  assert proc.poll() is None, "the run ended before it could be killed:\n" + proc.stdout.read()
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  from laplace_jax.training.checkpoint import Checkpointer

  with Checkpointer(ckpts) as c:
    resumed_from = c.latest_step()
  assert resumed_from is not None and 2 <= resumed_from < steps

  summary = run(load_config(args[:-2]))  # same run, in this process: resumes by default
  assert summary["start_step"] == resumed_from
  got = _losses(out)
  for s in range(resumed_from + 1, steps + 1):
    assert got[s] == want[s], (s, got[s], want[s])  # bit-identical


def test_two_processes_match_one_process(data_dir, reference, tmp_path):
  steps = 3
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  out = tmp_path / "two"
  procs = [
    _cli(
      *COMMON,
      *SCHEDULE,
      "--data_dir",
      str(data_dir),
      "--out_dir",
      str(out),
      "--steps",
      str(steps),
      "--simulate_devices",
      "4",
      "--coordinator",
      f"127.0.0.1:{port}",
      "--num_processes",
      "2",
      "--process_id",
      str(i),
    )
    for i in range(2)
  ]
  logs = [p.communicate(timeout=400)[0] for p in procs]
  assert all(p.returncode == 0 for p in procs), "\n\n".join(logs)
  assert "2 process(es)" in logs[0]
  one, two = reference, _losses(out)
  assert sorted(two) == [1, 2, 3]
  np.testing.assert_allclose([two[s] for s in (1, 2, 3)], [one[s] for s in (1, 2, 3)], rtol=1e-6)


def test_config_precedence_toml_then_flags(tmp_path):
  toml = tmp_path / "run.toml"
  toml.write_text(
    "[train]\nsteps = 7\nglobal_batch = 32\n[model]\nd_model = 32\n[optimizer]\nmuon_lr = 0.01\n"
  )
  rc = load_config(["--config", str(toml), "--steps", "9", "--model.n_layers", "3"])
  assert (rc.train.steps, rc.train.global_batch) == (9, 32)
  assert (rc.model.d_model, rc.model.n_layers, rc.model.n_heads) == (32, 3, 4)  # rest from the tiny preset
  assert rc.optimizer.muon_lr == 0.01 and rc.optimizer.total_steps == 9


@pytest.mark.parametrize(
  "argv, match",
  [
    (["--steps", "0"], "positive integer"),
    (["--model.n_decay_tiers", "3"], "divisor of n_heads"),
    (["--optimizer.muon_beta", "1.0"], "muon_beta"),
    (["--preset", "huge"], "preset"),
  ],
)
def test_bad_config_is_a_clear_error(argv, match):
  with pytest.raises(ValueError, match=match):
    load_config(argv)


def test_help_documents_every_flag():
  for action in build_parser()._actions:
    if action.option_strings and action.dest != "help":
      assert action.help and len(action.help) > 12, action.option_strings


def test_compile_only_reports_memory(tmp_path):
  # The reference's step (same schedule and steps): read back from the suite's compilation cache.
  summary = run(
    load_config(COMMON + SCHEDULE + ["--steps", str(STEPS), "--compile_only", "--out_dir", str(tmp_path)])
  )
  assert summary["memory"]["temp_bytes"] > 0 and summary["compile_s"] > 0
  assert not (tmp_path / "checkpoints").exists()


def test_context_parallel_run_follows_the_unsplit_run(data_dir, reference, tmp_path):
  """`--mesh_context 4`: each row's 64 tokens over 4 devices (data 1 × fsdp 2 × context 4), Muon and the
  packed documents' segment ids included; the losses of its steps are the 2 × 4 run's (the same batches)."""
  steps = 3
  mesh = ["--mesh_data", "1", "--mesh_fsdp", "2", "--mesh_context", "4"]
  out = tmp_path / "context"
  args = (
    COMMON + SCHEDULE + mesh + ["--data_dir", str(data_dir), "--out_dir", str(out), "--steps", str(steps)]
  )
  run(load_config(args + ["--save_every", "100"]))
  got = _losses(out)
  for s in range(1, steps + 1):
    np.testing.assert_allclose(got[s], reference[s], rtol=2e-5, err_msg=f"step {s}")
