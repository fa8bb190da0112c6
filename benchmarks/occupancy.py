"""What a step costs against its live sequences: the engine's generate calls run the smallest bucket of rows
that holds the live slots (serve.slots.slot_functions.step_rows), not the whole slot table.

    python -m benchmarks occupancy [--preset small] [--tables 64] [--live 1 8 64] [--max-tokens 32]
    python -m benchmarks occupancy --bytes-only --preset laplace-3b --tables 1280 --live 64 1280

Per table size S and live count L (L greedy requests of --max-tokens tokens, short prompts, no stop, in an
engine of S slots, random weights in the compute dtype, no HTTP):
- engine: ms per output token of one sequence after its first (steady decoding), with the buckets;
- whole table: the same engine made to step every slot (its only bucket S: the engine before buckets);
- bare: `model.decode_step` at batch L, jitted with its state donated (median of repeated steps);
- bytes: what the compiled decode call of the bucket for L moves (laplace_jax.analysis.hlo_bytes, compile only),
  and the whole table's; and the engine's start-up (warmup, every bucket compiled) and peak RSS.
Times are ratios within one run (a shared CPU).
"""

from __future__ import annotations

import argparse
import platform
import resource
import time

import jax
import jax.numpy as jnp

from laplace_jax import model
from laplace_jax.analysis import hlo_bytes
from laplace_jax.analysis.timing import median_seconds
from laplace_jax.data.tokenizer import VOCAB_SIZE
from laplace_jax.model.config import PRESETS, get_config
from serve.engine.engine import Engine, Request
from serve.engine.engine_config import EngineConfig
from serve.slots import loading
from serve.slots.slot_functions import SlotFunctions, bucket_sizes, step_rows


def decode_bytes(cfg, n_slots: int, rows: int) -> int:
  """Bytes the compiled decode call over `rows` rows of an n_slots table moves (abstract: nothing runs)."""
  fns = SlotFunctions(model, cfg, n_slots=n_slots, prefill_batch=1, n_stop=2, valid_vocab=VOCAB_SIZE)
  params = jax.eval_shape(
    lambda: loading.cast_params(model.init_params(cfg, jax.random.key(0)), cfg, "compute")
  )
  table = fns.table_shape
  compiled = fns.programs.decode.lower(params, table, jax.ShapeDtypeStruct((rows,), jnp.int32)).compile()
  return hlo_bytes.total_bytes(hlo_bytes.memory_traffic(compiled.as_text()))


def bare_step_ms(params, cfg, batch: int) -> float:
  state = model.init_state(cfg, batch)
  step = jax.jit(lambda p, s, t: model.decode_step(p, s, t, cfg=cfg), donate_argnums=1)
  tokens = jnp.zeros((batch,), jnp.int32)
  box = [state]

  def once():
    logits, box[0] = step(params, box[0], tokens)
    logits.block_until_ready()

  return 1e3 * median_seconds(once, n=7)


def engine_ms(eng: Engine, live: int, max_tokens: int) -> float:
  reqs = [Request(prompt_ids=[1 + i, 2, 3, 4], max_tokens=max_tokens, temperature=0.0) for i in range(live)]
  eng.generate(reqs)
  end = time.perf_counter()
  first = max(r.progress.first_token_at for r in reqs)
  return 1e3 * (end - first) / (max_tokens - 1)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--preset", choices=sorted(PRESETS), default="small")
  ap.add_argument("--tables", type=int, nargs="+", default=[64], help="slot table sizes S")
  ap.add_argument("--live", type=int, nargs="+", default=[1, 8, 64], help="live requests L (<= S)")
  ap.add_argument("--max-tokens", type=int, default=32)
  ap.add_argument("--bytes-only", action="store_true", help="only the compiled decode calls' bytes")
  ap.add_argument("--skip-whole", action="store_true", help="no whole-table runs (slow at large tables)")
  args = ap.parse_args(argv)
  cfg = get_config(args.preset)
  print(
    f"{args.preset} ({cfg.compute_dtype}, random weights) on {jax.devices()[0].device_kind} "
    f"({platform.machine()}), jax {jax.__version__}; {args.max_tokens} greedy tokens per request\n"
  )
  if args.bytes_only:
    print(
      "| slots | live | rows run | bytes per step (GB) | whole table's (GB) |\n|---:|---:|---:|---:|---:|"
    )
    for S in args.tables:
      whole = decode_bytes(cfg, S, S)
      for L in [n for n in args.live if n <= S]:
        B = len(step_rows(range(L), S, bucket_sizes(S)))
        print(f"| {S} | {L} | {B} | {decode_bytes(cfg, S, B) / 1e9:.3f} | {whole / 1e9:.3f} |", flush=True)
    return
  params, cfg = loading.load_model(checkpoint=None, preset=args.preset)
  print(
    "| slots | live | rows run | engine ms/token | whole table ms/token | bare decode_step ms | engine / bare | "
    "whole / bare | bytes per step (MB) | whole table's (MB) |"
  )
  print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
  for S in args.tables:
    eng = Engine(params, cfg, EngineConfig(n_slots=S), valid_vocab=VOCAB_SIZE)
    t = time.perf_counter()
    eng.warmup()
    startup = time.perf_counter() - t
    per_bucket = ", ".join(f"{k} {v:.1f} s" for k, v in eng.warmup_seconds.items())
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    whole_bytes = decode_bytes(cfg, S, S)
    for L in [n for n in args.live if n <= S]:
      engine_ms(eng, L, 4)  # the first batch's allocations, untimed
      ms = engine_ms(eng, L, args.max_tokens)
      buckets, whole = eng.fns.buckets, float("nan")
      if not args.skip_whole:
        eng.fns.buckets = (S,)  # the whole table each step: the engine before buckets
        whole = engine_ms(eng, L, args.max_tokens)
        eng.fns.buckets = buckets
      bare = bare_step_ms(params, cfg, L)
      B = len(step_rows(range(L), S, buckets))
      print(
        f"| {S} | {L} | {B} | {ms:.1f} | {whole:.1f} | {bare:.1f} | {ms / bare:.2f} | {whole / bare:.2f} | "
        f"{decode_bytes(cfg, S, B) / 1e6:.1f} | {whole_bytes / 1e6:.1f} |",
        flush=True,
      )
    print(f"<!-- {S} slots: start-up {startup:.1f} s ({per_bucket}); peak RSS so far {rss:.2f} GB -->")


if __name__ == "__main__":
  main()
