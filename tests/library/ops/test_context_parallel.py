"""The chunked GLA over a sequence split across devices (laplace_jax/ops/context_parallel.py) equals the unsplit
chunked GLA: outputs, final state and gradients, with segment starts inside a span, at a span's first token and
nowhere, and with an initial state, on 4 and 6 simulated devices (the scan's rounds at distances 1, 2 and
1, 2, 4). Then the train step on a ("data", "fsdp", "context") mesh against the unsplit one."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from laplace_jax import model, platform, sharding
from laplace_jax.analysis import neuron_check
from laplace_jax.model.config import get_config
from laplace_jax.ops import gla
from laplace_jax.ops.context_parallel import chunk_simple_gla_context
from laplace_jax.training import optimizer
from laplace_jax.training import train_step as ts

B, T, H, K, V = 2, 48, 3, 8, 5


def _inputs():
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.normal(size=(B, T, H, d)), jnp.float32) for d in (K, K, V))
  s0 = jnp.asarray(rng.normal(size=(B, H, K, V)), jnp.float32)
  reset = np.zeros((B, T), bool)
  reset[0, [5, 16, 17, 40]] = True  # inside spans, at a span's first token (6 devices) and the next
  return q, k, v, s0, jnp.asarray(reset)


@pytest.mark.parametrize("n_dev", [4, 6])
def test_split_sequence_equals_the_unsplit_gla(n_dev, form="parallel"):
  """(Each span's own work is gla.chunk_simple_gla in either form; the combination is form-independent.)"""
  q, k, v, s0, reset = _inputs()
  g = jnp.log(jnp.asarray([0.5, 0.9, 0.999]))
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:n_dev]), ("context",))
  seq = P(None, "context")

  @jax.jit
  @functools.partial(
    jax.shard_map, mesh=mesh, in_specs=(seq, seq, seq, P(), seq), out_specs=(seq, P()), check_vma=False
  )
  def split(q, k, v, s0, reset):
    return chunk_simple_gla_context(
      q, k, v, g, axis_name="context", initial_state=s0, reset=reset, chunk_size=8, form=form
    )

  whole = jax.jit(
    lambda q, k, v, s0, r: gla.chunk_simple_gla(
      q, k, v, g, initial_state=s0, reset=r, chunk_size=8, form=form
    )
  )
  o, s = split(q, k, v, s0, reset)
  want_o, want_s = whole(q, k, v, s0, reset)
  np.testing.assert_allclose(o, want_o, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(s, want_s, rtol=1e-5, atol=1e-5)

  w_o = jnp.asarray(np.random.default_rng(1).normal(size=(B, T, H, V)), jnp.float32)
  loss = lambda f: (
    lambda q, k, v, s0: jnp.sum(f(q, k, v, s0, reset)[0] * w_o) + jnp.sum(f(q, k, v, s0, reset)[1])
  )
  got = jax.jit(jax.grad(loss(split), argnums=(0, 1, 2, 3)))(q, k, v, s0)
  want = jax.jit(jax.grad(loss(whole), argnums=(0, 1, 2, 3)))(q, k, v, s0)
  for a, b in zip(got, want):
    assert float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)) < 1e-5


# ---- the train step on a ("data", "fsdp", "context") mesh -----------------------------------------------

CFG = get_config("tiny", chunk_size=8, vocab_size=256, n_layers=2, mixers="GS", window=6)
ROWS, SEQ = 4, 64  # 16 tokens per span over 4 context devices: documents cross spans, windows reach back


def _batch(rng, segmented: bool, first_id: int = 0):
  tok = rng.integers(0, CFG.vocab_size, (ROWS, SEQ + 1)).astype(np.int32)
  ids = None
  if segmented:  # documents of every length, one of them over the whole row; some begin at a span's start
    ids = first_id + np.sort(rng.integers(0, 7, (ROWS, SEQ)), axis=1)
    ids[1] = first_id
    ids[2, 16:] += 1
    ids = jnp.asarray(ids.astype(np.int32))
  return ts.Batch(inputs=tok[:, :-1], targets=tok[:, 1:], segment_ids=ids)


