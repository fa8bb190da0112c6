"""Bytes per device per step in Muon's collectives: two all_to_alls vs gathering every matrix.

Compiles (never runs, never allocates) the Muon update of a preset's hidden matrices on a simulated
N-device FSDP mesh, from ShapeDtypeStructs with NamedShardings, and counts the collectives in the compiled
HLO with laplace_jax.hlo_traffic. Prints a markdown table.

    python benchmarks/muon_traffic.py [--preset laplace-3b] [--devices 64]
"""

import argparse
import os
import sys


def _args(argv):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--preset", default="laplace-3b")
  p.add_argument("--devices", type=int, default=64, help="simulated CPU devices, all on the fsdp axis")
  return p.parse_args(argv)


ARGS = _args(sys.argv[1:])
# Before JAX's first use of a device: N simulated CPU devices.
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before JAX is imported

from laplace_jax.platform import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(ARGS.devices)

import platform  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from laplace_jax import config, counts, hlo_traffic, sharding  # noqa: E402
from laplace_jax.muon import MuonState, make_plan, muon, ns_flops_per_device  # noqa: E402

GB = 1e9


def abstract_muon_params(cfg, mesh):
  """The Muon leaves {layers: {name: [L, fan_in, fan_out]}} as sharded ShapeDtypeStructs."""
  shapes = counts.param_shapes(cfg)["layer"]
  tree = {
    "layers": {
      n: jax.ShapeDtypeStruct((cfg.n_layers,) + shapes[n], jnp.float32) for n in config.MUON_PARAM_NAMES
    }
  }
  shardings = sharding.param_shardings(tree, mesh)
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def measure(cfg, mesh, distribution):
  """Compile the Muon update for one distribution; return traffic, memory and compile time per device."""
  params = abstract_muon_params(cfg, mesh)
  tx = muon(0.02, mesh=mesh, distribution=distribution)
  state = MuonState(jax.ShapeDtypeStruct((), jnp.int32, sharding=sharding.replicated(mesh)), params)
  t0 = time.perf_counter()
  compiled = jax.jit(tx.update, donate_argnums=(1,)).lower(params, state).compile()
  seconds = time.perf_counter() - t0
  n = mesh.devices.size
  colls = hlo_traffic.parse_collectives(compiled.as_text(), n)
  kinds = hlo_traffic.traffic_by_kind(colls)
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


def main():
  cfg = config.get_config(ARGS.preset)
  mesh = sharding.make_mesh(fsdp=ARGS.devices)
  n = ARGS.devices
  rows = [measure(cfg, mesh, d) for d in ("all_to_all", "gather")]
  muon_bytes = counts.param_counts(cfg)["muon"] * 4
  shapes = [x.shape for x in jax.tree.leaves(abstract_muon_params(cfg, mesh))]
  plan = make_plan(shapes, n)

  print(
    f"Muon update of {ARGS.preset} ({muon_bytes / GB:.3f} GB of fp32 matrices, "
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


if __name__ == "__main__":
  main()
