"""Muon against optax.contrib.muon (one device) and against itself on one device (8-device mesh)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optax.contrib import MuonDimensionNumbers
from optax.contrib import muon as optax_muon
from optax.contrib._muon import orthogonalize_via_newton_schulz

from laplace_jax import param_names, sharding
from laplace_jax.analysis import hlo_traffic
from laplace_jax.model import config, counts
from laplace_jax.training.muon import (
  MuonState,
  make_plan,
  muon,
  newton_schulz,
  ns_flops,
  ns_flops_per_device,
  orthogonalize,
)

# Stacks with both orientations, a square one, counts that don't divide 8 and a plain 2-D matrix.
SHAPES = {"w_qkvg": (3, 16, 48), "w_out": (3, 24, 16), "w1": (2, 16, 32), "w3": (5, 32, 16), "m2d": (24, 40)}


def _tree(seed, shapes=SHAPES):
  rng = np.random.default_rng(seed)
  return {k: jnp.asarray(rng.standard_normal(s), jnp.float32) for k, s in shapes.items()}


def _run(tx, params, grads_seq):
  """Apply tx for each gradient in grads_seq; return the list of updates and the final state."""
  state, outs = tx.init(params), []
  step = jax.jit(tx.update)
  for g in grads_seq:
    u, state = step(g, state, params)
    outs.append(u)
    params = optax.apply_updates(params, u)
  return outs, state


def _dims(tree):
  return jax.tree.map(lambda x: MuonDimensionNumbers(x.ndim - 2, x.ndim - 1), tree)


def test_newton_schulz_matches_optax_and_orthogonalizes():
  x = _tree(0, {"a": (24, 40)})["a"]
  ours = newton_schulz(x, eps=1e-8)
  theirs = orthogonalize_via_newton_schulz(x, jnp.asarray((3.4445, -4.7750, 2.0315)), 5, eps=1e-8)
  np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
  s = np.linalg.svd(np.asarray(ours), compute_uv=False)
  assert 0.5 < s.min() and s.max() < 1.3  # the quintic's known band around 1
  u, _, vt = np.linalg.svd(np.asarray(x), full_matrices=False)
  cos = np.sum(np.asarray(ours) * (u @ vt)) / (np.linalg.norm(ours) * np.linalg.norm(u @ vt))
  assert cos > 0.95
  np.testing.assert_allclose(newton_schulz(x.T), newton_schulz(x).T, rtol=1e-5, atol=1e-6)


def test_bf16_newton_schulz_iterates_in_bf16_and_stays_near_fp32():
  x = _tree(1, {"a": (48, 80)})["a"]
  jaxpr = jax.make_jaxpr(lambda x: newton_schulz(x, dtype=jnp.bfloat16))(x).jaxpr
  dots = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]
  assert len(dots) == 15 and all(e.outvars[0].aval.dtype == jnp.bfloat16 for e in dots)  # 5 steps × 3
  lo, hi = newton_schulz(x, dtype=jnp.bfloat16), newton_schulz(x)
  assert lo.dtype == jnp.float32
  lo, hi = np.asarray(lo), np.asarray(hi)
  cos = lambda a, b: np.sum(a * b) / (np.linalg.norm(a) * np.linalg.norm(b))
  assert np.linalg.norm(lo - hi) / np.linalg.norm(hi) > 1e-4  # bf16 rounding shows...
  assert cos(lo, hi) > 0.99  # ...but the update points the same way
  u, _, vt = np.linalg.svd(np.asarray(x), full_matrices=False)
  assert abs(cos(lo, u @ vt) - cos(hi, u @ vt)) < 0.01  # and is as close to the exact U Vᵀ
  s = np.linalg.svd(lo, compute_uv=False)
  assert 0.5 < s.min() and s.max() < 1.3


@pytest.mark.parametrize(
  "nesterov,scale_mode,weight_decay,schedule",
  [
    (True, "reference", 0.0, False),
    (False, "adamw_rms", 0.1, True),
  ],
)
def test_matches_optax_contrib_muon(nesterov, scale_mode, weight_decay, schedule):
  params = _tree(1)
  grads = [_tree(10 + i) for i in range(3)]
  lr = optax.linear_schedule(0.05, 0.01, 3) if schedule else 0.02
  ours = muon(lr, nesterov=nesterov, scale_mode=scale_mode, weight_decay=weight_decay, eps=1e-7)
  theirs = optax_muon(
    lr,
    eps=1e-7,
    nesterov=nesterov,
    weight_decay=weight_decay,
    consistent_rms=0.2 if scale_mode == "adamw_rms" else None,
    muon_weight_dimension_numbers=_dims(params),
  )
  u_ours, _ = _run(ours, params, grads)
  u_theirs, _ = _run(theirs, params, grads)
  for a, b in zip(u_ours, u_theirs):
    for k in params:
      np.testing.assert_allclose(a[k], b[k], rtol=2e-5, atol=1e-7, err_msg=k)


@pytest.mark.parametrize("nesterov", [True, False])
def test_float64_run_matches_optax_contrib_muon_to_float64_rounding(nesterov):
  """The bias corrections are computed in the leaves' dtype: in float64 the updates equal optax's to 1e-12."""
  with jax.enable_x64(True):
    rng = np.random.default_rng(3)
    tree = lambda: {"w": jnp.asarray(rng.standard_normal((3, 8, 16)))}
    params, grads = tree(), [tree() for _ in range(3)]
    u_ours, _ = _run(muon(0.02, nesterov=nesterov, eps=1e-7), params, grads)
    theirs = optax_muon(0.02, eps=1e-7, nesterov=nesterov, muon_weight_dimension_numbers=_dims(params))
    u_theirs, _ = _run(theirs, params, grads)
    for a, b in zip(u_ours, u_theirs):
      assert a["w"].dtype == jnp.float64
      np.testing.assert_allclose(a["w"], b["w"], rtol=0, atol=1e-12 * float(jnp.abs(b["w"]).max()))


def test_stacked_leaf_is_independent_matrices():
  """A [L, in, out] leaf updates like L separate 2-D leaves given to optax's muon with default dims."""
  params, grads = _tree(2, {"w": (3, 16, 40)}), [_tree(20 + i, {"w": (3, 16, 40)}) for i in range(2)]
  u_stack, _ = _run(muon(0.02), params, grads)
  for l in range(3):
    p2 = {"w": params["w"][l]}
    g2 = [{"w": g["w"][l]} for g in grads]
    u2, _ = _run(optax_muon(0.02, eps=1e-7), p2, g2)
    for a, b in zip(u_stack, u2):
      np.testing.assert_allclose(a["w"][l], b["w"], rtol=2e-5, atol=1e-7)


