"""The compiled train step: accumulation, non-finite skipping, one compile, mesh == single device."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from laplace_jax import sharding
from laplace_jax.model.config import get_config
from laplace_jax.training import train_step as ts

CFG = get_config("tiny", max_seq_len=128, vocab_size=8192)
T = 64


def _batch(B, seed=0, T=T):
  toks = np.random.default_rng(seed).integers(0, 2000, (B, T + 1)).astype(np.int32)
  return ts.Batch(inputs=toks[:, :-1], targets=toks[:, 1:])


def _on_mesh(state, cfg, opt, mesh):
  """`state` (a host copy) in the layout init_train_state_on_mesh gives it on `mesh`: runs compared across
  meshes or optimizers start from one initialisation, compiled once (each run donates its own copy)."""
  shards = jax.tree.map(lambda s: s.sharding, ts.abstract_train_state(cfg, opt, mesh))
  return jax.device_put(state, shards)


def _run(opt, mesh, batches, micro=1, cfg=CFG, state=None, comp=None):
  if comp is None:
    comp = ts.compile_train_step(
      cfg,
      opt,
      mesh,
      global_batch=batches[0].inputs.shape[0],
      seq_len=T,
      step_cfg=ts.StepConfig(micro_batches=micro),
    )
  if state is None:
    state = ts.init_train_state_on_mesh(cfg, opt, mesh, seed=0)
  batch_sh = jax.tree.map(lambda s: s.sharding, ts.abstract_batch(batches[0].inputs.shape[0], T, mesh))
  losses = []
  for b in batches:
    state, m = comp(state, jax.device_put(b, batch_sh))
    losses.append(float(m.loss))
  return state, losses


# AdamW's step at global batch 16 in 2 micro-batches, on one device and on a 2×4 mesh: compiled once for
# the three tests that run it, from one initial state (kept on the host: the steps donate theirs).
ADAMW = optax.adamw(1e-3)


def _mesh(n_dev):
  if n_dev == 1:
    return sharding.make_mesh(data=1, fsdp=1, devices=jax.devices()[:1])
  return sharding.make_mesh(data=2, fsdp=4)


@functools.cache
def _adamw_step(n_dev):
  mesh = _mesh(n_dev)
  step_cfg = ts.StepConfig(micro_batches=2)
  return mesh, ts.compile_train_step(CFG, ADAMW, mesh, global_batch=16, seq_len=T, step_cfg=step_cfg)


@functools.cache
def _adamw_init():
  return jax.device_get(ts.init_train_state_on_mesh(CFG, ADAMW, _mesh(1), seed=0))


def _adamw_state(mesh):
  return _on_mesh(_adamw_init(), CFG, ADAMW, mesh)


def test_loss_matches_plain_cross_entropy():
  from laplace_jax import model

  params = model.init_params(CFG, jax.random.key(0))
  b = _batch(2)
  total, aux = ts.loss_sums(params, b, cfg=CFG)
  logits = model.forward(params, b.inputs, cfg=CFG)
  ref = optax.softmax_cross_entropy_with_integer_labels(logits, b.targets).sum()
  np.testing.assert_allclose(total, ref, rtol=1e-5)
  assert float(aux.tokens) == 2 * T


def test_accumulation_equals_one_big_batch():
  """4 micro-batches give the same step as the whole batch at once (token-weighted mean)."""
  mesh = sharding.make_mesh(data=1, fsdp=1, devices=jax.devices()[:1])
  batches = [_batch(8, s) for s in range(2)]
  s1, l1 = _run(optax.sgd(0.5), mesh, batches, micro=1)
  s4, l4 = _run(optax.sgd(0.5), mesh, batches, micro=4)
  np.testing.assert_allclose(l1, l4, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s4.params)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_weights_make_accumulation_token_weighted():
  """Masked tokens count zero: loss == mean over weighted tokens only, however the batch is split."""
  from laplace_jax import model

  params = model.init_params(CFG, jax.random.key(0))
  b = _batch(4)
  w = np.ones((4, T), np.float32)
  w[0, 10:] = 0
  w[3, :] = 0
  b = b.replace(weights=w)
  total, aux = ts.loss_sums(params, b, cfg=CFG)
  logits = model.forward(params, b.inputs, cfg=CFG)
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, b.targets)
  np.testing.assert_allclose(total / aux.tokens, (ce * w).sum() / w.sum(), rtol=1e-5)


def test_sharded_step_matches_single_device():
  batches = [_batch(16, s) for s in range(3)]
  (one, step1), (eight, step8) = _adamw_step(1), _adamw_step(8)
  _, l1 = _run(ADAMW, one, batches, state=_adamw_state(one), comp=step1)
  _, l8 = _run(ADAMW, eight, batches, state=_adamw_state(eight), comp=step8)
  np.testing.assert_allclose(l1, l8, rtol=2e-5)


def test_non_finite_step_is_skipped_and_counted():
  # test_sharded_step_matches_single_device's one-device step and initial state
  mesh, comp = _adamw_step(1)
  state = _adamw_state(mesh)
  nan_scale = state.params["final_norm_scale"].at[0].set(jnp.nan)
  state = state.replace(params={**state.params, "final_norm_scale": nan_scale})
  before = jax.tree.map(np.asarray, state.params)
  for i in range(2):
    state, m = comp(state, _batch(16, i))
    assert bool(m.skipped) and int(m.bad_steps) == i + 1
  assert int(state.step) == 0
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(state.params)):
    np.testing.assert_array_equal(a, b)


def test_no_recompilation_over_a_run():
  compiles = []
  jax.monitoring.register_event_duration_secs_listener(
    lambda ev, _d, **kw: compiles.append(ev) if ev == "/jax/core/compile/backend_compile_duration" else None
  )
  # test_sharded_step_matches_single_device's 8-device step and initial state
  mesh, comp = _adamw_step(8)
  state = _adamw_state(mesh)
  batch_sh = jax.tree.map(lambda s: s.sharding, ts.abstract_batch(16, T, mesh))
  state, _ = comp(state, jax.device_put(_batch(16), batch_sh))
  n = len(compiles)
  for s in range(5):
    state, m = comp(state, jax.device_put(_batch(16, s), batch_sh))
    float(m.loss)
  assert len(compiles) == n


def test_bad_batch_sizes_rejected_before_compiling():
  mesh = sharding.make_mesh(data=2, fsdp=4)
  with pytest.raises(ValueError, match="multiple of 16"):
    ts.compile_train_step(
      CFG, optax.adamw(1e-3), mesh, global_batch=8, seq_len=T, step_cfg=ts.StepConfig(micro_batches=2)
    )
  with pytest.raises(ValueError, match="micro_batches"):
    ts.StepConfig(micro_batches=0)


def test_20_steps_distributed_muon_equals_undistributed():
  """The tiny model's losses over 20 steps: Muon through two all_to_alls, every matrix gathered, and no
  distribution at all agree (same 8-device mesh, same data). The Muon update alone is bit-identical
  (tests/library/training/test_muon.py); inside the whole fused step XLA lays out the gradient producers per program, which
  moves the last bit of some Newton–Schulz inputs, so the losses agree to float32 rounding (measured max
  relative difference ≈ 1e-7 over the 20 steps)."""
  from laplace_jax.training.optimizer import OptimizerConfig, make_optimizer

  mesh = sharding.make_mesh(data=2, fsdp=4)
  ocfg = OptimizerConfig(total_steps=20, warmup_steps=2, muon_lr=0.05, adamw_lr=3e-3)
  batches = [_batch(8, s) for s in range(20)]
  runs, s0 = {}, None
  for name, opt in {
    "all_to_all": make_optimizer(ocfg, mesh=mesh),
    "gather": make_optimizer(ocfg.replace(muon_distribution="gather"), mesh=mesh),
    "undistributed": make_optimizer(ocfg, mesh=None),
  }.items():
    if s0 is None:  # the three start from one initial state (their optimizer states have one layout)
      s0 = jax.device_get(ts.init_train_state_on_mesh(CFG, opt, mesh, seed=0))
    runs[name] = _run(opt, mesh, batches, state=_on_mesh(s0, CFG, opt, mesh))[1]
  assert runs["all_to_all"][-1] < runs["all_to_all"][0] - 0.5  # it trains
  np.testing.assert_allclose(runs["all_to_all"], runs["gather"], rtol=1e-6)
  np.testing.assert_allclose(runs["all_to_all"], runs["undistributed"], rtol=1e-6)


def test_windowed_pattern_trains():
  """A GLA + sliding-window attention pattern (W = 16 over 64-token rows) runs through the train step and
  learns a repeated batch; its attention weights move."""
  cfg = CFG.replace(n_layers=2, mixers="GS", window=16)
  mesh = sharding.make_mesh(data=1, fsdp=1, devices=jax.devices()[:1])
  opt = optax.adam(1e-2)
  s0 = ts.init_train_state_on_mesh(cfg, opt, mesh, seed=0)
  w = lambda s: np.asarray(s.params["layers"]["block1"]["w_qkv"])
  w0 = w(s0)  # read before the run donates s0
  state, losses = _run(opt, mesh, [_batch(4)] * 4, cfg=cfg, state=s0)
  assert losses[-1] < losses[0] - 0.5, losses
  assert not np.allclose(w(state), w0)


def test_hybrid_pattern_sharded_muon_step_matches_single_device():
  """A GLA + attention pattern trains with Muon on its attention matrices too, sharded == one device."""
  from laplace_jax.training import optimizer as optim

  cfg = CFG.replace(n_layers=4, mixers="GA")
  ocfg = optim.OptimizerConfig(total_steps=10, warmup_steps=1)
  batches = [_batch(16, s) for s in range(2)]
  one = sharding.make_mesh(data=1, fsdp=1, devices=jax.devices()[:1])
  eight = sharding.make_mesh(data=2, fsdp=4)
  opt1, opt8 = optim.make_optimizer(ocfg, mesh=one), optim.make_optimizer(ocfg, mesh=eight)
  s0 = jax.device_get(ts.init_train_state_on_mesh(cfg, opt1, one, seed=0))
  s1, l1 = _run(opt1, one, batches, cfg=cfg, state=_on_mesh(s0, cfg, opt1, one))
  s8, l8 = _run(opt8, eight, batches, cfg=cfg, state=_on_mesh(s0, cfg, opt8, eight))
  np.testing.assert_allclose(l1, l8, rtol=2e-5)
  w = lambda s: np.asarray(s.params["layers"]["block1"]["w_qkv"])
  np.testing.assert_allclose(w(s1), w(s8), rtol=1e-4, atol=1e-6)
