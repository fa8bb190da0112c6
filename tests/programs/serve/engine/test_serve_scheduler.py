"""serve.engine.engine's scheduling over the numpy fake of its slot functions (tests/helpers/fake_slots.py): requests
arriving at any time, longer than a chunk, with several choices, cancelled in the queue, during their prefill
or while decoding, each get exactly the tokens the fake gives them decoded alone; the queue is bounded and
every slot comes free; one or several decode steps a call alike. The same engine over the compiled model:
tests/programs/serve/engine/test_serve_engine.py."""

import numpy as np
import pytest
from helpers import fake_slots
from helpers import serve_fixtures as sf
from helpers.serve_fixtures import GPT2_VOCAB

from serve.engine.engine import QueueFull, Request
from serve.engine.state_cache import StateCache


@pytest.fixture(params=[1, 3], ids=["one step a call", "three steps a call"])
def engine(request):
  return sf.fake_engine(
    n_slots=8, prefill_batch=2, max_queue=64, prefill_chunks_per_step=1, decode_steps=request.param
  )


def _specs(seed, n):
  rng = np.random.default_rng(seed)
  settings = [dict(temperature=0.0), dict(temperature=0.9, top_k=5), dict(temperature=1.0, top_p=0.7)]
  return [
    dict(
      prompt_ids=rng.integers(0, GPT2_VOCAB, int(rng.integers(1, 400))).tolist(),
      max_tokens=int(rng.integers(1, 30)),
      seed=int(rng.integers(0, 2**64, dtype=np.uint64)),
      **settings[i % len(settings)],
    )
    for i in range(n)
  ]


def _alone(spec):
  keys = ("temperature", "top_k", "top_p", "seed")
  return fake_slots.reference(
    spec["prompt_ids"], spec["max_tokens"], GPT2_VOCAB, **{k: spec[k] for k in keys if k in spec}
  )


def test_the_fake_decodes_as_its_reference():
  # The reference the tests below compare with is the fake's own model: greedy follows the top candidate,
  # sampling depends on the seed, and settings filter it as they say.
  prompt = [3, 1, 4, 1, 5]
  greedy = fake_slots.reference(prompt, 6, GPT2_VOCAB)
  h = fake_slots.consume(0, prompt[0])
  for t in prompt[1:]:
    h = fake_slots.consume(h, t)
  assert greedy[0] == fake_slots.candidates(h, GPT2_VOCAB)[0]
  draws = {tuple(fake_slots.reference(prompt, 6, GPT2_VOCAB, temperature=1.0, seed=s)) for s in range(8)}
  assert len(draws) > 4
  assert fake_slots.reference(prompt, 6, GPT2_VOCAB, temperature=1.0, top_k=1, seed=3) == greedy
  assert fake_slots.reference(prompt, 6, GPT2_VOCAB, temperature=1.0, top_p=1e-6, seed=3) == greedy


def test_requests_arriving_at_any_time_get_their_tokens_alone(engine):
  specs = _specs(0, 24)
  reqs = [Request(**s) for s in specs]
  for r in reqs[:10]:
    engine.submit(r)
  for _ in range(5):  # later requests join while earlier ones prefill and decode
    engine.step()
  for r in reqs[10:]:
    engine.submit(r)
    engine.step()
  engine.run_until_idle()
  for s, r in zip(specs, reqs):
    assert r.progress.output_ids == _alone(s), s
    assert r.progress.finish_reason == "length" and r.progress.done.is_set()
  assert engine.active_slots == 0 and not engine.slot_map.reserved and not engine.pending


def test_each_step_runs_the_smallest_bucket_that_holds_the_live_slots(engine):
  """A lone request in an 8-slot engine steps one row; three step four; as requests finish the bucket
  shrinks; every bucket was warmed up; the tokens are those each request gets alone."""
  assert set(engine.fns.buckets) == {1, 2, 4, 8} and {f"bucket {b}" for b in (2, 4, 8)} <= {
    k.removeprefix("compile ") for k in engine.warmup_seconds
  }
  for n in (1, 3):
    specs = [dict(s, max_tokens=4 + 6 * i) for i, s in enumerate(_specs(7, n))]
    reqs = [Request(**s) for s in specs]
    engine.fns.rows_run.clear()
    engine.generate(reqs)
    assert [r.progress.output_ids for r in reqs] == [_alone(s) for s in specs]
    assert max(engine.fns.rows_run) == (1 if n == 1 else 4) and min(engine.fns.rows_run) == 1


