"""Optimizer: labels, schedule, the Muon + AdamW composition against optax's own, accumulation."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optax.contrib import MuonDimensionNumbers
from optax.contrib import muon as optax_muon

from laplace_jax import param_names, sharding
from laplace_jax.model import config, counts
from laplace_jax.training.adamw import adamw as own_adamw
from laplace_jax.training.optimizer import (
  OptimizerConfig,
  accumulate_gradients,
  lr_schedule,
  make_optimizer,
  param_labels,
  split_microbatches,
)

CFG = config.get_config("tiny", vocab_size=256)


def _params(seed, scale=1.0):
  shapes = counts.param_shapes(CFG)
  rng = np.random.default_rng(seed)
  arr = lambda s: jnp.asarray(scale * rng.standard_normal(s), jnp.float32)
  tree = {n: arr(s) for n, s in shapes["model"].items()}
  tree["layers"] = {n: arr((CFG.n_layers,) + s) for n, s in shapes["layer"].items()}
  return tree


def test_labels_send_exactly_the_hidden_matrices_to_muon():
  labels = param_labels(_params(0))
  muon = {n for n, l in labels["layers"].items() if l == "muon"}
  assert muon == set(param_names.MUON_PARAM_NAMES)
  assert {labels[n] for n in ("embed", "lm_head", "final_norm_scale")} == {"adamw"}
  with pytest.raises(ValueError, match="layers/w1 has shape"):
    param_labels({"layers": {"w1": jnp.ones((4, 4))}})


def test_schedule_warms_up_linearly_then_cosine_decays():
  ocfg = OptimizerConfig(total_steps=110, warmup_steps=10, end_lr_fraction=0.1)
  lr = lr_schedule(2.0, ocfg)
  np.testing.assert_allclose([lr(0), lr(4), lr(9)], [0.2, 1.0, 2.0], rtol=1e-6)
  np.testing.assert_allclose([lr(10), lr(60), lr(110), lr(500)], [2.0, 1.1, 0.2, 0.2], rtol=1e-5)
  assert lr_schedule(1.0, OptimizerConfig()).__call__(3814) == pytest.approx(1.0)  # laplace-3b warm-up


def _reference(ocfg, clip=True):
  """The same recipe from optax's own parts: contrib.muon on the stacks, adamw on the rest."""
  muon = optax_muon(
    lr_schedule(ocfg.muon_lr, ocfg),
    eps=1e-7,
    beta=ocfg.muon_beta,
    weight_decay=ocfg.muon_weight_decay,
    muon_weight_dimension_numbers=MuonDimensionNumbers(1, 2),
  )
  mask = lambda p: jax.tree_util.tree_map_with_path(lambda path, _: path[-1].key in ("embed", "lm_head"), p)
  adamw = optax.adamw(
    lr_schedule(ocfg.adamw_lr, ocfg),
    b1=ocfg.adamw_b1,
    b2=ocfg.adamw_b2,
    eps=ocfg.adamw_eps,
    weight_decay=ocfg.adamw_weight_decay,
    mask=mask,
  )
  labels = lambda p: jax.tree_util.tree_map_with_path(
    lambda path, _: "muon" if path[-1].key in param_names.MUON_PARAM_NAMES else "adamw", p
  )
  parts = optax.partition({"muon": muon, "adamw": adamw}, labels)
  return optax.chain(optax.clip_by_global_norm(ocfg.clip_norm), parts) if clip else parts


def _updates(tx, params, grads_seq):
  state, out, step = tx.init(params), [], jax.jit(tx.update)
  for g in grads_seq:
    u, state = step(g, state, params)
    params = optax.apply_updates(params, u)
    out.append(u)
  return out


def _close(a, b):
  """Leafwise equal to rounding (Newton–Schulz rounds differently near zero: atol scales with the leaf)."""
  return all(
    np.allclose(x, y, rtol=2e-5, atol=1e-5 * np.abs(y).max())
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
  )


# The recipe the comparisons below run (the same programs: a test after the first reads them back from the
# compilation cache).
OCFG = OptimizerConfig(total_steps=20, warmup_steps=2, muon_weight_decay=0.05)


