"""Bytes the compiled decode step moves per step, against the minimum (docs/BENCHMARKS.md).

    python -m benchmarks decode_bytes [--preset small] [--slots 1280] [--top 12] [--json out.json]
                                      [--mixers GGGGS --window 2048 [--n_layers N]] [--max_len 1024]

Compiles `model.decode_step` (jitted, state donated, weights in the compute dtype as the server holds them)
from abstract shapes, so nothing is allocated, and counts with `laplace_jax.analysis.hlo_bytes` (loop bodies once per
layer). The minimum: every state array read once and written once (a ring, the conv windows' or a sliding-window
layer's; an attention layer's KV cache of --max_len positions: read once, one row written), every weight read
once (the embedding: only the looked-up rows), the logits written once. Also prints the compiled memory:
arguments, the part of the outputs aliased to the donated state, and temporaries (one state table means
temp << state).
"""

from __future__ import annotations

import argparse
import functools
import json
from collections import defaultdict

import jax
import jax.numpy as jnp

from laplace_jax import model
from laplace_jax.analysis import hlo_bytes
from laplace_jax.model.config import PRESETS, get_config


def abstract_inputs(cfg, slots, max_len=None):
  cdt = jnp.dtype(cfg.compute_dtype)
  params = jax.eval_shape(lambda: model.init_params(cfg, jax.random.key(0)))
  params = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, cdt if p.ndim >= 2 else p.dtype), params)
  state = jax.eval_shape(lambda: model.init_state(cfg, slots, max_len))
  return params, state, jax.ShapeDtypeStruct((slots,), jnp.int32)


def minimum_bytes(cfg, params, state, slots) -> dict:
  nbytes = lambda t: sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(t))
  embed = params["embed"]
  weights = nbytes(params) - nbytes(embed) + slots * embed.shape[1] * jnp.dtype(embed.dtype).itemsize
  # rings (the conv windows, a sliding-window layer's keys and values) and KV caches are read whole but
  # written one row (slot pos mod its length; position pos) per step
  ring_len = {"conv": cfg.conv_size, "ring_k": cfg.window, "ring_v": cfg.window}
  if state.kv is not None:
    ring_len.update(k=state.cache_len, v=state.cache_len)
  state = state.to_dict()  # the flat form: a length per key
  ring_bytes = sum(nbytes(state[k]) * (1 + 1 / n) for k, n in ring_len.items() if k in state)
  rest = {k: v for k, v in state.items() if k not in ring_len}
  return {
    "state_read_and_written": 2 * nbytes(rest) + ring_bytes,
    "weights_read": weights,
    "logits_written": slots * cfg.vocab_size * 4,
    "tokens_read": slots * 4,
  }


def measure(cfg, slots, max_len=None):
  params, state, tokens = abstract_inputs(cfg, slots, max_len)
  step = jax.jit(functools.partial(model.decode_step, cfg=cfg), donate_argnums=(1,))
  compiled = step.lower(params, state, tokens).compile()
  ops = hlo_bytes.memory_traffic(compiled.as_text())
  mem = compiled.memory_analysis()
  minimum = minimum_bytes(cfg, params, state, slots)
  state_bytes = sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(state))
  return ops, mem, minimum, state_bytes, compiled.as_text()


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--preset", default="small", choices=sorted(PRESETS))
  p.add_argument("--slots", type=int, default=1280)
  p.add_argument("--top", type=int, default=12, help="largest instructions to list")
  p.add_argument("--hlo", help="write the compiled HLO text to this file")
  p.add_argument("--json", help="also write the figures to this file")
  p.add_argument("--mixers", help="mixer pattern (default the preset's): G, S, A (A needs --max_len)")
  p.add_argument("--window", type=int, help="window of the S layers (default the preset's)")
  p.add_argument("--n_layers", type=int, help="layers (default the preset's), for a pattern that needs it")
  p.add_argument("--max_len", type=int, help="KV cache length of the attention (A) layers, in tokens")
  args = p.parse_args(argv)
  overrides = {k: getattr(args, k) for k in ("mixers", "window", "n_layers") if getattr(args, k) is not None}
  cfg = get_config(args.preset, **overrides)
  if ("A" in cfg.mixers) != (args.max_len is not None):
    p.error(
      f"--max_len is the KV cache length of attention layers: give it exactly when the pattern "
      f"({cfg.mixers!r}) has an A, e.g. --max_len 1024"
    )
  if args.max_len is not None:
    overrides["max_len"] = args.max_len
  ops, mem, minimum, state_bytes, text = measure(cfg, args.slots, args.max_len)
  if args.hlo:
    with open(args.hlo, "w") as f:
      f.write(text)
  moved, least = hlo_bytes.total_bytes(ops), sum(minimum.values())
  print(
    f"# decode step bytes, {args.preset} {overrides or ''} at {args.slots} slots, jax {jax.__version__}, "
    f"{jax.devices()[0].platform}"
  )
  print(
    f"moved per step: {moved / 1e9:.3f} GB;  minimum: {least / 1e9:.3f} GB  "
    + ", ".join(f"{k} {v / 1e9:.3f}" for k, v in minimum.items())
  )
  print(f"ratio: {moved / least:.2f}x the minimum")
  print(
    f"compiled memory: arguments {mem.argument_size_in_bytes / 1e9:.3f} GB, aliased outputs "
    f"{mem.alias_size_in_bytes / 1e9:.3f} GB (state {state_bytes / 1e9:.3f} GB), temporaries "
    f"{mem.temp_size_in_bytes / 1e9:.3f} GB"
  )
  by_kind = defaultdict(int)
  for o in ops:
    by_kind[o.opcode] += o.total_bytes
  order = sorted(by_kind.items(), key=lambda kv: -kv[1])
  print("by opcode: " + ", ".join(f"{k} {v / 1e9:.3f} GB" for k, v in order))
  print(f"\nlargest {args.top} (GB per step = (read + written) x executions):")
  for o in sorted(ops, key=lambda o: -o.total_bytes)[: args.top]:
    print(
      f"  {o.total_bytes / 1e9:7.3f}  x{o.count:<3d} r {o.read_bytes / 1e6:8.1f} MB  "
      f"w {o.written_bytes / 1e6:8.1f} MB  {o.opcode:8s} {o.name}  {o.op_name.split('/')[-1]}"
    )
  if args.json:
    with open(args.json, "w") as f:
      json.dump(
        {
          "preset": args.preset,
          "slots": args.slots,
          **overrides,
          "moved_bytes": moved,
          "minimum": minimum,
          "ratio": moved / least,
          "temp_bytes": mem.temp_size_in_bytes,
          "alias_bytes": mem.alias_size_in_bytes,
          "state_bytes": state_bytes,
        },
        f,
        indent=1,
      )


if __name__ == "__main__":
  main()
