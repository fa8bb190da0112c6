"""The train step at long sequence lengths, same tokens per step: time and activation memory per token.

    python -m benchmarks long_context [--preset small] [--lengths 2048 8192 16384 32768]
        [--tokens-per-step 32768] [--steps 2] [--compute-dtype float32] [--mesh-context C] [--model.FIELD V ...]

For each length T: global batch = tokens-per-step / T; the compiled step's temporaries per token
(`memory_analysis()`, no run needed) and, with --steps > 0, the median step time per token on one device
(random tokens, Muon + AdamW). Ratios are against the first length, measured in the same run.
--mesh-context C: on C simulated CPU devices, each row's T tokens split into C spans of T/C (context
parallelism, laplace_jax/ops/context_parallel.py); the temporaries are then one device's.
"""

from __future__ import annotations

import argparse
import platform

import jax
import numpy as np

from laplace_jax import platform as lj_platform
from laplace_jax import sharding
from laplace_jax.analysis import timing
from laplace_jax.data.tokenizer import VOCAB_SIZE
from laplace_jax.model.config import get_config
from laplace_jax.training import train_step as ts
from laplace_jax.training.optimizer import OptimizerConfig, make_optimizer


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--preset", default="small")
  ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 16384, 32768])
  ap.add_argument("--tokens-per-step", type=int, default=32768)
  ap.add_argument("--steps", type=int, default=2, help="timed steps per length (0: memory only)")
  ap.add_argument("--compute-dtype", default=None)
  ap.add_argument("--mesh-context", type=int, default=1, help="split each row over this many CPU devices")
  args, rest = ap.parse_known_args(argv)
  if args.mesh_context > 1:
    lj_platform.simulate_cpu_devices(args.mesh_context)  # before the first use of a device
  overrides = {k.split(".", 1)[1]: v for k, v in zip(rest[::2], rest[1::2]) if k.startswith("--model.")}
  cfg = get_config(args.preset)
  cfg = cfg.replace(**{k: type(getattr(cfg, k))(v) for k, v in overrides.items()})
  if args.compute_dtype:
    cfg = cfg.replace(compute_dtype=args.compute_dtype)
  n = args.mesh_context
  mesh = sharding.make_mesh(data=1, fsdp=1, context=n, devices=jax.devices()[:n])
  opt = make_optimizer(OptimizerConfig(total_steps=1000, warmup_steps=10))
  print(
    f"{args.preset} ({cfg.compute_dtype}, remat {cfg.remat}, gla_form {cfg.gla_form}) on "
    f"{jax.devices()[0].device_kind} ({platform.machine()}); {args.tokens_per_step} tokens per step"
    + (f", each row over {n} devices (context axis)" if n > 1 else "")
    + "\n"
  )
  print("| T | batch | temporaries MiB | bytes/token | × first | step s | µs/token | × first |")
  print("|---|---|---|---|---|---|---|---|")
  first = None
  for T in args.lengths:
    B = args.tokens_per_step // T
    if B < 1 or B * T != args.tokens_per_step:
      raise SystemExit(f"--tokens-per-step {args.tokens_per_step} is not a multiple of length {T}.")
    compiled = ts.compile_train_step(cfg, opt, mesh, global_batch=B, seq_len=T)
    per_tok = compiled.memory_analysis().temp_size_in_bytes / args.tokens_per_step
    step_s = float("nan")
    if args.steps:
      state = ts.init_train_state_on_mesh(cfg, opt, mesh, seed=0)
      toks = (
        np.random.default_rng(0).integers(0, min(cfg.vocab_size, VOCAB_SIZE), (B, T + 1)).astype(np.int32)
      )
      batch_sh = ts.abstract_batch(B, T, mesh)
      batch = ts.Batch(
        inputs=jax.device_put(toks[:, :-1], batch_sh.inputs.sharding),
        targets=jax.device_put(toks[:, 1:], batch_sh.targets.sharding),
      )

      def step():
        nonlocal state
        state, m = compiled(state, batch)
        jax.block_until_ready(m)

      step_s = timing.median_seconds(step, args.steps, warmup=1)
      del state
    us_tok = 1e6 * step_s / args.tokens_per_step
    first = first or (per_tok, us_tok)
    print(
      f"| {T} | {B} | {per_tok * args.tokens_per_step / 2**20:.0f} | {per_tok:.0f} | "
      f"{per_tok / first[0]:.2f} | {step_s:.2f} | {us_tok:.1f} | {us_tok / first[1]:.2f} |",
      flush=True,
    )


if __name__ == "__main__":
  main()
