"""Same-run A/B of the engine's generate step: decode and sampling as two compiled calls (what serve/slots.py
does) against one compiled program (the earlier form), beside the bare decode_step; greedy,
`tiny`, rounds alternating the three (docs/BENCHMARKS.md, "Engine overhead").

    python benchmarks/engine_ab.py SLOTS ROUNDS
"""

import sys
import time

import jax
import numpy as np
from serve_bench import LaplaceStep
from serve_bench_common import laplace_params

from laplace_jax.config import get_config
from laplace_jax.tokenizer import VOCAB_SIZE
from serve.engine import Engine, Request


def busy_engine(params, cfg, slots, one_program, rng):
  """An engine with every slot decoding a greedy request that never ends."""
  e = Engine(params, cfg, n_slots=slots, prefill_batch=min(slots, 64), max_queue=0, valid_vocab=VOCAB_SIZE)
  if one_program:
    f = e.fns
    one = jax.jit(lambda p, t: f._sample_next(*f._decode_logits(p, t)[::-1]), donate_argnums=1)
    f.generate = lambda p, t, steps=1, *flags: one(p, t)  # the engine's single steps (decode_steps 1)
  e.warmup()
  for _ in range(slots):
    e.submit(Request(prompt_ids=rng.integers(0, VOCAB_SIZE, 16).tolist(), max_tokens=1 << 20))
  while e.queue or e.prefill is not None:
    e.step()
  e.step()
  return e


def seconds_per_step(e, slots, n=10):
  tok0, t0 = e.stats["tokens"], time.perf_counter()
  for _ in range(n):
    e.step()
  return (time.perf_counter() - t0) * slots / (e.stats["tokens"] - tok0)


def main():
  slots, rounds = int(sys.argv[1]), int(sys.argv[2])
  cfg = get_config("tiny")
  params = laplace_params(cfg, "compute")
  rng = np.random.default_rng(0)
  engines = {
    "two calls": busy_engine(params, cfg, slots, False, rng),
    "one program": busy_engine(params, cfg, slots, True, rng),
  }
  bare = LaplaceStep(params, cfg, slots)
  bare()
  times = {name: [] for name in [*engines, "bare"]}
  for _ in range(rounds):
    for name, e in engines.items():
      times[name].append(seconds_per_step(e, slots))
    t0 = time.perf_counter()
    for _ in range(10):
      bare()
    times["bare"].append((time.perf_counter() - t0) / 10)
  b = np.median(times["bare"])
  print(slots, {k: f"{np.median(v) * 1e3:.2f} ms ({b / np.median(v):.0%} of bare)" for k, v in times.items()})


if __name__ == "__main__":
  main()
