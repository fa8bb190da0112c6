"""`--target neuron` on `python -m train` and `python -m serve`: every program lowered (in a fresh process, as
the platform choice must be made before anything is traced), written to --hlo_dir, checked; the exit status
and the printed counts agree with an independent check of the written files."""

import json
import os
import pathlib
import re
import subprocess
import sys

import helpers
import pytest

from laplace_jax.analysis import neuron_check
from laplace_jax.platform import CPU_DEVICES_ENV
from train.run_config import load_config

ROOT = helpers.ROOT
SERVE_PROGRAMS = {
  "empty_table",
  "empty_prefill",
  "prefill_chunk",
  "prefill_chunk_scored",
  "insert",
  "gather_slots",
  "gather_prefill",
  "load_prefill",
}


def serve_programs(slots_per_device: int, n_dev: int) -> set[str]:
  """Every engine program: the decode and sampling calls once per bucket of rows (serve.slots.slot_functions.bucket_sizes:
  each device's share doubling from 1 to all its slots)."""
  buckets = {n_dev * min(1 << i, slots_per_device) for i in range(slots_per_device.bit_length() + 1)}
  return SERVE_PROGRAMS | {f"{p}_b{b}" for p in ("decode", "sample") for b in buckets}


def _run(module, *args, timeout=300):
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  env.pop(CPU_DEVICES_ENV, None)
  env.pop("JAX_PLATFORMS", None)
  return subprocess.run(
    [sys.executable, "-m", module, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
  )


def _independent_counts(hlo_dir):
  return {p.stem: len(neuron_check.violations(p.read_text())) for p in pathlib.Path(hlo_dir).glob("*.mlir")}


@pytest.fixture(scope="module")
def train_lowered(tmp_path_factory):
  d = tmp_path_factory.mktemp("train_hlo")
  r = _run(
    "train",
    "--preset",
    "tiny",
    "--target",
    "neuron",
    "--simulate_devices",
    "8",
    "--mesh_data",
    "2",
    "--mesh_fsdp",
    "4",
    "--global_batch",
    "8",
    "--seq_len",
    "256",
    "--hlo_dir",
    str(d),
  )
  return r, d


@pytest.fixture(scope="module")
def serve_lowered(tmp_path_factory):
  d = tmp_path_factory.mktemp("serve_hlo")
  r = _run(
    "serve",
    "--preset",
    "tiny",
    "--target",
    "neuron",
    "--mesh-devices",
    "8",
    "--n-slots",
    "16",
    "--hlo-dir",
    str(d),
  )
  return r, d


# laplace-3b as on a trn2.48xlarge: 64 devices (the defaults of --target), the README's compile-proof batch,
# 1,280 serving slots. Lowering only: ≈5 s per process on a 2-core CPU.
@pytest.fixture(scope="module")
def train_3b(tmp_path_factory):
  d = tmp_path_factory.mktemp("train_3b")
  r = _run(
    "train",
    "--preset",
    "laplace-3b",
    "--target",
    "neuron",
    "--mesh_fsdp",
    "64",
    "--global_batch",
    "256",
    "--seq_len",
    "2048",
    "--micro_batches",
    "1",
    "--hlo_dir",
    str(d),
  )
  return r, d


@pytest.fixture(scope="module")
def serve_3b(tmp_path_factory):
  d = tmp_path_factory.mktemp("serve_3b")
  return _run("serve", "--preset", "laplace-3b", "--target", "neuron", "--hlo-dir", str(d)), d


def _check_train(r, d, mesh_line, n_dev):
  assert r.returncode in (0, 1), r.stdout + r.stderr
  summary = json.loads(r.stdout.strip().splitlines()[-1])
  text = (d / "train_step.mlir").read_text()
  assert mesh_line in text and f"mhlo.num_partitions = {n_dev} " in text
  assert _independent_counts(d) == {"train_step": summary["violations"]}
  assert r.returncode == (1 if summary["violations"] else 0)
  assert "lowered for neuron" in r.stdout and "compiled in" not in r.stdout
  return text


def test_train_target_neuron_lowers_and_reports(train_lowered):
  _check_train(*train_lowered, 'sdy.mesh @mesh = <["data"=2, "fsdp"=4]>', 8)


def test_train_target_neuron_laplace_3b_on_64_devices(train_3b):
  text = _check_train(*train_3b, 'sdy.mesh @mesh = <["data"=1, "fsdp"=64]>', 64)
  assert "tensor<256x2048xi32>" in text  # the global batch, as the README's compile proof


def _check_serve(r, d, n_dev, n_slots):
  assert r.returncode in (0, 1), r.stdout + r.stderr
  counts = _independent_counts(d)
  assert set(counts) == serve_programs(n_slots // n_dev, n_dev)
  printed = {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+): (\d+) violation", r.stdout, re.M)}
  assert printed == counts
  assert r.returncode == (1 if sum(counts.values()) else 0)
  assert f"mhlo.num_partitions = {n_dev} " in (d / f"decode_b{n_slots}.mlir").read_text()


def test_serve_target_neuron_lowers_every_engine_program(serve_lowered):
  _check_serve(*serve_lowered, 8, 16)
  # --prng auto under --target neuron: rbg, under which sampling draws with Philox (its first multiplier)
  assert f"dense<{0xD2511F53}>" in (serve_lowered[1] / "sample_b8.mlir").read_text()


def test_serve_target_neuron_laplace_3b_1280_slots(serve_3b):
  _check_serve(*serve_3b, 64, 1280)
  # every slot's GLA state in the table; a bucket's step gathers only its 64 rows (one per device)
  assert "tensor<24x1280x16x96x192xf32>" in (serve_3b[1] / "decode_b1280.mlir").read_text()
  assert "tensor<24x64x16x96x192xf32>" in (serve_3b[1] / "decode_b64.mlir").read_text()


def test_other_targets_are_refused():
  with pytest.raises(ValueError, match="only lowering target is 'neuron'"):
    load_config(["--target", "gpu"])
  with pytest.raises(ValueError, match="needs --target neuron"):
    load_config(["--hlo_dir", "x"])
  r = _run("serve", "--target", "tpu")
  assert r.returncode == 2 and "invalid choice: 'tpu'" in r.stderr


@pytest.mark.parametrize("lowered", ["serve_lowered", "serve_3b"])
def test_serving_programs_conform(lowered, request):
  """For serving: every engine program breaks no rule (branch-free sampling and logprobs, per-slot
  draws without Threefry under rbg), tiny at 16 slots on 8 devices and laplace-3b at 1,280 slots on 64."""
  r, d = request.getfixturevalue(lowered)
  counts = _independent_counts(d)
  assert r.returncode == 0 and set(counts.values()) == {0}, r.stdout[-4000:]


@pytest.mark.parametrize("lowered", ["train_lowered", "train_3b"])
def test_train_step_conforms(lowered, request):
  """For training: the step breaks no rule (Muon without switch, bf16 gathers, no runtime power)."""
  r, d = request.getfixturevalue(lowered)
  counts = _independent_counts(d)
  assert r.returncode == 0 and counts == {"train_step": 0}, r.stdout[-4000:]
