"""The typed decode state: its stored (flat) form, batch axes under tree.map / vmap / indexing, the row of each
layer in its table, and a state stored by the code before DecodeState still decoding the same."""

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from laplace_jax import model
from laplace_jax.model.config import get_config
from laplace_jax.model.state import DecodeState, KVCache

# tests/data/decode_state_flat_gas.npz was written by the dict-state code (before DecodeState): GAS_CFG and
# init_params(key 0); a prompt (rows of 11 and 6 tokens) prefilled into init_state(cfg, 2, max_len=24); the
# flat state {pos, conv, gla, k, v, ring_k, ring_v} as state/<key>; decode_step's logits[:, :512] after it.
GAS_CFG = get_config("tiny").replace(n_layers=3, mixers="GAS", window=8)
FIXTURE = helpers.DATA / "decode_state_flat_gas.npz"


def test_flat_state_stored_before_decodestate_decodes_the_same():
  data = np.load(FIXTURE)
  flat = {k.removeprefix("state/"): data[k] for k in data.files if k.startswith("state/")}
  assert sorted(flat) == ["conv", "gla", "k", "pos", "ring_k", "ring_v", "v"]
  stored = DecodeState.from_dict(flat)
  params = model.init_params(GAS_CFG, jax.random.key(0))
  _, fresh = model.prefill(
    params, model.init_state(GAS_CFG, 2, max_len=24), data["prompt"], data["lengths"], cfg=GAS_CFG
  )
  for k, x in fresh.to_dict().items():  # the same state, key by key, as the new code makes it
    np.testing.assert_allclose(np.asarray(x), flat[k], atol=1e-5, rtol=1e-5, err_msg=k)
  logits, after = model.decode_step(params, stored, jnp.asarray(data["next_tokens"]), cfg=GAS_CFG)
  want, _ = model.decode_step(params, fresh, jnp.asarray(data["next_tokens"]), cfg=GAS_CFG)
  np.testing.assert_allclose(logits, want, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(logits)[:, :512], data["logits_head"], atol=1e-5, rtol=1e-5)
  assert after.pos.tolist() == (data["lengths"] + 1).tolist()
  assert sorted(after.to_dict()) == sorted(flat)  # and it stores back in the same flat form


def test_to_dict_from_dict_round_trip_and_bad_keys():
  state = model.init_state(GAS_CFG, 2, max_len=5)
  flat = state.to_dict()
  assert sorted(flat) == ["conv", "gla", "k", "pos", "ring_k", "ring_v", "v"]
  back = DecodeState.from_dict(flat)
  assert jax.tree.structure(back) == jax.tree.structure(state)
  assert all(a is b for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(state)))
  carry = model.init_carry(GAS_CFG, 2)  # GLA and conv only: no attention tables in a training carry
  assert carry.kv is None and carry.ring is None and sorted(carry.to_dict()) == ["conv", "gla", "pos"]
  with pytest.raises(ValueError, match="ring_x"):
    DecodeState.from_dict({**flat, "ring_x": flat["pos"]})
  with pytest.raises(ValueError, match="from_dict"):
    model.check_state(flat, GAS_CFG)  # the stored form is not a state: the error names the conversion


@pytest.mark.parametrize("mixers", ["G", "GS", "GA", "GAS"])
def test_batch_axes_reach_every_leaf_under_tree_map_vmap_and_take(mixers):
  cfg = get_config("tiny").replace(n_layers=len(mixers) * 2, mixers=mixers, window=8)
  state = model.init_state(cfg, 3, 4)
  state = jax.tree.map(lambda x: jnp.arange(x.size, dtype=x.dtype).reshape(x.shape), state)
  axes = state.batch_axes()
  assert isinstance(axes, DecodeState) and axes.pos == 0 and axes.conv == 1
  assert jax.tree.leaves(jax.tree.map(lambda x, a: x.shape[a], state, axes)) == [3] * len(
    jax.tree.leaves(state)
  )
  rows = jnp.array([2, 0])
  taken = jax.tree.map(lambda x, a: jnp.take(x, rows, axis=a), state, axes)
  flat, flat_axes = state.to_dict(), axes.to_dict()
  for k, x in taken.to_dict().items():
    np.testing.assert_array_equal(x, np.take(np.asarray(flat[k]), [2, 0], flat_axes[k]), err_msg=k)
  # vmap over the sequences: each call sees one sequence's leaves without the batch axis
  per_seq = jax.jit(jax.vmap(lambda s: jax.tree.map(jnp.sum, s), in_axes=(axes,)))(state)
  for k, x in per_seq.to_dict().items():
    want = np.moveaxis(np.asarray(flat[k]), flat_axes[k], 0).reshape(3, -1).sum(1)
    np.testing.assert_array_equal(x, want, err_msg=k)


def test_kv_cache_is_a_pytree_of_two_tables():
  cache = KVCache(k=jnp.zeros((1, 2, 3)), v=jnp.ones((1, 2, 3)))
  assert [x.shape for x in jax.tree.leaves(cache)] == [(1, 2, 3), (1, 2, 3)]
  state = DecodeState(pos=jnp.zeros((2,), jnp.int32), conv=jnp.zeros((1, 2, 4, 8)), kv=cache)
  assert state.cache_len == 3 and state.batch_size == 2
  assert model.init_state(get_config("tiny"), 2).cache_len is None


@pytest.mark.parametrize("pattern, n_groups", [("G", 4), ("GA", 2), ("GGGS", 2), ("GAS", 3), ("AGGA", 2)])
def test_table_row_numbers_each_table_in_layer_order(pattern, n_groups):
  """Against a walk over the layers in order: the conv row is the layer's index, a mixer's row counts the
  earlier layers with that mixer; every table's rows 0..n-1 are each used once."""
  seen = {}
  for layer in range(n_groups * len(pattern)):
    g, slot = divmod(layer, len(pattern))
    letter = pattern[slot]
    assert model.table_row(pattern, g, slot) == layer
    assert model.table_row(pattern, g, slot, letter) == seen.setdefault(letter, 0)
    seen[letter] += 1
  cfg = get_config("tiny").replace(n_layers=n_groups * len(pattern), mixers=pattern, window=8)
  state = jax.eval_shape(lambda: model.init_state(cfg, 1, 4))
  field = {"G": state.gla, "A": state.kv and state.kv.k, "S": state.ring and state.ring.k}
  for letter, n in seen.items():
    assert field[letter].shape[0] == n, letter
  assert state.conv.shape[0] == n_groups * len(pattern)