@pytest.mark.parametrize("segmented", [True, False], ids=["packed", "stream"])
def test_context_parallel_step_equals_the_unsplit_loss_and_gradients(segmented):
  """Loss, every parameter's gradient and the carry after the step, over data 1 × fsdp 2 × context 4, equal
  train_step.loss_sums run whole on one device, from a carry that a previous batch left (state passing:
  the GLA state, the conv ring and the document that goes on) and with G and S layers."""
  mesh = sharding.make_mesh(data=1, fsdp=2, context=4)
  assert dict(mesh.shape) == {"data": 1, "fsdp": 2, "context": 4}
  rng = np.random.default_rng(4)
  params = model.init_params(CFG, jax.random.key(0))
  host = jax.jit(jax.value_and_grad(lambda p, b: ts.loss_sums(p, b, cfg=CFG), has_aux=True))
  carry = ts.init_carry(CFG, ROWS, segmented)
  (_, aux), _ = host(params, _batch(rng, segmented).replace(carry=carry))
  batch = _batch(rng, segmented, first_id=6).replace(carry=aux.carry)  # rows go on or begin anew
  (want_loss, want_aux), want_grads = host(params, batch)

  grad_fn = ts.fsdp_grad_fn(params, cfg=CFG, mesh=mesh, carry=True)
  on_mesh = jax.device_put(params, sharding.param_shardings(params, mesh))
  specs = ts.batch_partition_specs(batch, mesh)
  batch = jax.tree.map(
    lambda spec, f: jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, spec)), f),
    specs,
    batch,
    is_leaf=lambda x: isinstance(x, P),
  )
  assert batch.inputs.sharding.spec == P(("data", "fsdp"), "context")
  (loss, aux), grads = jax.jit(grad_fn)(on_mesh, batch)
  np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(want_grads)):
    rel = float(jnp.linalg.norm(g - w) / jnp.maximum(jnp.linalg.norm(w), 1e-30))
    assert rel < 1e-5, f"grad{jax.tree_util.keystr(path)}: rel {rel:.2e}"
  for (path, c), w in zip(jax.tree_util.tree_leaves_with_path(aux.carry), jax.tree.leaves(want_aux.carry)):
    np.testing.assert_allclose(c, w, rtol=1e-5, atol=1e-6, err_msg=f"carry{jax.tree_util.keystr(path)}")


def test_context_axis_refuses_full_attention():
  mesh = sharding.make_mesh(data=1, fsdp=2, context=4)
  cfg = CFG.replace(mixers="GA")
  params = jax.eval_shape(lambda: model.init_params(cfg, jax.random.key(0)))  # shapes: nothing runs
  batch = _batch(np.random.default_rng(0), False)
  grad_fn = ts.fsdp_grad_fn(params, cfg=cfg, mesh=mesh)
  with pytest.raises(ValueError, match="full attention layers"):
    jax.eval_shape(grad_fn, params, batch)


def test_context_parallel_step_lowers_clean_for_neuron():
  """The state-passing, packed-row step over data 1 × fsdp 2 × context 4, lowered as for Trainium (Muon and
  AdamW, the unrolled GLA form): no construct the Neuron compiler rejects (laplace_jax/analysis/neuron_check.py)."""
  mesh = sharding.make_mesh(data=1, fsdp=2, context=4)
  with platform.lowering_for("neuron"):
    opt = optimizer.make_optimizer(optimizer.OptimizerConfig(), mesh=mesh)
    lowered = ts.lower_train_step(
      CFG, opt, mesh, global_batch=ROWS, seq_len=SEQ, segmented=True, state_passing=True
    )
  text = lowered.as_text()
  assert "collective_permute" in text and "all_gather" in text  # the spans' edges and (decay, state) pairs
  assert neuron_check.violations(text) == []
