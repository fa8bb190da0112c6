"""Recall task generators and scoring: shapes, determinism, answers where they belong, errors."""

import jax
import numpy as np
import pytest

from laplace_jax.data import recall_tasks as recall


@pytest.mark.parametrize("T, N", recall.MQAR_SETTINGS)
def test_mqar_shapes_answers_and_causality(T, N):
  b = recall.mqar_batch(3, 6, T, N)
  x, y, w = b.inputs, b.targets, b.weights
  assert x.shape == y.shape == w.shape == (6, T) and x.dtype == np.int32
  np.testing.assert_array_equal(x[:, 1:], y[:, :-1])  # targets are the next inputs
  half = recall.MQAR_VOCAB // 2
  for r in range(6):
    keys, vals = x[r, 0 : 2 * N : 2], x[r, 1 : 2 * N : 2]
    assert len(set(keys)) == N and (keys >= 1).all() and (keys < half).all() and (vals >= half).all()
    table = dict(zip(keys, vals))
    q = np.flatnonzero(w[r])
    assert len(q) == N and (q >= 2 * N).all() and (q % 2 == 0).all()  # queries come after all pairs
    assert sorted(x[r, q]) == sorted(keys)  # each key asked exactly once
    assert all(y[r, t] == table[x[r, t]] for t in q)  # scored on its own value
    assert not w[r, : 2 * N].any()  # the pairs themselves are not scored


@pytest.mark.parametrize("T, N", [(64, 4), (256, 16)])
def test_zoology_layout_zero_filler_labels_only_at_queries(T, N):
  b = recall.zoology_batch(3, 50, T, N)
  x, y, w = b.inputs, b.targets, b.weights
  assert x.shape == y.shape == w.shape == (50, T) and x.dtype == y.dtype == np.int32
  half = recall.MQAR_VOCAB // 2
  for r in range(50):
    keys, vals = x[r, 0 : 2 * N : 2], x[r, 1 : 2 * N : 2]
    assert len(set(keys)) == len(set(vals)) == N  # distinct keys, distinct values
    assert (keys >= 1).all() and (keys < half).all() and (vals >= half).all() and (vals < 2 * half).all()
    q = np.flatnonzero(w[r])
    assert len(q) == N and (q >= 2 * N).all() and ((q - 2 * N) % 2 == 0).all()
    assert sorted(x[r, q]) == sorted(keys)  # each key asked once
    assert [y[r, t] for t in q] == [dict(zip(keys, vals))[x[r, t]] for t in q]  # labelled with its value
    rest = np.ones(T, bool)
    rest[: 2 * N], rest[q] = False, False
    assert not x[r, rest].any() and not y[r, w[r] == 0].any()  # zero filler, no other labels
  again, other = recall.zoology_batch(3, 50, T, N), recall.zoology_batch(4, 50, T, N)
  assert all(np.array_equal(u, v) for u, v in zip(jax.tree.leaves(b), jax.tree.leaves(again), strict=True))
  assert not np.array_equal(x, other.inputs)
  assert recall.task_batch(f"zoology:{T},{N}", 3, 50).inputs.tolist() == x.tolist()


def test_zoology_gaps_follow_numpy_choice_without_replacement():
  """The vectorised gap draw (Gumbel top-k) against Zoology's own way, np.random.choice(replace=False, p):
  how often each gap is asked, over 4,000 sequences each."""
  T, N, a = 64, 4, 0.01
  space = (T - 2 * N) // 2
  w = recall.zoology_batch(0, 4000, T, N).weights
  ours = w[:, 2 * N :: 2].mean(0)
  p = np.arange(1, space + 1) ** (a - 1.0)
  rng = np.random.default_rng(0)
  ref = np.zeros(space)
  for _ in range(4000):
    ref[rng.choice(space, N, replace=False, p=p / p.sum())] += 1 / 4000
  np.testing.assert_allclose(ours, ref, atol=0.035)
  assert ours[0] > 2 * ours[-1]  # short gaps are asked more often


def test_mqar_deterministic_by_seed():
  a, b, c = (recall.mqar_batch(s, 4, 64, 4) for s in (1, 1, 2))
  for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(u, v)
  assert not np.array_equal(a.inputs, c.inputs)


def test_mqar_gaps_favour_short_offsets():
  w = recall.mqar_batch(0, 400, 512, 16).weights
  gaps = (np.flatnonzero(w.sum(0)) - 32) // 2
  counts = w.sum(0)[32::2]
  assert counts[:10].sum() > counts[-10:].sum()  # power law: near slots are asked more often
  assert gaps.max() > 100  # but far ones are asked too