def test_make_optimizer_matches_optax_composition():
  ocfg = OCFG
  params = _params(1)
  grads = [_params(2, scale=50.0), _params(3, scale=0.01), _params(4)]  # the first one gets clipped
  ours = _updates(make_optimizer(ocfg), params, grads)
  for u, r in zip(ours, _updates(_reference(ocfg), params, grads)):
    assert _close(u, r)
  unclipped = _updates(_reference(ocfg, clip=False), params, grads)
  assert not _close(ours[1], unclipped[1])  # the control: clipping changes AdamW's second step


def test_clip_norm_zero_means_no_clipping():
  ocfg = OCFG.replace(clip_norm=0.0)
  params = _params(1)
  grads = [_params(2, scale=50.0), _params(3, scale=0.01)]
  ours = _updates(make_optimizer(ocfg), params, grads)
  for u, r in zip(ours, _updates(_reference(ocfg, clip=False), params, grads)):
    assert _close(u, r)


def _shard(tree, mesh):
  return jax.device_put(tree, sharding.param_shardings(tree, mesh))


def test_distributed_optimizer_matches_gather_and_one_device_closely():
  """Muon's all_to_all slots zero-pad matrices, which changes the matmuls' rounding (tests/library/training/test_muon.py)."""
  mesh = sharding.make_mesh(fsdp=8)
  ocfg = OCFG
  params, grads = _params(5), [_params(6 + i) for i in range(2)]
  single = _updates(make_optimizer(ocfg), params, grads)
  runs = {}
  for dist in ("all_to_all", "gather"):
    tx = make_optimizer(ocfg.replace(muon_distribution=dist), mesh=mesh)
    p = _shard(params, mesh)
    state = jax.device_put(tx.init(p), sharding.param_shardings(jax.eval_shape(tx.init, p), mesh))
    step, runs[dist] = jax.jit(tx.update), []
    for g in grads:
      u, state = step(_shard(g, mesh), state, p)
      p = optax.apply_updates(p, u)
      runs[dist].append(u)
  for a, b, s in zip(runs["all_to_all"], runs["gather"], single):
    assert _close(a, b) and _close(a, s) and _close(b, s)


@pytest.mark.parametrize(
  "change,needle",
  [
    (dict(muon_lr=-1.0), "muon_lr=-1.0"),
    (dict(adamw_lr=float("inf")), "adamw_lr=inf"),
    (dict(muon_beta=1.0), "muon_beta=1.0"),
    (dict(adamw_b2=-0.5), "adamw_b2=-0.5"),
    (dict(warmup_steps=30, total_steps=20), "warmup_steps=30"),
    (dict(total_steps=0), "total_steps=0"),
    (dict(clip_norm=-1.0), "clip_norm=-1.0"),
    (dict(muon_scale_mode="rms"), "muon_scale_mode='rms'"),
    (dict(muon_ns_steps=0), "muon_ns_steps=0"),
  ],
)
def test_bad_settings_are_clear_errors(change, needle):
  with pytest.raises(ValueError) as e:
    OptimizerConfig(**change)
  assert needle in str(e.value) and "expected" in str(e.value)


# ---- accumulation ----------------------------------------------------------------------------------


def _sum_loss(w, mb):
  """Summed masked squared error of a linear model and its token count."""
  err_BxT = (mb["x"] @ w["w"])[..., 0] - mb["y"]
  return jnp.sum(mb["mask"] * err_BxT**2), jnp.sum(mb["mask"])


