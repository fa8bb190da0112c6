"""What the serving benchmarks share (benchmarks/serve_bench.py, serve_bench_cache.py, sampling_cost.py,
constrained_cost.py): the Laplace params they time, a timed window of engine steps and the markdown tables
they print."""

from __future__ import annotations

import time

import jax

from laplace_jax import model
from serve.slots.loading import cast_params


def laplace_params(cfg, how):
  """Random Laplace weights (seed 0), cast as `python -m serve --params-dtype HOW` would serve them."""
  init = jax.jit(model.init_params, static_argnums=0)
  return cast_params(init(cfg, jax.random.key(0)), cfg, how)


def timed_steps(engine, reqs, steps: int) -> tuple[float, list[int]]:
  """Submit `reqs`, admit them all (untimed), then time `steps` engine steps: (seconds, tokens each request
  made in them). The window starts and ends with nothing in flight; the requests are cancelled after."""
  for r in reqs:
    engine.submit(r)
  while engine.queue_depth or engine.prefill is not None:  # admission: every prompt prefilled and inserted
    engine.step()
  engine.step()
  engine.read_back_all()
  before = [len(r.progress.output_ids) for r in reqs]
  t0 = time.perf_counter()
  for _ in range(steps):
    engine.step()
  engine.read_back_all()
  elapsed = time.perf_counter() - t0
  made = [len(r.progress.output_ids) - b for r, b in zip(reqs, before)]
  assert all(r.progress.finish_reason is None for r in reqs), "a request ended inside the timed window"
  for r in reqs:
    engine.cancel(r)
  engine.run_until_idle()
  return elapsed, made


def table(title, header, rows):
  print(f"\n## {title}")
  print(" | ".join(header))
  print(" | ".join("---" for _ in header))
  for r in rows:
    print(" | ".join(str(x) for x in r))


def gb(b):
  return f"{b / 1e9:.3g} GB" if b >= 1e9 else f"{b / 1e6:.3g} MB" if b >= 1e6 else f"{b / 1e3:.3g} kB"
