"""The laplace-3b compile proof: the whole train step, lowered from abstract shapes on N simulated devices.

    python benchmarks/train_compile.py [--preset laplace-3b] [--devices 64] [--global-batch 256]
        [--micro-batches 1] [--distributions all_to_all gather]

For each Muon distribution: compile time, per-device memory from `memory_analysis()`, and the bytes each
device sends+receives per step in Muon's collectives (ops under the `muon_orthogonalize` scope) and in all
collectives, counted from the compiled HLO (laplace_jax.hlo_traffic). Nothing is allocated or run.
"""

import argparse
import os
import sys


def _args(argv):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--preset", default="laplace-3b")
  p.add_argument("--devices", type=int, default=64)
  p.add_argument("--global-batch", type=int, default=256, help="sequences per step (256 × 2,048 = 524,288)")
  p.add_argument("--seq-len", type=int, default=2048)
  p.add_argument(
    "--micro-batches",
    type=int,
    default=1,
    help="1, as in the README's compile proof: the least FSDP traffic that fits 24 GiB",
  )
  p.add_argument("--distributions", nargs="+", default=["all_to_all", "gather"])
  return p.parse_args(argv)


ARGS = _args(sys.argv[1:])
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before JAX is imported

from laplace_jax.platform import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(ARGS.devices)

import platform  # noqa: E402
import time  # noqa: E402

from laplace_jax import hlo_traffic, sharding  # noqa: E402
from laplace_jax import train_step as ts  # noqa: E402
from laplace_jax.config import get_config  # noqa: E402
from laplace_jax.optimizer import OptimizerConfig, make_optimizer  # noqa: E402

GiB, GB = 2**30, 1e9


def main():
  cfg = get_config(ARGS.preset)
  mesh = sharding.make_mesh(data=1, fsdp=ARGS.devices)
  step_cfg = ts.StepConfig(micro_batches=ARGS.micro_batches)
  per_dev = ARGS.global_batch // (ARGS.devices * ARGS.micro_batches)
  print(
    f"{ARGS.preset} train step on {ARGS.devices} simulated devices ({platform.machine()}, "
    f"{os.cpu_count()} cores); {ARGS.global_batch} × {ARGS.seq_len} tokens per step = "
    f"{ARGS.micro_batches} micro-batches × {per_dev} sequence(s) per device; remat per layer: {cfg.remat}; "
    f"compute {cfg.compute_dtype}, params {cfg.param_dtype}\n"
  )
  print(
    "| Muon distribution | compile s | args GiB | temps GiB | peak GiB | Muon collectives GB/device/step "
    "| all collectives GB/device/step |"
  )
  print("|---|---|---|---|---|---|---|")
  muon_bytes = {}
  for dist in ARGS.distributions:
    opt = make_optimizer(OptimizerConfig(muon_distribution=dist), mesh=mesh)
    t0 = time.perf_counter()
    compiled = ts.compile_train_step(
      cfg, opt, mesh, global_batch=ARGS.global_batch, seq_len=ARGS.seq_len, step_cfg=step_cfg
    )
    secs = time.perf_counter() - t0
    m = compiled.memory_analysis()
    peak = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
    colls = hlo_traffic.parse_collectives(compiled.as_text(), ARGS.devices)
    muon = hlo_traffic.total_bytes(colls, "muon_orthogonalize")
    every = hlo_traffic.total_bytes(colls)
    muon_bytes[dist] = muon
    print(
      f"| {dist} | {secs:.1f} | {m.argument_size_in_bytes / GiB:.2f} | {m.temp_size_in_bytes / GiB:.2f} "
      f"| {peak / GiB:.2f} | {muon / GB:.3f} | {every / GB:.2f} |",
      flush=True,
    )
  if {"all_to_all", "gather"} <= set(muon_bytes):
    print(
      f"\nMuon traffic, gather / all_to_all: {muon_bytes['gather'] / muon_bytes['all_to_all']:.1f}× "
      f"(bound with two all_to_alls: N/2 = {ARGS.devices / 2:.0f}×)"
    )


if __name__ == "__main__":
  main()
