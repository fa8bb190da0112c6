"""State-cache sections of `python -m benchmarks serve_bench` (registered there):

  agent         --agent-conversations conversations of --agent-turns turns in lock step: each turn resends
                the whole conversation plus --turn-tokens new tokens and generates --gen-tokens. Per turn:
                prompt tokens prefilled and mean time to first token, cache off and on.
  prefix        --prefix-requests requests sharing a --prefix-tokens prefix (+ 64 own tokens), cache off
                and on: tokens prefilled and wall time.
  cache_memory  bytes per cached conversation (the state the cache really holds) against a same-size
                KV-cache transformer's keys and values at each --contexts (serve_baseline.py's arithmetic).
  cache_overhead  engine output tokens/s at --overhead-slots slots, every request's state copied out when
                it finishes (cache on) against cache off: the copies must not stall the step.
Engine model: --cache-preset (default tiny: the cache's effect is in the token counts and in time ratios,
which a small model shows on a CPU in minutes).
"""

from __future__ import annotations

import time

import numpy as np

from benchmarks import serve_baseline as baseline
from benchmarks.serve_bench_common import gb as _gb
from benchmarks.serve_bench_common import laplace_params
from benchmarks.serve_bench_common import table as _table
from laplace_jax.data.tokenizer import VOCAB_SIZE as GPT2
from laplace_jax.model.config import get_config
from laplace_jax.model.counts import state_bytes_per_sequence
from serve.engine.engine import Engine, Request
from serve.engine.engine_config import EngineConfig
from serve.engine.state_cache import StateCache, model_identity


def add_args(p):
  ints = lambda s: [int(x) for x in s.split(",") if x]
  g = p.add_argument_group("state cache sections")
  g.add_argument("--cache-preset", default="tiny", help="engine model for the cache sections (default: tiny)")
  g.add_argument("--agent-conversations", type=int, default=64)
  g.add_argument("--agent-turns", type=int, default=20)
  g.add_argument("--turn-tokens", type=int, default=300)
  g.add_argument("--gen-tokens", type=int, default=100)
  g.add_argument("--prefix-requests", type=int, default=256)
  g.add_argument("--prefix-tokens", type=int, default=4096)
  g.add_argument("--overhead-slots", type=int, default=1280)
  g.add_argument("--cache-contexts", type=ints, default=[1024, 8192, 65536])


def _engine(params, cfg, n_slots, cache_on, **kw):
  cache = StateCache(model_identity(cfg, params), 64 << 30) if cache_on else None
  config = EngineConfig(n_slots=n_slots, prefill_batch=kw.pop("prefill_batch", 4), max_queue=100_000, **kw)
  eng = Engine(params, cfg, config, valid_vocab=GPT2, state_cache=cache)
  eng.warmup()
  return eng


def _params(cfg):
  return laplace_params(cfg, "compute")


def run_agent(args, out):
  cfg = get_config(args.cache_preset)
  params = _params(cfg)
  C, T = args.agent_conversations, args.agent_turns
  res = {}
  for on in (False, True):
    eng = _engine(params, cfg, C, on, decode_steps=args.decode_steps)
    rng = np.random.default_rng(0)
    convs = [[] for _ in range(C)]
    turns = []
    for t in range(T):
      reqs = []
      for i in range(C):
        convs[i] += rng.integers(0, GPT2, args.turn_tokens).tolist()
        reqs.append(
          Request(prompt_ids=list(convs[i]), max_tokens=args.gen_tokens, temperature=0.0, stop_ids=())
        )
      before = eng.stats.prefill_tokens
      t0 = time.perf_counter()
      eng.submit_all(reqs)
      eng.run_until_idle()
      wall = time.perf_counter() - t0
      ttft = float(np.mean([r.progress.first_token_at - r.progress.submitted_at for r in reqs]))
      turns.append(
        {
          "turn": t + 1,
          "context": len(convs[0]),
          "prefill_tokens": eng.stats.prefill_tokens - before,
          "mean_ttft_s": ttft,
          "wall_s": wall,
        }
      )
      for i, r in enumerate(reqs):
        convs[i] += r.progress.output_ids
    res["on" if on else "off"] = turns
  rows = []
  for a, b in zip(res["off"], res["on"]):
    rows.append(
      [
        a["turn"],
        a["context"],
        a["prefill_tokens"],
        b["prefill_tokens"],
        f"{a['prefill_tokens'] / max(b['prefill_tokens'], 1):.1f}x",
        f"{a['mean_ttft_s']:.3f}",
        f"{b['mean_ttft_s']:.3f}",
        f"{a['mean_ttft_s'] / b['mean_ttft_s']:.1f}x",
      ]
    )
  _table(
    f"agent loop: {C} conversations x {T} turns (+{args.turn_tokens} tokens, {args.gen_tokens} generated "
    f"per turn), {args.cache_preset}, decode_steps {args.decode_steps}",
    ["turn", "prompt tokens", "prefill tokens off", "on", "ratio", "mean TTFT s off", "on", "ratio"],
    rows,
  )
  out["agent"] = res


