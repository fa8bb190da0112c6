"""Step-time comparisons shared by the benchmarks that set two variants of a compiled step side by side.

`time_alternately` runs each variant's step on its own state, the order flipped each round so both see the
same machine load, and returns each variant's median step time after `warmup` rounds.
"""

from __future__ import annotations

import statistics
import time

import jax


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
