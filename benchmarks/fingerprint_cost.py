"""What the state cache's model fingerprint (serve.state_cache.model_identity: SHA-256 of every parameter
byte) costs at start-up.

  python benchmarks/fingerprint_cost.py [--presets small laplace-3b] [--dtype bfloat16]

`small`: the real call on random weights in the serving dtype. Larger presets (laplace-3b would need 6 GB of
bf16 weights on the host): the same per-leaf SHA-256 over every leaf's bytes, the same thread pool, fed
from one reused buffer as large as the largest leaf (the hashing is what costs; the device-to-host copy of
the weights is not counted there).
"""

import argparse
import concurrent.futures
import hashlib
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from laplace_jax import get_config, model
from serve.state_cache import model_identity


def real(cfg, dtype):
  params = jax.tree.map(lambda x: x.astype(dtype), model.init_params(cfg, jax.random.key(0)))
  jax.block_until_ready(params)
  n = sum(x.size for x in jax.tree.leaves(params))
  t = time.perf_counter()
  model_identity(cfg, params)
  return n, time.perf_counter() - t


def synthetic(cfg, dtype):
  shapes = [
    x.shape for x in jax.tree.leaves(jax.eval_shape(lambda: model.init_params(cfg, jax.random.key(0))))
  ]
  item = jnp.dtype(dtype).itemsize
  buf = np.ones(max(int(np.prod(s)) for s in shapes) * item, np.uint8)
  sizes = [int(np.prod(s)) * item for s in shapes]
  t = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
    list(pool.map(lambda b: hashlib.sha256(memoryview(buf)[:b]).digest(), sizes))
  return sum(sizes) // item, time.perf_counter() - t


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--presets", nargs="+", default=["small", "laplace-3b"])
  p.add_argument("--dtype", default="bfloat16", help="the serving dtype (--params-dtype compute)")
  args = p.parse_args()
  print(f"{os.cpu_count()} CPUs, jax {jax.__version__}")
  for name in args.presets:
    cfg = get_config(name)
    how, (n, s) = (
      ("real", real(cfg, args.dtype))
      if name in ("tiny", "small")
      else ("synthetic", synthetic(cfg, args.dtype))
    )
    gb = n * jnp.dtype(args.dtype).itemsize / 1e9
    print(
      f"{name}: {n / 1e6:.1f} M parameters, {gb:.2f} GB {args.dtype}: {s:.2f} s ({how}), {gb / s:.2f} GB/s"
    )


if __name__ == "__main__":
  main()
