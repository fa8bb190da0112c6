"""Speculative decoding end to end through the serving engine: drafts from a prediction or from prompt lookup,
verified K at a time, against plain decoding of the same requests.

    python -m benchmarks speculative_serve [--preset small] [--batches 1 8] [--drafts 8] [--max-tokens 128]
                                           [--rules cost always]

Workload (the embedded corpus): each request's prompt is a KJV chapter's first `--passage-tokens` tokens,
then "Repeat the passage above exactly:" and the passage's first words: a prompt that quotes a passage and
asks for it back. Greedy decoding of `--max-tokens` tokens, no stop, `batch` requests at once in an engine of
`batch` slots (or `--n-slots`, where more), random weights of `--preset` in its compute dtype or a trained export (`--checkpoint`). Cases,
each on the same requests:

- none: no prediction, no lookup (the plain generate step);
- right: the prediction is the reply itself (as decoded by `none`);
- half: the reply with every other block of 8 tokens replaced by random tokens (half the tokens right);
- random: a prediction of random tokens, as long as the reply;
- lookup: no prediction, prompt lookup on (drafts from the sequence's own tokens);
- right 1/B: the first request predicts its reply, the others predict nothing.

Every case but none runs under each `--rules` (the engine's speculative_rule): `always` verifies whenever a
slot has drafts, `cost` only when the drafts' expected tokens pay for a verify's measured cost.

Reported per case: time per output token of one sequence (after its first token), tokens per model call
(output tokens / generate or verify steps), drafts verified and accepted, and the ratio to `none`; every case
must reproduce `none`'s tokens exactly (checked). Times are ratios within one run (a shared CPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import time

import jax
import numpy as np

from laplace_jax.data.tokenizer import VOCAB_SIZE
from laplace_jax.model.config import PRESETS
from serve.engine.engine import Engine, Request
from serve.engine.engine_config import SPECULATIVE_RULES, EngineConfig
from serve.slots import loading


def prompts(n: int, passage_tokens: int) -> list[list[int]]:
  from train.prepare import kjv_documents

  tok = loading.gpt2_tokenizer()
  out = []
  for doc in kjv_documents()[: n * 3 : 3]:
    ids = tok.encode(doc)[:passage_tokens]
    out.append(ids + tok.encode("\n\nRepeat the passage above exactly:\n\n") + ids[:4])
  return out


def run_case(eng: Engine, specs: list[dict], predictions, lookup: bool, rule: str = "always"):
  eng.drafter.prompt_lookup, eng.drafter.rule = lookup, rule
  before = dataclasses.replace(eng.stats)
  reqs = [Request(**s, prediction_ids=p) for s, p in zip(specs, predictions)]
  eng.generate(reqs)
  end = time.perf_counter()
  first = max(r.progress.first_token_at for r in reqs)
  n_out = [len(r.progress.output_ids) for r in reqs]
  steps = eng.stats.steps - before.steps
  return {
    "outputs": [r.progress.output_ids for r in reqs],
    "ms_per_token": 1e3 * (end - first) / (min(n_out) - 1),
    "tokens_per_call": sum(n_out) / len(reqs) / steps,
    "drafted": eng.stats.drafted_tokens - before.drafted_tokens,
    "accepted": eng.stats.accepted_tokens - before.accepted_tokens,
  }


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--preset", choices=sorted(PRESETS), help="default: small (random weights)")
  ap.add_argument(
    "--checkpoint",
    help="an export of `python -m train` (e.g. train/demo.sh's runs/demo-*/export/step_120) instead of random "
    "weights: its config is the model's, --preset must match it or be omitted",
  )
  ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
  ap.add_argument(
    "--n-slots", type=int, default=0, help="the engine's slot table (default 0: as many slots as the batch)"
  )
  ap.add_argument("--drafts", type=int, nargs="+", default=[8], help="K: drafts verified per slot and step")
  ap.add_argument("--max-tokens", type=int, default=128)
  ap.add_argument("--passage-tokens", type=int, default=160)
  ap.add_argument("--rules", nargs="+", choices=SPECULATIVE_RULES, default=list(SPECULATIVE_RULES))
  args = ap.parse_args(argv)
  preset = args.preset or (None if args.checkpoint else "small")
  params, cfg = loading.load_model(checkpoint=args.checkpoint, preset=preset)
  weights = f"trained: {args.checkpoint}" if args.checkpoint else "random weights"
  print(
    f"{preset or 'exported model'} ({cfg.compute_dtype}, {weights}) on {jax.devices()[0].device_kind} "
    f"({platform.machine()}), jax {jax.__version__}; {args.max_tokens} greedy tokens per request\n"
  )
  print(
    "| batch | K | rule | case | ms per token | × none | tokens per call | drafts verified | accepted | "
    "same tokens |"
  )
  print("|---:|---:|---|---|---:|---:|---:|---:|---:|---|")
  rng = np.random.default_rng(0)
  for B in args.batches:
    specs = [
      dict(prompt_ids=p, max_tokens=args.max_tokens, temperature=0.0) for p in prompts(B, args.passage_tokens)
    ]
    for K in args.drafts:
      config = EngineConfig(n_slots=max(B, args.n_slots), prefill_batch=min(B, 8), speculative_tokens=K)
      eng = Engine(params, cfg, config, valid_vocab=VOCAB_SIZE)
      eng.warmup()
      run_case(eng, [{**s, "max_tokens": 8} for s in specs], [()] * B, lookup=False)  # the first batch's
      # allocations and caches, not timed (the first timed case ran 1.0-1.5x slower without this)
      none = run_case(eng, specs, [()] * B, lookup=False)
      replies = none["outputs"]

      def half(o):
        o = list(o)
        for i in range(8, len(o), 16):
          o[i : i + 8] = rng.integers(0, VOCAB_SIZE, len(o[i : i + 8])).tolist()
        return o

      predictions = {
        "right": (replies, False),
        "half": ([half(o) for o in replies], False),
        "random": ([rng.integers(0, VOCAB_SIZE, len(o)).tolist() for o in replies], False),
        "lookup": ([()] * B, True),
      }
      if B > 1:
        predictions["right 1/B"] = ([replies[0]] + [()] * (B - 1), False)
      rows = [("", "none", none)]
      for name, (pred, lookup) in predictions.items():
        for rule in args.rules:
          rows.append((rule, name, run_case(eng, specs, pred, lookup, rule)))
      for rule, name, c in rows:
        same = sum(a == b for a, b in zip(c["outputs"], replies))
        print(
          f"| {B} | {K} | {rule} | {name} | {c['ms_per_token']:.1f} | "
          f"{c['ms_per_token'] / none['ms_per_token']:.2f} | {c['tokens_per_call']:.2f} | {c['drafted']} | "
          f"{c['accepted']} | {same}/{B} |",
          flush=True,
        )
      ratios = ", ".join(f"{b} rows {r:.2f}" for b, r in sorted(eng.drafter.cost.ratios().items()))
      print(f"<!-- verify / generate step measured by the engine, per bucket: {ratios} -->")


if __name__ == "__main__":
  main()
