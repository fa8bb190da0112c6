"""Step-time cost of state passing: the same train step with and without the carried state,
compiled side by side and timed alternately in one process (so both see the same machine load).

    python benchmarks/state_passing_cost.py [--preset tiny] [--seq_len 256] [--batch 16] [--rounds 10]

Prints the median step time of each and their ratio (state passing / plain). Random tokens; one device.
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
  ap.add_argument("--rounds", type=int, default=10, help="alternating timed steps of each (after 2 warm-ups)")
  a = ap.parse_args(argv)
  cfg = get_config(a.preset)
  mesh = sharding.make_mesh(data=1, fsdp=1, devices=jax.devices()[:1])
  opt = optim.make_optimizer(optim.OptimizerConfig(total_steps=1000, warmup_steps=10), mesh=mesh)
  steps, states = {}, {}
  for sp in (False, True):
    steps[sp] = ts.compile_train_step(
      cfg, opt, mesh, global_batch=a.batch, seq_len=a.seq_len, state_passing=sp
    )
    states[sp] = ts.init_train_state_on_mesh(cfg, opt, mesh, seed=0, carry_batch=a.batch if sp else 0)
  rng = np.random.default_rng(0)

  def round_batches(r):
    tok = rng.integers(0, VOCAB_SIZE, (a.batch, a.seq_len + 1)).astype(np.int32)
    batch = ts.Batch(inputs=tok[:, :-1], targets=tok[:, 1:])
    return {False: batch, True: batch}

  medians = time_alternately(steps, states, round_batches, a.rounds)
  plain, sp = medians[False], medians[True]
  print(
    f"{a.preset} at {a.batch} x {a.seq_len} on {jax.default_backend()}: plain {plain * 1e3:.1f} ms, "
    f"state passing {sp * 1e3:.1f} ms, ratio {sp / plain:.3f} (median of {a.rounds} alternating steps)"
  )


if __name__ == "__main__":
  main()
