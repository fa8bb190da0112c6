"""serve.slots.sampling draws exactly the distribution its settings define: thousands of seeded draws per setting in
one call, against a float64 numpy reference of the rule (top-k: fewer than k larger scaled logits; nucleus:
top-k-renormalised mass of strictly larger logits < top_p), whichever path serves the row (the candidates'
rejection, the capped top-k, the bisection), with the boundary itself exact, ties kept or dropped together,
and padded ids never drawn."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from laplace_jax import platform
from serve.slots import sampling

V, VALID, N = 300, 290, 4000  # N draws per setting: one row per draw, seeds 0..N-1, one position


def reference(logits, temperature, top_k, top_p):
  """The settings' distribution over the valid ids, in float64."""
  s = np.asarray(logits, np.float64)[:VALID] / temperature
  e = np.exp(s - s.max())
  above_n = (s[None, :] > s[:, None]).sum(-1)
  in_k = above_n < top_k if 0 < top_k < VALID else np.ones(VALID, bool)
  ek = np.where(in_k, e, 0.0)
  above = (np.where(s[None, :] > s[:, None], ek[None, :], 0.0)).sum(-1)
  keep = in_k & ((above < top_p * ek.sum()) | (above_n == 0) | (top_p >= 1))
  q = np.where(keep, ek, 0.0)
  return q / q.sum()


@functools.cache
def _draw(branch_free):
  return jax.jit(functools.partial(sampling.sample, valid_vocab=VALID, branch_free=branch_free))


def draws(logits, temperature, top_k, top_p, branch_free=False, pos=3):
  """N tokens: the same row of logits under seeds 0..N-1."""
  full = lambda v, dt: jnp.full((N,), v, dt)
  return np.asarray(
    _draw(branch_free)(
      jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (N, V)),
      full(temperature, jnp.float32),
      full(top_k, jnp.int32),
      full(top_p, jnp.float32),
      jnp.arange(N, dtype=jnp.uint32),
      full(pos, jnp.int32),
    )
  )


def assert_follows(toks, q, what):
  """No draw outside q's support; a chi-square test (bins of expected count >= 5, the rest pooled) at 1e-4."""
  counts = np.bincount(toks, minlength=V)
  assert counts[VALID:].sum() == 0, f"{what}: padded ids drawn"
  assert counts[:VALID][q == 0].sum() == 0, f"{what}: drew {np.flatnonzero(counts[:VALID] * (q == 0))[:5]}"
  exp = q * len(toks)
  big = exp >= 5
  obs_b, exp_b = (
    np.append(counts[:VALID][big], counts[:VALID][~big].sum()),
    np.append(exp[big], exp[~big].sum()),
  )
  if exp_b[-1] < 5:  # too little pooled mass for a bin of its own: fold it into the largest
    obs_b[np.argmax(exp_b[:-1])] += obs_b[-1]
    exp_b[np.argmax(exp_b[:-1])] += exp_b[-1]
    obs_b, exp_b = obs_b[:-1], exp_b[:-1]
  if len(exp_b) > 1:
    chi2 = ((obs_b - exp_b) ** 2 / exp_b).sum()
    assert stats.chi2.sf(chi2, len(exp_b) - 1) > 1e-4, f"{what}: chi-square {chi2:.1f} over {len(exp_b)} bins"


def _logits(kind):
  rng = np.random.default_rng(7)
  x = np.full(V, 50.0, np.float32)  # padding: larger than any valid logit, and never drawn
  if kind == "flat":  # nuclei of 0.9 hold ~200 tokens: past the candidates of the capped path
    x[:VALID] = rng.normal(size=VALID) * 0.5
  else:  # peaked: a few likely tokens and a long tail, with a block of ties
    x[:VALID] = -0.4 * np.arange(VALID) ** 0.7 + rng.normal(size=VALID) * 0.1
    x[40:48] = x[40]
    x[:VALID] = x[rng.permutation(VALID)]
  return x


SETTINGS = [  # (temperature, top_k, top_p)
  (1.0, 0, 1.0),
  (0.7, 0, 1.0),
  (1.0, 50, 1.0),
  (1.0, 0, 0.9),
  (1.0, 50, 0.9),
  (0.7, 0, 0.9),
  (1.0, 0, 0.3),  # on flat rows every candidate may miss: the bisection fallback
  (1.3, 20, 0.5),
  (1.0, 100, 0.95),  # top-k past the cap: the bisection
]


@pytest.mark.parametrize("kind", ["flat", "peaked"])
def test_draws_follow_the_settings_distribution(kind):
  x = _logits(kind)
  for t, k, p in SETTINGS:
    assert_follows(draws(x, t, k, p), reference(x, t, k, p), f"{kind} t={t} k={k} p={p}")


def _exact_exp_logit(target):
  """A float32 logit whose exp, as XLA computes it here, is exactly `target` (a power of two)."""
  x = np.float32(np.log(target))
  for _ in range(64):
    got = float(jax.jit(jnp.exp)(x))
    if got == target:
      return x
    x = np.nextafter(x, np.float32(np.inf if got < target else -np.inf), dtype=np.float32)
  raise AssertionError(f"no float32 logit with exp exactly {target}")


