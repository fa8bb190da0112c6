"""Runs that cannot silently change: the saved run config, resume refusals and overrides, the LR schedule
kept when a run is extended, metrics rows written once per step across a crash."""

import json
import shutil
from pathlib import Path

import helpers
import jax
import numpy as np
import pytest

from laplace_jax import sharding
from laplace_jax.model.config import get_config
from laplace_jax.training import checkpoint
from laplace_jax.training import optimizer as optim
from laplace_jax.training import train_step as ts
from train import prepare, resume
from train.loop import run
from train.run_config import load_config

# One device: what is checked here does not depend on the mesh, and the step compiles faster.
COMMON = [
  "--preset",
  "tiny",
  "--global_batch",
  "8",
  "--seq_len",
  "64",
  "--mesh_data",
  "1",
  "--mesh_fsdp",
  "1",
  "--eval_batches",
  "0",
  "--log_every",
  "1",
  "--no-progress",
]
# The LR schedule of test_extended_run_keeps_its_schedule's reference, given to every first run here whose
# schedule the test does not check (later runs keep the saved one): their train steps are then one program,
# compiled once and read back from the suite's compilation cache (tests/conftest.py).
SCHEDULE = ["--optimizer.total_steps", "4"]
# The allowed changes both resume tests accept: a field (muon_lr) and the schedule (total_steps). One set, so
# their resumed runs (each saved with SCHEDULE's schedule) compile one program between them, not two.
ALLOWED_CHANGES = [
  "--optimizer.muon_lr",
  "0.5",
  "--optimizer.total_steps",
  "12",
  "--allow_changes",
  "optimizer.muon_lr,optimizer.total_steps",
]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  d = tmp_path_factory.mktemp("data") / "kjv"
  prepare.main(
    ["--corpus", "kjv", "-o", str(d), "--max-documents", "40", "--val-fraction", "0.1", "--no-progress"]
  )
  return d


def _rows(out_dir):
  return [json.loads(l) for l in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]


def _train(data_dir, out, *extra):
  return run(load_config(COMMON + ["--data_dir", str(data_dir), "--out_dir", str(out), *extra]))


def test_changed_config_is_refused_listing_each_difference_then_allowed(data_dir, tmp_path):
  out = tmp_path / "run"
  _train(data_dir, out, "--steps", "2", "--profile_steps", "1", *SCHEDULE)
  assert list((out / "profile").rglob("*.xplane.pb")), "no jax.profiler trace written"
  with pytest.raises(ValueError) as e:
    _train(
      data_dir,
      out,
      "--steps",
      "3",
      "--optimizer.muon_lr",
      "0.5",
      "--global_batch",
      "16",
      "--model.remat",
      "true",
    )  # remat is allowed: it does not change the math
  msg = str(e.value)
  assert "optimizer.muon_lr: saved 0.02, now 0.5 (--optimizer.muon_lr)" in msg
  assert "train.global_batch: saved 8, now 16 (--global_batch)" in msg
  assert "remat" not in msg
  assert "--allow_changes train.global_batch,optimizer.muon_lr" in msg
  with pytest.raises(ValueError, match=r"--allow_changes 'optimizer.muon_rate'.*unknown field"):
    _train(
      data_dir, out, "--steps", "3", "--optimizer.muon_lr", "0.5", "--allow_changes", "optimizer.muon_rate"
    )
  summary = _train(data_dir, out, "--steps", "3", *ALLOWED_CHANGES)
  assert summary["start_step"] == 2 and summary["end_step"] == 3


def test_extended_run_keeps_its_schedule(data_dir, tmp_path):
  # The reference: one uninterrupted 8-step run on the schedule a 4-step run starts with.
  ref = tmp_path / "ref"
  _train(data_dir, ref, "--steps", "8", "--optimizer.total_steps", "4", "--optimizer.warmup_steps", "1")
  out = tmp_path / "extended"
  _train(data_dir, out, "--steps", "4")
  _train(data_dir, out, "--steps", "8")
  want = {r["step"]: (r["loss"], r["lr"]) for r in _rows(ref)}
  got = {r["step"]: (r["loss"], r["lr"]) for r in _rows(out)}
  assert got == want  # bit-identical losses and learning rates, steps 1-8
  assert got[5][1] <= got[4][1]  # the control: no jump back up to the peak at step 5
  with pytest.raises(ValueError, match=r"optimizer.total_steps: saved 4, now 12"):
    _train(data_dir, out, "--steps", "12", "--optimizer.total_steps", "12")
  summary = _train(data_dir, out, "--steps", "9", *ALLOWED_CHANGES)
  assert summary["start_step"] == 8


