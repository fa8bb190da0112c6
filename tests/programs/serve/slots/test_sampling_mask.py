"""serve.slots.sampling with a per-row allowed-token bitmask (`allowed_SxG`, serve/api/grammar.py's rows): a masked row
only ever yields an allowed token, greedy is the argmax over the allowed tokens, sampling draws the settings'
distribution renormalised over them (against the float64 reference of test_sampling_exact), and an all-ones
mask changes no token."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_sampling_exact import VALID, N, V, assert_follows, reference

from serve.slots import sampling

W = -(-V // 32)
# Every call has N rows (test_sampling_exact's shape): one compile with a mask, one without.


def pack(allowed_SxV) -> np.ndarray:
  """Bit t % 32 of word t // 32 set where token t is allowed: int32 [S, W]."""
  S = allowed_SxV.shape[0]
  bits = np.zeros((S, W * 32), bool)
  bits[:, : allowed_SxV.shape[1]] = allowed_SxV
  return np.packbits(bits, axis=1, bitorder="little").view(np.int32)


@functools.cache
def _sample():
  return jax.jit(functools.partial(sampling.sample, valid_vocab=VALID))


def sample(logits, temperature, top_k, top_p, allowed):
  S = logits.shape[0]
  full = lambda v, dt: jnp.full((S,), v, dt)
  return np.asarray(
    _sample()(
      jnp.asarray(logits, jnp.float32),
      full(temperature, jnp.float32),
      full(top_k, jnp.int32),
      full(top_p, jnp.float32),
      jnp.arange(S, dtype=jnp.uint32),
      full(3, jnp.int32),
      allowed_SxG=None if allowed is None else jnp.asarray(allowed),
    )
  )


SETTINGS = {  # (temperature, top_k, top_p): every path of the sampler
  "greedy": (0.0, 0, 1.0),
  "temperature": (0.8, 0, 1.0),
  "top-p (rejection)": (1.0, 0, 0.7),
  "capped top-k": (1.0, 5, 1.0),
  "top-k past the cap (bisection)": (1.0, sampling.TOPK_CAP + 10, 0.9),
}


@pytest.mark.parametrize("setting", SETTINGS)
def test_masked_rows_yield_only_allowed_tokens(setting):
  rng = np.random.default_rng(1)
  S = N
  logits = rng.normal(0, 3, (S, V)).astype(np.float32)
  allowed = rng.random((S, V)) < rng.choice([0.003, 0.05, 0.5], (S, 1))
  allowed[np.arange(S), rng.integers(0, VALID, S)] = True  # every row allows something
  allowed[:, VALID:] = rng.random((S, V - VALID)) < 0.5  # padded ids: allowed or not, never drawn
  tok = sample(logits, *SETTINGS[setting], pack(allowed))
  assert (tok < VALID).all()
  assert allowed[np.arange(S), tok].all(), f"{setting}: a disallowed token"
  if setting == "greedy":
    ref = np.where(allowed[:, :VALID], logits[:, :VALID], -np.inf).argmax(-1)
    np.testing.assert_array_equal(tok, ref)
    np.testing.assert_array_equal(
      np.asarray(sampling.argmax_rows(jnp.asarray(logits), VALID, jnp.asarray(pack(allowed)))), ref
    )


@pytest.mark.parametrize("setting", [s for s in SETTINGS if s != "greedy"])
def test_masked_draws_follow_the_restricted_distribution(setting):
  rng = np.random.default_rng(2)
  row = rng.normal(0, 2, V).astype(np.float32)
  allowed = np.zeros(V, bool)
  allowed[rng.choice(VALID, 120, replace=False)] = True
  temperature, top_k, top_p = SETTINGS[setting]
  toks = sample(
    np.broadcast_to(row, (N, V)), temperature, top_k, top_p, pack(np.broadcast_to(allowed, (N, V)))
  )
  q = reference(np.where(allowed, row, -np.inf), temperature, top_k, top_p)
  assert_follows(toks, q, setting)


def test_an_all_ones_mask_changes_no_token():
  rng = np.random.default_rng(3)
  S = N
  logits = rng.normal(0, 3, (S, V)).astype(np.float32)
  ones = np.full((S, W), -1, np.int32)
  for setting in SETTINGS.values():
    np.testing.assert_array_equal(sample(logits, *setting, ones), sample(logits, *setting, None))


def test_a_few_constrained_rows_get_the_tokens_of_a_wholly_masked_batch():
  """A batch with a few constrained rows (the rest free): every row's token is the one the masked sampler over
  the whole batch gives it, and a free row's is the unmasked sampler's."""
  rng = np.random.default_rng(4)
  logits = rng.normal(0, 3, (N, V)).astype(np.float32)
  allowed = np.ones((N, V), bool)
  some = rng.choice(N, 3, replace=False)
  allowed[some] = rng.random((3, V)) < 0.05
  whole = jax.jit(lambda *a: sampling._sample(*a, VALID, None, False, jnp.asarray(pack(allowed))))
  for setting in SETTINGS.values():
    full = lambda v, dt: jnp.full((N,), v, dt)
    args = (full(setting[0], jnp.float32), full(setting[1], jnp.int32), full(setting[2], jnp.float32))
    ref = whole(jnp.asarray(logits), *args, jnp.arange(N, dtype=jnp.uint32), full(3, jnp.int32))
    np.testing.assert_array_equal(sample(logits, *setting, pack(allowed)), np.asarray(ref))