@functools.cache
def boundary_logits():
  """Weights 1, 1/2, 1/4, 1/8, 1/8 (a tie), the other valid ids exp-underflowing to 0: every mass and its
  sum is exact in float32, so top_p can sit exactly on a token's mass above (0.75 for the third, 0.875 for
  the tied pair, of the total 2)."""
  x = np.full(V, 50.0, np.float32)
  x[:VALID] = -200.0
  ids = [17, 3, 250, 64, 130]
  for i, w in zip(ids, (1.0, 0.5, 0.25, 0.125, 0.125)):
    x[i] = _exact_exp_logit(w)
  return x, ids


@pytest.mark.parametrize("top_k", [0, 4, 100], ids=["candidates", "capped", "bisection"])
def test_the_nucleus_boundary_is_exact(top_k):
  """Mass above equal to top_p: excluded; top_p one float above it: included (a tie: both members). top_k 4
  keeps five tokens (the tie at the 4th place) and rank 5 and beyond have weight 0."""
  x, ids = boundary_logits()
  up = lambda p: float(np.nextafter(np.float32(p), np.float32(1)))
  for p, kept in ((0.75, 2), (up(0.75), 3), (0.875, 3), (up(0.875), 5)):
    q = reference(x, 1.0, top_k, p)
    assert (q[ids] > 0).sum() == kept and q.sum() == pytest.approx(1.0)  # the reference says the same
    for bf in (False, True):
      toks = draws(x, 1.0, top_k, p, branch_free=bf)
      assert_follows(toks, q, f"top_k {top_k}, top_p {p}, branch_free {bf}")


def test_top_k_keeps_ties_together():
  x, ids = boundary_logits()
  for k, kept in ((3, 3), (4, 5), (5, 5)):
    q = reference(x, 1.0, k, 1.0)
    assert (q[ids] > 0).sum() == kept
    assert_follows(draws(x, 1.0, k, 1.0), q, f"top_k {k}")


@pytest.mark.parametrize("impl", ["threefry", "rbg"])
def test_branch_free_draws_the_same_tokens(impl):
  x = _logits("flat")
  with platform.using_prng(impl):
    for t, k, p in SETTINGS:
      np.testing.assert_array_equal(draws(x, t, k, p, True), draws(x, t, k, p, False), err_msg=f"{t} {k} {p}")


WIDE_S, WIDE_V = 64, 12800  # 200 blocks of 64: 64-row passes loop over groups of blocks, 8-row ones do not


@functools.cache
def _draw_wide(branch_free):
  return jax.jit(functools.partial(sampling.sample, valid_vocab=WIDE_V - 5, branch_free=branch_free))


@pytest.mark.parametrize("setting", SETTINGS[1:6], ids=str)
def test_a_rows_token_does_not_depend_on_how_many_rows_sample(setting):
  """In a batch with few sampling rows (the rest greedy) their tokens are the ones they draw among 64 sampling
  rows, and the branch-free form's (which runs every path on every row)."""
  S = WIDE_S
  x = jnp.asarray(np.random.default_rng(3).normal(size=(S, WIDE_V)) * 1.5, jnp.float32)
  t, k, p = setting
  full = lambda v, dt: jnp.full((S,), v, dt)
  seeds, pos = jnp.arange(S, dtype=jnp.uint32) * 7919, full(11, jnp.int32)
  every = np.asarray(
    _draw_wide(False)(x, full(t, jnp.float32), full(k, jnp.int32), full(p, jnp.float32), seeds, pos)
  )
  greedy = np.argmax(np.asarray(x)[:, : WIDE_V - 5], -1)
  for few in ([5], [3, 10, 17, 40, 63], list(range(0, 64, 5))):
    temp = jnp.zeros((S,), jnp.float32).at[jnp.asarray(few)].set(t)
    args = (x, temp, full(k, jnp.int32), full(p, jnp.float32), seeds, pos)
    got = np.asarray(_draw_wide(False)(*args))
    np.testing.assert_array_equal(got[few], every[few])
    np.testing.assert_array_equal(np.delete(got, few), np.delete(greedy, few))
    if few[0] == 3:
      np.testing.assert_array_equal(np.asarray(_draw_wide(True)(*args)), got)


def test_the_few_rows_that_need_a_path_take_it_gathered():
  """With every row sampling, the rows needing a later candidate or the bisection (here: top-k past the
  cap) are gathered when few; their tokens are the branch-free form's, which runs every path on every row."""
  S = WIDE_S
  x = jnp.asarray(np.random.default_rng(4).normal(size=(S, WIDE_V)), jnp.float32)
  k = jnp.zeros((S,), jnp.int32).at[jnp.asarray([2, 30, 61])].set(100)
  f32 = lambda v: jnp.full((S,), v, jnp.float32)  # the dtypes of the test above: its compiled programs serve
  args = (x, f32(1.0), k, f32(0.9), jnp.arange(S, dtype=jnp.uint32) * 7919, jnp.full((S,), 11, jnp.int32))
  np.testing.assert_array_equal(np.asarray(_draw_wide(False)(*args)), np.asarray(_draw_wide(True)(*args)))
