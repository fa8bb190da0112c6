"""`python -m benchmarks serve_bench`: serving throughput, time per token against context, memory per sequence, and
decode-step FLOP/s, for Laplace and for a same-size softmax-attention KV-cache baseline (benchmarks/serve_baseline.py).

Sections (each prints a table; --json writes all numbers; `overhead` runs only when named):
  throughput  output tokens/s at each concurrency: the engine end to end (prefill, insert, decode+sampling,
              read-back; greedy), Laplace's bare decode_step, and the baseline's decode step over a cache of
              --throughput-context tokens (skipped, with the memory it needs, past --baseline-mem-gb).
  context     time per decoded token of one sequence at each context. Laplace: decode_step on a state
              prefilled for real with min(context, --max-real-prefill) tokens; the step has no position
              input and the same shapes at any context, so this is the cost at that context. Baseline: a
              cache of exactly that many (random) keys and values, attended in full.
  overhead    engine tokens/s as a share of the bare decode_step's, the two interleaved in rounds, and
              against the memory floor: the whole decode state scaled in place (read + written once).
  memory      bytes per sequence: Laplace's state (measured array bytes) against the baseline's KV cache.
  flops       Laplace decode_step at --flops-slots slots: model FLOP/s against a matmul peak measured
              in the same run (square matmuls in the compute dtype).
  agent, prefix, cache_memory, cache_overhead: the state cache (benchmarks/serve_bench_cache.py; not in the default).
Timings are medians over repeated steps; sizes default to what a 2-core CPU finishes in a few minutes.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import serve_baseline as baseline
from benchmarks import serve_bench_cache as bench_cache
from benchmarks.serve_bench_common import gb as _gb
from benchmarks.serve_bench_common import laplace_params
from benchmarks.serve_bench_common import table as _table
from laplace_jax import model
from laplace_jax.analysis.timing import matmul_peak_flops, median_seconds
from laplace_jax.data.tokenizer import VOCAB_SIZE
from laplace_jax.model.config import PRESETS, get_config
from laplace_jax.model.counts import param_counts, state_bytes_per_sequence
from serve.engine.engine import Engine, Request
from serve.engine.engine_config import EngineConfig
from serve.slots.loading import cast_params
from serve.slots.sampling import argmax_rows


def parse_args(argv=None):
  p = argparse.ArgumentParser(
    prog="python -m benchmarks serve_bench",
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  ints = lambda s: [int(x) for x in s.split(",") if x]
  p.add_argument(
    "--sections",
    default="throughput,context,memory,flops",
    help="comma list of sections to run (default: all)",
  )
  p.add_argument(
    "--preset",
    default="small",
    choices=sorted(PRESETS),
    help="model for context, memory and flops (default: small)",
  )
  p.add_argument(
    "--throughput-preset",
    default="tiny",
    choices=sorted(PRESETS),
    help="model for the throughput section (default: tiny, so 1,280 slots prefill in seconds on a CPU)",
  )
  p.add_argument("--concurrency", type=ints, default=[1, 8, 64, 256, 1280], help="default: 1,8,64,256,1280")
  p.add_argument("--prompt-tokens", type=int, default=16, help="prompt length per request (default: 16)")
  p.add_argument(
    "--throughput-context",
    type=int,
    default=1024,
    help="baseline cache length in the throughput section (default: 1024)",
  )
  p.add_argument("--steps", type=int, default=5, help="timed decode steps per point (default: 5)")
  p.add_argument("--contexts", type=ints, default=[1024, 8192, 65536], help="default: 1024,8192,65536")
  p.add_argument(
    "--max-real-prefill",
    type=int,
    default=1024,
    help="longest prompt Laplace really prefills in the context section (default: 1024)",
  )
  p.add_argument(
    "--overhead-rounds", type=int, default=5, help="interleaved rounds in the overhead section (default: 5)"
  )
  p.add_argument("--context-steps", type=int, default=12, help="timed steps per context (default: 12)")
  p.add_argument("--flops-slots", type=int, default=1280, help="slots in the flops section (default: 1280)")
  p.add_argument(
    "--matmul-size", type=int, default=2048, help="side of the peak-matmul probe (default: 2048)"
  )
  p.add_argument(
    "--baseline-mem-gb",
    type=float,
    default=8.0,
    help="largest baseline KV cache the bench allocates (default: 8 GB)",
  )
  p.add_argument(
    "--params-dtype",
    default="compute",
    choices=["compute", "param"],
    help="serve weights cast to the compute dtype (default) or as stored",
  )
  p.add_argument(
    "--speculative-tokens",
    type=int,
    default=0,
    help="the throughput and overhead engines' --speculative_tokens: their verify path in place, with no "
    "prediction to draft from (default: 0)",
  )
  p.add_argument(
    "--decode-steps",
    type=int,
    default=1,
    help="the throughput, overhead and agent engines' --decode_steps: tokens per slot and generate call "
    "(default: 1)",
  )
  p.add_argument("--json", help="also write every number to this file")
  bench_cache.add_args(p)
  return p.parse_args(argv)


# ---- helpers ----


def laplace_decode_flops_per_token(cfg) -> float:
  """Matmul FLOPs of one decoded token: 2 per weight of the hidden matrices and LM head, plus the GLA
  state update and readout (4·d_k·d_v per head per layer)."""
  counts = param_counts(cfg)
  return (
    2 * (counts["muon"] + cfg.d_model * cfg.vocab_size) + cfg.n_layers * cfg.n_heads * 4 * cfg.d_k * cfg.d_v
  )


def baseline_params(cfg, how):
  init = jax.jit(baseline.init_params, static_argnums=0)
  return cast_params(init(cfg, jax.random.key(1)), cfg, how)


class LaplaceStep:
  """Jitted Laplace decode_step over a donated state of `batch` rows; with `greedy`, the step also picks
  each row's next token (the engine's argmax, serve.slots.sampling.argmax_rows) and returns only the tokens."""

  def __init__(self, params, cfg, batch, greedy: bool = False):
    self.params, self.cfg = params, cfg

    def greedy_step(params, state, tokens):
      logits, state = model.decode_step(params, state, tokens, cfg=cfg)
      return argmax_rows(logits.astype(jnp.float32), VOCAB_SIZE), state

    plain = functools.partial(model.decode_step, cfg=cfg)
    self.fn = jax.jit(greedy_step if greedy else plain, donate_argnums=(1,))
    self.state = jax.jit(model.init_state, static_argnums=(0, 1))(cfg, batch)
    self.tokens = jnp.zeros((batch,), jnp.int32)

  def __call__(self):
    out, self.state = self.fn(self.params, self.state, self.tokens)
    out.block_until_ready()


class BaselineStep:
  """Jitted baseline decode_step at position `context - 1` over a cache of exactly `context` entries."""

  def __init__(self, params, cfg, batch, context):
    self.params = params
    self.fn = jax.jit(functools.partial(baseline.decode_step, cfg=cfg), donate_argnums=(1,))
    self.cache = jax.jit(lambda key: baseline.init_cache(cfg, batch, context, fill_rng=key))(
      jax.random.key(2)
    )
    self.tokens = jnp.zeros((batch,), jnp.int32)
    self.pos = jnp.full((batch,), context - 1, jnp.int32)

  def __call__(self):
    logits, self.cache = self.fn(self.params, self.cache, self.tokens, self.pos)
    logits.block_until_ready()


def _engine(params, cfg, slots, args) -> Engine:
  """The throughput and overhead sections' engine: every prompt admitted at once, greedy requests."""
  config = EngineConfig(
    n_slots=slots,
    prefill_batch=min(slots, 64),
    max_queue=0,
    speculative_tokens=args.speculative_tokens,
    decode_steps=args.decode_steps,
  )
  return Engine(params, cfg, config, valid_vocab=VOCAB_SIZE)