def test_rbg_run_resumes_bit_identically_and_refuses_another_prng(data_dir, tmp_path, capsys):
  ref, out = tmp_path / "ref", tmp_path / "resumed"
  schedule = ["--prng", "rbg", "--optimizer.total_steps", "4"]
  _train(data_dir, ref, "--steps", "4", *schedule)
  # Threefry runs of this file compiled the same config's step: the PRNG is part of the program.
  assert "train step compiled in" in capsys.readouterr().out
  _train(data_dir, out, "--steps", "2", *schedule)
  assert "train step reused (compiled by an earlier run in this process)" in capsys.readouterr().out
  summary = _train(data_dir, out, "--steps", "4", *schedule)
  assert summary["start_step"] == 2
  assert [r["loss"] for r in _rows(out)] == [r["loss"] for r in _rows(ref)]  # bit-identical, steps 1-4
  with checkpoint.Checkpointer(out / "checkpoints") as ckpt:
    assert ckpt.metadata()["prng_impl"] == "rbg"
    assert ckpt.restore(restore_data=False).train_state["rng"].shape == (4,)  # an rbg key (threefry's: 2)
  for prng in ("auto", "threefry"):  # auto is threefry on this CPU
    with pytest.raises(ValueError, match=r"used the 'rbg' PRNG, this one would use 'threefry'.*--prng rbg"):
      _train(data_dir, out, "--steps", "5", "--prng", prng)
  with pytest.raises(ValueError, match=r"--prng='philox'"):
    _train(data_dir, out, "--prng", "philox")


def test_checkpoint_without_a_prng_counts_as_threefry():
  resume.check_prng("threefry", {}, where="old")
  with pytest.raises(
    ValueError,
    match=r"refusing to resume old: that run used the 'threefry' PRNG, this one "
    r"would use 'rbg'\. Resume with --prng threefry",
  ):
    resume.check_prng("rbg", {}, where="old")


def test_metrics_hold_each_step_once_after_a_crash_and_resume(data_dir, tmp_path):
  out = tmp_path / "run"
  _train(data_dir, out, "--steps", "6", "--save_every", "2", *SCHEDULE)
  # A crash after step 6's metrics were written but before its checkpoint was: remove that checkpoint,
  # and leave a row cut short by the kill.
  shutil.rmtree(out / "checkpoints" / "6")
  with open(out / "metrics.jsonl", "a") as f:
    f.write('{"step": 7, "lo')
  summary = _train(data_dir, out, "--steps", "6", "--save_every", "2")
  assert summary["start_step"] == 4
  steps = [r["step"] for r in _rows(out) if "loss" in r]
  assert steps == [1, 2, 3, 4, 5, 6]


def test_checkpoint_metadata_holds_the_model_config_once():
  rc = load_config(["--preset", "tiny"])
  meta = resume.checkpoint_metadata(rc, "threefry")
  assert "model" not in meta["run_config"] and meta["config"] == resume.run_config_dict(rc)["model"]
  assert resume.saved_run_config(meta) == resume.run_config_dict(rc)
  old = {"config": meta["config"], "run_config": resume.run_config_dict(rc), "prng_impl": "threefry"}
  assert resume.saved_run_config(old) == resume.run_config_dict(rc)  # the model twice, as saved before
  assert resume.saved_run_config({"config": meta["config"]}) == {"model": meta["config"]}  # no run config


def test_checkpoint_with_the_model_config_twice_still_resumes(data_dir, tmp_path):
  """Checkpoints saved before the model config was stored once held it twice, under "config" and under
  run_config["model"]: rewritten to that form, a checkpoint still resumes, and its model is still compared."""
  out = tmp_path / "run"
  _train(data_dir, out, "--steps", "2", *SCHEDULE)
  meta_file = out / "checkpoints" / "2" / "meta" / "metadata"
  meta = json.loads(meta_file.read_text())
  assert "model" not in meta["run_config"]
  meta["run_config"] = {"train": meta["run_config"]["train"], "model": meta["config"], **meta["run_config"]}
  meta_file.write_text(json.dumps(meta))
  with checkpoint.Checkpointer(out / "checkpoints") as ck:
    assert ck.metadata(2)["run_config"]["model"] == ck.metadata(2)["config"]
  with pytest.raises(ValueError, match=r"model.d_model: saved 64, now 128"):
    _train(data_dir, out, "--steps", "3", "--model.d_model", "128")
  summary = _train(data_dir, out, "--steps", "3", *ALLOWED_CHANGES)
  assert summary["start_step"] == 2 and summary["end_step"] == 3


def test_field_newer_than_the_checkpoint_counts_as_its_default():
  rc = load_config([])
  saved = resume.run_config_dict(rc)
  del saved["optimizer"]["muon_ns_dtype"]
  assert resume.reconcile(rc, saved, where="x")[0] == rc
  with pytest.raises(ValueError, match=r"optimizer.muon_ns_dtype: saved 'float32', now 'bfloat16'"):
    resume.reconcile(load_config(["--optimizer.muon_ns_dtype", "bfloat16"]), saved, where="x")


def test_run_saved_before_segment_ids_keeps_them_off():
  """A run saved before train.segment_ids existed read packed rows as one stream: it resumes so (a note says
  why), and asking for segment ids is a change to allow like any other."""
  saved = resume.run_config_dict(load_config([]))
  del saved["train"]["segment_ids"]
  rc, notes = resume.reconcile(load_config([]), saved, where="x")
  assert rc.train.segment_ids is False and any("train.segment_ids=False" in n for n in notes)
  with pytest.raises(ValueError, match=r"train.segment_ids: saved False, now True"):
    resume.reconcile(load_config(["--segment_ids"]), saved, where="x")
  allow = ["--segment_ids", "--allow_changes", "train.segment_ids"]
  assert resume.reconcile(load_config(allow), saved, where="x")[0].train.segment_ids is True
  assert resume.reconcile(load_config([]), resume.run_config_dict(load_config([])), where="x")[1] == []


