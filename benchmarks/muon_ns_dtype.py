"""Newton–Schulz in bf16 against fp32 on laplace-3b's matrix shapes: how much the Muon update changes.

    python benchmarks/muon_ns_dtype.py [--preset laplace-3b] [--seed 0] [--time]

Per distinct matrix shape, from a Gaussian momentum-like input X: ‖O_bf16 − O_fp32‖/‖O_fp32‖, the cosine
between them, each one's distance from orthogonality, and with --exact each one's cosine with the exact
orthogonal factor U Vᵀ of X (SVD). `--time` adds the median time of each (meaningful on an accelerator; bf16 matmuls are
slower than fp32 ones on this project's CPU).
"""

import argparse
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from laplace_jax import timing  # noqa: E402
from laplace_jax.config import MUON_PARAM_NAMES, get_config  # noqa: E402
from laplace_jax.counts import param_shapes  # noqa: E402
from laplace_jax.muon import newton_schulz  # noqa: E402


def main(argv):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--preset", default="laplace-3b")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--time", action="store_true")
  ap.add_argument("--exact", action="store_true", help="also compare with U Vᵀ from an SVD (slow on CPUs)")
  args = ap.parse_args(argv)
  shapes = sorted({param_shapes(get_config(args.preset))["layer"][n] for n in MUON_PARAM_NAMES})
  cos = lambda a, b: float(np.sum(a * b) / (np.linalg.norm(a) * np.linalg.norm(b)))

  def orth_err(o):  # ‖O Oᵀ − I‖_F / √rows on the short side: how far from orthogonal the update is
    o = o if o.shape[0] <= o.shape[1] else o.T
    return float(np.linalg.norm(o @ o.T - np.eye(o.shape[0])) / np.sqrt(o.shape[0]))

  f32 = jax.jit(lambda x: newton_schulz(x))
  bf16 = jax.jit(lambda x: newton_schulz(x, dtype=jnp.bfloat16))
  print(f"{args.preset}: Newton–Schulz (5 steps) bf16 vs fp32 on {jax.default_backend()}, seed {args.seed}\n")
  cols = ["shape", "rel. diff", "cos(bf16, fp32)", "orth. err fp32", "orth. err bf16"]
  cols += ["cos(fp32, UVᵀ)", "cos(bf16, UVᵀ)"] if args.exact else []
  cols += ["fp32 ms", "bf16 ms"] if args.time else []
  print("| " + " | ".join(cols) + " |\n" + "|---" * len(cols) + "|")
  for shape in shapes:
    x = jax.random.normal(jax.random.key(args.seed), shape, jnp.float32)
    hi, lo = np.asarray(f32(x)), np.asarray(bf16(x))
    row = [
      f"{shape[0]}×{shape[1]}",
      f"{np.linalg.norm(lo - hi) / np.linalg.norm(hi):.4f}",
      f"{cos(lo, hi):.5f}",
      f"{orth_err(hi):.4f}",
      f"{orth_err(lo):.4f}",
    ]
    if args.exact:
      u, _, vt = np.linalg.svd(np.asarray(x), full_matrices=False)
      row += [f"{cos(hi, u @ vt):.5f}", f"{cos(lo, u @ vt):.5f}"]
    if args.time:
      row += [f"{1e3 * timing.median_seconds(lambda: f(x).block_until_ready(), 3):.1f}" for f in (f32, bf16)]
    print("| " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
  main(sys.argv[1:])
