"""speculative.verify + commit against decode_step fed the same tokens one by one: the logits after every
verified token, and the state after each row's own accepted length (GLA state, conv ring, window ring, KV
cache, position), for a pure-GLA model and one with G, S and A layers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from laplace_jax import model, platform
from laplace_jax.analysis import neuron_check
from laplace_jax.inference import speculative
from laplace_jax.model.config import get_config

B, T, MAX_LEN = 3, 5, 40
PROMPTS = [5, 9, 3]  # tokens already in each row's state
N_B = [0, 3, 5]  # each row's accepted length: nothing to verify, a mismatch after 2 drafts, all 4 drafts


def _cfg(mixers):
  n = 2 if mixers == "G" else 3
  return get_config("tiny", vocab_size=256, n_layers=n, mixers=mixers, window=4)  # the ring wraps


@pytest.mark.parametrize("mixers", ["G", "GSA"])
def test_verify_then_commit_equals_decoding_the_accepted_tokens(mixers):
  cfg = _cfg(mixers)
  params = model.init_params(cfg, jax.random.key(0))
  rng = np.random.default_rng(0)
  prompt = rng.integers(0, cfg.vocab_size, (B, max(PROMPTS))).astype(np.int32)
  _, state = model.prefill(params, model.init_state(cfg, B, MAX_LEN), prompt, np.asarray(PROMPTS), cfg=cfg)
  tokens = rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32)

  step = jax.jit(lambda p, s, t: model.decode_step(p, s, t, cfg=cfg))
  want_logits, states, s = [], [state], state
  for j in range(T):
    logits, s = step(params, s, tokens[:, j])
    want_logits.append(logits)
    states.append(s)

  got_logits, _ = jax.jit(lambda p, s, t: speculative.verify(p, s, t, cfg=cfg))(params, state, tokens)
  np.testing.assert_allclose(got_logits, jnp.stack(want_logits, 1), rtol=1e-4, atol=2e-5)

  spec = jax.jit(
    lambda p, s, t, n: speculative.commit(s, speculative.verify(p, s, t, cfg=cfg)[1], n, cfg=cfg)
  )
  got = spec(params, state, tokens, np.asarray(N_B, np.int32))
  # what decode_step reached: row b of the state after its first N_B[b] tokens
  rows = lambda ax, *per_n: jnp.concatenate(
    [jax.lax.slice_in_dim(per_n[n], b, b + 1, axis=ax) for b, n in enumerate(N_B)], axis=ax
  )
  reached = jax.tree.map(rows, state.batch_axes(), *states)
  np.testing.assert_array_equal(got.pos, np.asarray(PROMPTS) + np.asarray(N_B))
  for name, a, w in (("conv", got.conv, reached.conv), ("gla", got.gla, reached.gla)):
    if w is not None:
      np.testing.assert_allclose(a, w, rtol=1e-5, atol=1e-5, err_msg=name)
  if reached.ring is not None:
    np.testing.assert_allclose(got.ring.k, reached.ring.k, rtol=1e-5, atol=1e-5, err_msg="ring k")
    np.testing.assert_allclose(got.ring.v, reached.ring.v, rtol=1e-5, atol=1e-5, err_msg="ring v")
  if reached.kv is not None:  # up to each row's position; the rejected rows after it are never read:
    for b, p in enumerate(got.pos.tolist()):
      np.testing.assert_allclose(got.kv.k[:, b, :p], reached.kv.k[:, b, :p], rtol=1e-5, atol=1e-5)
      np.testing.assert_allclose(got.kv.v[:, b, :p], reached.kv.v[:, b, :p], rtol=1e-5, atol=1e-5)
  # the next tokens from the committed state are those from the state decode_step reached
  nxt = rng.integers(0, cfg.vocab_size, (B,)).astype(np.int32)
  for _ in range(2):
    (a, got), (w, reached) = step(params, got, nxt), step(params, reached, nxt)
    np.testing.assert_allclose(a, w, rtol=1e-5, atol=1e-5)
    nxt = np.asarray(jnp.argmax(w, -1), np.int32)


@pytest.mark.parametrize("mixers", ["G", "GSA"])
def test_decode_step_rows_not_live_do_not_advance(mixers):
  """decode_step with live_B: live rows as without it; a row that is not live keeps its GLA state and position
  bit for bit, and the steps after it give what they give from the state before (its rings and KV cache took
  the token only in the slot its next token writes first)."""
  cfg = _cfg(mixers)
  params = model.init_params(cfg, jax.random.key(0))
  rng = np.random.default_rng(1)
  prompt = rng.integers(0, cfg.vocab_size, (B, max(PROMPTS))).astype(np.int32)
  _, state = model.prefill(params, model.init_state(cfg, B, MAX_LEN), prompt, np.asarray(PROMPTS), cfg=cfg)
  tokens = rng.integers(0, cfg.vocab_size, (B, 4)).astype(np.int32)
  step = jax.jit(lambda p, s, t: model.decode_step(p, s, t, cfg=cfg))
  masked = jax.jit(lambda p, s, t, live: model.decode_step(p, s, t, cfg=cfg, live_B=live))
  live = np.asarray([True, False, True])
  want_logits, want = step(params, state, tokens[:, 0])
  got_logits, got = masked(params, state, tokens[:, 0], live)
  np.testing.assert_allclose(got_logits[live], want_logits[live], rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(got.pos, np.asarray(PROMPTS) + live)
  np.testing.assert_array_equal(got.gla[:, 1], state.gla[:, 1])
  np.testing.assert_allclose(got.gla[:, live], want.gla[:, live], rtol=1e-5, atol=1e-5)
  # then every row decodes on: row 1 as from the state before the step, the others as from `want`
  before, after = state, want
  for j in range(1, 4):
    (a, got), (w_live, after), (w_dead, before) = (
      step(params, got, tokens[:, j]),
      step(params, after, tokens[:, j]),
      step(params, before, tokens[:, j]),
    )
    np.testing.assert_allclose(a[live], w_live[live], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(a[1], w_dead[1], rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="live_B has shape"):
    model.decode_step(params, state, tokens[:, 0], cfg=cfg, live_B=np.ones((2,), bool))


def test_verify_refuses_a_single_token_and_commit_an_impossible_length():
  cfg = _cfg("G")
  params = model.init_params(cfg, jax.random.key(0))
  state = model.init_state(cfg, B)
  with pytest.raises(ValueError, match="T >= 2"):
    speculative.verify(params, state, np.zeros((B, 1), np.int32), cfg=cfg)
  _, drafted = speculative.verify(params, state, np.zeros((B, T), np.int32), cfg=cfg)
  with pytest.raises(ValueError, match=r"accepted lengths in \[0, 5\]"):
    speculative.commit(state, drafted, np.asarray([0, 6, 1]), cfg=cfg)


def test_verify_and_commit_lower_clean_for_neuron():
  """One program: verify 8 tokens per row, accept greedily (the drafts that equal the argmax before them),
  commit; lowered as for Trainium, no construct the Neuron compiler rejects."""
  cfg = _cfg("GSA")

  def greedy(params, state, tokens):
    logits, drafted = speculative.verify(params, state, tokens, cfg=cfg)
    agree = jnp.argmax(logits[:, :-1], -1) == tokens[:, 1:]
    n_B = 1 + jnp.sum(jnp.cumprod(agree.astype(jnp.int32), axis=1), axis=1)
    return jnp.argmax(logits, -1), speculative.commit(state, drafted, n_B, cfg=cfg)

  with platform.lowering_for("neuron"):
    params = jax.eval_shape(lambda: model.init_params(cfg, jax.random.key(0)))
    state = jax.eval_shape(lambda: model.init_state(cfg, 4, MAX_LEN))
    tokens = jax.ShapeDtypeStruct((4, 8), jnp.int32)
    text = jax.jit(greedy).lower(params, state, tokens).as_text()
  assert neuron_check.violations(text) == []