def run_prefix(args, out):
  cfg = get_config(args.cache_preset)
  params = _params(cfg)
  rng = np.random.default_rng(1)
  prefix = rng.integers(0, GPT2, args.prefix_tokens).tolist()
  suffixes = [rng.integers(0, GPT2, 64).tolist() for _ in range(args.prefix_requests)]
  res = {}
  for on in (False, True):
    eng = _engine(params, cfg, 64, on)
    reqs = [Request(prompt_ids=prefix + s, max_tokens=16, temperature=0.0) for s in suffixes]
    t0 = time.perf_counter()
    eng.submit_all(reqs)
    eng.run_until_idle()
    res["on" if on else "off"] = {
      "prefill_tokens": eng.stats.prefill_tokens,
      "wall_s": time.perf_counter() - t0,
      "mean_ttft_s": float(np.mean([r.progress.first_token_at - r.progress.submitted_at for r in reqs])),
    }
  a, b = res["off"], res["on"]
  _table(
    f"{args.prefix_requests} requests sharing a {args.prefix_tokens}-token prefix (+64 own, 16 generated), "
    f"{args.cache_preset}, 64 slots",
    ["cache", "prefill tokens", "wall s", "mean TTFT s"],
    [
      ["off", a["prefill_tokens"], f"{a['wall_s']:.2f}", f"{a['mean_ttft_s']:.2f}"],
      ["on", b["prefill_tokens"], f"{b['wall_s']:.2f}", f"{b['mean_ttft_s']:.2f}"],
      [
        "off / on",
        f"{a['prefill_tokens'] / b['prefill_tokens']:.1f}x",
        f"{a['wall_s'] / b['wall_s']:.1f}x",
        f"{a['mean_ttft_s'] / b['mean_ttft_s']:.1f}x",
      ],
    ],
  )
  out["prefix"] = res


def run_cache_memory(args, out):
  """Measured: the bytes of one entry the cache holds for the tiny engine (checked against the config's
  arithmetic), then the same arithmetic for the other presets."""
  cfg = get_config(args.cache_preset)
  params = _params(cfg)
  eng = _engine(params, cfg, 4, True, cache_min_tokens=1)
  eng.generate([Request(prompt_ids=list(range(300)), max_tokens=4, temperature=0.0)])
  eng.state_io.collect(block=True)
  measured = next(iter(eng.cache.entries.values())).nbytes
  assert measured == state_bytes_per_sequence(cfg), (measured, state_bytes_per_sequence(cfg))
  rows, res = [], []
  for preset in ("tiny", "small", "laplace-3b"):
    c = get_config(preset)
    kv = [baseline.kv_cache_bytes_per_sequence(c, n) for n in args.cache_contexts]
    st = state_bytes_per_sequence(c)
    rows.append([preset, _gb(st)] + [f"{_gb(k)} ({k / st:.1f}x)" for k in kv])
    res.append({"preset": preset, "state_bytes": st, "kv_bytes": dict(zip(args.cache_contexts, kv))})
  _table(
    f"memory per cached conversation (measured entry for {args.cache_preset}: {measured} B)",
    ["preset", "Laplace state (any context)"] + [f"KV cache @ {n}" for n in args.cache_contexts],
    rows,
  )
  out["cache_memory"] = {"measured_entry_bytes": measured, "rows": res}


def run_cache_overhead(args, out):
  cfg = get_config(args.cache_preset)
  params = _params(cfg)
  S = args.overhead_slots
  res = {}
  for on in (False, True, False, True):  # twice each, interleaved: the shared machine's speed drifts
    eng = _engine(params, cfg, S, on, prefill_batch=min(S, 64), cache_min_tokens=1)
    rng = np.random.default_rng(2)
    # Staggered lengths: requests finish (and are copied out) on many different steps, while others decode.
    reqs = [
      Request(
        prompt_ids=rng.integers(0, GPT2, 16).tolist(), max_tokens=int(rng.integers(20, 60)), temperature=0.0
      )
      for _ in range(S)
    ]
    eng.submit_all(reqs)
    while eng.prefill is not None or eng.queue_depth:  # prefill everything first; time the decode steps
      eng.step()
    t0, tok0 = time.perf_counter(), eng.stats.tokens
    eng.run_until_idle()
    rate = (eng.stats.tokens - tok0) / (time.perf_counter() - t0)
    res.setdefault("on" if on else "off", []).append(rate)
    if on:
      res["copied_states"] = eng.cache.stats.stored
  off, on = max(res["off"]), max(res["on"])
  _table(
    f"decode throughput with the state cache copying every finished slot out ({S} slots, "
    f"{args.cache_preset}; best of 2 each)",
    ["cache off tok/s", "cache on tok/s", "on / off", "states copied out"],
    [[f"{off:.0f}", f"{on:.0f}", f"{on / off:.3f}", res["copied_states"]]],
  )
  out["cache_overhead"] = res


SECTIONS = {
  "agent": run_agent,
  "prefix": run_prefix,
  "cache_memory": run_cache_memory,
  "cache_overhead": run_cache_overhead,
}
