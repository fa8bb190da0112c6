"""What the serving benchmark's sections share (benchmarks/serve_bench.py and serve_bench_cache.py): the
Laplace params they time and the markdown tables they print."""

from __future__ import annotations

import jax

from laplace_jax import model
from serve.loading import cast_params


def laplace_params(cfg, how):
  """Random Laplace weights (seed 0), cast as `python -m serve --params-dtype HOW` would serve them."""
  init = jax.jit(model.init_params, static_argnums=0)
  return cast_params(init(cfg, jax.random.key(0)), cfg, how)


def table(title, header, rows):
  print(f"\n## {title}")
  print(" | ".join(header))
  print(" | ".join("---" for _ in header))
  for r in rows:
    print(" | ".join(str(x) for x in r))


def gb(b):
  return f"{b / 1e9:.3g} GB" if b >= 1e9 else f"{b / 1e6:.3g} MB" if b >= 1e6 else f"{b / 1e3:.3g} kB"
