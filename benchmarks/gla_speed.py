"""Speed of chunk_simple_gla against the token-by-token scan and softmax attention.

    python -m benchmarks gla_speed [--lengths 2048 8192 16384] [--heads 16 --dk 96 --dv 192]

Prints a markdown table: forward and forward+backward times, achieved GFLOP/s of the chunked form (counted as
2C(K+V)+4KV FLOPs per token and head forward, 3× that for forward+backward), and a fp32 matmul peak measured
in the same run. Softmax attention is jax.nn.dot_product_attention (causal, same heads, K for q/k, V for v).
"""

from __future__ import annotations

import argparse
import platform

import jax
import jax.numpy as jnp
import numpy as np

from laplace_jax.analysis import timing
from laplace_jax.model.config import LaplaceConfig, log_decays
from laplace_jax.ops import gla


def bench(fn, *args, reps=3):
  """Median wall time of a compiled call (compile and one warm-up excluded)."""
  return timing.median_seconds(lambda: jax.block_until_ready(fn(*args)), reps, warmup=1)


def fwd_bwd(f):
  """Forward+backward of sum(o·w): gradients w.r.t. q, k, v."""

  def loss(q, k, v, w):
    return jnp.sum(f(q, k, v) * w)

  return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def softmax_attn(q, k, v):
  if q.shape[-1] != v.shape[-1]:  # the XLA implementation wants one head width: pad q/k with zeros
    pad = [(0, 0)] * 3 + [(0, v.shape[-1] - q.shape[-1])]
    q, k = jnp.pad(q, pad), jnp.pad(k, pad)
  return jax.nn.dot_product_attention(q, k, v, is_causal=True, scale=q.shape[-1] ** -0.5)


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 16384])
  ap.add_argument("--heads", type=int, default=16)
  ap.add_argument("--dk", type=int, default=96)
  ap.add_argument("--dv", type=int, default=192)
  ap.add_argument("--chunk", type=int, default=128)
  ap.add_argument(
    "--token-scan-max",
    type=int,
    default=2048,
    help="longest T for the token-by-token scan's backward (it stores a state per token)",
  )
  ap.add_argument(
    "--softmax-max",
    type=int,
    default=8192,
    help="longest T for softmax attention (its [T,T] scores per head must fit in memory)",
  )
  ap.add_argument("--dtype", default="float32")
  ap.add_argument("--batch", type=int, default=1)
  ap.add_argument(
    "--form",
    default="parallel",
    choices=["parallel", "scan"],
    help="chunk_simple_gla's form: intra-chunk work for all chunks at once, or inside the scan",
  )
  ap.add_argument("--only-chunked", action="store_true", help="skip the token scan and softmax attention")
  args = ap.parse_args()
  H, K, V, C = args.heads, args.dk, args.dv, args.chunk
  dtype = jnp.dtype(args.dtype)
  g = jnp.asarray(log_decays(LaplaceConfig(n_heads=H, n_decay_tiers=1)))
  peak = timing.matmul_peak_flops(dtype=dtype) / 1e9
  print(
    f"device: {jax.devices()[0].device_kind} ({platform.processor() or platform.machine()}), "
    f"{jax.device_count()} device(s); {args.dtype} 2048² matmul peak: {peak:.1f} GFLOP/s"
  )
  print(f"B={args.batch}, H={H}, K={K}, V={V}, chunk={C}, form={args.form}\n")
  print(
    "| T | chunked fwd ms | chunked fwd+bwd ms | fwd+bwd GFLOP/s | % of peak | µs/token fwd+bwd "
    "| token scan fwd ms | token scan fwd+bwd ms | softmax fwd ms | softmax fwd+bwd ms "
    "| chunked vs scan (fwd+bwd) | chunked vs softmax (fwd+bwd) |"
  )
  print("|---" * 12 + "|")
  chunked = lambda q, k, v: gla.chunk_simple_gla(q, k, v, g, chunk_size=C, form=args.form)[0]
  Bt = args.batch
  scan = lambda q, k, v: gla.naive_recurrent_simple_gla(q, k, v, g)[0]
  for T in args.lengths:
    ks = jax.random.split(jax.random.key(T), 4)
    q, k = (jax.random.normal(kk, (Bt, T, H, K), dtype) for kk in ks[:2])
    v, w = (jax.random.normal(kk, (Bt, T, H, V), dtype) for kk in ks[2:])
    flops_fwd = Bt * T * H * (2 * C * (K + V) + 4 * K * V)
    t_cf = bench(jax.jit(chunked), q, k, v)
    t_cb = bench(fwd_bwd(chunked), q, k, v, w)
    gflops = 3 * flops_fwd / t_cb / 1e9
    t_sf = bench(jax.jit(scan), q, k, v, reps=1) if not args.only_chunked else float("nan")
    t_sb = (
      bench(fwd_bwd(scan), q, k, v, w, reps=1)
      if T <= args.token_scan_max and not args.only_chunked
      else float("nan")
    )
    if T <= args.softmax_max and not args.only_chunked:
      t_af = bench(jax.jit(softmax_attn), q, k, v, reps=1)
      t_ab = bench(fwd_bwd(softmax_attn), q, k, v, w, reps=1)
    else:
      t_af = t_ab = float("nan")
    ms = lambda t: f"{t * 1e3:.1f}" if np.isfinite(t) else "–"
    ratio = lambda a, b: f"{a / b:.1f}×" if np.isfinite(a) else "–"
    print(
      f"| {T} | {ms(t_cf)} | {ms(t_cb)} | {gflops:.1f} | {100 * gflops / peak:.0f}% | {t_cb / (T * Bt) * 1e6:.2f} "
      f"| {ms(t_sf)} | {ms(t_sb)} | {ms(t_af)} | {ms(t_ab)} | {ratio(t_sb, t_cb)} | {ratio(t_ab, t_cb)} |",
      flush=True,
    )


if __name__ == "__main__":
  main()
