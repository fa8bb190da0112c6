"""laplace_jax.analysis.neuron_check: each rule fires on a small jitted program that breaks it, and not on one that
keeps it (the programs are lowered here, so the patterns are the ones this jax emits)."""

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from laplace_jax.analysis import neuron_check

X = jnp.ones((4, 8), jnp.float32)


def text(f, *args):
  return jax.jit(f).lower(*args).as_text()


def rules(f, *args):
  return neuron_check.check(text(f, *args)).counts()


def test_cond_and_switch_fire_where_does_not():
  assert rules(lambda x: lax.cond(x.sum() > 0, lambda: x, lambda: -x), X) == {"cond": 1}
  assert rules(lambda x, i: lax.switch(i, [lambda: x, lambda: -x, lambda: 2 * x]), X, 1) == {"cond": 1}
  assert rules(lambda x: jnp.where(x.sum() > 0, x, -x), X) == {}


def test_violation_names_its_line_and_fix():
  t = text(lambda x: lax.cond(x.sum() > 0, lambda: x, lambda: -x), X)
  (v,) = neuron_check.violations(t)
  assert "stablehlo.case" in t.splitlines()[v.line - 1] and "stablehlo.case" in v.excerpt
  assert "jnp.where" in v.message
  assert "cond 1" in neuron_check.check(t).summary("f")


def test_while_needs_a_constant_trip_count():
  assert rules(lambda x: lax.while_loop(lambda c: c.sum() < 100, lambda c: c * 2, x), X) == {"while": 1}
  assert rules(lambda x, n: lax.fori_loop(0, n, lambda i, c: c * 2, x), X, 3) == {"while": 1}
  assert rules(lambda x, s: lax.fori_loop(s, 5, lambda i, c: c * 2, x), X, 0) == {"while": 1}
  assert rules(lambda x: lax.fori_loop(0, 3, lambda i, c: c * 2, x), X) == {}
  scan = lambda x: lax.scan(lambda c, y: (c + y, c), jnp.zeros(8), x)[0]
  assert rules(scan, X) == {}
  assert rules(jax.grad(lambda x: scan(x).sum()), X) == {}


def test_threefry_fires_unsafe_rbg_does_not():
  draw = lambda impl: (
    lambda s, p: jax.random.uniform(jax.random.fold_in(jax.random.key(s, impl=impl), p), (4,))
  )
  seed = (jnp.uint32(1), jnp.uint32(2))
  assert rules(draw("threefry2x32"), *seed).get("threefry", 0) >= 1
  assert rules(draw("rbg"), *seed).get("threefry", 0) >= 1  # rbg's fold_in and split are Threefry's
  # unsafe_rbg: rng_bit_generator only, whose ui64[2] state is not a dtype violation.
  assert rules(draw("unsafe_rbg"), *seed) == {}
  assert "rng_bit_generator" in text(draw("unsafe_rbg"), *seed)


def test_element_types_of_values_not_attributes():
  t = text(lambda x: x.astype(jnp.int16) + 1, X)
  found = neuron_check.violations(t)  # the signature, convert, constant, broadcast, add and return: one each
  assert {v.rule for v in found} == {"dtype"} and len(found) == sum(
    "xi16>" in l or "<i16>" in l for l in t.splitlines()
  )
  assert rules(lambda x: lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16), X).keys() == {"dtype"}
  assert rules(lambda x: x.astype(jnp.complex64) * 2, X).get("dtype", 0) >= 1
  with jax.enable_x64(True):
    assert rules(lambda x: x.astype(jnp.float64) * 2, X).get("dtype", 0) >= 1
    assert rules(lambda x: jnp.arange(8) + x.shape[0], X).get("dtype", 0) >= 1  # i64 indices
  # reduce_window's padding, sort's dimension and gather's sizes are i64 attributes, not values.
  ok = lambda x: jnp.cumsum(x, -1) + jnp.sort(x, -1) + x[:, jnp.array([1, 0, 2, 3, 4, 5, 6, 7])]
  assert rules(ok, X) == {}
  assert rules(lambda x: x.astype(jnp.bfloat16).astype(jnp.int8).astype(jnp.uint32), X) == {}


