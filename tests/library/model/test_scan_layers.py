"""`scan_layers`: the layer stack scanned (one compiled body) or unrolled (Neuron's default) — one parameter
tree, one initialisation, equal outputs: forward, prefill + decode_step and the sharded train step."""

import jax
import numpy as np
import optax
import pytest

from laplace_jax import model, platform, sharding
from laplace_jax.model.config import LaplaceConfig, get_config, layers_scanned
from laplace_jax.training import train_step as ts

TINY = get_config("tiny", vocab_size=8192)  # a small LM head: the forms differ in the layers, not in it
HYBRID = TINY.replace(n_layers=4, mixers="GA")  # a Group of blocks per scan step, with an attention KV cache


def _both(cfg):
  return cfg.replace(scan_layers="true"), cfg.replace(scan_layers="false")


def _assert_trees_equal(a, b, **tol):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for path, x, y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path[0]), **tol)


def test_choice_per_platform_and_spellings():
  assert [layers_scanned(TINY, b) for b in ("cpu", "gpu", "tpu", "neuron")] == [True, True, True, False]
  assert not layers_scanned(TINY.replace(scan_layers=False), "cpu")  # a Python/TOML bool is accepted
  assert TINY.replace(scan_layers=True).scan_layers == "true"
  assert layers_scanned(TINY.replace(scan_layers="true"), "neuron")
  with pytest.raises(ValueError, match="scan_layers"):
    LaplaceConfig(scan_layers="sometimes")


@pytest.mark.parametrize("cfg", [TINY, HYBRID], ids=["G", "GA"])
def test_same_parameter_tree_and_no_layer_loop_when_unrolled(cfg):
  """Lowering only. (The initial values are equal too: the sharded train step below starts both forms from
  their own init and ends equal.)"""
  scanned, unrolled = _both(cfg)
  init = lambda c: jax.eval_shape(lambda: model.init_params(c, jax.random.key(0)))
  p = init(scanned)
  assert jax.tree.map(lambda x: (x.shape, x.dtype), p) == jax.tree.map(
    lambda x: (x.shape, x.dtype), init(unrolled)
  )
  toks = jax.ShapeDtypeStruct((2, 64), np.int32)
  loops = lambda c: (
    jax.jit(model.forward, static_argnames="cfg").lower(p, toks, cfg=c).as_text().count("stablehlo.while")
  )
  assert loops(scanned) == loops(unrolled) + 1  # the layer loop (the CPU's GLA chunk scan is one more)
  with platform.lowering_for("neuron"):  # auto, as --target neuron lowers: layers and GLA chunks unrolled
    assert loops(cfg) == 0


def test_forward_prefill_and_decode_equal():
  scanned, unrolled = _both(HYBRID)
  params = jax.jit(model.init_params, static_argnums=0)(HYBRID, jax.random.key(1))
  toks = jax.random.randint(jax.random.key(2), (2, 140), 0, HYBRID.vocab_size)
  np.testing.assert_allclose(
    model.forward(params, toks, cfg=unrolled), model.forward(params, toks, cfg=scanned), rtol=1e-6, atol=1e-6
  )
  step = jax.jit(model.decode_step, static_argnames="cfg")
  out = {}
  for cfg in (scanned, unrolled):
    logits, state = model.prefill(
      params, model.init_state(cfg, 2, 160), toks[:, :130], np.array([130, 77]), cfg=cfg
    )
    seq = [logits]
    for t in range(130, 140):
      logits, state = step(params, state, toks[:, t], cfg=cfg)
      seq.append(logits)
    out[cfg.scan_layers] = (np.stack(seq), state)
  _assert_trees_equal(out["false"], out["true"], rtol=1e-6, atol=1e-6)


def test_sharded_train_step_loss_and_grads_equal():
  """FSDP gathers per layer inside remat (which keeps its CSE barrier when unrolled), 2 x 4 mesh: one SGD
  step, so the new parameters are the gradients' image."""
  mesh = sharding.make_mesh(data=2, fsdp=4)
  rng = np.random.default_rng(0)
  toks = rng.integers(0, 2000, (8, 65)).astype(np.int32)
  batch_sh = jax.tree.map(lambda s: s.sharding, ts.abstract_batch(8, 64, mesh))
  batch = jax.device_put(ts.Batch(inputs=toks[:, :-1], targets=toks[:, 1:]), batch_sh)
  out = {}
  for cfg in _both(TINY.replace(remat=True, max_seq_len=128)):
    opt = optax.sgd(1.0)
    comp = ts.compile_train_step(cfg, opt, mesh, global_batch=8, seq_len=64)
    state, metrics = comp(ts.init_train_state_on_mesh(cfg, opt, mesh, seed=0), batch)
    out[cfg.scan_layers] = (float(metrics.loss), float(metrics.grad_norm), state.params)
  np.testing.assert_allclose(out["false"][:2], out["true"][:2], rtol=1e-6)
  _assert_trees_equal(out["false"][2], out["true"][2], rtol=1e-6, atol=1e-7)


def test_checkpoints_and_cached_states_move_between_the_forms():
  import dataclasses

  from laplace_jax.training import checkpoint
  from serve.engine import state_cache

  saved_before_the_field = {k: v for k, v in dataclasses.asdict(TINY).items() if k != "scan_layers"}
  for value in ("auto", "true", "false"):
    checkpoint.check_config(saved_before_the_field, TINY.replace(scan_layers=value), where="export")
    checkpoint.check_config(
      dataclasses.asdict(TINY.replace(scan_layers="true")), TINY.replace(scan_layers=value), where="export"
    )
  with pytest.raises(ValueError, match="remat: saved False, given True"):  # the control: other fields count
    checkpoint.check_config(saved_before_the_field, TINY.replace(remat=True), where="export")
  params = {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}
  ids = {state_cache.model_identity(TINY.replace(scan_layers=v), params) for v in ("auto", "true", "false")}
  assert len(ids) == 1
  assert state_cache.model_identity(TINY.replace(d_model=32, d_ff=64), params) not in ids
