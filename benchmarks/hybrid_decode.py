"""Decode tokens/s of mixer patterns side by side, and per-token time at a short vs a long context.

    python -m benchmarks hybrid_decode [--preset small] [--n_layers 8] [--slots 64,1280]
        [--cases G,GGGS:2048,GGGS:64,GGGA] [--context 1024] [--long 65536] [--long_slots 32]
        [--steps 3] [--rounds 3] [--budget_gb 2.5] [--sections slots,context] [--json out.json]

The bare compiled step, as the server runs it: `model.decode_step` jitted with the state donated, weights
in the compute dtype, one token per slot per call. A case is a pattern with, for S layers, its window
(`GGGS:64`), and optionally `@matmuls`: the window and attention layers' decode in the matmul form (Neuron's;
the window layers' on every backend before their in-place form; `GGGS:2048@matmuls`, `GGGA@matmuls`). Every state is made "full" before timing: GLA matrices, conv windows and every ring slot hold
random values and `pos` is the context, so a window layer attends over all W slots; an attention (A) layer's
KV cache is sized for the context plus the timed steps, and random too.

Sections (cases interleaved in rounds, so the shared machine's drift hits all of them; each figure is the
median step time over every round; ratios are taken within one run):
  slots    tokens/s at each slot count, at --context tokens, and each case's ratio to the first (G);
  context  per-token time at --context vs --long tokens of context, per case, at --long_slots slots.
A case whose state would exceed --budget_gb is listed with its size and not run in `slots`; in `context` it
runs at the largest slot count that fits (halving; both contexts at the same count). `small` has 10 layers;
the default --n_layers 8 keeps the pattern GGGS whole (2 of 8 layers windowed, the share laplace-3b's GGGS
has) and the states within a shared machine's memory; every case uses the same depth.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from laplace_jax import model
from laplace_jax.model.config import get_config
from laplace_jax.model.state import DecodeState
from laplace_jax.ops import attention, window_attention


def parse_case(text: str) -> tuple[str, int | None]:
  """'GGGS:64' -> ('GGGS', 64); 'G' -> ('G', None); a '@form' suffix is read by ring_form."""
  mixers, _, window = text.partition("@")[0].partition(":")
  if window and not window.isdigit():
    raise SystemExit(f"case {text!r}: expected PATTERN or PATTERN:WINDOW, e.g. GGGS:2048")
  return mixers, int(window) if window else None


def case_config(base, case: str):
  mixers, window = parse_case(case)
  if "S" in mixers and window is None:
    raise SystemExit(f"case {case!r}: a pattern with S layers needs its window, e.g. {mixers}:2048")
  return base.replace(mixers=mixers, **({"window": window} if window else {}))


def state_bytes(cfg, slots: int, cache_len: int) -> int:
  shapes = jax.eval_shape(lambda: model.init_state(cfg, slots, max_len=cache_len))
  return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(shapes))


def fitting_slots(cfg, slots: int, cache_len: int, budget: float) -> int:
  while slots > 1 and state_bytes(cfg, slots, cache_len) > budget:
    slots //= 2
  return slots


def full_state(cfg, slots: int, context: int, cache_len: int, seed: int = 0) -> DecodeState:
  """A decode state after `context` tokens with every array filled (random), pos = context."""
  state = model.init_state(cfg, slots, max_len=cache_len).to_dict()
  keys = jax.random.split(jax.random.key(seed), len(state))
  filled = {}
  for key, (name, x) in zip(keys, sorted(state.items())):
    if name == "pos":
      filled[name] = jnp.full_like(x, context)
    else:
      filled[name] = (0.5 * jax.random.normal(key, x.shape, jnp.float32)).astype(x.dtype)
  return DecodeState.from_dict(filled)


def matmul_form(case: str) -> bool:
  form = case.partition("@")[2]
  if form not in ("", "matmuls"):
    raise SystemExit(f"case {case!r}: the only form suffix is @matmuls")
  return bool(form)


@functools.cache
def compiled_step(cfg, matmuls: bool):
  """One jitted step per config and decode form, so cases of the same shapes share a compilation."""

  def step(params, state, tokens):
    saved = window_attention.ring_decode_attention, attention.cache_decode_attention
    if matmuls:  # read when the step is traced
      window_attention.ring_decode_attention = window_attention.decode_matmuls
      attention.cache_decode_attention = attention.cache_decode_matmuls
    try:
      return model.decode_step(params, state, tokens, cfg=cfg)
    finally:
      window_attention.ring_decode_attention, attention.cache_decode_attention = saved

  return jax.jit(step, donate_argnums=(1,))


class Case:
  """One timed configuration: its compiled step, weights, state and recorded step times."""

  def __init__(self, label, cfg, params, slots, context, cache_len, calls):
    self.label, self.cfg, self.slots, self.context = label, cfg, slots, context
    self.params = params
    self.state = full_state(cfg, slots, context, cache_len)
    self.tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, slots), jnp.int32)
    self.step = compiled_step(cfg, matmul_form(label))
    self.times: list[float] = []
    self.calls_left = calls

  def run(self, n: int, record: bool = True):
    for _ in range(n):
      assert self.calls_left > 0, "more calls than the KV cache was sized for"
      t = time.perf_counter()
      logits, self.state = self.step(self.params, self.state, self.tokens)
      logits.block_until_ready()
      if record:
        self.times.append(time.perf_counter() - t)
      self.calls_left -= 1

  @property
  def seconds(self) -> float:
    return statistics.median(self.times)


def weights(cfg, cache: dict):
  """Random weights in the compute dtype (as the server holds them), one set per mixer pattern."""
  if cfg.mixers not in cache:
    cdt = jnp.dtype(cfg.compute_dtype)
    params = model.init_params(cfg, jax.random.key(0))
    cache[cfg.mixers] = jax.tree.map(lambda p: p.astype(cdt) if p.ndim >= 2 else p, params)
  return cache[cfg.mixers]


def timed(cases: list[Case], steps: int, rounds: int):
  for c in cases:  # compile and one warm call each
    c.run(1, record=False)
  for _ in range(rounds):
    for c in cases:
      c.run(steps)
      jax.block_until_ready(c.state)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--preset", default="small")
  p.add_argument("--n_layers", type=int, default=8)
  p.add_argument("--slots", default="64,1280")
  p.add_argument("--cases", default="G,GGGS:2048,GGGS:64,GGGA")
  p.add_argument("--context", type=int, default=1024)
  p.add_argument("--long", type=int, default=65536)
  p.add_argument("--long_slots", type=int, default=32)
  p.add_argument("--steps", type=int, default=3, help="timed calls per case per round")
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--budget_gb", type=float, default=2.5, help="largest state per case (GB)")
  p.add_argument("--sections", default="slots,context")
  p.add_argument("--json")
  args = p.parse_args(argv)
  base = get_config(args.preset, n_layers=args.n_layers)
  labels = [c for c in args.cases.split(",") if c]
  budget = args.budget_gb * 1e9
  calls = 1 + args.steps * args.rounds
  params: dict = {}
  out = {
    "preset": args.preset,
    "n_layers": args.n_layers,
    "jax": jax.__version__,
    "device": jax.devices()[0].device_kind,
    "steps": args.steps,
    "rounds": args.rounds,
  }
  print(
    f"# {args.preset}, {args.n_layers} layers, {base.compute_dtype}; jax {jax.__version__} on "
    f"{jax.devices()[0].device_kind}; median of {args.steps} x {args.rounds} interleaved calls per case"
  )

  if "slots" in args.sections:
    out["slots"] = []
    for want in (int(s) for s in args.slots.split(",")):
      cases, unfit = [], []
      for label in labels:
        cfg = case_config(base, label)
        size = state_bytes(cfg, want, args.context + calls)
        if size > budget:
          unfit.append((label, size))
          continue
        cases.append(Case(label, cfg, weights(cfg, params), want, args.context, args.context + calls, calls))
      timed(cases, args.steps, args.rounds)
      first = cases[0]
      print(
        f"\n| {want} slots, context {args.context:,} | slots | state GB | ms/step | tokens/s | "
        f"/ {first.label} |\n|---|---:|---:|---:|---:|---:|"
      )
      for c in cases:
        tps = c.slots / c.seconds
        row = {
          "case": c.label,
          "slots_asked": want,
          "slots": c.slots,
          "context": args.context,
          "state_bytes": state_bytes(c.cfg, c.slots, args.context + calls),
          "seconds": c.seconds,
          "times": c.times,
          "tokens_per_s": tps,
          "ratio": tps / (first.slots / first.seconds),
        }
        out["slots"].append(row)
        print(
          f"| {c.label} | {c.slots:,} | {row['state_bytes'] / 1e9:.2f} | {1e3 * c.seconds:.1f} | {tps:,.0f} | "
          f"{row['ratio']:.2f} |",
          flush=True,
        )
      for label, size in unfit:
        out["slots"].append({"case": label, "slots_asked": want, "slots": 0, "state_bytes": size})
        print(f"| {label} | not run: state {size / 1e9:.2f} GB > --budget_gb | {size / 1e9:.2f} | | | |")
      del cases

  if "context" in args.sections:
    out["context"] = []
    cases = []
    for label in labels:
      cfg = case_config(base, label)
      slots = fitting_slots(cfg, args.long_slots, args.long + calls, budget)
      for ctx in (args.context, args.long):
        cases.append(Case(label, cfg, weights(cfg, params), slots, ctx, ctx + calls, calls))
    timed(cases, args.steps, args.rounds)
    print(
      f"\n| case | slots | ms/step at {args.context:,} | ms/step at {args.long:,} | long / short |"
      "\n|---|---:|---:|---:|---:|"
    )
    for short, long in zip(cases[::2], cases[1::2]):
      row = {
        "case": short.label,
        "slots": short.slots,
        "short": args.context,
        "long": args.long,
        "short_seconds": short.seconds,
        "long_seconds": long.seconds,
        "short_times": short.times,
        "long_times": long.times,
        "ratio": long.seconds / short.seconds,
      }
      out["context"].append(row)
      print(
        f"| {short.label} | {short.slots:,} | {1e3 * short.seconds:.1f} | {1e3 * long.seconds:.1f} | "
        f"{row['ratio']:.3f} |",
        flush=True,
      )
  if args.json:
    with open(args.json, "w") as f:
      json.dump(out, f, indent=1)


if __name__ == "__main__":
  main()
