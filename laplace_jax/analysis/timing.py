"""Wall-clock measurement shared by the programs and benchmarks: medians of blocking calls, matmul peak."""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp


def median_seconds(fn, n: int, warmup: int = 2) -> float:
  """Median wall time of fn() (which must block on its result) over n calls after `warmup` calls."""
  for _ in range(warmup):
    fn()
  times = []
  for _ in range(n):
    t = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t)
  return statistics.median(times)


def matmul_peak_flops(n: int = 2048, dtype=jnp.float32, reps: int = 5) -> float:
  """FLOP/s of an n×n×n matmul of random operands on the default device: the denominator of MFU figures."""
  a = jax.random.normal(jax.random.key(0), (n, n), dtype)
  b = jax.random.normal(jax.random.key(1), (n, n), dtype)
  mm = jax.jit(lambda a, b: a @ b)
  return 2 * n**3 / median_seconds(lambda: mm(a, b).block_until_ready(), reps)
