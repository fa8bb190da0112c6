"""The model half of speculative decoding: one verify + commit of k drafts against one decode step.

    python -m benchmarks speculative_model [--preset small] [--batches 1 8 64] [--drafts 2 4 8 16]
        [--calls 10]

For each batch size: the compiled decode step (`model.decode_step`, state donated) and, per draft count k,
the compiled speculative step (speculative.verify of k + 1 tokens, greedy acceptance of the drafts that
equal the argmax before them, speculative.commit; state donated), both from the server's weights (compute
dtype). Reported: bytes each moves (compiled HLO, laplace_jax.analysis.hlo_bytes, as benchmarks/decode_bytes.py
counts the decode step), median ms per call over --calls calls after warm-up, and what a call is worth:
with every draft right a call yields k + 1 tokens, so the speed-up bound is (k + 1)·t_step / t_verify;
with a fraction p of drafts right in a row (each one right with probability p, independently) it yields
(1 − p^{k+1}) / (1 − p) tokens on average. Times are ratios within one run (a shared CPU).
"""

from __future__ import annotations

import argparse
import functools
import platform

import jax
import jax.numpy as jnp
import numpy as np

from laplace_jax import model
from laplace_jax.analysis import hlo_bytes, timing
from laplace_jax.inference import speculative
from laplace_jax.model.config import PRESETS, get_config


def greedy_step(params, state, tokens_BxT, *, cfg):
  """verify, accept the drafts that equal the argmax before them (the first mismatch ends a row's run),
  commit: (the next input per row, the state)."""
  logits, drafted = speculative.verify(params, state, tokens_BxT, cfg=cfg)
  best = jnp.argmax(logits, -1).astype(jnp.int32)  # [B, T]: the token after each verified one
  agree = best[:, :-1] == tokens_BxT[:, 1:]
  accepted = jnp.sum(jnp.cumprod(agree.astype(jnp.int32), axis=1), axis=1)
  nxt = jnp.take_along_axis(best, accepted[:, None], axis=1)[:, 0]
  return nxt, speculative.commit(state, drafted, accepted + 1, cfg=cfg)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--preset", default="small", choices=sorted(PRESETS))
  ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
  ap.add_argument("--drafts", type=int, nargs="+", default=[2, 4, 8, 16])
  ap.add_argument("--calls", type=int, default=10)
  args = ap.parse_args(argv)
  cfg = get_config(args.preset)
  cdt = jnp.dtype(cfg.compute_dtype)
  params = model.init_params(cfg, jax.random.key(0))
  params = jax.tree.map(lambda p: p.astype(cdt) if p.ndim >= 2 else p, params)
  print(
    f"{args.preset} ({cfg.compute_dtype}) on {jax.devices()[0].device_kind} ({platform.machine()}), "
    f"jax {jax.__version__}, median of {args.calls} calls\n"
  )
  print(
    "| batch | call | tokens in | GB moved | × step | ms per call | × step | tokens per call, all right "
    "| speed-up bound | tokens per call at p = 0.5 | speed-up at p = 0.5 |"
  )
  print("|---|---|---|---|---|---|---|---|---|---|---|")
  rng = np.random.default_rng(0)
  for B in args.batches:
    tok = jnp.asarray(rng.integers(0, cfg.vocab_size, (B,)), jnp.int32)
    step_bytes, t_step = measure(model.decode_step, params, cfg, B, tok, args.calls)
    print(
      f"| {B} | decode step | 1 | {step_bytes / 1e9:.3f} | 1.00 | {1e3 * t_step:.2f} | 1.00 | 1 | 1.00 | 1 | 1.00 |",
      flush=True,
    )
    for k in args.drafts:
      toks = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, k + 1)), jnp.int32)
      moved, t = measure(greedy_step, params, cfg, B, toks, args.calls)
      half = (1 - 0.5 ** (k + 1)) / 0.5
      print(
        f"| {B} | verify k = {k} | {k + 1} | {moved / 1e9:.3f} | {moved / step_bytes:.2f} | {1e3 * t:.2f} | "
        f"{t / t_step:.2f} | {k + 1} | {(k + 1) * t_step / t:.2f} | {half:.2f} | {half * t_step / t:.2f} |",
        flush=True,
      )


def measure(fn, params, cfg, batch: int, tokens, calls: int) -> tuple[int, float]:
  """fn(params, state, tokens, cfg=) -> (out, state) compiled with the state donated: (bytes it moves per
  call, median seconds per call), calls chained on one state from zero."""
  compiled = (
    jax.jit(functools.partial(fn, cfg=cfg), donate_argnums=(1,))
    .lower(params, model.init_state(cfg, batch), tokens)
    .compile()
  )
  moved = hlo_bytes.total_bytes(hlo_bytes.memory_traffic(compiled.as_text()))
  state = model.init_state(cfg, batch)

  def call():
    nonlocal state
    out, state = compiled(params, state, tokens)
    jax.block_until_ready(out)

  return moved, timing.median_seconds(call, calls)


if __name__ == "__main__":
  main()