def test_choices_of_one_prompt_share_its_prefill_and_follow_their_seeds(engine):
  prompt = list(range(300))  # three chunks
  siblings = [Request(prompt_ids=prompt, max_tokens=9, temperature=1.0, seed=s) for s in (2, 3)]
  lead = Request(prompt_ids=prompt, max_tokens=9, temperature=1.0, seed=1, siblings=siblings)
  before = engine.fns.calls["prefill"]
  engine.generate([lead])
  assert engine.fns.calls["prefill"] - before == 3  # one prefill row for the three choices
  for r, s in zip([lead, *siblings], (1, 2, 3)):
    assert r.progress.output_ids == fake_slots.reference(prompt, 9, GPT2_VOCAB, temperature=1.0, seed=s)


def test_stop_ids_end_a_request_at_the_first_one(engine):
  base = _alone(dict(prompt_ids=[5, 6, 7], max_tokens=12))
  stop = base[4]
  req = Request(prompt_ids=[5, 6, 7], max_tokens=12, stop_ids=[stop])
  engine.generate([req])
  assert req.progress.output_ids == base[: base.index(stop) + 1] and req.progress.finish_reason == "stop"


def test_cancels_in_the_queue_in_prefill_and_decoding_free_everything(engine):
  long = lambda p: Request(prompt_ids=p, max_tokens=1000)
  decoding = [engine.submit(long([i])) for i in range(8)]
  for _ in range(6):
    engine.step()
  assert engine.active_slots == 8
  queued = [engine.submit(long(list(range(500)))) for _ in range(4)]
  engine.cancel(decoding[0])
  engine.step()  # the freed slot starts the first queued prompt's 4-chunk prefill
  assert engine.prefill is not None and engine.prefill.next_chunk < engine.prefill.n_chunks
  in_prefill = engine.prefill.reqs[0]
  engine.cancel(in_prefill)
  bystander = Request(prompt_ids=[9, 9], max_tokens=3)
  engine.submit(bystander)
  for r in decoding[1:] + queued:
    engine.cancel(r)
  engine.run_until_idle()
  assert all(r.progress.finish_reason == "cancelled" for r in decoding + queued)
  assert bystander.progress.output_ids == _alone(dict(prompt_ids=[9, 9], max_tokens=3))
  assert engine.active_slots == 0 and engine.queue_depth == 0 and not engine.slot_map.reserved
  assert all(r is None for r in engine.slot_map.req) and not engine.pending and engine.prefill is None


def test_queue_bound_and_cancel_free_slots(engine):
  long = lambda: Request(prompt_ids=[1, 2], max_tokens=1000, temperature=0.0)
  reqs = [engine.submit(long()) for _ in range(8 + 64)]  # 8 slots + a queue of 64
  with pytest.raises(QueueFull):
    engine.submit(long())
  for _ in range(6):
    engine.step()
  assert engine.active_slots == 8 and engine.queue_depth == 64
  for r in reqs:
    engine.cancel(r)
  engine.run_until_idle()
  assert engine.active_slots == 0 and engine.queue_depth == 0
  assert all(r.progress.finish_reason == "cancelled" and r.progress.done.is_set() for r in reqs)
  assert not engine.slot_map.reserved and not engine.pending and engine.prefill is None


