"""Roofline of laplace-3b on one trn2.48xlarge from this project's own counts (docs/NEURON.md).

    python -m benchmarks neuron_roofline [--slots 1280] [--measure]

Hardware (Neuron docs, Trainium2): 16 chips; per chip 667 dense BF16 TFLOP/s, 96 GiB HBM at 2.9 TB/s,
NeuronLink-v3 1.28 TB/s; LNC=2 gives 4 logical cores per chip (64 devices), each assumed to get a quarter of
its chip's HBM and link bandwidth. Counts (nothing runs):
  training   FLOPs per token from laplace_jax.model.counts.flops_per_token (6·N-style, plus the chunked GLA; remat
             re-runs the forward, so the hardware does 4/3 of it); collective bytes per device per step: the
             FSDP floor 16·P·(N−1)/N (bf16 gathers in forward and remat, fp32 reduce-scatter) plus Muon's two
             all_to_alls, or with --measure both counted in the compiled step (laplace_jax.analysis.hlo_traffic; ≈15 s).
  decode     per step and device, in the serving layout (slots split over the 64 devices, weights
             replicated in bf16): every weight read once (embedding: its looked-up rows), the device's slot
             states read and written once, its logits written (benchmarks/decode_bytes.py's minimum);
             FLOPs 2·(matmul params) + 4·H·d_k·d_v per layer per token.
Published: ~120,000 training tokens/s and 11,544 decode tokens/s (1,280 sequences) on one instance.
"""

from __future__ import annotations

import argparse
import os
import sys

ARGS = None
CHIPS, CORES_PER_CHIP = 16, 4
BF16_FLOPS, HBM_BPS, LINK_BPS, HBM_GIB = 667e12, 2.9e12, 1.28e12, 96
PUBLISHED_TRAIN_TPS, PUBLISHED_DECODE_TPS = 120_000, 11_544
GLOBAL_BATCH, SEQ_LEN = 256, 2048  # 524,288 tokens per step, as the README's compile proof


def _args(argv):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--slots", type=int, default=1280)
  p.add_argument(
    "--measure",
    action="store_true",
    help="count the training collectives in the compiled laplace-3b step on 64 simulated devices",
  )
  return p.parse_args(argv)


def training(cfg, n_dev: int, measured: dict | None) -> dict:
  from laplace_jax.model.counts import flops_per_token, param_counts

  counts = param_counts(cfg)
  P, M = counts["total"], counts["muon"]
  fpt = flops_per_token(cfg)
  tokens = GLOBAL_BATCH * SEQ_LEN
  fsdp = 16 * P * (n_dev - 1) / n_dev
  muon = 2 * 2 * (4 * M / n_dev) * (n_dev - 1) / n_dev  # two all_to_alls of the fp32 shards, sent + received
  if measured:
    fsdp, muon = measured["all"] - measured["muon"], measured["muon"]
  peak = CHIPS * BF16_FLOPS
  t_compute = fpt * tokens / peak
  t_link = (fsdp + muon) * CORES_PER_CHIP / LINK_BPS
  return {
    "flops_per_token": fpt,
    "hardware_flops_per_token": fpt * 4 / 3 if cfg.remat else fpt,
    "tokens_per_step": tokens,
    "fsdp_bytes": fsdp,
    "muon_bytes": muon,
    "compute_s": t_compute,
    "link_s": t_link,
    "bound_tps": tokens / max(t_compute, t_link),
    "published_mfu": PUBLISHED_TRAIN_TPS * fpt / peak,
  }


def decode(cfg, slots: int, n_dev: int) -> dict:
  import jax

  from benchmarks import decode_bytes
  from laplace_jax.model.counts import param_counts, state_bytes_per_sequence

  params, state, _ = decode_bytes.abstract_inputs(cfg, slots)
  least = decode_bytes.minimum_bytes(cfg, params, state, slots)
  per_dev = least["weights_read"] + (least["state_read_and_written"] + least["logits_written"]) / n_dev
  counts = param_counts(cfg)
  fpt = (
    2 * (counts["muon"] + cfg.d_model * cfg.vocab_size) + 4 * cfg.n_layers * cfg.n_heads * cfg.d_k * cfg.d_v
  )
  t_hbm = per_dev / (HBM_BPS / CORES_PER_CHIP)
  t_state_only = (least["state_read_and_written"] / n_dev) / (HBM_BPS / CORES_PER_CHIP)
  t_compute = fpt * slots / (CHIPS * BF16_FLOPS)
  weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))  # the whole embedding is resident
  resident = weights + slots / n_dev * state_bytes_per_sequence(cfg)
  return {
    "minimum": least,
    "bytes_per_device": per_dev,
    "flops_per_token": fpt,
    "hbm_s": t_hbm,
    "compute_s": t_compute,
    "bound_tps": slots / max(t_hbm, t_compute),
    "state_only_tps": slots / t_state_only,
    "resident_bytes_per_device": resident,
    "state_bytes": state_bytes_per_sequence(cfg),
  }


