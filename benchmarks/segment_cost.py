"""Step-time cost of packed documents apart (segment ids): the same train step with and without segment ids
in the batch, compiled side by side and timed alternately in one process (both see the same machine load).

    python benchmarks/segment_cost.py [--preset tiny] [--seq_len 256] [--batch 16] [--rounds 20] [--docs 4]

Prints the median step time of each and their ratio (segment ids / plain). Random tokens, `--docs` documents
of random lengths per row; one device; the suite's XLA flags are not applied (XLA's defaults).
"""

from __future__ import annotations

import argparse

import jax
import numpy as np
from step_timing import time_alternately

from laplace_jax import optimizer as optim
from laplace_jax import sharding
from laplace_jax import train_step as ts
from laplace_jax.config import get_config
from laplace_jax.tokenizer import VOCAB_SIZE


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--preset", default="tiny")
  ap.add_argument("--seq_len", type=int, default=256)
  ap.add_argument("--batch", type=int, default=16)
  ap.add_argument("--rounds", type=int, default=20, help="alternating timed steps of each (after 2 warm-ups)")
  ap.add_argument("--docs", type=int, default=4, help="documents per row (segment ids)")
  a = ap.parse_args(argv)
  cfg = get_config(a.preset)
  mesh = sharding.make_mesh(data=1, fsdp=1, devices=jax.devices()[:1])
  opt = optim.make_optimizer(optim.OptimizerConfig(total_steps=1000, warmup_steps=10), mesh=mesh)
  steps, states = {}, {}
  for seg in (False, True):
    steps[seg] = ts.compile_train_step(cfg, opt, mesh, global_batch=a.batch, seq_len=a.seq_len, segmented=seg)
    states[seg] = ts.init_train_state_on_mesh(cfg, opt, mesh, seed=0)
  rng = np.random.default_rng(0)

  def round_batches(r):
    tok = rng.integers(0, VOCAB_SIZE, (a.batch, a.seq_len + 1)).astype(np.int32)
    cuts = np.sort(rng.integers(1, a.seq_len, (a.batch, a.docs - 1)), axis=1)
    ids = (np.arange(a.seq_len)[None, :, None] >= cuts[:, None, :]).sum(-1).astype(np.int32)
    plain = ts.Batch(inputs=tok[:, :-1], targets=tok[:, 1:])
    return {False: plain, True: plain.replace(segment_ids=ids)}

  medians = time_alternately(steps, states, round_batches, a.rounds)
  plain, seg = medians[False], medians[True]
  print(
    f"{a.preset} at {a.batch} x {a.seq_len}, {a.docs} documents per row, on {jax.default_backend()}: plain "
    f"{plain * 1e3:.1f} ms, segment ids {seg * 1e3:.1f} ms, ratio {seg / plain:.3f} (median of {a.rounds} "
    "alternating steps)"
  )


if __name__ == "__main__":
  main()