@pytest.mark.parametrize(
  "kwargs,needle",
  [
    (dict(learning_rate=-0.1), "learning_rate=-0.1"),
    (dict(learning_rate=float("nan")), "learning_rate=nan"),
    (dict(beta=1.0), "beta=1.0"),
    (dict(beta=-0.1), "beta=-0.1"),
    (dict(ns_steps=0), "ns_steps=0"),
    (dict(ns_coeffs=(1.0, 2.0)), "ns_coeffs"),
    (dict(weight_decay=-1.0), "weight_decay=-1.0"),
    (dict(scale_mode="spectral"), "scale_mode='spectral'"),
    (dict(distribution="broadcast"), "distribution='broadcast'"),
  ],
)
def test_bad_settings_fail_at_construction(kwargs, needle):
  kwargs = {"learning_rate": 0.02, **kwargs}
  with pytest.raises(ValueError, match=None) as e:
    muon(kwargs.pop("learning_rate"), **kwargs)
  assert needle in str(e.value) and "expected" in str(e.value)


def test_bad_leaves_fail_at_init():
  with pytest.raises(ValueError, match="expected matrices"):
    muon(0.02).init({"scale": jnp.ones(8)})
  mesh = sharding.make_mesh(fsdp=8)
  with pytest.raises(ValueError, match=r"\['w'\].*\(2, 12, 20\).*8"):
    muon(0.02, mesh=mesh).init({"w": jnp.ones((2, 12, 20))})


