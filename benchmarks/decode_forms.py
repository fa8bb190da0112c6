"""How XLA:CPU compiles formulations of the GLA decode step: passes over the state per layer.

    python benchmarks/decode_forms.py [--layers 4] [--slots 256]

A toy of the decode step's layer scan (carry: activations and the state table [L, B, H, K, V]; per layer a
dot to q, k, v from stacked weights, the state step, a dot back) compiled from abstract shapes for each
formulation of the step, and counted with `laplace_jax.hlo_bytes`: passes = bytes of the loop-body
instructions that read or write at least half a layer's state, in units of one layer's state. Also the
bytes of per-layer weight copies (each layer's slice of the stacked weights written out before its dot);
last, the current step with the layers unrolled and each layer's weights separate arrays.
docs/BENCHMARKS.md ("Decode at the memory bound") names the XLA rule behind each row.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp

from laplace_jax import gla, gla_decode, hlo_bytes

F32 = jnp.float32
H, K, V, D = 8, 48, 96, 768


def _before(q, k, v, g, T, i):
  s = jax.lax.dynamic_index_in_dim(T, i, 0, keepdims=False)
  o, s = gla.recurrent_simple_gla_step(q, k, v, g, s)
  return o, jax.lax.dynamic_update_index_in_dim(T, s, i, 0)


def _from_old_rows(readout: str, ordered: bool = True, keep_dim: bool = False):
  """o = λ·(q·S) + (q·k)·v from the old rows S, by a batched dot, a one-input sum ("sum"), or a sum whose
  reducer is a − (−b) ("subneg"); the write ordered after o (a select on each row's o > +∞, never true) or
  not; the layer's rows as [B, H, K, V] (a bitcast on either side) or with the table's leading dim 1 kept."""

  def step(q, k, v, g, T, i):
    lam, q = jnp.exp(g), q * K**-0.5
    s = jax.lax.dynamic_slice_in_dim(T, i, 1, 0) if keep_dim else jax.lax.dynamic_index_in_dim(T, i, 0, False)
    qs = q[None] if keep_dim else q
    if readout == "dot":
      qs = jnp.einsum("bhk,bhkv->bhv", q, s)
    elif readout == "sum":
      qs = jnp.sum(qs[..., None] * s, axis=-2)
    else:
      qs = jax.lax.reduce(qs[..., None] * s, F32(0), lambda a, b: a - (-b), (s.ndim - 2,))
    o = lam[:, None] * qs.reshape(q.shape[:2] + (V,)) + jnp.sum(q * k, -1)[..., None] * v
    if ordered:
      k = jnp.where(o[:, :1, :1] > jnp.inf, 0.0, k)
    s = lam[:, None, None] * s + (k[..., None] * v[..., None, :]).reshape(s.shape)
    return o, (
      jax.lax.dynamic_update_slice_in_dim(T, s, i, 0)
      if keep_dim
      else jax.lax.dynamic_update_index_in_dim(T, s, i, 0)
    )

  return step


FORMS = {
  "before: S' temporary, dot readout": _before,
  "old rows, unordered": _from_old_rows("sum", ordered=False),
  "old rows, ordered, dot": _from_old_rows("dot"),
  "old rows, ordered, one-input sum": _from_old_rows("sum"),
  "  the same, layer dim kept": _from_old_rows("sum", keep_dim=True),
  "  the same, reducer a - (-b)": _from_old_rows("subneg", keep_dim=True),
  "now: gla_decode XLA step": functools.partial(gla_decode.gla_decode_layer, impl="xla"),
}


def toy_decode(step, W, Wo, x, T):
  g = jnp.log(jnp.linspace(0.5, 0.99, H)).astype(F32)

  def layer(carry, xs):
    x, T = carry
    w, wo, i = xs
    q, k, v = jnp.split(x @ w, [H * K, 2 * H * K], -1)
    B = x.shape[0]
    o, T = step(q.reshape(B, H, K), k.reshape(B, H, K), v.reshape(B, H, V), g, T, i)
    return (x + o.reshape(B, H * V) @ wo, T), None

  (x, T), _ = jax.lax.scan(layer, (x, T), (W, Wo, jnp.arange(W.shape[0])))
  return x, T


def toy_decode_unrolled(step, Ws, Wos, x, T, layer_ids):
  """The same layers unrolled, each with its own weight arrays; the state's layer index stays a runtime value."""
  g = jnp.log(jnp.linspace(0.5, 0.99, H)).astype(F32)
  B = x.shape[0]
  for w, wo, i in zip(Ws, Wos, layer_ids):
    q, k, v = jnp.split(x @ w, [H * K, 2 * H * K], -1)
    o, T = step(q.reshape(B, H, K), k.reshape(B, H, K), v.reshape(B, H, V), g, T, i)
    x = x + o.reshape(B, H * V) @ wo
  return x, T


def measure(step, L: int, B: int, unrolled: bool = False) -> tuple[float, float]:
  """(state passes per layer, bytes of weight copies per layer) of the compiled toy."""
  w, wo = jax.ShapeDtypeStruct((D, H * (2 * K + V)), F32), jax.ShapeDtypeStruct((H * V, D), F32)
  x, T = jax.ShapeDtypeStruct((B, D), F32), jax.ShapeDtypeStruct((L, B, H, K, V), F32)
  if unrolled:
    fn, args = toy_decode_unrolled, ([w] * L, [wo] * L, x, T, jax.ShapeDtypeStruct((L,), jnp.int32))
  else:
    fn, args = (
      toy_decode,
      (jax.ShapeDtypeStruct((L,) + w.shape, F32), jax.ShapeDtypeStruct((L,) + wo.shape, F32), x, T),
    )
  text = jax.jit(functools.partial(fn, step), donate_argnums=3).lower(*args).compile().as_text()
  ops = [o for o in hlo_bytes.memory_traffic(text) if unrolled or o.count == L]  # the layers' instructions
  per = L if unrolled else 1
  layer = B * H * K * V * 4
  passes = sum(o.total_bytes for o in ops if max(o.read_bytes, o.written_bytes) >= layer // 2) / (layer * L)
  weights = {w.size * 4, wo.size * 4}
  copies = sum(o.written_bytes for o in ops if o.written_bytes in weights and o.opcode == "fusion") / per
  return passes, copies


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--slots", type=int, default=256)
  args = p.parse_args(argv)
  print(
    f"# toy decode scan: {args.layers} layers, state [{args.slots}, {H}, {K}, {V}] fp32 per layer; "
    f"jax {jax.__version__}, {jax.devices()[0].platform}"
  )
  print(f"{'formulation':40s} {'state passes/layer':>18s} {'weight copies MB/layer':>23s}")
  for name, step in FORMS.items():
    passes, copies = measure(step, args.layers, args.slots)
    print(f"{name:40s} {passes:18.2f} {copies / 1e6:23.1f}")
  passes, copies = measure(FORMS["now: gla_decode XLA step"], args.layers, args.slots, unrolled=True)
  print(f"{'  the same, unrolled, weights per layer':40s} {passes:18.2f} {copies / 1e6:23.1f}")


if __name__ == "__main__":
  main()