# ---- sections ----


def run_throughput(args, out):
  cfg = get_config(args.throughput_preset)
  params = laplace_params(cfg, args.params_dtype)
  bparams = baseline_params(cfg, args.params_dtype)
  rng = np.random.default_rng(0)
  rows, res = [], []
  for c in args.concurrency:
    engine = _engine(params, cfg, c, args)
    t0 = time.perf_counter()
    engine.warmup()
    compile_s = time.perf_counter() - t0
    reqs = [
      Request(
        prompt_ids=rng.integers(0, VOCAB_SIZE, args.prompt_tokens).tolist(),
        max_tokens=1 << 20,
        temperature=0.0,
      )
      for _ in range(c)
    ]
    t0 = time.perf_counter()
    for r in reqs:
      engine.submit(r)
    while engine.queue_depth or engine.prefill is not None:  # admission: every prompt prefilled and inserted
      engine.step()
    engine.step()
    admit_s = time.perf_counter() - t0
    engine.read_back_all()  # the timed window starts and ends with nothing in flight
    tok0, t0 = engine.stats.tokens, time.perf_counter()
    for _ in range(args.steps):
      engine.step()
    engine.read_back_all()
    engine_tps = (engine.stats.tokens - tok0) / (time.perf_counter() - t0)
    for r in reqs:
      engine.cancel(r)
    engine.run_until_idle()
    del engine, reqs  # free the slot table before the next big allocation
    gc.collect()
    step = LaplaceStep(params, cfg, c)
    lap_s = median_seconds(step, args.steps)
    del step
    need = c * baseline.kv_cache_bytes_per_sequence(cfg, args.throughput_context)
    if need <= args.baseline_mem_gb * 1e9:
      bstep = BaselineStep(bparams, cfg, c, args.throughput_context)
      base_s = median_seconds(bstep, args.steps)
      del bstep
      base_tps = f"{c / base_s:,.0f}"
    else:
      base_s, base_tps = None, f"n/a (cache needs {_gb(need)})"
    rows.append(
      [
        c,
        f"{engine_tps:,.0f}",
        f"{c / lap_s:,.0f}",
        f"{engine_tps * lap_s / c:.0%}",
        f"{lap_s * 1e3:.2f}",
        base_tps,
        f"{admit_s:.1f}",
        f"{compile_s:.1f}",
      ]
    )
    res.append(
      {
        "concurrency": c,
        "engine_tokens_per_s": engine_tps,
        "laplace_step_s": lap_s,
        "baseline_step_s": base_s,
        "baseline_cache_bytes": need,
        "admit_s": admit_s,
        "compile_s": compile_s,
      }
    )
  _table(
    f"throughput ({args.throughput_preset}; prompts of {args.prompt_tokens} tokens, greedy; baseline "
    f"cache {args.throughput_context} tokens)",
    [
      "concurrent",
      "engine tok/s",
      "Laplace decode_step tok/s",
      "engine / decode_step",
      "Laplace step ms",
      "baseline decode tok/s",
      "admission s",
      "compile s",
    ],
    rows,
  )
  out["throughput"] = {"preset": args.throughput_preset, "points": res}