# ---- distribution ----------------------------------------------------------------------------------


def _sharded(tree, mesh):
  return jax.device_put(
    tree, jax.tree.map(lambda x: jax.NamedSharding(mesh, sharding.matrix_spec(x.shape, mesh)), tree)
  )


def _sharded_state(state, mesh):
  return MuonState(jax.device_put(state.count, sharding.replicated(mesh)), _sharded(state.mu, mesh))


def _mesh_updates(tx, params, grads, mesh):
  p, step = _sharded(params, mesh), jax.jit(tx.update)
  state, outs = _sharded_state(tx.init(p), mesh), []
  for g in grads:
    u, state = step(_sharded(g, mesh), state, p)
    p = optax.apply_updates(p, u)
    outs.append(u)
  return outs, state


@pytest.mark.parametrize("data,fsdp", [(1, 8), (2, 4)])
def test_distributed_update_matches_one_device(data, fsdp):
  """Padded slots and matrices turned wide by their sender change the matmuls' summation blocking: equal to
  rounding. The gather variant runs each whole matrix as one device does: bit-identical."""
  mesh = sharding.make_mesh(data=data, fsdp=fsdp)
  params, grads = _tree(3), [_tree(30 + i) for i in range(3)]
  lr = optax.cosine_decay_schedule(0.03, 10)
  single, s_state = _run(muon(lr, weight_decay=0.1), params, grads)
  for distribution in ("all_to_all", "gather"):
    got, state = _mesh_updates(
      muon(lr, weight_decay=0.1, mesh=mesh, distribution=distribution), params, grads, mesh
    )
    for u, want in zip(got, single):
      for k in params:
        if distribution == "gather":
          np.testing.assert_array_equal(u[k], want[k], err_msg=f"{distribution} {k}")
        else:
          np.testing.assert_allclose(u[k], want[k], rtol=1e-5, atol=1e-7, err_msg=f"{distribution} {k}")
    for k in params:
      np.testing.assert_array_equal(state.mu[k], s_state.mu[k])


def test_matrices_filling_their_slot_as_row_shards_are_bit_identical():
  shapes = {"a": (8, 16, 32), "b": (3, 8, 16)}  # wide, fan_in sharded; "b" leaves 5 slots empty
  mesh = sharding.make_mesh(fsdp=8)
  plan = make_plan(list(shapes.values()), 8)
  assert plan.slots == ((16, 32), (8, 16)) and plan.slot_mats[1][3:] == (-1,) * 5
  params, grads = _tree(7, shapes), [_tree(70 + i, shapes) for i in range(2)]
  single, _ = _run(muon(0.02), params, grads)
  got, _ = _mesh_updates(muon(0.02, mesh=mesh), params, grads, mesh)
  for u, want in zip(got, single):
    for k in shapes:
      np.testing.assert_array_equal(u[k], want[k], err_msg=k)


def test_zero_padded_newton_schulz_is_the_padded_iterate():
  """What an owner runs: the matrix zero-padded to its slot, rows and columns permuted (each device's zero
  rows follow its own). Its iterate is the matrix's own (optax's Newton–Schulz, independently), padded and
  permuted alike, with the padding exactly zero."""
  rng = np.random.default_rng(8)
  x = jnp.asarray(rng.standard_normal((12, 20)), jnp.float32)
  want = orthogonalize_via_newton_schulz(x, jnp.asarray((3.4445, -4.7750, 2.0315)), 5, eps=1e-7)
  padded = jnp.pad(x, ((0, 4), (0, 12)))
  y = np.asarray(newton_schulz(padded))
  np.testing.assert_allclose(y[:12, :20], want, rtol=1e-5, atol=1e-6)
  assert not y[12:].any() and not y[:, 20:].any()
  rows, cols = rng.permutation(16), rng.permutation(32)
  np.testing.assert_allclose(newton_schulz(padded[rows][:, cols]), y[rows][:, cols], rtol=1e-5, atol=1e-6)


