"""Time of one layer's decode-state update against a copy of the same bytes (docs/BENCHMARKS.md).

    python -m benchmarks gla_decode_speed [--preset laplace-3b] [--slots 1280] [--layers 2] [--impls xla,pallas]

For each implementation of `gla_decode.gla_decode_layer` (table donated, layer 1 of --layers): the median
step time, the state bytes it must move (one layer read + written once) per second, and that time as a
multiple of an in-place scaling of one layer's state timed in the same run (one read and one write: the
memory-bound floor on this device).
First checks each implementation against `gla.recurrent_simple_gla_step` on the same inputs.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from laplace_jax.analysis.timing import median_seconds
from laplace_jax.model.config import PRESETS, get_config, log_decays
from laplace_jax.ops import gla, gla_decode


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--preset", default="small", choices=sorted(PRESETS))
  p.add_argument("--slots", type=int, default=1280)
  p.add_argument("--layers", type=int, default=2, help="layers in the table (the step updates layer 1)")
  p.add_argument("--impls", default="xla", help="comma list of xla, pallas, interpret (default: xla)")
  p.add_argument("--steps", type=int, default=5, help="timed calls per round (default: 5)")
  p.add_argument("--rounds", type=int, default=3, help="rounds alternating floor and implementations")
  p.add_argument("--dtype", default="compute", help="q/k/v dtype: compute (the preset's) or a dtype name")
  args = p.parse_args(argv)
  cfg = get_config(args.preset)
  B, H, K, V, L = args.slots, cfg.n_heads, cfg.d_k, cfg.d_v, args.layers
  dt = jnp.dtype(cfg.compute_dtype if args.dtype == "compute" else args.dtype)
  keys = jax.random.split(jax.random.key(0), 4)
  q, k = (jax.random.normal(kk, (B, H, K), dt) for kk in keys[:2])
  v = jax.random.normal(keys[2], (B, H, V), dt)
  g = jnp.asarray(log_decays(cfg))
  layer_bytes = B * H * K * V * 4
  print(
    f"# {args.preset}: {B} slots, table [{L},{B},{H},{K},{V}] fp32, one layer {layer_bytes / 1e9:.3f} GB; "
    f"{jax.devices()[0].device_kind}, jax {jax.__version__}"
  )

  table = jax.random.normal(keys[3], (L, B, H, K, V), jnp.float32)
  o_ref, s_ref = gla.recurrent_simple_gla_step(q, k, v, g, table[1])
  o_ref, s_ref = np.asarray(o_ref, np.float32), np.asarray(s_ref)
  # The floor: scaling one layer in place (one read + one write). Each implementation is timed in rounds
  # alternating with the floor, so a shared machine's drift hits both; ratios are medians over rounds.
  # (Returning anything read from t besides the update made XLA copy the whole table first.)
  fns = {"floor": jax.jit(lambda q, k, v, g, t, l: (jnp.zeros(()), t.at[1].multiply(0.5)), donate_argnums=4)}
  for impl in [s for s in args.impls.split(",") if s]:
    fns[impl] = jax.jit(functools.partial(gla_decode.gla_decode_layer, impl=impl), donate_argnums=4)
    o, t = fns[impl](q, k, v, g, jnp.array(table), 1)
    err_o = float(np.abs(np.asarray(o, np.float32) - o_ref).max() / np.abs(o_ref).max())
    err_s = float(np.abs(np.asarray(t[1]) - s_ref).max() / np.abs(s_ref).max())
    print(f"{impl}: max relative error vs recurrent_simple_gla_step: o {err_o:.1e}, state {err_s:.1e}")
    del t
  state = {"t": jnp.array(table)}
  del table

  def timed(fn):
    def step():
      o, state["t"] = fn(q, k, v, g, state["t"], 1)
      jax.block_until_ready((o, state["t"]))

    return median_seconds(step, args.steps)

  rounds = {name: [] for name in fns}
  for _ in range(args.rounds):
    for name, fn in fns.items():
      rounds[name].append(timed(fn))
  floor = float(np.median(rounds["floor"]))
  print(
    f"floor (in-place scale of one layer): {floor * 1e3:.2f} ms = {2 * layer_bytes / floor / 1e9:.0f} GB/s"
  )
  for name in fns:
    if name != "floor":
      s = float(np.median(rounds[name]))
      ratio = float(np.median(np.array(rounds[name]) / np.array(rounds["floor"])))
      print(
        f"{name:9s} {s * 1e3:8.2f} ms  {2 * layer_bytes / s / 1e9:6.0f} GB/s of state  "
        f"{ratio:5.2f}x the floor"
      )


if __name__ == "__main__":
  main()