def run_context(args, out):
  cfg = get_config(args.preset)
  params = laplace_params(cfg, args.params_dtype)
  bparams = baseline_params(cfg, args.params_dtype)
  prefill_tokens = min(max(args.contexts), args.max_real_prefill)
  prompt = np.random.default_rng(0).integers(0, VOCAB_SIZE, (1, prefill_tokens)).astype(np.int32)
  t0 = time.perf_counter()
  _, state = model.prefill(params, model.init_state(cfg, 1), prompt, cfg=cfg)
  prefill_s = time.perf_counter() - t0
  lap = LaplaceStep(params, cfg, 1)
  lap.state = state
  lap_times, base_times, rows, res = {}, {}, [], []
  for ctx in args.contexts:
    lap_times[ctx] = median_seconds(lap, args.context_steps)
    need = baseline.kv_cache_bytes_per_sequence(cfg, ctx)
    if need <= args.baseline_mem_gb * 1e9:
      bstep = BaselineStep(bparams, cfg, 1, ctx)
      base_times[ctx] = median_seconds(bstep, args.context_steps)
      del bstep
    else:
      base_times[ctx] = None
  # A second Laplace pass in reverse order: drift of a shared machine shows up as disagreement.
  for ctx in reversed(args.contexts):
    lap_times[ctx] = min(lap_times[ctx], median_seconds(lap, args.context_steps))
  first = args.contexts[0]
  for ctx in args.contexts:
    b = base_times[ctx]
    rows.append(
      [
        ctx,
        f"{lap_times[ctx] * 1e3:.2f}",
        f"{lap_times[ctx] / lap_times[first]:.3f}",
        "n/a (cache over --baseline-mem-gb)" if b is None else f"{b * 1e3:.2f}",
        "" if b is None or base_times[first] is None else f"{b / base_times[first]:.2f}",
      ]
    )
    res.append({"context": ctx, "laplace_s": lap_times[ctx], "baseline_s": b})
  _table(
    f"time per decoded token, one sequence ({args.preset}; Laplace state from a real "
    f"{prefill_tokens}-token prefill in {prefill_s:.1f} s)",
    ["context", "Laplace ms/token", f"Laplace vs {first}", "baseline ms/token", f"baseline vs {first}"],
    rows,
  )
  out["context"] = {"preset": args.preset, "real_prefill_tokens": prefill_tokens, "points": res}


