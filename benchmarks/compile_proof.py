"""Compile proofs: laplace-3b's whole train step (or its Muon update alone) lowered from abstract shapes on N
simulated CPU devices and compiled; nothing is allocated or run. Per-device memory from `memory_analysis()`;
bytes each device sends plus receives per step in the collectives of the compiled HLO
(laplace_jax.analysis.hlo_traffic: loop bodies once per iteration). One mode per question:

    python -m benchmarks fsdp_traffic [--micro-batches 1 2 4] [--no-remat]
    python -m benchmarks train_compile [--micro-batches 1] [--distributions all_to_all gather]
    python -m benchmarks muon_traffic
    python -m benchmarks context_parallel_compile [--runs 65536:4 262144:16] [--rows-per-group 1]

(each is `python -m benchmarks.compile_proof {fsdp,distributions,muon,context} ...`; every mode takes
`--preset laplace-3b --devices 64`, the step modes `--global-batch 256 --seq-len 2048`).

fsdp           FSDP's traffic per micro-batch count against the floor of the design,
               floor = m · (2 gathers · 2·(2P) + 1 reduce-scatter · 2·(4P)) · (N−1)/N = m · 16·P·(N−1)/N
               (m micro-batches, P parameters, N FSDP devices; bf16 weights gathered in the forward and again
               in the rematerialised backward, fp32 gradients reduce-scattered once; without remat one gather).
distributions  per Muon distribution: memory, Muon's collectives (the `muon_orthogonalize` scope) and all.
muon           the Muon update of the hidden matrices alone, from sharded ShapeDtypeStructs: two all_to_alls
               against gathering every matrix, Newton–Schulz FLOPs per device and the slot plan.
context        each run SEQ:C on a data 1 × fsdp (devices/C) × context C mesh, rows-per-group rows per FSDP
               device, each row's SEQ tokens in C spans, packed documents' segment ids; against the floor
                 FSDP's 16·P·(F−1)/F (F the fsdp size)
                 + the gradient shards' all-reduce over C, 2·2·(4P/F)·(C−1)/C
                 + the GLA state across spans, 3 passes (forward, remat, backward) · L · rows · H·d_k·d_v·4 B
                   each way;
               Muon's all_to_alls are shown apart and left out of the ratio, and the context-parallel
               exchanges alone (the `context_parallel` scope) beside the GLA term.
"""

import argparse
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # simulated CPU devices; before JAX is imported

import platform  # noqa: E402
import time  # noqa: E402
from collections import defaultdict  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from laplace_jax import param_names, sharding
from laplace_jax.analysis import hlo_traffic
from laplace_jax.model import config, counts  # noqa: E402
from laplace_jax.ops import context_parallel
from laplace_jax.platform import simulate_cpu_devices  # noqa: E402
from laplace_jax.training import train_step as ts  # noqa: E402
from laplace_jax.training.muon import MuonState, make_plan, muon, ns_flops_per_device  # noqa: E402
from laplace_jax.training.optimizer import OptimizerConfig, make_optimizer  # noqa: E402

GiB, GB = 2**30, 1e9


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  common = argparse.ArgumentParser(add_help=False)
  common.add_argument("--preset", default="laplace-3b")
  common.add_argument("--devices", type=int, default=64, help="simulated CPU devices")
  step = argparse.ArgumentParser(add_help=False, parents=[common])
  step.add_argument(
    "--global-batch", type=int, default=256, help="sequences per step (256 × 2,048 = 524,288)"
  )
  step.add_argument("--seq-len", type=int, default=2048)
  modes = p.add_subparsers(dest="mode", required=True)
  m = modes.add_parser("fsdp", parents=[step], help="FSDP traffic per micro-batch count against its floor")
  m.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2, 4])
  m.add_argument("--no-remat", action="store_true", help="compile without per-layer remat")
  m = modes.add_parser("distributions", parents=[step], help="memory and traffic per Muon distribution")
  m.add_argument(
    "--micro-batches",
    type=int,
    default=1,
    help="1, as in the README's compile proof: the least FSDP traffic that fits 24 GiB",
  )
  m.add_argument("--distributions", nargs="+", default=["all_to_all", "gather"])
  modes.add_parser("muon", parents=[common], help="the Muon update alone: all_to_all against gather")
  m = modes.add_parser("context", parents=[common], help="context parallelism: memory and traffic per run")
  m.add_argument("--runs", nargs="+", default=["65536:4", "262144:16"], help="SEQ:CONTEXT pairs")
  m.add_argument("--rows-per-group", type=int, default=1, help="rows per FSDP device (and per context group)")
  return p.parse_args(argv)


