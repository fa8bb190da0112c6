"""Decode-state bytes per sequence and sequences per accelerator, by mixer pattern (docs/EVAL.md).

    python -m benchmarks state_density [--preset laplace-3b] [--patterns G,GGGS,GGGA,A] [--window 2048]
                                       [--contexts 2048,32768,131072] [--json out.json]

Bytes are summed over the arrays of `model.init_state(cfg, 1, max_len=context)` as `jax.eval_shape` gives
them (nothing is allocated), and checked against `counts.state_bytes_per_sequence`. Sequences per chip:
floor(memory / bytes per sequence) with weights, activations and the server's own tables aside — a 141 GB
H200 (141·10⁹ B, the spec sheet's figure) and a 96 GiB Trainium2 chip (96·2³⁰ B).
"""

from __future__ import annotations

import argparse
import json

import jax
import numpy as np

from laplace_jax import model
from laplace_jax.model.config import get_config
from laplace_jax.model.counts import state_bytes_per_sequence

CHIPS = {"H200 (141 GB)": 141 * 10**9, "Trn2 chip (96 GiB)": 96 * 2**30}


def state_bytes(cfg, context: int) -> int:
  """Bytes of one sequence's decode state with room for `context` tokens, from init_state's own shapes."""
  shapes = jax.eval_shape(lambda: model.init_state(cfg, 1, max_len=context))
  return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(shapes))


def density(preset: str, patterns, window: int, contexts) -> list[dict]:
  rows = []
  for pattern in patterns:
    cfg = get_config(preset, mixers=pattern, window=window)
    per_seq = {}
    for ctx in contexts:
      b = state_bytes(cfg, ctx)
      want = state_bytes_per_sequence(cfg, ctx if "A" in pattern else None)
      if b != want:
        raise AssertionError(
          f"{pattern} at {ctx}: init_state holds {b} B, state_bytes_per_sequence says {want}"
        )
      per_seq[ctx] = b
    rows.append(
      {
        "pattern": pattern,
        "window": window if "S" in pattern else None,
        "bytes_per_seq": per_seq,
        "seqs_per_chip": {chip: {ctx: mem // b for ctx, b in per_seq.items()} for chip, mem in CHIPS.items()},
      }
    )
  return rows


def _size(b: int) -> str:
  for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
    if b >= scale:
      return f"{b / scale:.3g} {unit}"
  return f"{b} B"


def _ctx(n: int) -> str:
  return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def markdown(rows, contexts) -> str:
  head = " / ".join(_ctx(c) for c in contexts)
  out = [
    f"| pattern | bytes per sequence at {head} | "
    + " | ".join(f"sequences per {chip} at {head}" for chip in CHIPS)
    + " |",
    "|---|---|" + "---|" * len(CHIPS),
  ]
  for r in rows:
    name = r["pattern"] + (f" (W = {r['window']:,})" if r["window"] else "")
    size = " / ".join(_size(r["bytes_per_seq"][c]) for c in contexts)
    seqs = [" / ".join(f"{r['seqs_per_chip'][chip][c]:,}" for c in contexts) for chip in CHIPS]
    out.append(f"| {name} | {size} | " + " | ".join(seqs) + " |")
  return "\n".join(out)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--preset", default="laplace-3b")
  ap.add_argument("--patterns", default="G,GGGS,GGGA,A")
  ap.add_argument("--window", type=int, default=2048, help="W of the sliding-window (S) layers")
  ap.add_argument("--contexts", default="2048,32768,131072")
  ap.add_argument("--json", help="also write the rows here")
  args = ap.parse_args(argv)
  contexts = [int(c) for c in args.contexts.split(",")]
  rows = density(args.preset, args.patterns.split(","), args.window, contexts)
  print(markdown(rows, contexts))
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"preset": args.preset, "chips_bytes": CHIPS, "rows": rows}, f, indent=1)
  return rows


if __name__ == "__main__":
  main()
