"""FSDP traffic of the compiled train step against its floor, per micro-batch count (nothing runs).

    python benchmarks/fsdp_traffic.py [--preset laplace-3b] [--devices 64] [--global-batch 256]
        [--seq-len 2048] [--micro-batches 1 2 4] [--no-remat]

For each micro-batch count: compile time, per-device memory (`memory_analysis()`), and the bytes each device
sends plus receives per step in every collective of the compiled HLO (laplace_jax.hlo_traffic: loop bodies
once per iteration), by kind and element type, against the floor of the design:

    floor = m · (2 gathers · 2·(2P) + 1 reduce-scatter · 2·(4P)) · (N−1)/N = m · 16·P·(N−1)/N

(m micro-batches, P parameters, N FSDP devices; bf16 weights gathered in the forward and again in the
rematerialised backward, fp32 gradients reduce-scattered once). Without remat the floor counts one gather.
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
  p.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2, 4])
  p.add_argument("--no-remat", action="store_true", help="compile without per-layer remat")
  return p.parse_args(argv)


ARGS = _args(sys.argv[1:])
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before JAX is imported

from laplace_jax.platform import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(ARGS.devices)

import time  # noqa: E402
from collections import defaultdict  # noqa: E402

from laplace_jax import hlo_traffic, sharding  # noqa: E402
from laplace_jax import train_step as ts  # noqa: E402
from laplace_jax.config import get_config  # noqa: E402
from laplace_jax.counts import param_counts  # noqa: E402
from laplace_jax.optimizer import OptimizerConfig, make_optimizer  # noqa: E402

GiB, GB = 2**30, 1e9


def floor_bytes(n_params: int, n_dev: int, micro_batches: int, remat: bool = True) -> float:
  """Bytes sent + received per device per step by FSDP's weight gathers and gradient reduce-scatters."""
  gathers = 2 if remat else 1
  return micro_batches * (gathers * 2 * 2 * n_params + 2 * 4 * n_params) * (n_dev - 1) / n_dev


def main():
  cfg = get_config(ARGS.preset, remat=not ARGS.no_remat)
  P = param_counts(cfg)["total"]
  mesh = sharding.make_mesh(data=1, fsdp=ARGS.devices)
  opt = make_optimizer(OptimizerConfig(), mesh=mesh)
  print(
    f"{ARGS.preset} ({P:,} parameters) train step on {ARGS.devices} simulated CPU devices, "
    f"{ARGS.global_batch} × {ARGS.seq_len} tokens per step, remat {cfg.remat}, compute {cfg.compute_dtype}\n"
  )
  print(
    "| micro-batches | compile s | peak GiB/device | all-gather GB (dtype) | reduce-scatter GB (dtype) | "
    "all-reduce GB | all-to-all GB | total GB | floor GB | total / floor |"
  )
  print("|---|---|---|---|---|---|---|---|---|---|")
  for m in ARGS.micro_batches:
    t0 = time.perf_counter()
    compiled = ts.compile_train_step(
      cfg,
      opt,
      mesh,
      global_batch=ARGS.global_batch,
      seq_len=ARGS.seq_len,
      step_cfg=ts.StepConfig(micro_batches=m),
    )
    secs = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    peak = (
      mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes - mem.alias_size_in_bytes
    )
    colls = hlo_traffic.parse_collectives(compiled.as_text(), ARGS.devices)
    by = defaultdict(float)
    dtypes = defaultdict(set)
    for c in colls:
      by[c.kind] += c.sent_bytes + c.received_bytes
      if c.sent_bytes:
        dtypes[c.kind].add(c.dtype)
    total = sum(by.values())
    fl = floor_bytes(P, ARGS.devices, m, cfg.remat)
    show = lambda k: f"{by[k] / GB:.2f}" + (f" ({','.join(sorted(dtypes[k]))})" if dtypes[k] else "")
    print(
      f"| {m} | {secs:.0f} | {peak / GiB:.2f} | {show('all-gather')} | {show('reduce-scatter')} | "
      f"{show('all-reduce')} | {by['all-to-all'] / GB:.2f} | {total / GB:.2f} | {fl / GB:.2f} | "
      f"{total / fl:.3f} |",
      flush=True,
    )


if __name__ == "__main__":
  main()