def _shard_mapped(f, dtype):
  mesh = jax.make_mesh((2, 4), ("data", "fsdp"))
  g = jax.shard_map(f, mesh=mesh, in_specs=P("fsdp"), out_specs=P("fsdp"), check_vma=False)
  x = jax.ShapeDtypeStruct((16, 4), dtype, sharding=NamedSharding(mesh, P("fsdp")))
  return neuron_check.check(jax.jit(g).lower(x).as_text())


def test_collectives_move_f32_or_bf16():
  def every(x):
    a = lax.all_gather(x, "fsdp", tiled=True)[:4]
    b = lax.psum(x, "fsdp")
    c = jnp.tile(lax.psum_scatter(x, "fsdp", tiled=True), (4, 1))
    d = lax.all_to_all(x, "fsdp", 0, 0, tiled=True)
    e = lax.ppermute(x, "fsdp", [(i, (i + 1) % 4) for i in range(4)])
    return a + b + c + d + e

  assert _shard_mapped(every, jnp.bfloat16).counts() == {}
  assert _shard_mapped(every, jnp.float32).counts() == {}
  assert _shard_mapped(every, jnp.int32).counts() == {"collective": 5}
  bits = lambda x: lax.bitcast_convert_type(
    lax.all_gather(lax.bitcast_convert_type(x, jnp.uint16), "fsdp", tiled=True)[:4], jnp.bfloat16
  )
  counts = _shard_mapped(bits, jnp.bfloat16).counts()
  assert counts["collective"] == 1 and counts["dtype"] >= 1


def test_reports_replica_groups_and_reduce_windows():
  r = _shard_mapped(lambda x: lax.psum(x, "fsdp"), jnp.float32)
  assert dict(r.replica_group_sizes) == {4: 1}
  r = neuron_check.check(text(lambda x: jnp.cumsum(x, -1), X))
  assert dict(r.reduce_windows) == {(1, 8): 1} and r.violations == []
  assert "widest [1, 8]" in r.summary()


def test_variadic_reduce_fires_argmax_does_not():
  two = lambda x: lax.reduce((x, 2 * x), (0.0, 0.0), lambda a, b: (a[0] + b[0], a[1] + b[1]), (1,))
  assert rules(two, X) == {"variadic_reduce": 1}
  assert rules(lambda x: jnp.argmax(x, -1) + jnp.argmin(x, -1), X) == {}


def test_sort_comparator_one_key():
  assert rules(lambda x: lax.sort((x, -x), num_keys=2)[0], X) == {"sort": 1}
  assert rules(lambda x: lax.sort((x, -x), num_keys=1)[1] + jnp.argsort(x, -1), X) == {}


def test_custom_calls_only_the_allowlist():
  kernel = lambda x: jax.ffi.ffi_call("my_gpu_kernel", jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
  assert rules(kernel, X) == {"custom_call": 1}
  allowed = text(lambda x: jax.ffi.ffi_call("AwsNeuronRmsNorm", jax.ShapeDtypeStruct(x.shape, x.dtype))(x), X)
  assert neuron_check.violations(allowed) == []
  assert neuron_check.violations(allowed.replace("AwsNeuronRmsNorm", "SPMDFullToShardShape")) == []


def test_power_needs_a_constant_exponent():
  assert rules(lambda x, n: x**n, X, jnp.float32(2.0)) == {"power": 1}
  assert rules(lambda x, t: 1 - jnp.float32(0.95) ** t, X, jnp.int32(3).astype(jnp.float32)) == {"power": 1}
  assert rules(lambda x: x**2.5 + x**3, X) == {}


def test_empty_and_unrelated_text():
  assert neuron_check.violations("") == []
  with pytest.raises(AttributeError):
    neuron_check.check(None)


def test_argmax_of_booleans_is_argmaxs_pair():
  assert rules(lambda x: jnp.argmax(x > 0.5, -1), X) == {}