def _compiled_text(distribution, mesh):
  """The update test_distributed_update_matches_one_device[1-8] runs (one program: a compilation-cache read
  after it)."""
  tx = muon(optax.cosine_decay_schedule(0.03, 10), weight_decay=0.1, mesh=mesh, distribution=distribution)
  g = _sharded(_tree(4), mesh)
  state = _sharded_state(tx.init(g), mesh)
  return jax.jit(tx.update).lower(g, state, g).compile().as_text()


def test_hlo_uses_two_all_to_alls_and_no_gather():
  mesh = sharding.make_mesh(fsdp=8)
  a2a = hlo_traffic.parse_collectives(_compiled_text("all_to_all", mesh), 8)
  gather = hlo_traffic.parse_collectives(_compiled_text("gather", mesh), 8)
  assert sorted(c.kind for c in a2a) == ["all-to-all", "all-to-all"]
  tx = muon(0.02, mesh=mesh)
  g = _sharded(_tree(4), mesh)
  lowered = jax.jit(tx.update).lower(g, _sharded_state(tx.init(g), mesh)).as_text()
  assert "stablehlo.case" not in lowered and "stablehlo.if" not in lowered  # one program on every device
  assert all("muon_orthogonalize" in c.op_name for c in a2a)
  assert {c.kind for c in gather} == {"all-gather"}  # the control: this check can see gathers
  # All-to-all traffic: 4 transfers of the padded per-peer chunk, 7/8 of it leaving the device.
  total = sum(np.prod(s) for s in SHAPES.values())
  plan = make_plan(list(SHAPES.values()), 8)
  assert hlo_traffic.total_bytes(a2a) == pytest.approx(4 * 4 * plan.chunk * 8 * 7 / 8)
  assert hlo_traffic.total_bytes(gather) == pytest.approx(2 * 4 * total * 7 / 8)


def test_plan_owns_every_matrix_once_and_balances_laplace_3b():
  shapes = counts.param_shapes(config.get_config("laplace-3b"))["layer"]
  stacks = [(24,) + shapes[n] for n in param_names.MUON_PARAM_NAMES]
  plan = make_plan(stacks, 64)
  owned = sorted(i for o in plan.owned for i in o)
  assert owned == list(range(120))
  for k, (S, L) in enumerate(plan.slots):  # every matrix fits its slot, turned wide
    for i in plan.slot_mats[k]:
      if i >= 0:
        s, l = sorted(plan.mats[i].shape)
        assert s <= S and l <= L
  report = ns_flops_per_device(stacks, 64)
  assert report["total"] == sum(24 * ns_flops(s[1:]) for s in stacks)
  assert report["per_device"] == [sum(ns_flops(s) for s in plan.slots)] * 64  # padding runs too
  assert report["max_over_mean"] <= 1.4
  # The per-switch plan's chunk was two [3072, 8192] shards (96 of the 120 matrices hold >= 25M values, so
  # some owner takes two): the slots may cost at most 1.1x that.
  assert plan.chunk == sum(S * L for S, L in plan.slots) // 64
  assert plan.chunk <= 1.1 * 2 * 3072 * 8192 // 64


def test_orthogonalize_pads_when_devices_outnumber_matrices():
  mesh = sharding.make_mesh(fsdp=8)
  tree = _tree(5, {"a": (3, 8, 16)})
  want = orthogonalize(tree)
  got = jax.jit(lambda t: orthogonalize(t, mesh=mesh))(_sharded(tree, mesh))
  np.testing.assert_array_equal(got["a"], want["a"])


def test_column_sharded_matrices_reassemble_correctly():
  """fan_in not divisible by 8 -> column shards: same values (XLA may fuse the reassembling transpose
  into the norm's reduction, so equality is to rounding here; row shards are bit-identical above)."""
  mesh = sharding.make_mesh(fsdp=8)
  tree = _tree(6, {"c": (3, 20, 16), "d": (12, 40)})
  assert all(sharding.matrix_spec(x.shape, mesh)[-1] == "fsdp" for x in tree.values())
  want = orthogonalize(tree)
  for distribution in ("all_to_all", "gather"):
    got = jax.jit(lambda t: orthogonalize(t, mesh=mesh, distribution=distribution))(_sharded(tree, mesh))
    for k in tree:
      np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6)
