"""Meshes and partition specs on 8 simulated devices (and an abstract 64-device mesh for laplace-3b)."""

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from laplace_jax import param_names, sharding
from laplace_jax.model import config, counts


def _abstract_params(cfg):
  shapes = counts.param_shapes(cfg)
  tree = {n: jax.ShapeDtypeStruct(s, jnp.float32) for n, s in shapes["model"].items()}
  tree["layers"] = {
    n: jax.ShapeDtypeStruct((cfg.n_layers,) + s, jnp.float32) for n, s in shapes["layer"].items()
  }
  return tree


def test_make_mesh_axes_and_sizes():
  mesh = sharding.make_mesh(data=2, fsdp=4)
  assert mesh.axis_names == ("data", "fsdp") and dict(mesh.shape) == {"data": 2, "fsdp": 4}
  assert dict(sharding.make_mesh(data=2).shape) == {"data": 2, "fsdp": 4}  # fsdp takes the rest
  assert mesh.devices.size == 8 and len({d.id for d in mesh.devices.flat}) == 8
  assert dict(sharding.make_mesh(fsdp=2, devices=jax.devices()[4:]).shape) == {"data": 1, "fsdp": 2}


def test_make_mesh_too_large_says_how_to_simulate():
  with pytest.raises(ValueError, match=r"needs 16 devices but 8 are present.*simulate_cpu_devices"):
    sharding.make_mesh(data=2, fsdp=8)
  with pytest.raises(ValueError, match="data=3"):
    sharding.make_mesh(data=3)
  with pytest.raises(ValueError, match="fsdp=0"):
    sharding.make_mesh(fsdp=0)


def test_laplace_3b_specs_on_64_devices():
  specs = sharding.param_specs(
    _abstract_params(config.get_config("laplace-3b")), AbstractMesh((1, 64), ("data", "fsdp"))
  )
  layers = specs["layers"]
  for name in param_names.MUON_PARAM_NAMES:  # fan_in over fsdp, never the layer axis
    assert layers[name] == P(None, "fsdp", None), name
  assert specs["embed"] == P("fsdp", None) and specs["lm_head"] == P(None, "fsdp")  # vocab is the larger dim
  assert layers["ln1_scale"] == P(None, "fsdp") and layers["conv_kernel"] == P(None, None, "fsdp")
  assert layers["aug_balance"] == P(None, None, None)  # 36,864 values: below the threshold, replicated
  assert specs["final_norm_scale"] == P(None)


def _shard_shapes(tree, mesh):
  placed = jax.device_put(
    jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), tree), sharding.param_shardings(tree, mesh)
  )
  return jax.tree.map(lambda x: x.addressable_shards[0].data.shape, placed)


def test_tiny_params_placed_fsdp_sharded():
  mesh = sharding.make_mesh(data=2, fsdp=4)
  cfg = config.get_config("tiny", vocab_size=512)
  local = _shard_shapes(_abstract_params(cfg), mesh)
  assert local["layers"]["w_qkvg"] == (2, 16, 192)  # [L, D/4, qkvg]: Muon leaves always shard
  assert local["layers"]["w3"] == (2, 32, 64)
  assert local["layers"]["ln1_scale"] == (2, 64)  # small: replicated
  # Replicated over "data": devices 0 and 4 (same fsdp index, other data replica) hold the same block.
  arr = jax.device_put(
    jnp.arange(64.0).reshape(1, 64, 1) * jnp.ones((2, 64, 8)),
    jax.NamedSharding(mesh, sharding.matrix_spec((2, 64, 8), mesh)),
  )
  blocks = {s.device.id: s.index for s in arr.addressable_shards}
  devs = mesh.devices
  assert blocks[devs[0, 1].id] == blocks[devs[1, 1].id] != blocks[devs[0, 2].id]


def test_large_leaf_that_does_not_divide_is_an_error():
  mesh = AbstractMesh((1, 64), ("data", "fsdp"))
  tree = {"layers": {"big_table": jax.ShapeDtypeStruct((24, 1000, 999), jnp.float32)}}
  with pytest.raises(ValueError, match=r"layers/big_table: shape \(24, 1000, 999\).*'fsdp' axis size 64"):
    sharding.param_specs(tree, mesh)
  assert sharding.param_specs(tree, mesh, min_shard_elements=10**9)["layers"]["big_table"] == P(
    None, None, None
  )
  with pytest.raises(ValueError, match=r"layers/w1: shape \(24, 100, 30\) has neither matrix dim"):
    sharding.param_specs({"layers": {"w1": jax.ShapeDtypeStruct((24, 100, 30), jnp.float32)}}, mesh)


def test_layer_axis_is_never_sharded_even_when_it_is_largest():
  mesh = AbstractMesh((1, 8), ("data", "fsdp"))
  spec = sharding.leaf_spec(("layers", "norm"), (4096, 8, 24), mesh)
  assert spec == P(None, None, "fsdp")
  with pytest.raises(ValueError, match="after the layer axis"):
    sharding.leaf_spec(("layers", "odd"), (4096, 7, 9999), mesh)


def test_batch_and_decode_state_split_over_every_device():
  mesh = sharding.make_mesh(data=2, fsdp=4)
  batch = {"tokens": jnp.zeros((16, 32), jnp.int32), "mask": jnp.zeros((16, 32))}
  shard = sharding.batch_shardings(batch, mesh)
  assert shard["tokens"].spec == P(("data", "fsdp"), None)
  placed = jax.device_put(batch, shard)
  assert placed["tokens"].addressable_shards[0].data.shape == (2, 32)
  state = {
    "gla": jax.ShapeDtypeStruct((2, 8, 4, 8, 16), jnp.float32),
    "conv": jax.ShapeDtypeStruct((2, 8, 4, 64), jnp.float32),
  }
  specs = jax.tree.map(lambda s: s.spec, sharding.decode_state_shardings(state, mesh))
  assert specs == {
    "gla": P(None, ("data", "fsdp"), None, None, None),
    "conv": P(None, ("data", "fsdp"), None, None),
  }
  with pytest.raises(ValueError, match=r"batch/tokens: batch size 12 .* does not divide over the 8 devices"):
    sharding.batch_shardings({"tokens": jnp.zeros((12, 32))}, mesh)
  with pytest.raises(ValueError, match=r"state/gla: batch size 6"):
    sharding.decode_state_shardings({"gla": jax.ShapeDtypeStruct((2, 6, 4), jnp.float32)}, mesh)


def test_optimizer_state_follows_param_rule():
  mesh = sharding.make_mesh(fsdp=8)
  params = {
    "embed": jnp.zeros((512, 64)),
    "layers": {"w1": jnp.zeros((2, 64, 128)), "ln1_scale": jnp.zeros((2, 64))},
  }
  state = jax.eval_shape(optax.adamw(1e-3).init, params)
  specs = sharding.param_specs(state, mesh)
  leaves = {
    jax.tree_util.keystr(p): s
    for p, s in jax.tree_util.tree_leaves_with_path(specs, is_leaf=lambda x: isinstance(x, P))
  }
  mu = [s for k, s in leaves.items() if ".mu" in k and "'w1'" in k]
  assert mu == [P(None, "fsdp", None)]
  assert all(s == P() for k, s in leaves.items() if "count" in k)
  assert len(leaves) == 7  # count + mu, nu of three leaves
