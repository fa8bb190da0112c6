"""Step-time cost of a train-step option: the same train step with and without it, compiled side by side and
timed alternately in one process (the order flipped each round, so both see the same machine load).

    python -m benchmarks step_cost --variant segments [--preset tiny] [--seq_len 256] [--batch 16]
        [--rounds 20] [--docs 4]                  # packed documents apart (segment ids); = segment_cost
    python -m benchmarks step_cost --variant state_passing [--rounds 10]     # the carried state; = state_passing_cost

Prints the median step time of each and their ratio (option / plain). Random tokens (`segments`: `--docs`
documents of random lengths per row); one device; the suite's XLA flags are not applied (XLA's defaults).
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np

from laplace_jax import sharding
from laplace_jax.data.tokenizer import VOCAB_SIZE
from laplace_jax.model.config import get_config
from laplace_jax.training import optimizer as optim
from laplace_jax.training import train_step as ts

ROUNDS = {"segments": 20, "state_passing": 10}


def time_alternately(steps: dict, states: dict, round_batches, rounds: int, warmup: int = 2) -> dict:
  """{variant: median seconds}; `round_batches(r)` -> {variant: batch} for round r (called once a round)."""
  keys = list(steps)
  times: dict = {k: [] for k in keys}
  for r in range(rounds + warmup):
    batches = round_batches(r)
    for key in keys if r % 2 else keys[::-1]:
      t0 = time.perf_counter()
      states[key], m = steps[key](states[key], batches[key])
      jax.block_until_ready((states[key], m))
      if r >= warmup:
        times[key].append(time.perf_counter() - t0)
  return {k: statistics.median(v) for k, v in times.items()}


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--variant", choices=sorted(ROUNDS), required=True)
  ap.add_argument("--preset", default="tiny")
  ap.add_argument("--seq_len", type=int, default=256)
  ap.add_argument("--batch", type=int, default=16)
  ap.add_argument(
    "--rounds",
    type=int,
    help="alternating timed steps of each, after 2 warm-ups (20 segments, 10 state_passing)",
  )
  ap.add_argument("--docs", type=int, default=4, help="documents per row (segments)")
  a = ap.parse_args(argv)
  rounds = a.rounds or ROUNDS[a.variant]
  cfg = get_config(a.preset)
  mesh = sharding.make_mesh(data=1, fsdp=1, devices=jax.devices()[:1])
  opt = optim.make_optimizer(optim.OptimizerConfig(total_steps=1000, warmup_steps=10), mesh=mesh)
  segmented = a.variant == "segments"
  steps, states = {}, {}
  for on in (False, True):
    option = {"segmented": on} if segmented else {"state_passing": on}
    steps[on] = ts.compile_train_step(cfg, opt, mesh, global_batch=a.batch, seq_len=a.seq_len, **option)
    carry = a.batch if on and not segmented else 0
    states[on] = ts.init_train_state_on_mesh(cfg, opt, mesh, seed=0, carry_batch=carry)
  rng = np.random.default_rng(0)

  def round_batches(r):
    tok = rng.integers(0, VOCAB_SIZE, (a.batch, a.seq_len + 1)).astype(np.int32)
    plain = ts.Batch(inputs=tok[:, :-1], targets=tok[:, 1:])
    if not segmented:
      return {False: plain, True: plain}
    cuts = np.sort(rng.integers(1, a.seq_len, (a.batch, a.docs - 1)), axis=1)
    ids = (np.arange(a.seq_len)[None, :, None] >= cuts[:, None, :]).sum(-1).astype(np.int32)
    return {False: plain, True: plain.replace(segment_ids=ids)}

  medians = time_alternately(steps, states, round_batches, rounds)
  plain, on = medians[False], medians[True]
  where = f", {a.docs} documents per row, on" if segmented else " on"
  name = "segment ids" if segmented else "state passing"
  print(
    f"{a.preset} at {a.batch} x {a.seq_len}{where} {jax.default_backend()}: plain {plain * 1e3:.1f} ms, "
    f"{name} {on * 1e3:.1f} ms, ratio {on / plain:.3f} (median of {rounds} alternating steps)"
  )


if __name__ == "__main__":
  main()
