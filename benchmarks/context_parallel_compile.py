"""Long rows by context parallelism: the train step compiled with a "context" mesh axis (nothing runs).

    python benchmarks/context_parallel_compile.py [--preset laplace-3b] [--devices 64]
        [--runs 65536:4 262144:16] [--rows-per-group 1]

Each run SEQ:C lowers and compiles the whole step (Muon all_to_all + AdamW, packed documents' segment ids)
from abstract shapes on a data 1 × fsdp (devices/C) × context C mesh, with rows-per-group rows per FSDP
device (global batch fsdp · rows-per-group), each row's SEQ tokens split into C spans of SEQ/C. It reports
per-device memory (`memory_analysis()`) and the bytes each device sends plus receives per step (compiled HLO,
laplace_jax.hlo_traffic), against the floor of this design:

    FSDP (fsdp_traffic.py's):  16·P·(F−1)/F, F = the fsdp size (bf16 gathers in the forward and the remat,
                               fp32 reduce-scatter)
    gradient shards over C:    2·2·(4P/F)·(C−1)/C (an all-reduce of the fp32 shards: every span saw the rows)
    the GLA state across spans: 3 passes (forward, remat, backward) · L · rows · H·d_k·d_v·4 bytes, each way:
                               one state per device and layer, sent and received

Muon's own all_to_alls (the `muon_orthogonalize` scope; benchmarks/muon_traffic.py has their floor) are shown
apart and left out of the ratio. And what the context-parallel exchanges alone move (ops in the
`context_parallel` scope: the GLA's scan, the conv's previous inputs, segment structure), beside their floor,
the GLA term above.
"""

import argparse
import os
import sys


def _args(argv):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--preset", default="laplace-3b")
  p.add_argument("--devices", type=int, default=64)
  p.add_argument("--runs", nargs="+", default=["65536:4", "262144:16"], help="SEQ:CONTEXT pairs")
  p.add_argument("--rows-per-group", type=int, default=1, help="rows per FSDP device (and per context group)")
  return p.parse_args(argv)


ARGS = _args(sys.argv[1:])
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before JAX is imported

from laplace_jax.platform import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(ARGS.devices)

import platform  # noqa: E402
import time  # noqa: E402

from laplace_jax import context_parallel, hlo_traffic, sharding  # noqa: E402
from laplace_jax import train_step as ts  # noqa: E402
from laplace_jax.config import get_config  # noqa: E402
from laplace_jax.counts import param_counts  # noqa: E402
from laplace_jax.optimizer import OptimizerConfig, make_optimizer  # noqa: E402

GiB, GB = 2**30, 1e9


def floors(cfg, n_params: int, fsdp: int, context: int, rows: int) -> tuple[float, float, float]:
  """(FSDP's, the gradient shards' all-reduce over the context axis, the GLA state's) bytes per device."""
  fsdp_b = 16 * n_params * (fsdp - 1) / fsdp
  grads_b = 2 * 2 * (4 * n_params / fsdp) * (context - 1) / context
  state = cfg.n_heads * cfg.d_k * cfg.d_v * 4
  passes = 3 if cfg.remat else 2
  gla_b = 2 * passes * cfg.n_mixer_layers("G") * rows * state
  return fsdp_b, grads_b, gla_b


def main():
  cfg = get_config(ARGS.preset)
  n_params = param_counts(cfg)["total"]
  print(
    f"{ARGS.preset} ({n_params:,} parameters) train step on {ARGS.devices} simulated devices "
    f"({platform.machine()}, {os.cpu_count()} cores), {ARGS.rows_per_group} row(s) per FSDP device, remat "
    f"{cfg.remat}, compute {cfg.compute_dtype}, packed documents' segment ids\n"
  )
  print(
    "| tokens per row | mesh (fsdp × context) | span tokens | rows | compile s | args GiB | temps GiB | "
    "peak GiB/device | all collectives GB | Muon GB | the rest GB | floor GB | rest / floor | "
    "context-parallel GB | its floor GB |"
  )
  print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
  for run in ARGS.runs:
    seq, context = (int(x) for x in run.split(":"))
    fsdp = ARGS.devices // context
    rows = fsdp * ARGS.rows_per_group
    mesh = sharding.make_mesh(data=1, fsdp=fsdp, context=context)
    opt = make_optimizer(OptimizerConfig(), mesh=mesh)
    t0 = time.perf_counter()
    compiled = ts.compile_train_step(cfg, opt, mesh, global_batch=rows, seq_len=seq, segmented=True)
    secs = time.perf_counter() - t0
    m = compiled.memory_analysis()
    peak = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
    colls = hlo_traffic.parse_collectives(compiled.as_text(), ARGS.devices)
    every, cp = hlo_traffic.total_bytes(colls), hlo_traffic.total_bytes(colls, context_parallel.SCOPE)
    muon = hlo_traffic.total_bytes(colls, "muon_orthogonalize")
    fsdp_b, grads_b, gla_b = floors(cfg, n_params, fsdp, context, ARGS.rows_per_group)
    floor = fsdp_b + grads_b + gla_b
    print(
      f"| {seq:,} | {fsdp} × {context} | {seq // context:,} | {rows} | {secs:.0f} | "
      f"{m.argument_size_in_bytes / GiB:.2f} | {m.temp_size_in_bytes / GiB:.2f} | {peak / GiB:.2f} | "
      f"{every / GB:.2f} | {muon / GB:.2f} | {(every - muon) / GB:.2f} | {floor / GB:.2f} | "
      f"{(every - muon) / floor:.3f} | {cp / GB:.3f} | {gla_b / GB:.3f} |",
      flush=True,
    )


if __name__ == "__main__":
  main()