def run_memory(args, out):
  rows, res = [], []
  for name in dict.fromkeys([args.preset, "laplace-3b"]):
    cfg = get_config(name)
    state = jax.eval_shape(lambda: model.init_state(cfg, 1))
    lap = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
    assert lap == state_bytes_per_sequence(cfg)
    kv = {ctx: baseline.kv_cache_bytes_per_sequence(cfg, ctx) for ctx in args.contexts}
    rows.append([name, _gb(lap)] + [f"{_gb(kv[c])} ({kv[c] / lap:,.1f}×)" for c in args.contexts])
    res.append(
      {
        "preset": name,
        "laplace_state_bytes": lap,
        "baseline_kv_bytes": kv,
        "baseline_dtype": cfg.compute_dtype,
      }
    )
  _table(
    "memory per sequence (Laplace fp32 state vs baseline KV cache in the compute dtype)",
    ["preset", "Laplace state"] + [f"baseline KV @ {c}" for c in args.contexts],
    rows,
  )
  out["memory"] = res


def run_flops(args, out):
  cfg = get_config(args.preset)
  params = laplace_params(cfg, args.params_dtype)
  n, dt = args.matmul_size, jnp.dtype(cfg.compute_dtype)
  peak = matmul_peak_flops(n, dt, reps=10)
  step = LaplaceStep(params, cfg, args.flops_slots)
  step_s = median_seconds(step, args.steps)
  # Re-measure the peak after the step: a shared machine's speed drifts.
  peak = max(peak, matmul_peak_flops(n, dt, reps=10))
  flops = args.flops_slots * laplace_decode_flops_per_token(cfg)
  achieved = flops / step_s
  _table(
    f"decode step FLOP/s ({args.preset}, {args.flops_slots} slots, {cfg.compute_dtype})",
    ["step s", "model GFLOP/step", "model GFLOP/s", f"matmul {n}³ peak GFLOP/s", "fraction of peak"],
    [
      [
        f"{step_s:.3f}",
        f"{flops / 1e9:.1f}",
        f"{achieved / 1e9:.1f}",
        f"{peak / 1e9:.1f}",
        f"{achieved / peak:.2f}",
      ]
    ],
  )
  out["flops"] = {
    "preset": args.preset,
    "slots": args.flops_slots,
    "step_s": step_s,
    "model_flops_per_step": flops,
    "achieved_flops": achieved,
    "matmul_peak_flops": peak,
    "fraction_of_peak": achieved / peak,
  }