def measure_collectives(cfg, n_dev: int) -> dict:
  from laplace_jax import sharding
  from laplace_jax.analysis import hlo_traffic
  from laplace_jax.training import train_step as ts
  from laplace_jax.training.optimizer import OptimizerConfig, make_optimizer

  mesh = sharding.make_mesh(data=1, fsdp=n_dev)
  opt = make_optimizer(OptimizerConfig(), mesh=mesh)
  compiled = ts.compile_train_step(cfg, opt, mesh, global_batch=GLOBAL_BATCH, seq_len=SEQ_LEN)
  colls = hlo_traffic.parse_collectives(compiled.as_text(), n_dev)
  total = lambda cs: sum(c.sent_bytes + c.received_bytes for c in cs)
  return {"all": total(colls), "muon": total([c for c in colls if "muon" in c.op_name])}


def main():
  from laplace_jax.model.config import get_config

  cfg = get_config("laplace-3b")
  n_dev = CHIPS * CORES_PER_CHIP
  measured = measure_collectives(cfg, n_dev) if ARGS.measure else None
  tr, de = training(cfg, n_dev, measured), decode(cfg, ARGS.slots, n_dev)
  GB = 1e9
  print(f"laplace-3b on one trn2.48xlarge ({CHIPS} chips, {n_dev} logical cores at LNC=2)\n")
  print("training, per step of 524,288 tokens")
  print(
    f"  FLOPs per token {tr['flops_per_token'] / 1e9:.2f} G (model), {tr['hardware_flops_per_token'] / 1e9:.2f} G "
    f"with remat's second forward"
  )
  print(
    f"  compute bound  {tr['compute_s'] * 1e3:7.1f} ms/step at {CHIPS} × 667 TFLOP/s -> "
    f"{tr['tokens_per_step'] / tr['compute_s']:,.0f} tokens/s"
  )
  src = "measured in the compiled step" if measured else "floor formula"
  print(
    f"  collectives    {tr['fsdp_bytes'] / GB:.2f} GB FSDP + {tr['muon_bytes'] / GB:.2f} GB Muon per device "
    f"({src}) -> {tr['link_s'] * 1e3:.1f} ms/step at 1.28 TB/s per chip"
  )
  print(
    f"  bound {tr['bound_tps']:,.0f} tokens/s; published {PUBLISHED_TRAIN_TPS:,} = "
    f"{PUBLISHED_TRAIN_TPS / tr['bound_tps']:.1%} of it (model-FLOPs MFU {tr['published_mfu']:.1%})"
  )
  m = de["minimum"]
  print(f"\ndecode, {ARGS.slots} slots split over {n_dev} devices, bf16 weights replicated")
  print(
    f"  state {de['state_bytes'] / 1e6:.1f} MB per sequence; per step: states read+written "
    f"{m['state_read_and_written'] / GB:.1f} GB in all, weights read {m['weights_read'] / GB:.2f} GB per device, "
    f"logits {m['logits_written'] / GB:.2f} GB in all"
  )
  print(
    f"  HBM bytes per device per step {de['bytes_per_device'] / GB:.2f} GB -> {de['hbm_s'] * 1e3:.2f} ms at "
    f"{HBM_BPS / CORES_PER_CHIP / 1e9:.0f} GB/s per logical core"
  )
  print(
    f"  compute {de['flops_per_token'] / 1e9:.2f} GFLOP per token -> {de['compute_s'] * 1e3:.2f} ms per step"
  )
  print(
    f"  resident per device {de['resident_bytes_per_device'] / 2**30:.2f} GiB of "
    f"{HBM_GIB / CORES_PER_CHIP:.0f} GiB"
  )
  print(
    f"  bound {de['bound_tps']:,.0f} tokens/s (states alone: {de['state_only_tps']:,.0f}); published "
    f"{PUBLISHED_DECODE_TPS:,} = {PUBLISHED_DECODE_TPS / de['bound_tps']:.1%} of it"
  )


if __name__ == "__main__":
  ARGS = _args(sys.argv[1:])
  if ARGS.measure:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before JAX is imported
    from laplace_jax.platform import simulate_cpu_devices

    simulate_cpu_devices(CHIPS * CORES_PER_CHIP)
  main()
