"""Same-run A/B of the engine's sampling call (serve/slots.py `_sample_next`: sample the next token, finished
flags, logprob rows) with the batch-level `cond`s (CPU/GPU) against the branch-free form (Neuron), per batch
kind and slot count, in alternating rounds; medians and ratios from one process (docs/BENCHMARKS.md,
"Sampling without cond").

    python benchmarks/sampling_step.py [--preset small] [--slots 64,1280] [--rounds 5] [--calls 3]

Batches: greedy (every slot temperature 0: the cond form runs one blocked argmax); mixed (a quarter each
greedy, temperature 1, top-k 50, top-p 0.9; one slot asks for logprobs: the cond form skips the bisection);
mixed+bisection (one more slot with top-k 100, past the candidates: the cond form runs the bisection too, on
that slot's row). Logits: Zipf-like rows (probability ∝ rank^-1.5, ranks
shuffled per row), as peaked as a language model's next-token distribution often is.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from laplace_jax import model
from laplace_jax.config import get_config
from laplace_jax.tokenizer import VOCAB_SIZE as VALID_VOCAB
from serve.slots import SlotFunctions, SlotSettings, SlotTable


def zipf_logits(S, V, rng):
  base = -1.5 * np.log(np.arange(1, VALID_VOCAB + 1, dtype=np.float32))
  rows = np.full((S, V), -30.0, np.float32)
  for i in range(S):
    rows[i, :VALID_VOCAB] = base[rng.permutation(VALID_VOCAB)]
  return jnp.asarray(rows)


def table(S, kind):
  t, k, p, lp = (
    np.zeros(S, np.float32),
    np.zeros(S, np.int32),
    np.ones(S, np.float32),
    np.full(S, -1, np.int32),
  )
  if kind != "greedy":
    q = np.arange(S) % 4
    t[q > 0] = 1.0
    k[q == 2] = 50
    p[q == 3] = 0.9
    lp[1] = 5
    if kind == "mixed+bisection":
      k[2] = 100
  return SlotTable(
    model=None,  # the sampling call never reads the model state
    tokens=jnp.zeros(S, jnp.int32),
    last_output_index=jnp.arange(S, dtype=jnp.int32),
    settings=SlotSettings(
      temperature=jnp.asarray(t),
      top_k=jnp.asarray(k),
      top_p=jnp.asarray(p),
      seed=jnp.arange(S, dtype=jnp.uint32),
      seed_hi=jnp.zeros(S, jnp.uint32),
      max_tokens=jnp.full(S, 1 << 20, jnp.int32),
      logprobs=jnp.asarray(lp),
      stop_ids=jnp.full((S, 4), -1, jnp.int32),
    ),
  )


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--preset", default="small")
  ap.add_argument("--slots", default="64,1280")
  ap.add_argument("--rounds", type=int, default=5)
  ap.add_argument("--calls", type=int, default=3, help="calls per program per round")
  a = ap.parse_args()
  cfg = get_config(a.preset)
  print(f"backend {jax.default_backend()}, jax {jax.__version__}, preset {a.preset} (vocab {cfg.vocab_size})")
  print("| slots | batch | with cond ms | branch-free ms | branch-free / cond | tokens equal |")
  print("|---:|---|---:|---:|---:|---|")
  for S in (int(s) for s in a.slots.split(",")):
    logits = zipf_logits(S, cfg.vocab_size, np.random.default_rng(0))
    progs = {
      bf: jax.jit(
        SlotFunctions(
          model, cfg, n_slots=S, prefill_batch=1, n_stop=4, valid_vocab=VALID_VOCAB, branch_free=bf
        )._sample_next
      )
      for bf in (False, True)
    }
    for kind in ("greedy", "mixed", "mixed+bisection"):
      tab = table(S, kind)
      outs = {bf: np.asarray(jax.block_until_ready(f(logits, tab))[1]) for bf, f in progs.items()}  # compile
      times = {bf: [] for bf in progs}
      for _ in range(a.rounds):
        for bf, f in progs.items():
          t0 = time.perf_counter()
          for _ in range(a.calls):
            jax.block_until_ready(f(logits, tab))
          times[bf].append((time.perf_counter() - t0) / a.calls)
      c, b = (np.median(times[bf]) * 1e3 for bf in (False, True))
      same = bool((outs[False] == outs[True]).all())
      print(f"| {S:,} | {kind} | {c:.2f} | {b:.2f} | {b / c:.2f}x | {same} |", flush=True)


if __name__ == "__main__":
  main()