def run_overhead(args, out):
  """Engine tokens/s against the bare decode step, interleaved in rounds so a shared machine's drift hits
  both alike: each round times --steps engine steps (one step in flight, as served), as many bare
  decode_step calls over the same number of rows, as many of those compiled with the engine's greedy argmax
  (the tokens out instead of the logits), and as many of the engine's own compiled generate calls
  (decode, then sampling and the packed output) run back to back and waited for, on a table of idle
  slots: the device work of an engine step without its host work. Ratios are of the medians over rounds."""
  cfg = get_config(args.throughput_preset)
  params = laplace_params(cfg, args.params_dtype)
  rng = np.random.default_rng(0)
  rows, res = [], []
  for c in args.concurrency:
    engine = _engine(params, cfg, c, args)
    engine.warmup()
    reqs = [
      Request(prompt_ids=rng.integers(0, VOCAB_SIZE, args.prompt_tokens).tolist(), max_tokens=1 << 20)
      for _ in range(c)
    ]
    for r in reqs:
      engine.submit(r)
    while engine.queue_depth or engine.prefill is not None:
      engine.step()
    engine.step()
    step, greedy = LaplaceStep(params, cfg, c), LaplaceStep(params, cfg, c, greedy=True)
    step()
    greedy()
    # The memory floor: every state array of c slots read and written once, in place (the int32 positions,
    # a few bytes per slot, kept as they are).
    half = lambda x: x * 0.5 if jnp.issubdtype(x.dtype, jnp.floating) else x
    scale = jax.jit(lambda s: jax.tree.map(half, s), donate_argnums=0)

    def floor_step(step=step):
      step.state = scale(step.state)
      jax.block_until_ready(step.state)

    floor_step()
    calls = {"table": engine.fns.empty_table()}

    M = args.decode_steps
    n_calls = -(-args.steps // M)  # engine steps (calls) per round: about --steps tokens per slot

    def engine_calls(fns=engine.fns, calls=calls):  # the engine's compiled call: no pipelining, no host work
      # greedy: the program the engine runs for these all-greedy requests (ignored for one step)
      calls["table"], packed = fns.generate(params, calls["table"], M, greedy=True)
      packed.block_until_ready()

    engine_calls()
    eng_s, bare_s, floor_s, calls_s, greedy_s = [], [], [], [], []
    for _ in range(args.overhead_rounds):
      # The window starts and ends with nothing in flight: no call of the window runs before or after it.
      engine.read_back_all()
      tok0, t0 = engine.stats.tokens, time.perf_counter()
      for _ in range(n_calls):
        engine.step()
      engine.read_back_all()
      eng_s.append((time.perf_counter() - t0) * c / (engine.stats.tokens - tok0))
      t0 = time.perf_counter()
      for _ in range(args.steps):
        step()
      bare_s.append((time.perf_counter() - t0) / args.steps)
      t0 = time.perf_counter()
      for _ in range(args.steps):
        greedy()
      greedy_s.append((time.perf_counter() - t0) / args.steps)
      t0 = time.perf_counter()
      for _ in range(n_calls):
        engine_calls()
      calls_s.append((time.perf_counter() - t0) / (n_calls * M))
      floor_s.append(median_seconds(floor_step, args.steps, warmup=0))
    for r in reqs:
      engine.cancel(r)
    engine.run_until_idle()
    del engine, reqs, step, greedy, calls
    gc.collect()
    e, b, f = float(np.median(eng_s)), float(np.median(bare_s)), float(np.median(floor_s))
    g, a = float(np.median(calls_s)), float(np.median(greedy_s))
    rows.append(
      [
        c,
        f"{e * 1e3:.2f}",
        f"{b * 1e3:.2f}",
        f"{b / e:.0%}",
        f"{a * 1e3:.2f}",
        f"{a / e:.0%}",
        f"{g * 1e3:.2f}",
        f"{g / e:.0%}",
        f"{c / e:,.0f}",
        f"{f * 1e3:.2f}",
        f"{f / e:.0%}",
      ]
    )
    res.append(
      {
        "concurrency": c,
        "engine_step_s": e,
        "decode_step_s": b,
        "state_floor_s": f,
        "engine_calls_s": g,
        "decode_argmax_step_s": a,
        "ratio": b / e,
        "ratio_to_decode_argmax": a / e,
        "ratio_to_engine_calls": g / e,
        "engine_tokens_per_s": c / e,
        "engine_rounds_s": eng_s,
        "decode_rounds_s": bare_s,
        "floor_rounds_s": floor_s,
        "engine_calls_rounds_s": calls_s,
        "decode_argmax_rounds_s": greedy_s,
      }
    )
  _table(
    f"engine overhead ({args.throughput_preset}; greedy; speculative_tokens {args.speculative_tokens}; "
    f"decode_steps {args.decode_steps}; {args.overhead_rounds} rounds of {args.steps} steps, interleaved)",
    [
      "concurrent",
      "engine ms/step",
      "decode_step ms",
      "engine / decode_step tok/s",
      "decode_step + argmax ms",
      "engine / that tok/s",
      "engine's calls ms (blocking)",
      "engine / its calls tok/s",
      "engine tok/s",
      "state r+w floor ms",
      "engine / floor-bound tok/s",
    ],
    rows,
  )
  out["overhead"] = {
    "preset": args.throughput_preset,
    "speculative_tokens": args.speculative_tokens,
    "decode_steps": args.decode_steps,
    "points": res,
  }


SECTIONS = {
  "throughput": run_throughput,
  "overhead": run_overhead,
  "context": run_context,
  "memory": run_memory,
  "flops": run_flops,
  **bench_cache.SECTIONS,
}


def main(argv=None):
  args = parse_args(argv)
  sections = [s for s in args.sections.split(",") if s]
  unknown = set(sections) - set(SECTIONS)
  if unknown:
    raise SystemExit(f"--sections: unknown {sorted(unknown)}; choose from {sorted(SECTIONS)}")
  dev = jax.devices()[0]
  machine = (
    f"{platform.processor() or platform.machine()}, {dev.platform}: {dev.device_kind}, jax {jax.__version__}"
  )
  print(f"# serve_bench on {machine}")
  out = {"machine": machine, "args": vars(args)}
  for s in sections:
    t = time.perf_counter()
    SECTIONS[s](args, out)
    print(f"({s}: {time.perf_counter() - t:.0f} s)")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(out, f, indent=1)


if __name__ == "__main__":
  main()