def compile_step(cfg, opt, mesh, n_dev, **kw):
  """The train step compiled from abstract shapes: (seconds, memory analysis, peak bytes, collectives)."""
  t0 = time.perf_counter()
  compiled = ts.compile_train_step(cfg, opt, mesh, **kw)
  secs = time.perf_counter() - t0
  m = compiled.memory_analysis()
  peak = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
  return secs, m, peak, hlo_traffic.parse_collectives(compiled.as_text(), n_dev)


def fsdp_floor_bytes(n_params: int, n_dev: int, micro_batches: int, remat: bool = True) -> float:
  """Bytes sent + received per device per step by FSDP's weight gathers and gradient reduce-scatters."""
  gathers = 2 if remat else 1
  return micro_batches * (gathers * 2 * 2 * n_params + 2 * 4 * n_params) * (n_dev - 1) / n_dev


def fsdp(a):
  cfg = config.get_config(a.preset, remat=not a.no_remat)
  P = counts.param_counts(cfg)["total"]
  mesh = sharding.make_mesh(data=1, fsdp=a.devices)
  opt = make_optimizer(OptimizerConfig(), mesh=mesh)
  print(
    f"{a.preset} ({P:,} parameters) train step on {a.devices} simulated CPU devices, "
    f"{a.global_batch} × {a.seq_len} tokens per step, remat {cfg.remat}, compute {cfg.compute_dtype}\n"
  )
  print(
    "| micro-batches | compile s | peak GiB/device | all-gather GB (dtype) | reduce-scatter GB (dtype) | "
    "all-reduce GB | all-to-all GB | total GB | floor GB | total / floor |"
  )
  print("|---|---|---|---|---|---|---|---|---|---|")
  for m in a.micro_batches:
    secs, _, peak, colls = compile_step(
      cfg,
      opt,
      mesh,
      a.devices,
      global_batch=a.global_batch,
      seq_len=a.seq_len,
      step_cfg=ts.StepConfig(micro_batches=m),
    )
    by: dict = defaultdict(float)
    dtypes = defaultdict(set)
    for c in colls:
      by[c.kind] += c.sent_bytes + c.received_bytes
      if c.sent_bytes:
        dtypes[c.kind].add(c.dtype)
    total = sum(by.values())
    fl = fsdp_floor_bytes(P, a.devices, m, cfg.remat)
    show = lambda k: f"{by[k] / GB:.2f}" + (f" ({','.join(sorted(dtypes[k]))})" if dtypes[k] else "")
    print(
      f"| {m} | {secs:.0f} | {peak / GiB:.2f} | {show('all-gather')} | {show('reduce-scatter')} | "
      f"{show('all-reduce')} | {by['all-to-all'] / GB:.2f} | {total / GB:.2f} | {fl / GB:.2f} | "
      f"{total / fl:.3f} |",
      flush=True,
    )


def distributions(a):
  cfg = config.get_config(a.preset)
  mesh = sharding.make_mesh(data=1, fsdp=a.devices)
  step_cfg = ts.StepConfig(micro_batches=a.micro_batches)
  per_dev = a.global_batch // (a.devices * a.micro_batches)
  print(
    f"{a.preset} train step on {a.devices} simulated devices ({platform.machine()}, "
    f"{os.cpu_count()} cores); {a.global_batch} × {a.seq_len} tokens per step = "
    f"{a.micro_batches} micro-batches × {per_dev} sequence(s) per device; remat per layer: {cfg.remat}; "
    f"compute {cfg.compute_dtype}, params {cfg.param_dtype}\n"
  )
  print(
    "| Muon distribution | compile s | args GiB | temps GiB | peak GiB | Muon collectives GB/device/step "
    "| all collectives GB/device/step |"
  )
  print("|---|---|---|---|---|---|---|")
  muon_bytes = {}
  for dist in a.distributions:
    opt = make_optimizer(OptimizerConfig(muon_distribution=dist), mesh=mesh)
    secs, m, peak, colls = compile_step(
      cfg, opt, mesh, a.devices, global_batch=a.global_batch, seq_len=a.seq_len, step_cfg=step_cfg
    )
    muon_b = hlo_traffic.total_bytes(colls, "muon_orthogonalize")
    every = hlo_traffic.total_bytes(colls)
    muon_bytes[dist] = muon_b
    print(
      f"| {dist} | {secs:.1f} | {m.argument_size_in_bytes / GiB:.2f} | {m.temp_size_in_bytes / GiB:.2f} "
      f"| {peak / GiB:.2f} | {muon_b / GB:.3f} | {every / GB:.2f} |",
      flush=True,
    )
  if {"all_to_all", "gather"} <= set(muon_bytes):
    print(
      f"\nMuon traffic, gather / all_to_all: {muon_bytes['gather'] / muon_bytes['all_to_all']:.1f}× "
      f"(bound with two all_to_alls: N/2 = {a.devices / 2:.0f}×)"
    )


