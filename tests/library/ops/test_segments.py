"""Packed rows: every document of a row computed exactly as if it ran alone (laplace_jax/ops/segments.py).

References: the token-by-token GLA recurrence with its state zeroed at each start, and the model run on
each document by itself (logits and parameter gradients)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from laplace_jax import model, platform, sharding
from laplace_jax.analysis import neuron_check
from laplace_jax.model.config import get_config
from laplace_jax.ops import gla, short_conv
from laplace_jax.ops.segments import Segments
from laplace_jax.training import adamw
from laplace_jax.training import train_step as ts

CFG = get_config("tiny", chunk_size=8, vocab_size=256)
T = 40
# Row 0: documents of 1, 2, 9 (across a chunk boundary), 1, 16 (two whole chunks, then) and 11 tokens;
# row 1: one document over the whole row (no start).
LENGTHS = ([1, 2, 9, 1, 16, 11], [T])


def _ids():
  return np.stack([np.repeat(np.arange(len(ls)), ls) for ls in LENGTHS]).astype(np.int32)


def _docs():
  """(row, first, last + 1) of every document."""
  out = []
  for r, ls in enumerate(LENGTHS):
    ends = np.cumsum(ls)
    out += [(r, int(e - n), int(e)) for n, e in zip(ls, ends)]
  return out


def test_segments_record():
  ids = np.asarray([[7, 7, 3, 3, 3, 9], [1, 1, 1, 1, 1, 1]], np.int32)
  s = Segments.from_ids(ids, pos_B=np.asarray([5, 0]))
  np.testing.assert_array_equal(s.start, [[0, 0, 1, 0, 0, 1], [0] * 6])
  np.testing.assert_array_equal(s.index, [[0, 0, 1, 1, 1, 2], [0] * 6])
  np.testing.assert_array_equal(s.offset, [[5, 6, 0, 1, 2, 0], [0, 1, 2, 3, 4, 5]])
  with pytest.raises(ValueError, match="integer ids"):
    Segments.from_ids(np.zeros((2, 3), np.float32))


@pytest.mark.parametrize("form", ["parallel", "scan"])
def test_chunked_gla_resets_equal_the_recurrence(form):
  rng = np.random.default_rng(0)
  B, H, K, V = 2, 3, 8, 5
  q, k, v = (jnp.asarray(rng.normal(size=(B, T, H, d)), jnp.float32) for d in (K, K, V))
  g = jnp.log(jnp.asarray([0.9, 0.5, 0.999]))
  s0 = jnp.asarray(rng.normal(size=(B, H, K, V)), jnp.float32)  # the first segment continues it
  reset = Segments.from_ids(_ids()).start
  naive = jax.jit(gla.naive_recurrent_simple_gla)
  want_o, want_s = naive(q, k, v, g, initial_state=s0, reset=reset)
  chunked = jax.jit(gla.chunk_simple_gla, static_argnames=("chunk_size", "form"))
  for C in (4, 8, 64):
    o, s = chunked(q, k, v, g, initial_state=s0, reset=reset, chunk_size=C, form=form)
    np.testing.assert_allclose(o, want_o, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(s, want_s, rtol=1e-5, atol=1e-5)
  # a right-padded row: padding never starts a segment nor touches the state
  mask = jnp.arange(T)[None] < jnp.asarray([[30], [T]])
  o, s = chunked(q, k, v, g, initial_state=s0, reset=reset, mask=mask, chunk_size=8, form=form)
  cut = lambda x: x[:1, :30]
  want = naive(cut(q), cut(k), cut(v), g, initial_state=s0[:1], reset=cut(reset))
  np.testing.assert_allclose(o[:1, :30], want[0], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(s[:1], want[1], rtol=1e-5, atol=1e-5)


def test_conv_ring_after_a_start_holds_only_the_last_segment():
  rng = np.random.default_rng(1)
  W, D = CFG.conv_size, 6
  h = jnp.asarray(rng.normal(size=(1, 10, D)), jnp.float32)
  kernel, bias = jnp.asarray(rng.normal(size=(W, D)), jnp.float32), jnp.zeros((D,))
  ring0 = jnp.asarray(rng.normal(size=(1, W, D)), jnp.float32)
  pos, n = jnp.asarray([3]), jnp.asarray([10])
  seg = Segments.from_ids(np.asarray([[0] * 8 + [1] * 2]), pos)
  out, ring = short_conv.conv_sequence(h, kernel, bias, ring0, pos, n, seg.offset)
  # the last document alone (2 tokens from a fresh ring), then its next token, both ways
  _, ring_alone = short_conv.conv_sequence(h[:, 8:], kernel, bias, jnp.zeros_like(ring0), pos * 0, n * 0 + 2)
  x = jnp.asarray(rng.normal(size=(1, 1, D)), jnp.float32)
  a = short_conv.conv_sequence(x, kernel, bias, ring, pos + 10, n * 0 + 1)[0]
  b = short_conv.conv_sequence(x, kernel, bias, ring_alone, pos * 0 + 2, n * 0 + 1)[0]
  np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
  # and the first segment continues the incoming ring: equal to the unsegmented conv there
  plain = short_conv.conv_sequence(h, kernel, bias, ring0, pos, n)[0]
  np.testing.assert_allclose(out[:, :8], plain[:, :8], rtol=1e-6, atol=1e-6)


def _weighted_loss(params, tokens, w_BxT, cfg, segment_ids=None):
  logits = model.forward(params, tokens, cfg=cfg, segment_ids_BxT=segment_ids)
  return jnp.sum(jax.nn.log_softmax(logits)[..., 0] * w_BxT), logits


def test_packed_rows_equal_each_document_alone():
  """One layer of each mixer (G, then S, then A: what the G, GS and GA patterns are made of), one compile
  per program."""
  cfg = CFG.replace(mixers="GSA", window=6, n_layers=3)
  params = model.init_params(cfg, jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (2, T), 0, cfg.vocab_size)
  ids = jnp.asarray(_ids())
  # every position weighted by where it sits in the row, so each document's gradient is its own
  w_BxT = jnp.broadcast_to(jnp.linspace(0.5, 1.5, T), (2, T))
  loss_and_grad = jax.jit(jax.value_and_grad(_weighted_loss, has_aux=True), static_argnums=3)
  (_, packed), grad = loss_and_grad(params, tokens, w_BxT, cfg, ids)
  # the reference: each document alone at the start of its own row (right-padding never reaches back);
  # after them, weighted zero (no gradient), the packed rows themselves without segment ids
  docs = _docs()
  alone_tokens = np.zeros((len(docs) + 2, T), np.int32)
  alone_w = np.zeros((len(docs) + 2, T), np.float32)
  for d, (r, a, b) in enumerate(docs):
    alone_tokens[d, : b - a] = tokens[r, a:b]
    alone_w[d, : b - a] = w_BxT[r, a:b]
  alone_tokens[len(docs) :] = tokens
  (_, alone), want_grad = loss_and_grad(params, jnp.asarray(alone_tokens), jnp.asarray(alone_w), cfg)
  for d, (r, a, b) in enumerate(docs):
    np.testing.assert_allclose(packed[r, a:b], alone[d, : b - a], rtol=1e-5, atol=1e-5)
  for got, want in zip(jax.tree.leaves(grad), jax.tree.leaves(want_grad)):
    assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) < 1e-5
  # without segment ids a packed row reads across its documents (what the resets prevent)
  plain = alone[len(docs) :]
  assert not np.allclose(plain[0, 3:], packed[0, 3:], atol=1e-3)


def test_a_carried_row_continues_its_document_or_begins_the_next():
  """A packed row split in two: the second half from the first's carry, whose next document may begin
  exactly at the cut (first_start_B), equals the whole row (GLA states, conv rings, positions; attention
  layers carry nothing across steps by design, so the pattern is G)."""
  cfg = CFG.replace(n_layers=2)
  params = model.init_params(cfg, jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(2), (2, T), 0, cfg.vocab_size)
  # cut at 20: row 0's sixth document begins there, row 1's second runs across it
  row0, row1 = np.repeat(np.arange(7), [1, 2, 9, 1, 7, 4, 16]), np.repeat([0, 1], [13, 27])
  ids = jnp.asarray(np.stack([row0, row1]).astype(np.int32))
  whole = model.forward(params, tokens, cfg=cfg, segment_ids_BxT=ids)
  cut = 20
  first, carry = model.forward_carry(
    params, tokens[:, :cut], model.init_carry(cfg, 2), cfg=cfg, segment_ids_BxT=ids[:, :cut]
  )
  begins = ids[:, cut] != ids[:, cut - 1]
  assert begins.tolist() == [True, False]
  second, _ = model.forward_carry(
    params, tokens[:, cut:], carry, cfg=cfg, segment_ids_BxT=ids[:, cut:], first_start_B=begins
  )
  np.testing.assert_allclose(jnp.concatenate([first, second], 1), whole, rtol=1e-5, atol=1e-5)


def test_sharded_step_on_packed_rows_equals_the_unsharded_loss_and_lowers_clean_for_neuron():
  """The state-passing train step over a 2×4 mesh with segment ids in the batch, two steps: each step's
  loss and gradient norm those of train_step.loss_sums run whole on one device from the same carry (the
  rows' last ids kept in it); the same step lowered for Neuron breaks no rule."""
  cfg = CFG.replace(n_layers=1)  # GLA and conv: what crosses steps (test_packed_rows... checks attention)
  mesh = sharding.make_mesh(data=2, fsdp=4)
  opt = adamw.adamw(1e-3)  # not what is checked (test_train_step checks Muon's steps); Neuron-clean
  B = 8
  rng = np.random.default_rng(3)
  step = ts.compile_train_step(cfg, opt, mesh, global_batch=B, seq_len=T, segmented=True, state_passing=True)
  state = ts.init_train_state_on_mesh(cfg, opt, mesh, seed=0, carry_batch=B, segmented=True)
  assert state.carry is not None and state.carry.segment.shape == (B,)
  host_loss = jax.jit(jax.value_and_grad(lambda p, b: ts.loss_sums(p, b, cfg=cfg), has_aux=True))
  start = 0
  for _ in range(2):
    tok = rng.integers(0, cfg.vocab_size, (B, T + 1)).astype(np.int32)
    ids = (start + np.sort(rng.integers(0, 6, (B, T)), axis=1)).astype(np.int32)
    start = int(ids.max())  # row ids rise across steps; some rows go on with their last document
    batch = ts.Batch(inputs=tok[:, :-1], targets=tok[:, 1:], segment_ids=ids)
    host = jax.device_get(state)
    (loss, aux), grads = host_loss(host.params, batch.replace(carry=host.carry))
    state, m = step(state, batch)
    np.testing.assert_allclose(float(m.loss), float(loss / aux.tokens), rtol=1e-5)
    want_norm = float(optax.tree.norm(grads) / aux.tokens)
    np.testing.assert_allclose(float(m.grad_norm), want_norm, rtol=1e-5)
    np.testing.assert_array_equal(state.carry.segment, ids[:, -1])
    np.testing.assert_allclose(state.carry.gla, aux.carry.gla, rtol=1e-5, atol=1e-6)
  with platform.lowering_for("neuron"):
    lowered = ts.lower_train_step(
      cfg, opt, mesh, global_batch=B, seq_len=T, segmented=True, state_passing=True
    )
  assert neuron_check.violations(lowered.as_text()) == []
