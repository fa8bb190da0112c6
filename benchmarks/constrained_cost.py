"""What a grammar costs per token through the engine (decode, the host's mask work beside it, the masked
sampling call, read-back) on a 64-slot table with random weights, all requests sampling at temperature 1:
- a constrained request's time per token against a free one's, `c` requests all constrained or all free;
- free requests beside constrained ones: the free requests' time per token when 1 (or half) of the `c`
  requests are constrained, against all `c` free.
The grammar is a strict JSON schema, an array of at least 16 objects with an enum, a bounded integer, a
string of at most 8 characters and an array of at most 3 enums (benchmarks/openai_tools_check.py's
SCHEMA), so no request ends inside a timed window. Cases and rounds interleave in one process (each round
times every case once), so the shared machine's drift hits them alike; figures are medians over rounds of
each round's ratio (docs/BENCHMARKS.md, "Constrained decoding").

    python -m benchmarks constrained_cost [--preset tiny] [--concurrency 1,16,64] [--rounds 5] [--steps 16]
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.openai_tools_check import SCHEMA
from benchmarks.serve_bench_common import laplace_params, timed_steps
from laplace_jax.data.tokenizer import EOS_ID, VOCAB_SIZE
from laplace_jax.model.config import get_config
from serve.api import grammar
from serve.engine.engine import Engine, Request
from serve.engine.engine_config import EngineConfig
from serve.slots.slot_functions import SlotSettings

LONG = {"type": "array", "items": SCHEMA, "minItems": 16}


def time_per_token(engine: Engine, n_free: int, n_constrained: int, steps: int, rng, g: grammar.Grammar):
  """(free, constrained) seconds per generated token of each request (None where there are none) over
  `steps` engine steps after admission, the slots inert at the start (as sampling_cost does)."""
  engine.table = dataclasses.replace(
    engine.table, settings=SlotSettings.inert(engine.n_slots, engine.fns.n_stop, xp=jnp)
  )

  def request(constrained: bool) -> Request:
    return Request(
      prompt_ids=rng.integers(0, VOCAB_SIZE, 16).tolist(),
      max_tokens=1 << 20,
      temperature=1.0,
      seed=int(rng.integers(1 << 31)),
      stop_ids=[EOS_ID],
      constraint=g.matcher() if constrained else None,
    )

  kinds = [False] * n_free + [True] * n_constrained
  reqs = [request(k) for k in rng.permutation(kinds)]
  elapsed, made = timed_steps(engine, reqs, steps)
  out = []
  for k in (False, True):
    n = [m for m, r in zip(made, reqs) if (r.constraint is not None) == k]
    out.append(elapsed / (sum(n) / len(n)) if n else None)
  return out


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--preset", default="tiny")
  ap.add_argument("--slots", type=int, default=64)
  ap.add_argument("--concurrency", default="1,16,64")
  ap.add_argument("--rounds", type=int, default=5)
  ap.add_argument("--steps", type=int, default=16, help="timed engine steps per (round, case)")
  ap.add_argument("--prefill-batch", type=int, default=16)
  a = ap.parse_args()
  cfg = get_config(a.preset)
  conc = [int(c) for c in a.concurrency.split(",")]
  engine = Engine(
    laplace_params(cfg, "compute"),
    cfg,
    EngineConfig(n_slots=a.slots, prefill_batch=a.prefill_batch, max_queue=0),
    valid_vocab=VOCAB_SIZE,
  )
  t0 = time.perf_counter()
  engine.warmup()
  t1 = time.perf_counter()
  g = grammar.Grammar(grammar.Constraint(kind="json_schema", schema=LONG, strict=True))
  print(f"warm-up {t1 - t0:.1f} s; grammar compile {time.perf_counter() - t1:.2f} s", flush=True)
  print(
    f"backend {jax.default_backend()}, jax {jax.__version__}, preset {a.preset}, {a.slots} slots", flush=True
  )
  # case: (free, constrained) requests at concurrency c
  cases = {}
  for c in conc:
    cases[c, "free"] = (c, 0)
    cases[c, "constrained"] = (0, c)
    if c > 1:
      cases[c, "1 constrained"] = (c - 1, 1)
      cases[c, "half constrained"] = (c - c // 2, c // 2)
  rng = np.random.default_rng(0)
  times = {k: [] for k in cases}
  for r in range(a.rounds):
    for k, (f, n) in cases.items():
      times[k].append(time_per_token(engine, f, n, a.steps, rng, g))
    print(f"round {r + 1}/{a.rounds} done", flush=True)

  def ratio(k, i, base=(0, "free"), j=0):
    x = np.asarray([t[i] for t in times[k]]) / np.asarray([t[j] for t in times[base[0], base[1]]])
    return f"{np.median(x):.2f}x ({np.min(x):.2f}-{np.max(x):.2f})"

  print("\n| requests | free ms/token | constrained / free | free beside 1 constrained | free beside half |")
  print("|---:|---:|---:|---:|---:|")
  for c in conc:
    free_ms = np.median([t[0] for t in times[c, "free"]]) * 1e3
    cells = [f"{free_ms:.2f}", ratio((c, "constrained"), 1, (c, "free"))]
    cells += [ratio((c, k), 0, (c, "free")) if c > 1 else "-" for k in ("1 constrained", "half constrained")]
    print(f"| {c} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
  main()