def abstract_muon_params(cfg, mesh):
  """The Muon leaves {layers: {name: [L, fan_in, fan_out]}} as sharded ShapeDtypeStructs."""
  shapes = counts.param_shapes(cfg)["layer"]
  tree = {
    "layers": {
      n: jax.ShapeDtypeStruct((cfg.n_layers,) + shapes[n], jnp.float32) for n in param_names.MUON_PARAM_NAMES
    }
  }
  shardings = sharding.param_shardings(tree, mesh)
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def measure_muon(cfg, mesh, distribution):
  """Compile the Muon update for one distribution; return traffic, memory and compile time per device."""
  params = abstract_muon_params(cfg, mesh)
  tx = muon(0.02, mesh=mesh, distribution=distribution)
  state = MuonState(jax.ShapeDtypeStruct((), jnp.int32, sharding=sharding.replicated(mesh)), params)
  t0 = time.perf_counter()
  compiled = jax.jit(tx.update, donate_argnums=(1,)).lower(params, state).compile()
  seconds = time.perf_counter() - t0
  n = mesh.devices.size
  kinds = hlo_traffic.traffic_by_kind(hlo_traffic.parse_collectives(compiled.as_text(), n))
  mem = compiled.memory_analysis()
  flops = ns_flops_per_device([x.shape for x in jax.tree.leaves(params)], n, distribution=distribution)
  return {
    "distribution": distribution,
    "compile_s": seconds,
    "kinds": kinds,
    "sent": sum(k["sent_bytes"] for k in kinds.values()),
    "received": sum(k["received_bytes"] for k in kinds.values()),
    "temp_bytes": getattr(mem, "temp_size_in_bytes", float("nan")),
    "flops_max": flops["max"],
    "flops_mean": flops["mean"],
    "padding": flops["padding_overhead"],
  }


def muon_update(a):
  cfg = config.get_config(a.preset)
  mesh = sharding.make_mesh(fsdp=a.devices)
  n = a.devices
  rows = [measure_muon(cfg, mesh, d) for d in ("all_to_all", "gather")]
  muon_bytes = counts.param_counts(cfg)["muon"] * 4
  shapes = [x.shape for x in jax.tree.leaves(abstract_muon_params(cfg, mesh))]
  plan = make_plan(shapes, n)
  print(
    f"Muon update of {a.preset} ({muon_bytes / GB:.3f} GB of fp32 matrices, "
    f"{len(plan.mats)} matrices) on {n} simulated devices ({platform.machine()}, {os.cpu_count()} cores, "
    f"jax {jax.__version__})\n"
  )
  print(
    "| variant | collectives | sent GB/device | received GB/device | sent+received GB | "
    "NS GFLOP max/mean per device | temp GB/device | compile s |"
  )
  print("|---|---|---:|---:|---:|---:|---:|---:|")
  for r in rows:
    kinds = ", ".join(f"{v['count']}× {k}" for k, v in sorted(r["kinds"].items()))
    print(
      f"| {r['distribution']} | {kinds} | {r['sent'] / GB:.3f} | {r['received'] / GB:.3f} | "
      f"{(r['sent'] + r['received']) / GB:.3f} | {r['flops_max'] / 1e9:,.0f} / {r['flops_mean'] / 1e9:,.0f} | "
      f"{r['temp_bytes'] / GB:.2f} | {r['compile_s']:.1f} |"
    )
  a2a, gather = rows
  ratio = (gather["sent"] + gather["received"]) / (a2a["sent"] + a2a["received"])
  ideal_chunk = muon_bytes / n / n
  print(
    f"\ngather / all_to_all traffic: {ratio:.1f}×  (N/2 = {n / 2:.0f}× if every owner held exactly 1/N "
    f"of the matrices; this plan's per-peer chunk is {plan.chunk * 4 / ideal_chunk:.3f}× that share, so "
    f"{n / 2 / (plan.chunk * 4 / ideal_chunk):.1f}× is this plan's bound)"
  )
  slots = ", ".join(f"[{S}, {L}]" for S, L in plan.slots)
  padded = sum(
    plan.mats[i].wide_shape != slot for slot, row in zip(plan.slots, plan.slot_mats) for i in row if i >= 0
  )
  empty = sum(i < 0 for row in plan.slot_mats for i in row)
  print(
    f"Slots on every device: {slots}; {padded} of {len(plan.mats)} matrices zero-padded, {empty} slots empty"
  )
  print(
    f"Newton–Schulz balance (all_to_all): busiest device / even split = "
    f"{a2a['flops_max'] / a2a['flops_mean']:.3f}; slot padding FLOP overhead (FLOPs run on all devices / "
    f"the matrices' own − 1) = {a2a['padding']:.1%}"
  )


