"""What the attention and window-attention decode tests share: which form a decode step lowers to on each target,
and how many times one compiled decode step moves its key/value tables (imported by tests/library/ops/test_attention.py and
tests/library/ops/test_window_attention.py)."""

import math

import jax
import jax.numpy as jnp

from helpers.hlo_compile import compile_as_benchmarks
from laplace_jax import platform
from laplace_jax.analysis import hlo_bytes


def assert_matmul_form_on_neuron_reduces_elsewhere(decode, args):
  """`decode(*args)` lowers to dots and no variadic reduce on Neuron (which has none), and to reduces and no
  dot elsewhere (the in-place form)."""
  # a new function each time: a traced function is cached without the lowering target in its key
  primitives = lambda: str(jax.make_jaxpr(lambda *a: decode(*a))(*args))
  with platform.lowering_for("neuron"):
    assert "dot_general" in primitives() and " reduce[" not in primitives()
  with platform.lowering_for("cpu"):
    assert "dot_general" not in primitives() and " reduce[" in primitives()


def passes_over_tables(decode, table_shape, q_shape) -> float:
  """Bytes one compiled decode step moves, in units of its two fp32 tables [L, ...] (keys and values).

  `decode(q, k, v, k_tables, v_tables, layer, pos_B) -> (o, k_tables, v_tables)` runs for each of the L layers
  in a scan, with the tables donated as a serving step donates its state: 1.0 means each table is read once
  and written in place."""
  L = table_shape[0]

  def step(kt, vt, q, pos):
    def body(c, i):
      o, kt, vt = decode(q, q, q, c[1], c[2], i, pos)
      return (c[0] + o, kt, vt), None

    return jax.lax.scan(body, (jnp.zeros_like(q), kt, vt), jnp.arange(L))[0]

  f32 = lambda s: jax.ShapeDtypeStruct(s, jnp.float32)
  compiled = compile_as_benchmarks(
    jax.jit(step, donate_argnums=(0, 1)).lower(
      f32(table_shape), f32(table_shape), f32(q_shape), jax.ShapeDtypeStruct(q_shape[:1], jnp.int32)
    )
  )
  return hlo_bytes.total_bytes(hlo_bytes.memory_traffic(compiled.as_text())) / (
    2 * math.prod(table_shape) * 4
  )
