"""What sampling costs per token against greedy decoding: the engine end to end (decode, the sampling call,
read-back) on a 64-slot table with random weights, `c` concurrent requests that all use one setting, time per
token relative to greedy's at the same `c`. Settings, concurrencies and rounds interleave in one process
(each round times every (c, setting) once, in turn), so the shared machine's drift hits all of them alike;
the figures are medians over rounds of each round's ratio (docs/BENCHMARKS.md, "What sampling costs").
`--baseline PATH` also times an engine whose sampler is `sample` from another copy of serve/slots/sampling.py
(the code before a change), interleaved with this one's in the same rounds.

    python -m benchmarks sampling_cost [--preset small] [--concurrency 1,16,64] [--rounds 5] [--steps 16]
        [--baseline /path/to/old/serve/slots/sampling.py]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.serve_bench_common import laplace_params, timed_steps
from laplace_jax.data.tokenizer import VOCAB_SIZE
from laplace_jax.model.config import get_config
from serve.engine.engine import Engine, Request
from serve.engine.engine_config import EngineConfig
from serve.slots.slot_functions import SlotSettings

# name: (temperature, top_k, top_p)
SETTINGS = {
  "greedy": (0.0, 0, 1.0),
  "temperature 1.0": (1.0, 0, 1.0),
  "top-k 50": (1.0, 50, 1.0),
  "top-p 0.95": (1.0, 0, 0.95),
  "top-k 50 + top-p 0.95": (1.0, 50, 0.95),
  "top-p 0.9 + temperature 0.7": (0.7, 0, 0.9),
}


def time_per_token(engine: Engine, c: int, setting, steps: int, rng) -> float:
  """Seconds per generated token of each of c requests over `steps` engine steps, after admission. The
  slots start inert, as at start-up: a slot the engine frees keeps the settings of its last request on the
  device (the sampler still draws for it), so without this a greedy round after a top-p one would time
  top-p's sampling."""
  engine.table = dataclasses.replace(
    engine.table, settings=SlotSettings.inert(engine.n_slots, engine.fns.n_stop, xp=jnp)
  )
  t, k, p = setting
  reqs = [
    Request(
      prompt_ids=rng.integers(0, VOCAB_SIZE, 16).tolist(),
      max_tokens=1 << 20,
      temperature=t,
      top_k=k,
      top_p=p,
      seed=int(rng.integers(1 << 31)),
    )
    for _ in range(c)
  ]
  elapsed, made = timed_steps(engine, reqs, steps)
  return elapsed / (sum(made) / c)


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--preset", default="small")
  ap.add_argument("--slots", type=int, default=64)
  ap.add_argument("--concurrency", default="1,16,64")
  ap.add_argument("--rounds", type=int, default=5)
  ap.add_argument("--steps", type=int, default=16, help="timed engine steps per (round, c, setting)")
  ap.add_argument(
    "--prefill-batch", type=int, default=16, help="prompts per prefill call (admission is untimed)"
  )
  ap.add_argument(
    "--baseline", default=None, help="another serve/slots/sampling.py whose sampler to time as well"
  )
  a = ap.parse_args()
  cfg = get_config(a.preset)
  conc = [int(c) for c in a.concurrency.split(",")]
  params = laplace_params(cfg, "compute")
  engines = {
    "this": Engine(
      params,
      cfg,
      EngineConfig(n_slots=a.slots, prefill_batch=a.prefill_batch, max_queue=0),
      valid_vocab=VOCAB_SIZE,
    )
  }
  if a.baseline:
    spec = importlib.util.spec_from_file_location("baseline_sampling", a.baseline)
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    engines["baseline"] = Engine(
      params,
      cfg,
      EngineConfig(n_slots=a.slots, prefill_batch=a.prefill_batch, max_queue=0),
      valid_vocab=VOCAB_SIZE,
    )
    engines["baseline"].fns.sample = functools.partial(
      old.sample, valid_vocab=VOCAB_SIZE
    )  # before any compile
  for name, engine in engines.items():
    t0 = time.perf_counter()
    engine.warmup()
    print(f"{name}: warm-up {time.perf_counter() - t0:.1f} s", flush=True)
  print(
    f"backend {jax.default_backend()}, jax {jax.__version__}, preset {a.preset}, {a.slots} slots", flush=True
  )
  rng = np.random.default_rng(0)
  times = {(e, c, s): [] for e in engines for c in conc for s in SETTINGS}
  for r in range(a.rounds):
    for c in conc:
      for name, setting in SETTINGS.items():
        for e, engine in engines.items():
          times[e, c, name].append(time_per_token(engine, c, setting, a.steps, rng))
    print(f"round {r + 1}/{a.rounds} done", flush=True)
  for e in engines:
    greedy = {c: np.median(times[e, c, "greedy"]) for c in conc}
    print(f"\n{e}: greedy ms/token " + ", ".join(f"c={c}: {greedy[c] * 1e3:.2f}" for c in conc))
    print("| setting | " + " | ".join(f"{c} request{'s' * (c > 1)}" for c in conc) + " |")
    print("|---|" + "---:|" * len(conc))
    for name in SETTINGS:
      cells = []
      for c in conc:
        ratios = np.asarray(times[e, c, name]) / np.asarray(times[e, c, "greedy"])  # per round: same drift
        cells.append(f"{np.median(ratios):.2f}x ({np.min(ratios):.2f}-{np.max(ratios):.2f})")
      print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
  main()