def context_floors(cfg, n_params: int, fsdp: int, context: int, rows: int) -> tuple[float, float, float]:
  """(FSDP's, the gradient shards' all-reduce over the context axis, the GLA state's) bytes per device."""
  fsdp_b = 16 * n_params * (fsdp - 1) / fsdp
  grads_b = 2 * 2 * (4 * n_params / fsdp) * (context - 1) / context
  state = cfg.n_heads * cfg.d_k * cfg.d_v * 4
  passes = 3 if cfg.remat else 2
  gla_b = 2 * passes * cfg.n_mixer_layers("G") * rows * state
  return fsdp_b, grads_b, gla_b


def context(a):
  cfg = config.get_config(a.preset)
  n_params = counts.param_counts(cfg)["total"]
  print(
    f"{a.preset} ({n_params:,} parameters) train step on {a.devices} simulated devices "
    f"({platform.machine()}, {os.cpu_count()} cores), {a.rows_per_group} row(s) per FSDP device, remat "
    f"{cfg.remat}, compute {cfg.compute_dtype}, packed documents' segment ids\n"
  )
  print(
    "| tokens per row | mesh (fsdp × context) | span tokens | rows | compile s | args GiB | temps GiB | "
    "peak GiB/device | all collectives GB | Muon GB | the rest GB | floor GB | rest / floor | "
    "context-parallel GB | its floor GB |"
  )
  print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
  for run in a.runs:
    seq, ctx = (int(x) for x in run.split(":"))
    fsdp_n = a.devices // ctx
    rows = fsdp_n * a.rows_per_group
    mesh = sharding.make_mesh(data=1, fsdp=fsdp_n, context=ctx)
    opt = make_optimizer(OptimizerConfig(), mesh=mesh)
    secs, m, peak, colls = compile_step(
      cfg, opt, mesh, a.devices, global_batch=rows, seq_len=seq, segmented=True
    )
    every, cp = hlo_traffic.total_bytes(colls), hlo_traffic.total_bytes(colls, context_parallel.SCOPE)
    muon_b = hlo_traffic.total_bytes(colls, "muon_orthogonalize")
    fsdp_b, grads_b, gla_b = context_floors(cfg, n_params, fsdp_n, ctx, a.rows_per_group)
    floor = fsdp_b + grads_b + gla_b
    print(
      f"| {seq:,} | {fsdp_n} × {ctx} | {seq // ctx:,} | {rows} | {secs:.0f} | "
      f"{m.argument_size_in_bytes / GiB:.2f} | {m.temp_size_in_bytes / GiB:.2f} | {peak / GiB:.2f} | "
      f"{every / GB:.2f} | {muon_b / GB:.2f} | {(every - muon_b) / GB:.2f} | {floor / GB:.2f} | "
      f"{(every - muon_b) / floor:.3f} | {cp / GB:.3f} | {gla_b / GB:.3f} |",
      flush=True,
    )


MODES = {"fsdp": fsdp, "distributions": distributions, "muon": muon_update, "context": context}


def main(argv=None):
  a = parse_args(argv)
  simulate_cpu_devices(a.devices)  # before the first use of a device
  MODES[a.mode](a)


if __name__ == "__main__":
  main()
