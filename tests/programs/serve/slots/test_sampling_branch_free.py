"""serve.slots.sampling without `cond` (the Neuron form): every path computed, the same predicates select. It must give
the cond form's tokens and logprob rows exactly, for every kind of batch (including batches where the cond form
skips a path that the branch-free form computes), and its lowered program must hold no `case`."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from laplace_jax import model
from laplace_jax.analysis import neuron_check
from laplace_jax.model.config import get_config
from serve.slots import sampling
from serve.slots.slot_functions import SlotFunctions, SlotSettings, SlotTable, StepOutput

V, VALID, S = 300, 290, 8  # TOPK_CAP = 64 < VALID: top-k 100 and wide nuclei take the bisection path
# (temperature, top_k, top_p) per batch of S rows
BATCHES = {
  "greedy": [(0.0, 0, 1.0)] * S,
  "plain": [(1.0, 0, 1.0), (0.7, 0, 1.0)] + [(0.0, 0, 1.0)] * (S - 2),
  "capped": [(1.0, 5, 1.0), (0.8, 0, 0.5), (1.2, 20, 0.9), (0.0, 3, 0.5)] + [(0.0, 0, 1.0)] * (S - 4),
  "bisection": [(1.0, 100, 1.0), (1.0, 0, 0.999), (0.9, 200, 0.95)] + [(0.0, 0, 1.0)] * (S - 3),
  "mixed": [
    (0.0, 0, 1.0),
    (1.0, 0, 1.0),
    (0.7, 40, 1.0),
    (1.0, 0, 0.9),
    (1.0, 150, 0.97),
    (0.5, 0, 0.999),
    (2.0, 1, 1.0),
    (1.0, 300, 1.0),
  ],
}


def _logits(seed):
  rng = np.random.default_rng(seed)
  # peaked rows (nuclei close in the cap) and flat rows (they do not)
  scale = np.where(np.arange(S) % 2, 4.0, 0.5)[:, None]
  return jnp.asarray(rng.normal(size=(S, V)) * scale, jnp.float32)


@functools.cache
def _sampler(branch_free):
  return jax.jit(functools.partial(sampling.sample, valid_vocab=VALID, branch_free=branch_free))


@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_branch_free_draws_the_cond_forms_tokens(batch):
  t, k, p = (jnp.asarray(c, dt) for c, dt in zip(zip(*BATCHES[batch]), (jnp.float32, jnp.int32, jnp.float32)))
  for trial in range(6):
    logits = _logits(trial)
    seed = jnp.asarray(np.random.default_rng(100 + trial).integers(0, 2**32, S), jnp.uint32)
    seed_hi = jnp.asarray([0, 1, 0, 7, 0, 0, 3, 0], jnp.uint32) if trial % 2 else None
    pos = jnp.full((S,), trial * 37, jnp.int32)
    args = (logits, t, k, p, seed, pos)
    with_cond = np.asarray(_sampler(False)(*args, seed_hi_S=seed_hi))
    np.testing.assert_array_equal(
      np.asarray(_sampler(True)(*args, seed_hi_S=seed_hi)), with_cond, err_msg=f"{batch}, trial {trial}"
    )
    if batch == "greedy":
      np.testing.assert_array_equal(with_cond, np.argmax(np.asarray(logits)[:, :VALID], -1))


@functools.cache
def _slot_fns(branch_free):
  cfg = get_config("tiny", vocab_size=V)
  return SlotFunctions(
    model, cfg, n_slots=S, prefill_batch=1, n_stop=2, valid_vocab=VALID, branch_free=branch_free
  )


def _table(batch, want_logprobs):
  t, k, p = (np.asarray(c, dt) for c, dt in zip(zip(*BATCHES[batch]), (np.float32, np.int32, np.float32)))
  return SlotTable(
    model=None,  # the sampling call never reads the model state
    tokens=jnp.zeros(S, jnp.int32),
    last_output_index=jnp.arange(S, dtype=jnp.int32),
    settings=SlotSettings(
      temperature=t,
      top_k=k,
      top_p=p,
      seed=jnp.arange(S, dtype=jnp.uint32) * 977,
      seed_hi=jnp.zeros(S, jnp.uint32),
      max_tokens=jnp.full(S, 100, jnp.int32),
      logprobs=jnp.asarray(want_logprobs, jnp.int32),
      stop_ids=jnp.full((S, 2), -1, jnp.int32),
    ),
  )


@pytest.mark.parametrize("want", [[-1] * S, [-1, 2, -1, 5, 0, -1, -1, -1]], ids=["no_logprobs", "logprobs"])
def test_the_sample_program_packs_the_same_output(want):
  """The engine's sampling call (tokens, finished flags, logprobs) is the same output in both forms, with a
  mask that allows every token (the cond form's unmasked sampler) and with rows it constrains."""
  progs = {bf: jax.jit(_slot_fns(bf)._sample_next) for bf in (False, True)}
  free = np.full((S, -(-V // 32)), -1, np.int32)
  some = free.copy()
  some[1:4] = 0x0F0F0F0F  # rows 1-3 (sampled, top-k, top-p) may take half of each word's tokens
  for batch, mask in (("greedy", free), ("mixed", free), ("mixed", some)):
    every = jnp.arange(S, dtype=jnp.int32)
    outs = {bf: progs[bf](_logits(3), _table(batch, want), every, mask) for bf in progs}
    np.testing.assert_array_equal(np.asarray(outs[True][1]), np.asarray(outs[False][1]))
    jax.tree.map(np.testing.assert_array_equal, outs[True][0], outs[False][0])
    tok = StepOutput.unpack(np.asarray(outs[True][1])).token
    assert all(mask[i, t // 32] >> (t % 32) & 1 for i, t in enumerate(tok)), tok
    if want[1] < 0:  # no row asked: the logprob fields are zeros
      step = StepOutput.unpack(np.asarray(outs[True][1]))
      assert not (step.logprob.any() or step.top_ids.any() or step.top_logprobs.any())


def test_branch_free_lowers_without_case():
  """The rule the branch-free form exists for; the cond form breaks it (so the check can fail)."""
  count = {}
  for bf in (False, True):
    every = jnp.arange(S, dtype=jnp.int32)
    mask = jnp.full((S, -(-V // 32)), -1, jnp.int32)
    text = (
      jax.jit(_slot_fns(bf)._sample_next).lower(_logits(0), _table("mixed", [-1] * S), every, mask).as_text()
    )
    count[bf] = sum(v.rule == "cond" for v in neuron_check.violations(text))
  assert count[False] > 0 and count[True] == 0


@pytest.mark.parametrize("V, valid", [(300, 290), (320, 320), (50304, 50257)])
def test_greedy_argmax_is_numpys_over_the_valid_columns(V, valid):
  """argmax_rows (blocked, two plain reductions per level) against numpy's argmax over the valid columns:
  ties go to the first, a maximum in the padded columns is ignored, an all -inf row gives 0."""
  x = np.array(jax.random.normal(jax.random.key(V), (6, V)), np.float32)
  x[0, [3, V // 2]] = 9.0  # a tie across blocks: the first
  x[1, [63, 64]] = 9.0  # a tie across a block edge
  x[2, valid - 1] = 9.0  # the last valid column
  x[3, :] = -np.inf
  if valid < V:
    x[4, valid] = 1e9  # padding never wins
  got = np.asarray(jax.jit(sampling.argmax_rows, static_argnums=1)(jnp.asarray(x), valid))
  np.testing.assert_array_equal(got, np.argmax(x[:, :valid], -1))
