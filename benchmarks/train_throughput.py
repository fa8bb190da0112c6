"""Train-step throughput and MFU, and Muon's share of step time beside its share of FLOPs.

    python -m benchmarks train_throughput [--preset small] [--batch 4] [--seq-len 512] [--steps 3]
        [--compute-dtype float32] [--matmul-size 2048] [--micro-batches 1] [--muon-ns-dtype float32]
        [--compile-only]

Runs the real compiled step (model + Muon/AdamW, one device) on random tokens. Model FLOPs per token are
laplace_jax.model.counts.flops_per_token (6·matmul params + the chunked GLA); MFU is against a matmul peak of the
same dtype measured in the same run. Muon's time share is the compiled optimizer update timed alone over
the step time; its FLOP share is the Newton–Schulz FLOPs over model + Newton–Schulz FLOPs.
"""

from __future__ import annotations

import argparse
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from laplace_jax import sharding
from laplace_jax.analysis import timing
from laplace_jax.data.tokenizer import VOCAB_SIZE
from laplace_jax.model.config import get_config
from laplace_jax.model.counts import flops_per_token, param_shapes
from laplace_jax.param_names import MUON_PARAM_NAMES
from laplace_jax.training import train_step as ts
from laplace_jax.training.muon import ns_flops
from laplace_jax.training.optimizer import OptimizerConfig, make_optimizer


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--preset", default="small")
  ap.add_argument("--batch", type=int, default=4)
  ap.add_argument("--seq-len", type=int, default=512)
  ap.add_argument("--steps", type=int, default=3)
  ap.add_argument("--compute-dtype", default=None, help="override the preset's compute dtype")
  ap.add_argument("--no-remat", action="store_true")
  ap.add_argument(
    "--micro-batches", type=int, default=1, help="split the batch into accumulated micro-batches"
  )
  ap.add_argument("--muon-ns-dtype", default="float32", help="Newton-Schulz iterations: float32 | bfloat16")
  ap.add_argument("--compile-only", action="store_true", help="print the compiled step's memory and exit")
  ap.add_argument("--matmul-size", type=int, default=2048)
  args = ap.parse_args()
  cfg = get_config(args.preset)
  if args.compute_dtype:
    cfg = cfg.replace(compute_dtype=args.compute_dtype)
  if args.no_remat:
    cfg = cfg.replace(remat=False)
  mesh = sharding.make_mesh(data=1, fsdp=1, devices=jax.devices()[:1])
  opt = make_optimizer(
    OptimizerConfig(total_steps=1000, warmup_steps=10, muon_ns_dtype=args.muon_ns_dtype), mesh=None
  )
  peak = timing.matmul_peak_flops(args.matmul_size, jnp.dtype(cfg.compute_dtype))
  print(
    f"device: {jax.devices()[0].device_kind} ({platform.machine()}); {cfg.compute_dtype} "
    f"{args.matmul_size}² matmul peak {peak / 1e9:.1f} GFLOP/s"
  )

  compiled = ts.compile_train_step(
    cfg,
    opt,
    mesh,
    global_batch=args.batch,
    seq_len=args.seq_len,
    step_cfg=ts.StepConfig(micro_batches=args.micro_batches),
  )
  mem = compiled.memory_analysis()
  if mem is not None:
    print(
      f"compiled step: arguments {mem.argument_size_in_bytes / 2**30:.1f} GiB, temporaries "
      f"{mem.temp_size_in_bytes / 2**30:.1f} GiB ({args.micro_batches} micro-batch(es) of "
      f"{args.batch // args.micro_batches} × {args.seq_len})"
    )
  if args.compile_only:
    return
  state = ts.init_train_state_on_mesh(cfg, opt, mesh, seed=0)
  toks = np.random.default_rng(0).integers(0, VOCAB_SIZE, (args.batch, args.seq_len + 1)).astype(np.int32)
  batch = ts.Batch(inputs=toks[:, :-1], targets=toks[:, 1:])
  state, m = compiled(state, batch)  # warm-up
  jax.block_until_ready(m)
  times = []
  for _ in range(args.steps):
    t0 = time.perf_counter()
    state, m = compiled(state, batch)
    jax.block_until_ready(m)
    times.append(time.perf_counter() - t0)
  step_s = float(np.median(times))

  # The optimizer update alone, on gradients shaped like the params.
  upd = jax.jit(lambda g, o, p: opt.update(g, o, p))
  grads = jax.tree.map(lambda p: jnp.full(p.shape, 1e-3, jnp.float32), state.params)
  opt_s = timing.median_seconds(
    lambda: jax.block_until_ready(upd(grads, state.opt_state, state.params)), args.steps, warmup=1
  )

  tokens = args.batch * args.seq_len
  model_flops = flops_per_token(cfg, seq_len=args.seq_len) * tokens
  shapes = param_shapes(cfg)["layer"]
  muon_flops = cfg.n_layers * sum(ns_flops(shapes[n]) for n in MUON_PARAM_NAMES)
  mfu = model_flops / step_s / peak
  print(
    f"{args.preset}: batch {args.batch} × {args.seq_len} tokens, remat {cfg.remat}; step {step_s * 1e3:.0f} ms "
    f"(median of {args.steps}), {tokens / step_s:,.0f} tokens/s, model {model_flops / step_s / 1e9:.1f} GFLOP/s"
    f" = {100 * mfu:.1f}% MFU; loss {float(m.loss):.3f}"
  )
  time_share, flop_share = opt_s / step_s, muon_flops / (model_flops + muon_flops)
  print(
    f"optimizer update alone {opt_s * 1e3:.0f} ms = {100 * time_share:.1f}% of the step; Newton–Schulz "
    f"{muon_flops / 1e9:.1f} GFLOP = {100 * flop_share:.1f}% of the step's FLOPs; time/FLOP share ratio "
    f"{time_share / flop_share:.2f}"
  )


if __name__ == "__main__":
  main()