def test_drop_rows_after_keeps_earlier_rows_in_order(tmp_path):
  p = tmp_path / "metrics.jsonl"
  rows = [{"step": 1, "loss": 3.0}, {"step": 2, "eval_loss": 2.5}, {"step": 3, "loss": 2.0}]
  p.write_text("".join(json.dumps(r) + "\n" for r in rows))
  assert resume.drop_rows_after(p, 2) == 1
  assert [json.loads(l) for l in p.read_text().splitlines()] == rows[:2]
  assert resume.drop_rows_after(tmp_path / "absent.jsonl", 2) == 0


def test_clip_norm_off_from_toml_and_flags(tmp_path):
  toml = tmp_path / "run.toml"
  toml.write_text("[optimizer]\nclip_norm = 0.0\n")
  assert load_config(["--config", str(toml)]).optimizer.clip_norm == 0.0
  assert load_config(["--optimizer.clip_norm", "0"]).optimizer.clip_norm == 0.0


def test_tokens_per_step_sets_the_batch_for_any_length():
  assert load_config(["--seq_len", "16384", "--tokens_per_step", "32768"]).train.global_batch == 2
  assert load_config(["--seq_len", "2048", "--tokens_per_step", "32768"]).train.global_batch == 16
  with pytest.raises(
    ValueError, match=r"--tokens_per_step=1000: expected a multiple of the sequence length 256"
  ):
    load_config(["--tokens_per_step", "1000"])
  with pytest.raises(ValueError, match="disagree"):
    load_config(["--seq_len", "128", "--tokens_per_step", "1024", "--global_batch", "4"])


# Written by the trainer before its state was a TrainState (a dict with the same keys, which is what a
# checkpoint still holds): the test's state-passing step (FIXTURE_CFG, its optimizer, the 2×4 mesh) from seed 0
# after one step on _fixture_batch(0), saved as step 1 with the config as metadata.
FIXTURE = helpers.DATA / "train_state_v1"
FIXTURE_CFG = dict(d_model=8, n_heads=2, d_k=2, d_v=4, d_ff=16, vocab_size=64, chunk_size=8, max_seq_len=32)


def _fixture_batch(seed, B=8, T=16):
  tok = np.random.default_rng(seed).integers(0, FIXTURE_CFG["vocab_size"], (B, T + 1)).astype(np.int32)
  return ts.Batch(inputs=tok[:, :-1], targets=tok[:, 1:])


def test_checkpoint_from_before_the_typed_state_restores_and_resumes(tmp_path):
  """The old checkpoint restores into a TrainState equal to the one this code reaches by the same step, on
  the abstract state's shardings, and training goes on from it exactly as from that state."""
  cfg = get_config("tiny", **FIXTURE_CFG)
  mesh = sharding.make_mesh(data=2, fsdp=4)
  opt = optim.make_optimizer(optim.OptimizerConfig(total_steps=10, warmup_steps=1), mesh=mesh)
  step = ts.compile_train_step(cfg, opt, mesh, global_batch=8, seq_len=16, state_passing=True)
  want, _ = step(ts.init_train_state_on_mesh(cfg, opt, mesh, seed=0, carry_batch=8), _fixture_batch(0))
  shutil.copytree(FIXTURE, tmp_path / "ckpt")
  abstract = ts.abstract_train_state(cfg, opt, mesh, carry_batch=8)
  with checkpoint.Checkpointer(tmp_path / "ckpt") as ck:
    restored, note = resume.restore_train_state(ck, abstract)
  got = restored.train_state
  assert restored.step == 1 and note is None and isinstance(got, ts.TrainState)
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for (path, a), b, s in zip(
    jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), jax.tree.leaves(abstract)
  ):
    assert a.sharding == s.sharding, jax.tree_util.keystr(path)
    # the fixture was written on another CPU, whose kernels round the one step's last bits otherwise
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))
  assert int(got.step) == 1 and got.carry.gla.shape[0] == 8
  got, m_got = step(got, _fixture_batch(1))
  want, m_want = step(want, _fixture_batch(1))
  assert int(got.step) == int(want.step) == 2 and not bool(m_got.skipped)
  np.testing.assert_allclose(float(m_got.loss), float(m_want.loss), rtol=1e-6)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  # What this code saves is laid out on disk as the old checkpoint is: same leaves, keys and shapes.
  with checkpoint.Checkpointer(tmp_path / "new") as ck:
    ck.save(2, got.to_tree(), force=True)
  tree = lambda d: json.loads((d / "train_state" / "_METADATA").read_text())["tree_metadata"]
  assert tree(tmp_path / "new" / "2") == tree(FIXTURE / "1")
