"""Per-slot random numbers under each PRNG: Threefry (JAX's default) keeps its streams bit for bit; under rbg /
unsafe_rbg (Neuron) they come from Philox-4x32-10 (serve/slots/philox.py, checked against Random123's known answers
and a plain-Python reference), depend on the slot's own (seed, position) only, and lower without Threefry."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from laplace_jax import platform
from laplace_jax.analysis import neuron_check
from serve.slots import philox, sampling

M32 = 0xFFFFFFFF


def _philox_reference(ctr, key, rounds=10):
  """Philox-4x32 with Python integers (the paper's round function)."""
  c, (k0, k1) = list(ctr), key
  for r in range(rounds):
    if r:
      k0, k1 = (k0 + 0x9E3779B9) & M32, (k1 + 0xBB67AE85) & M32
    p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
    c = [(p1 >> 32) ^ c[1] ^ k0, p1 & M32, (p0 >> 32) ^ c[3] ^ k1, p0 & M32]
  return c


def test_philox_known_answers_and_reference():
  # Random123's kat_vectors for philox4x32 10
  for ctr, key, want in (
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((M32,) * 4, (M32,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
  ):
    assert [int(x) for x in philox.philox4x32(ctr, key)] == list(want) == _philox_reference(ctr, key)
  rng = np.random.default_rng(0)
  ctr, key = (
    rng.integers(0, 2**32, (4, 64), dtype=np.uint32),
    rng.integers(0, 2**32, (2, 64), dtype=np.uint32),
  )
  got = np.stack([np.asarray(x) for x in jax.jit(philox.philox4x32)(tuple(ctr), tuple(key))])
  want = np.array(
    [_philox_reference([int(c) for c in ctr[:, i]], [int(k) for k in key[:, i]]) for i in range(64)]
  )
  np.testing.assert_array_equal(got.T, want)


def test_threefry_streams_are_unchanged():
  seed, pos, hi = (
    jnp.array([0, 5, 7, 2**32 - 1], jnp.uint32),
    jnp.array([0, 1, 9, 3]),
    jnp.array([0, 0, 3, 1]),
  )
  got = np.asarray(jax.jit(sampling.slot_uniforms)(seed, pos, hi))
  for i in range(4):
    key = jax.random.key(int(seed[i]))
    key = jax.random.fold_in(key, int(hi[i])) if int(hi[i]) else key
    assert got[i] == float(jax.random.uniform(jax.random.fold_in(key, int(pos[i])), (), jnp.float32))


@pytest.mark.parametrize("impl", ["rbg", "unsafe_rbg"])
def test_rbg_draws_are_philox_of_the_slots_own_seed_and_position(impl):
  seed = jnp.array([0, 5, 7, 2**32 - 1, 5, 5], jnp.uint32)
  hi = jnp.array([0, 0, 3, 1, 0, 1], jnp.uint32)
  pos = jnp.array([0, 1, 9, 3, 2, 1], jnp.int32)
  with platform.using_prng(impl):
    u = np.asarray(jax.jit(sampling.slot_uniforms)(seed, pos, hi))
    flipped = np.asarray(jax.jit(sampling.slot_uniforms)(seed[::-1], pos[::-1], hi[::-1]))[::-1]
  bits = [_philox_reference([int(p), 0, 0, 0], [int(s), int(h)])[0] for s, p, h in zip(seed, pos, hi)]
  np.testing.assert_array_equal(u, np.array([(b >> 9) / 2**23 for b in bits], np.float32))
  np.testing.assert_array_equal(flipped, u)  # a slot's draw does not depend on its neighbours
  assert len(set(u.tolist())) == len(u)  # seed, high word and position each change the draw
  assert ((u >= 0) & (u < 1)).all()


def test_rbg_draws_are_uniform():
  with platform.using_prng("rbg"):
    u = np.asarray(jax.jit(sampling.slot_uniforms)(jnp.full(20000, 3, jnp.uint32), jnp.arange(20000)))
  counts = np.histogram(u, bins=20, range=(0, 1))[0]
  assert abs(u.mean() - 0.5) < 0.01 and ((counts - 1000) ** 2 / 1000).sum() < 45  # chi-square, 19 dof


@pytest.mark.parametrize("impl", ["threefry", "rbg"])
def test_seeded_tokens_reproduce_and_ignore_the_batch(impl):
  """Same seed and position → same token, whichever slot it sits in and whoever shares the batch."""
  V, S = 200, 6
  logits = jnp.asarray(np.random.default_rng(1).normal(size=(1, V)), jnp.float32).repeat(S, 0)
  t, k, p = jnp.full(S, 1.0), jnp.zeros(S, jnp.int32), jnp.full(S, 0.95)
  draw = jax.jit(functools.partial(sampling.sample, valid_vocab=V))
  with platform.using_prng(impl):
    toks = {}
    for trial in range(2):
      seeds = jnp.asarray(np.random.default_rng(trial).permutation(S) * 1000 + 11, jnp.uint32)
      out = np.asarray(draw(logits, t, k, p, seeds, jnp.full(S, 4)))
      for s, tok in zip(np.asarray(seeds), out):
        toks.setdefault(int(s), set()).add(int(tok))
  assert all(len(v) == 1 for v in toks.values())
  assert len({v.pop() for v in toks.values()}) > 1  # and the seed matters


def test_rbg_sampling_lowers_without_threefry():
  args = (
    jnp.zeros((4, 300)),
    jnp.ones(4),
    jnp.zeros(4, jnp.int32),
    jnp.ones(4),
    jnp.zeros(4, jnp.uint32),
    jnp.zeros(4, jnp.int32),
  )
  count = {}
  for impl in ("threefry", "rbg"):
    with platform.using_prng(impl):
      text = jax.jit(functools.partial(sampling.sample, valid_vocab=300)).lower(*args).as_text()
    count[impl] = sum(v.rule == "threefry" for v in neuron_check.violations(text))
  assert count["threefry"] > 0 and count["rbg"] == 0
