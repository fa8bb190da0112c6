"""What unrolling the layer stack costs to lower: the laplace-3b train step under `--target neuron` (64 simulated
devices, the README's compile-proof shapes), scanned vs unrolled, in fresh processes, alternated.

    python benchmarks/scan_layers_cost.py [--runs 3]

Prints each run's CPU seconds of the lowering alone (`time.process_time`, which a busy shared machine stretches
less than wall time) and the StableHLO's size. docs/NEURON.md ("The layer stack") quotes it.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

from laplace_jax.platform import CPU_DEVICES_ENV

ROOT = pathlib.Path(__file__).resolve().parents[1]
ARGS = [
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
]


def one(scan_layers: str, hlo_dir: str) -> None:
  """In this process: lower once, the loop's lowering timer reading CPU seconds; print the summary JSON."""
  import time

  time.perf_counter = time.process_time  # train.loop's lower_s becomes CPU seconds
  from train.__main__ import main

  main([*ARGS, "--model.scan_layers", scan_layers, "--hlo_dir", hlo_dir, "--no_progress"])


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--runs", type=int, default=3)
  ap.add_argument("--one", help=argparse.SUPPRESS)
  ap.add_argument("--hlo_dir", help=argparse.SUPPRESS)
  args = ap.parse_args()
  if args.one:
    return one(args.one, args.hlo_dir)
  env = {k: v for k, v in os.environ.items() if k not in (CPU_DEVICES_ENV, "JAX_PLATFORMS")}
  got = {"true": [], "false": []}
  size = {}
  for _ in range(args.runs):
    for form in got:
      with tempfile.TemporaryDirectory() as d:
        out = subprocess.run(
          [sys.executable, __file__, "--one", form, "--hlo_dir", d],
          cwd=ROOT,
          env=env,
          capture_output=True,
          text=True,
          check=True,
        ).stdout
        got[form].append(json.loads(out.strip().splitlines()[-1])["lower_s"])
        size[form] = (pathlib.Path(d) / "train_step.mlir").stat().st_size
  for form, cpu in got.items():
    name = "scanned" if form == "true" else "unrolled"
    print(
      f"{name:9s} lowering CPU s {', '.join(f'{c:.2f}' for c in cpu)} (median {statistics.median(cpu):.2f}); "
      f"StableHLO {size[form]:,} bytes"
    )
  print(
    f"unrolled / scanned: CPU {statistics.median(got['false']) / statistics.median(got['true']):.2f}x, "
    f"text {size['false'] / size['true']:.2f}x"
  )


if __name__ == "__main__":
  main()