@pytest.mark.parametrize("spec", ["mqar:15,4", "mqar:64", "mqar:64,0", "passkey:10", "copy:5", "mqar:a,b"])
def test_bad_settings_rejected_with_the_fix(spec):
  with pytest.raises(ValueError, match="mqar:|4·n_pairs"):
    recall.parse_task(spec)


def test_passkey_prompt_length_depth_and_answer():
  with pytest.raises(ValueError, match="at least"):
    recall.passkey_example(0, recall.MIN_PASSKEY_CONTEXT - 1, 0.5)
  for ctx in (recall.MIN_PASSKEY_CONTEXT, 64, 1000):
    for depth in (0.0, 0.5, 1.0):
      prompt, answer = recall.passkey_example(5, ctx, depth)
      assert len(prompt) == ctx and len(answer) == 5
      words = [recall.PASSKEY_WORDS[i] for i in prompt]
      assert " ".join(words).endswith("what is the pass key ? the pass key is")
      at = words.index("pass")
      assert words[at + 3 : at + 8] == [recall.PASSKEY_WORDS[i] for i in answer]
      n_fill = ctx - recall.MIN_PASSKEY_CONTEXT
      assert at - 1 == round(depth * n_fill)  # the key sentence starts at the depth
      assert words.count("remember") == 1  # stated once
  p1, a1 = recall.passkey_example(5, 200, 0.3)
  p2, a2 = recall.passkey_example(5, 200, 0.3)
  np.testing.assert_array_equal(p1, p2)


def test_passkey_at_a_distance_from_the_question():
  ctx = 300
  for distance in (0, 64, recall.max_passkey_distance(ctx)):
    prompt, answer = recall.passkey_example(5, ctx, distance=distance)
    words = [recall.PASSKEY_WORDS[i] for i in prompt]
    question = ctx - 10  # "what is the pass key ? the pass key is"
    assert words[question] == "what" and len(prompt) == ctx
    r = words.index("remember")  # "remember it . d d d d d is the pass key ."
    key_end = r + 13
    assert words[key_end - 4 : key_end] == ["the", "pass", "key", "."] and question - key_end == distance
    assert words[r + 3 : r + 8] == [recall.PASSKEY_WORDS[i] for i in answer]
  for bad in (dict(distance=ctx), dict(), dict(depth=0.5, distance=3)):
    with pytest.raises(ValueError, match="distance|one of"):
      recall.passkey_example(5, ctx, **bad)


def test_passkey_batch_scores_exactly_the_answer():
  b = recall.passkey_batch(0, 4, 128)
  for r in range(4):
    q = np.flatnonzero(b.weights[r])
    assert len(q) == 5 and q[-1] == 127
    assert all(recall.PASSKEY_WORDS[t] in recall.DIGITS for t in b.targets[r, q])
    assert [recall.PASSKEY_WORDS[t] for t in b.inputs[r, q[0] - 3 : q[0] + 1]] == [
      "the",
      "pass",
      "key",
      "is",
    ]


def test_accuracy_on_hand_made_cases():
  targets = np.array([[1, 2, 3], [4, 5, 6]])
  weights = np.array([[0, 1, 1], [1, 0, 0]], np.float32)
  assert recall.accuracy(np.array([[9, 2, 0], [4, 9, 9]]), targets, weights) == 2 / 3
  logits = np.zeros((2, 3, 10))
  logits[0, 1, 2] = logits[0, 2, 3] = logits[1, 0, 4] = 1
  assert recall.accuracy(logits, targets, weights) == 1.0
  with pytest.raises(ValueError, match="no scored"):
    recall.accuracy(targets, targets, np.zeros_like(weights))


def test_stream_resumes_where_it_stopped_and_splits_processes():
  s = recall.RecallStream("mqar:64,4", seq_len=64, global_batch=8, seed=1)
  first = [next(s) for _ in range(3)]
  state = s.get_state()
  again = recall.RecallStream("mqar:64,4", seq_len=64, global_batch=8, seed=1)
  again.set_state(state)
  np.testing.assert_array_equal(next(again).inputs, next(s).inputs)
  half = recall.RecallStream(
    "mqar:64,4", seq_len=64, global_batch=8, seed=1, process_index=1, process_count=2
  )
  np.testing.assert_array_equal(next(half).inputs, first[0].inputs[4:])
  with pytest.raises(ValueError, match="seq_len"):
    recall.RecallStream("mqar:64,4", seq_len=128, global_batch=8)
