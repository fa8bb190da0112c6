"""Compare lm-evaluation-harness's per-choice loglikelihoods (its --log_samples file) with the same sums
computed directly from `model.forward` of the weights the server was started with (--random-init).

    python -m benchmarks lm_eval_compare SAMPLES.jsonl --preset tiny --seed 0
It tokenizes each (context, continuation) the way lm-eval does (trailing spaces of the context move to the
continuation; continuation ids = ids(context + continuation) after ids(context)) and prints the largest
absolute difference; exit status 1 if it is above --tol.
"""

import argparse
import json
import sys

import numpy as np

from laplace_jax import model
from laplace_jax.data import tokenizer as gpt2
from serve.slots import loading


def loglikelihood(params, cfg, encode, context, continuation):
  n = len(context) - len(context.rstrip())
  if n:
    context, continuation = context[:-n], context[-n:] + continuation
  whole, ctx = encode(context + continuation), encode(context)
  logits = np.asarray(model.forward(params, np.array([whole]), cfg=cfg))[0, :, : gpt2.VOCAB_SIZE].astype(
    np.float64
  )
  m = logits.max(-1, keepdims=True)
  logp = logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))
  return float(sum(logp[t - 1, whole[t]] for t in range(len(ctx), len(whole))))


def main():
  p = argparse.ArgumentParser()
  p.add_argument("samples")
  p.add_argument("--preset", default="tiny")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--tol", type=float, default=1e-3)
  a = p.parse_args()
  params, cfg = loading.load_model(preset=a.preset, seed=a.seed)
  encode = loading.gpt2_tokenizer().encode
  worst, n = 0.0, 0
  with open(a.samples) as f:
    for line in f:
      doc = json.loads(line)
      args = doc["arguments"]
      args = (
        [args[k] for k in sorted(args, key=lambda k: int(k.rsplit("_", 1)[1]))]
        if isinstance(args, dict)
        else args
      )
      for arg, resp in zip(args, doc["resps"]):
        ctx, cont = (arg["arg_0"], arg["arg_1"]) if isinstance(arg, dict) else arg
        served = float(resp[0][0])
        direct = loglikelihood(params, cfg, encode, ctx, cont)
        worst = max(worst, abs(served - direct))
        n += 1
        print(f"{served:12.5f} {direct:12.5f} {served - direct:+.2e}  {ctx[-30:]!r} -> {cont!r}")
  print(f"{n} choices; largest |served - direct| = {worst:.2e} (tolerance {a.tol})")
  sys.exit(0 if n and worst <= a.tol else 1)


if __name__ == "__main__":
  main()