def test_accumulation_weights_tokens_like_one_big_batch():
  rng = np.random.default_rng(0)
  B, T, D = 8, 6, 3
  mask = np.ones((B, T), np.float32)
  mask[1::4, 2:] = 0  # micro-batch 1 (rows 1, 5 after interleaving) loses most of its tokens
  mask[3, :] = 0  # and micro-batch 3 one whole row
  batch = {
    "x": jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32),
    "y": jnp.asarray(rng.standard_normal((B, T)), jnp.float32),
    "mask": jnp.asarray(mask),
  }
  w = {"w": jnp.asarray(rng.standard_normal((D, 1)), jnp.float32)}
  grad_fn = jax.value_and_grad(_sum_loss, has_aux=True)
  micro = split_microbatches(batch, 4)
  counts = np.asarray(micro["mask"].sum(axis=(1, 2)))
  assert len(set(counts.tolist())) > 1  # unequal token counts: the case that needs weighting
  loss, grads, tokens = jax.jit(lambda w, m: accumulate_gradients(grad_fn, w, m))(w, micro)
  (big_sum, big_n), big_g = grad_fn(w, batch)
  assert tokens == big_n
  np.testing.assert_allclose(loss, big_sum / big_n, rtol=1e-6)
  np.testing.assert_allclose(grads["w"], big_g["w"] / big_n, rtol=1e-5)
  # the control: averaging per-micro-batch means would not match
  per_mb = [
    jax.tree.map(lambda g, n=n: g / n, grad_fn(w, jax.tree.map(lambda x: x[k], micro))[1])
    for k, n in enumerate(counts)
  ]
  naive = sum(g["w"] for g in per_mb) / 4
  assert not np.allclose(naive, big_g["w"] / big_n, rtol=1e-3)


def test_split_microbatches_interleaves_rows_and_rejects_bad_sizes():
  x = jnp.arange(8)[:, None] * jnp.ones((1, 2))
  np.testing.assert_array_equal(split_microbatches({"x": x}, 4)["x"][1, :, 0], [1, 5])
  with pytest.raises(ValueError, match="batch size 8 does not split into 3"):
    split_microbatches({"x": x}, 3)


# ---- no runtime power (Neuron) ------------------------------------------------------------------------


def test_own_adamw_matches_optax_adamw_over_steps():
  params = _params(11)
  grads = [_params(12 + i, scale=s) for i, s in enumerate((1.0, 0.01, 30.0, 1.0))]
  mask = lambda p: jax.tree.map(lambda x: x.ndim == 2, p)
  ours = _updates(own_adamw(1e-3, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, mask=mask), params, grads)
  theirs = _updates(optax.adamw(1e-3, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, mask=mask), params, grads)
  for u, r in zip(ours, theirs):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-9), u, r)
  assert jax.tree.structure(own_adamw(1e-3).init(params)) == jax.tree.structure(
    optax.adamw(1e-3).init(params)
  )


def test_own_adamw_in_float64_equals_optax_adamw():
  """1 − βᵗ is computed in the leaves' dtype: a float64 run equals optax.adamw's to 1e-12 (in float32 the
  corrections parted them by ~1e-7 relative from step 1 on), and still lowers without a power op."""
  with jax.enable_x64(True):
    rng = np.random.default_rng(21)
    tree = lambda: {"w": jnp.asarray(rng.standard_normal((8, 16))), "b": jnp.asarray(rng.standard_normal(16))}
    params, grads = tree(), [tree() for _ in range(4)]
    ours_tx = own_adamw(1e-3, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)
    ours = _updates(ours_tx, params, grads)
    theirs = _updates(optax.adamw(1e-3, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1), params, grads)
    for u, r in zip(ours, theirs):
      for x, y in zip(jax.tree.leaves(u), jax.tree.leaves(r)):
        assert x.dtype == jnp.float64
        np.testing.assert_allclose(x, y, rtol=1e-12, atol=0)
    lowered = jax.jit(ours_tx.update).lower(params, ours_tx.init(params), params).as_text()
    assert "stablehlo.power" not in lowered and "f64" in lowered


def test_optimizer_update_lowers_without_power():
  ocfg = OptimizerConfig(total_steps=20, warmup_steps=2)
  params = _params(13)
  lowered = lambda tx: jax.jit(tx.update).lower(params, tx.init(params), params).as_text()
  assert "stablehlo.power" in lowered(_reference(ocfg))  # the control: optax's bias corrections
  assert "stablehlo.power" not in lowered(make_optimizer(ocfg))