@pytest.mark.parametrize("steps", [1, 3])
def test_a_cached_state_has_consumed_exactly_the_tokens_it_is_cached_under(steps):
  """However a request ended (its length, a stop id, a cancel with a call in flight) and however many steps
  a call runs, the state the engine copied into the cache has consumed exactly the ids it is cached under
  (the fake's state is the count and a hash of the tokens it consumed): all of the request's, or all but
  the last."""
  cache = StateCache("fake-model", 1 << 30)
  eng = sf.fake_engine(n_slots=4, prefill_batch=2, state_cache=cache, cache_min_tokens=16, decode_steps=steps)
  rng = np.random.default_rng(4)
  prompts = [rng.integers(0, GPT2_VOCAB, 40).tolist() for _ in range(4)]
  stop = _alone(dict(prompt_ids=prompts[1], max_tokens=12))[4]
  reqs = [
    Request(prompt_ids=prompts[0], max_tokens=7),
    Request(prompt_ids=prompts[1], max_tokens=12, stop_ids=[stop]),
    Request(prompt_ids=prompts[2], max_tokens=1000),
    Request(prompt_ids=prompts[3], max_tokens=1000, temperature=1.0, seed=3),
  ]
  eng.submit_all(reqs)
  for cancelled in reqs[2:]:
    for _ in range(4):
      eng.step()
    eng.cancel(cancelled)
  eng.run_until_idle()
  eng.state_io.collect(block=True)
  assert [r.progress.finish_reason for r in reqs] == ["length", "stop", "cancelled", "cancelled"]
  for r in reqs:
    ids = list(r.prompt_ids) + r.progress.output_ids
    n, state = cache.lookup(ids + [0], len(ids))
    assert n in (len(ids) - 1, len(ids)), (r.progress.finish_reason, n, len(ids))
    h = 0
    for t in ids[:n]:
      h = fake_slots.consume(h, t)
    # (the hash's low 32 bits: the gather makes it a jax array, int32 without x64)
    assert (
      state is not None and state["pos"] == n and state["conv"].ravel()[0] == np.int64(h).astype(np.int32)
    )


def _consumed(state, ids) -> bool:
  """Whether the fake's cached state has consumed exactly `ids`."""
  h = 0
  for t in ids:
    h = fake_slots.consume(h, t)
  return (
    state is not None
    and state["pos"] == len(ids)
    and state["conv"].ravel()[0] == np.int64(h).astype(np.int32)
  )


@pytest.mark.parametrize("steps", [1, 3])
def test_a_conversation_keeps_states_where_its_prompt_and_its_reply_text_end(steps):
  """A client re-sends a reply as its text: cut before a stop string (its state ran past the cut) or
  without the stop id that ended it. The cache then holds states that consumed exactly the prompt, and
  exactly the prompt and the tokens the reply's text keeps (prefilled again from the prompt's state where
  the slot's state ran past them); a later prompt that extends one restores it."""
  cache = StateCache("fake-model", 1 << 30)
  eng = sf.fake_engine(n_slots=4, prefill_batch=2, state_cache=cache, decode_steps=steps)
  rng = np.random.default_rng(7)
  prompts = [rng.integers(0, GPT2_VOCAB, n).tolist() for n in (5, 150)]
  stop = _alone(dict(prompt_ids=prompts[1], max_tokens=12))[6]
  cut = Request(prompt_ids=prompts[0], max_tokens=1000)
  ended = Request(prompt_ids=prompts[1], max_tokens=12, stop_ids=[stop])
  eng.submit_all([cut, ended])
  for _ in range(8):
    eng.step()
  eng.cancel(cut, keep=3)  # the reply's text before a stop string holds its first 3 tokens
  eng.run_until_idle()
  eng.state_io.collect(block=True)
  assert ended.progress.finish_reason == "stop" and len(ended.progress.output_ids) == 7
  assert len(cut.progress.output_ids) > 4 and eng.stats.requests == eng.stats.finished == 2
  for r, keep in ((cut, 3), (ended, 6)):
    for ids in (list(r.prompt_ids), list(r.prompt_ids) + r.progress.output_ids[:keep]):
      n, state = cache.lookup(ids + [1, 2], len(ids))
      assert n == len(ids) and _consumed(state, ids), (r.progress.finish_reason, n, len(ids))
  # The next turn restores the longest of them and gets the tokens a full prefill gives.
  later = list(cut.prompt_ids) + cut.progress.output_ids[:3] + [9, 8, 7]
  nxt = Request(prompt_ids=later, max_tokens=5)
  eng.generate([nxt])
  assert nxt.progress.cached_tokens == len(later) - 3
  assert nxt.progress.output_ids == _alone(dict(prompt_ids=later, max_tokens=5))
