"""Explicit FSDP: gathers in the compute dtype, fp32 reduce-scatters, and the step's traffic at its floor."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from laplace_jax import fsdp, platform, sharding
from laplace_jax.analysis import hlo_traffic
from laplace_jax.model.config import get_config
from laplace_jax.model.counts import param_counts
from laplace_jax.training import train_step as ts
from laplace_jax.training.optimizer import OptimizerConfig, make_optimizer


@pytest.mark.parametrize("dim", [0, 1])
def test_gather_backward_is_the_summed_gradient_shard(dim):
  mesh = sharding.make_mesh(data=2, fsdp=4)
  w = jax.random.normal(jax.random.key(0), (16, 24), jnp.float32)
  x = jax.random.normal(jax.random.key(1), (8, 16), jnp.float32)
  spec = P("fsdp", None) if dim == 0 else P(None, "fsdp")

  def per_device(w_shard, x_rows):
    loss = lambda ws: jnp.sum(jnp.tanh(x_rows @ fsdp.gather(ws, dim, jnp.float32)) ** 2)
    l, g = jax.value_and_grad(loss)(w_shard)
    return jax.lax.psum(l, sharding.BATCH_AXES), g

  f = jax.shard_map(
    per_device, mesh=mesh, in_specs=(spec, P(sharding.BATCH_AXES)), out_specs=(P(), spec), check_vma=False
  )
  l, g = jax.jit(f)(jax.device_put(w, NamedSharding(mesh, spec)), x)
  want_l, want_g = jax.value_and_grad(lambda w: jnp.sum(jnp.tanh(x @ w) ** 2))(w)  # plain jnp, one device
  np.testing.assert_allclose(l, want_l, rtol=1e-5)
  np.testing.assert_allclose(g, want_g, rtol=1e-5, atol=1e-6)


def test_gather_in_bf16_equals_cast_after_gather():
  mesh = sharding.make_mesh(data=1, fsdp=8)
  w = jax.random.normal(jax.random.key(2), (16, 8), jnp.float32)
  f = jax.shard_map(
    lambda ws: fsdp.gather(ws, 0, jnp.bfloat16),
    mesh=mesh,
    in_specs=P("fsdp", None),
    out_specs=P(),
    check_vma=False,
  )
  got = jax.jit(f)(jax.device_put(w, NamedSharding(mesh, P("fsdp", None))))
  assert got.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(w.astype(jnp.bfloat16), np.float32))


def test_split_dim_names_the_shapes_when_not_a_one_dim_split():
  assert fsdp.split_dim((4, 8), (4, 8)) is None and fsdp.split_dim((4, 2), (4, 8)) == 1
  with pytest.raises(ValueError, match=r"\(2, 2\).*\(4, 8\)"):
    fsdp.split_dim((2, 2), (4, 8))


def test_sharded_step_traffic_is_bf16_gathers_and_fp32_reduce_scatters_at_the_floor():
  """Fails if a weight gather goes back to fp32, a gradient reduction back to an all-reduce, or the step's
  collectives grow past 1.2× the floor (2 bf16 gathers + 1 fp32 reduce-scatter of every weight per
  micro-batch)."""
  cfg = get_config("tiny", compute_dtype="bfloat16", remat=True)
  n, micro = 8, 2
  mesh = sharding.make_mesh(data=1, fsdp=n)
  opt = make_optimizer(OptimizerConfig(total_steps=10, warmup_steps=1), mesh=mesh)
  compiled = ts.compile_train_step(
    cfg, opt, mesh, global_batch=16, seq_len=128, step_cfg=ts.StepConfig(micro_batches=micro)
  )
  colls = [c for c in hlo_traffic.parse_collectives(compiled.as_text(), n) if c.sent_bytes]
  gathers = [c for c in colls if c.kind == "all-gather"]
  reductions = [c for c in colls if c.kind == "reduce-scatter"]
  assert gathers and {c.dtype for c in gathers} <= {"u16", "bf16"}, {c.dtype for c in gathers}
  assert reductions and {c.dtype for c in reductions} == {"f32"}
  P_ = param_counts(cfg)["total"]
  floor = micro * (2 * 2 * 2 * P_ + 2 * 4 * P_) * (n - 1) / n
  total = hlo_traffic.total_bytes(colls)
  all_reduce = hlo_traffic.total_bytes([c for c in colls if c.kind == "all-reduce"])
  assert all_reduce < 0.01 * total  # scalars and the small replicated leaves only
  assert hlo_traffic.total_bytes(reductions) >= 0.99 * micro * 2 * 4 * P_ * (n - 1) / n
  assert total <= 1.2 * floor, (total, floor)


def test_neuron_lowered_step_gathers_bf16_directly_and_cpu_gathers_bits():
  """On the CPU the bf16 weights travel as u16 bits (XLA:CPU widens bf16 collectives); lowered for Neuron
  (no uint16 on Trn2) the same step all-gathers bf16 itself."""
  cfg = get_config("tiny", compute_dtype="bfloat16", remat=True)
  mesh = sharding.make_mesh(data=1, fsdp=8)
  opt = make_optimizer(OptimizerConfig(total_steps=10, warmup_steps=1), mesh=mesh)
  lower = lambda: ts.lower_train_step(cfg, opt, mesh, global_batch=8, seq_len=64).as_text()
  gathers = lambda text: [l for l in text.splitlines() if "all_gather" in l]
  cpu = gathers(lower())
  with platform.lowering_for("neuron"):
    neuron = gathers(lower())
  assert any("ui16" in l for l in cpu)  # the control: the CPU path is the bit trick
  assert neuron and any("bf16" in l for l in neuron)
  assert not any("ui16" in l or "i16" in l for l in neuron), [l for l in neuron if "i16" in l][:2]
