"""Calls that advance a slot by several tokens against single generate steps. SlotFunctions.verify: every
slot emits exactly the tokens (and logprobs) that as many generate steps give it, whatever its drafts (right,
half right, random, none), greedy and seeded alike, a finished slot accepts nothing after its last token,
and its state is committed at the length it emitted. generate(steps=T): the same tokens, T a call, and a
finished slot stays as it ended. The model half of verify (speculative.verify / commit against
decode_step): tests/library/inference/test_speculative.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import serve_fixtures as sf
from helpers.serve_fixtures import GPT2_VOCAB

from laplace_jax import model, platform
from laplace_jax.analysis import neuron_check
from laplace_jax.model.config import get_config
from serve.engine import drafting
from serve.engine.drafting import FORGET, DraftRecord, LookupIndex, PredictionIndex, VerifyCost
from serve.engine.engine import Engine, Request
from serve.engine.engine_config import EngineConfig
from serve.slots.slot_functions import SlotFunctions, SlotSettings, StepOutput, StepsOutput, host_settings

CFG = get_config("tiny", vocab_size=256, n_layers=3, mixers="GSA", window=4)  # G, S and A pieces; rings wrap
S, K, MAX_CONTEXT, STEPS = 4, 4, 96, 30
PROMPTS = [5, 17, 1, 9]
SETTINGS = [  # slot 0 greedy and done at its 7th token; the others seeded, one with logprobs, one with a stop id
  dict(temperature=0.0, top_k=0, top_p=1.0, seed=0, max_tokens=7, logprobs=-1),
  dict(temperature=1.0, top_k=0, top_p=1.0, seed=7, max_tokens=1000, logprobs=-1),
  dict(temperature=0.8, top_k=20, top_p=1.0, seed=9, max_tokens=1000, logprobs=3),
  dict(temperature=0.9, top_k=0, top_p=0.9, seed=11, max_tokens=1000, logprobs=-1),
]


@pytest.fixture(scope="module")
def served():
  """(fns, params, the table after inserting 4 prompts, the reference: each generate step's output and table)."""
  params = model.init_params(CFG, jax.random.key(0))
  fns = SlotFunctions(  # one program over the whole table (an engine's warmup over it compiles one bucket)
    model,
    CFG,
    n_slots=S,
    prefill_batch=S,
    n_stop=2,
    valid_vocab=CFG.vocab_size,
    max_context=MAX_CONTEXT,
    buckets="table",
  )
  rng = np.random.default_rng(0)
  tokens = np.zeros((S, 32), np.int32)
  for i, n in enumerate(PROMPTS):
    tokens[i, :n] = rng.integers(0, CFG.vocab_size, n)
  pf = fns.prefill_chunk(params, fns.empty_prefill(), jnp.asarray(tokens), jnp.asarray(PROMPTS, jnp.int32))
  rows = [SlotSettings(seed_hi=0, stop_ids=[], **s) for s in SETTINGS]
  table, first = fns.insert(
    params,
    fns.empty_table(),
    pf,
    jnp.arange(S, dtype=jnp.int32),
    jnp.arange(S, dtype=jnp.int32),
    host_settings(rows, S, 2),
  )
  first = StepOutput.unpack(np.asarray(first))
  host = lambda t: jax.tree.map(np.array, t)
  outputs, tables, t = [first], [host(table)], jax.tree.map(jnp.copy, table)
  for _ in range(STEPS):
    t, out = fns.generate(params, t)
    outputs.append(StepOutput.unpack(np.asarray(out)))
    tables.append(host(t))
  return fns, params, table, outputs, tables


def _drafts(kind: str, want: list[int], rng) -> list[int]:
  """K drafts for a slot whose next tokens are `want`: right, right twice then wrong, random, or none."""
  wrong = lambda t: (t + 1) % CFG.vocab_size
  return {
    "right": want[:K],
    "half": want[:2] + [wrong(t) for t in want[2:K]],
    "random": rng.integers(0, CFG.vocab_size, K).tolist(),
    "none": [],
  }[kind]


def test_verify_emits_what_generate_would_and_commits_the_state_at_that_length(served):
  fns, params, table, outputs, tables = served
  table = jax.tree.map(jnp.copy, table)  # the fixture's stays whole for the next test (verify donates)
  ref = [[int(o.token[s]) for o in outputs] for s in range(S)]
  kinds = ["right", "half", "random", "none"]
  got = [[ref[s][0]] for s in range(S)]  # insert's first token
  got_logprobs: list[list] = [[] for _ in range(S)]
  rng = np.random.default_rng(1)
  emitted_by_round = []
  for _ in range(5):
    drafts, n = np.zeros((S, K), np.int32), np.zeros((S,), np.int32)
    for s, kind in enumerate(kinds):
      d = _drafts(kind, ref[s][len(got[s]) :], rng)
      drafts[s, : len(d)], n[s] = d, len(d)
    table, packed = fns.verify(params, table, jnp.asarray(drafts), jnp.asarray(n))
    out = StepsOutput.unpack(np.asarray(packed), K + 1)
    emitted_by_round.append(out.emitted.tolist())
    for s in range(S):
      c = len(got[s])
      for j in range(int(out.emitted[s])):
        want = outputs[c + j]
        assert bool(out.steps.done[s, j]) == bool(want.done[s]), (s, c + j)
        if SETTINGS[s]["logprobs"] >= 0:
          got_logprobs[s].append(
            (out.steps.logprob[s, j], out.steps.top_ids[s, j], out.steps.top_logprobs[s, j])
          )
      got[s] += out.tokens_of(s)
  # The same tokens, with or without drafts, up to the slot's end (then an ended slot stands still in
  # generate: its later tokens and states are nobody's).
  ends = [next((i + 1 for i, o in enumerate(outputs) if o.done[s]), len(outputs)) for s in range(S)]
  for s in range(S):
    n = min(len(got[s]), ends[s])
    assert got[s][:n] == ref[s][:n], s
  # right drafts: K + 1 tokens a call until slot 0 ends (at its 7th token, in the second call: that token
  # is emitted, nothing after it); half right: 3; random: 1 unless a draft happens to be right; none: 1
  assert [r[0] for r in emitted_by_round] == [K + 1, 1, 1, 1, 1]
  assert all(r[1] == 3 for r in emitted_by_round) and all(r[3] == 1 for r in emitted_by_round)
  assert outputs[6].done[0] and not outputs[5].done[0]
  # logprobs as generate's (the chunked form's rounding apart)
  s = 2
  for i, (lp, ids, top) in enumerate(got_logprobs[s]):
    want = outputs[1 + i]
    np.testing.assert_allclose(lp, want.logprob[s], rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(ids, want.top_ids[s])
    np.testing.assert_allclose(top, want.top_logprobs[s], rtol=1e-4, atol=1e-5)
  # each slot's state, next input and output index: those of the table after as many generate steps (of
  # the KV cache, the rows the sequence has reached: verify also writes its rejected rows, past them, where
  # no query reads before they are overwritten)
  final = jax.tree.map(np.asarray, table)
  for s in range(S):
    if len(got[s]) <= ends[s]:
      _assert_state_is(final, tables[len(got[s]) - 1], s)


def _assert_state_is(final, want, s, ended: bool = False):
  """Slot s of table `final` holds `want`'s state, next input and output index (of the KV cache, the rows
  the sequence has reached; of a slot that `ended`, its rings but the slot its next token writes first)."""
  close = lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
  assert final.tokens[s] == want.tokens[s] and final.last_output_index[s] == want.last_output_index[s]
  g, w = final.model, want.model
  pos = int(w.pos[s])
  assert int(g.pos[s]) == pos
  read = lambda n: np.arange(n) != pos % n if ended else np.ones(n, bool)  # ring slots read before written
  close(g.gla[:, s], w.gla[:, s])
  conv = read(g.conv.shape[2])
  close(g.conv[:, s, conv], w.conv[:, s, conv])
  ring = read(g.ring.k.shape[3])
  for a, b in ((g.ring.k, w.ring.k), (g.ring.v, w.ring.v)):
    close(a[:, s, :, ring], b[:, s, :, ring])
  for a, b in ((g.kv.k, w.kv.k), (g.kv.v, w.kv.v)):
    close(a[:, s, :pos], b[:, s, :pos])


def test_generate_steps_emit_what_single_steps_would_and_leave_a_finished_slot_as_it_ended(served):
  fns, params, table, outputs, tables = served
  T = 4
  t, g = jax.tree.map(jnp.copy, table), jax.tree.map(jnp.copy, table)  # generate donates them
  got = [[int(outputs[0].token[s])] for s in range(S)]
  ended = [bool(outputs[0].done[s]) for s in range(S)]
  for _ in range(STEPS // T):
    t, packed = fns.generate(params, t, T)
    out = StepsOutput.unpack(np.asarray(packed), T)
    # greedy=True (argmax for every slot, no logprobs): the greedy slot's tokens as the sampler's
    g, greedy = fns.generate(params, g, T, greedy=True)
    greedy = StepsOutput.unpack(np.asarray(greedy), T)
    if not ended[0]:
      assert greedy.tokens_of(0) == out.tokens_of(0) and not greedy.steps.logprob.any()
    for s in range(S):
      if ended[s]:
        continue
      c, n = len(got[s]), int(out.emitted[s])
      want = outputs[c : c + T]
      ends = [j for j in range(T) if want[j].done[s]]
      assert n == (ends[0] + 1 if ends else T), s  # up to the token that ends the slot
      for j in range(n):
        assert out.steps.token[s, j] == want[j].token[s] and out.steps.done[s, j] == want[j].done[s]
        if SETTINGS[s]["logprobs"] >= 0:
          np.testing.assert_allclose(out.steps.logprob[s, j], want[j].logprob[s], rtol=1e-4, atol=1e-5)
          np.testing.assert_array_equal(out.steps.top_ids[s, j], want[j].top_ids[s])
      got[s] += out.tokens_of(s)
      ended[s] = bool(out.steps.done[s, n - 1])
  assert ended == [True, False, False, False] and len(got[0]) == 7 and len(got[1]) == 1 + STEPS // T * T
  final = jax.tree.map(np.asarray, t)
  for s in range(S):
    # slot 0 ended at its 7th token: its state has fed the six before it, as after the single step that
    # sampled that token, and the calls after it left it so
    _assert_state_is(final, tables[len(got[s]) - 1], s, ended=s == 0)


def test_verify_and_generate_steps_lower_clean_for_neuron():
  """The whole verify call (model pass, sampling at every position, acceptance, commit, packing) and a
  generate of several steps, lowered as for Trainium (with its PRNG, as `python -m serve --target neuron`
  picks it): no construct the Neuron compiler rejects."""
  with platform.lowering_for("neuron"), platform.using_prng("auto"):
    fns = SlotFunctions(
      model, CFG, n_slots=S, prefill_batch=S, n_stop=2, valid_vocab=CFG.vocab_size, max_context=MAX_CONTEXT
    )
    params = jax.eval_shape(lambda: model.init_params(CFG, jax.random.key(0)))
    table = fns.table_shape
    B = 2  # a bucket of the table's rows: gathered by index, written back in place
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    text = fns.programs.verify.lower(
      params, table, i32(B), i32(B, K), i32(B), i32(B, K + 1, fns.words)
    ).as_text()
    steps_texts = [
      fns.programs.generate_steps.lower(params, table, i32(B), 4, g).as_text() for g in (False, True)
    ]
  assert neuron_check.violations(text) == []
  assert [neuron_check.violations(t) for t in steps_texts] == [[], []]


@pytest.fixture(scope="module")
def spec_engine():
  """The tiny model (GPT-2 vocabulary) in an engine that verifies K drafts whenever a slot has one, warmed up."""
  cfg, params = sf.tiny(0)
  return sf.engine(params, cfg, n_slots=4, prefill_batch=2, speculative_tokens=K, speculative_rule="always")


@pytest.fixture(scope="module")
def spec_engine_steps(spec_engine):
  """spec_engine's compiled functions in an engine that generates 4 tokens a call when it does not verify."""
  cfg, params = sf.tiny(0)
  return sf.engine(
    params,
    cfg,
    n_slots=4,
    prefill_batch=2,
    speculative_tokens=K,
    speculative_rule="always",
    decode_steps=4,
    make_slots=lambda *a, **kw: spec_engine.fns,
  )


@pytest.mark.parametrize("engine_name", ["spec_engine", "spec_engine_steps"])
def test_engine_gives_the_same_outputs_with_predictions_and_counts_the_drafts(request, engine_name):
  """Requests with predictions (right, right then wrong, right with an edit in the middle, random, none) give
  exactly the tokens, logprobs and finish reasons they give without one, in a batch mixing greedy and seeded
  sampling, top-k / top-p, logprobs and a stop id; right predictions take fewer steps, and the prediction
  tokens each output matched are counted as accepted (OpenAI's accepted_prediction_tokens). Alike when the
  steps that verify nothing generate 4 tokens a call."""
  eng = request.getfixturevalue(engine_name)
  rng = np.random.default_rng(3)
  settings = [
    dict(temperature=0.0),
    dict(temperature=1.0, seed=5),
    dict(temperature=0.9, top_k=20, seed=6, logprobs=2),
    dict(temperature=0.8, top_p=0.9, seed=7),
    dict(temperature=0.0, logprobs=1),
  ]
  specs = [
    dict(prompt_ids=rng.integers(0, GPT2_VOCAB, 3 + 7 * i).tolist(), max_tokens=14, **s)
    for i, s in enumerate(settings)
  ]
  plain = [Request(**spec) for spec in specs]
  eng.generate(plain)
  steps_plain = eng.stats.steps
  specs[3]["stop_ids"] = [plain[3].progress.output_ids[5]]  # ends at its 6th token (or earlier)
  plain[3] = Request(**specs[3])
  eng.generate([plain[3]])
  outs = [r.progress.output_ids for r in plain]

  def edited(o):  # right, with two tokens changed in the middle: the drafts find their place again
    return o[:4] + [(o[4] + 1) % GPT2_VOCAB, (o[5] + 1) % GPT2_VOCAB] + o[6:]

  predictions = [
    outs[0],
    outs[1][:6] + rng.integers(0, GPT2_VOCAB, 8).tolist(),
    edited(outs[2]),
    outs[3] + outs[3],
    rng.integers(0, GPT2_VOCAB, 14).tolist(),
  ]
  before, drafts_before = eng.stats.steps, (eng.stats.drafted_tokens, eng.stats.accepted_tokens)
  spec_reqs = [Request(**spec, prediction_ids=pred) for spec, pred in zip(specs, predictions)]
  eng.generate(spec_reqs)
  for want, got in zip(plain, spec_reqs):
    w, g = want.progress, got.progress
    assert g.output_ids == w.output_ids and g.finish_reason == w.finish_reason
    assert len(g.token_logprobs) == len(w.token_logprobs)
    for (lp_g, top_g), (lp_w, top_w) in zip(g.token_logprobs, w.token_logprobs):
      np.testing.assert_allclose(lp_g, lp_w, rtol=1e-4, atol=1e-5)
      assert [t for t, _ in top_g] == [t for t, _ in top_w]
      np.testing.assert_allclose([v for _, v in top_g], [v for _, v in top_w], rtol=1e-4, atol=1e-5)
  accepted = [r.progress.accepted_prediction_tokens for r in spec_reqs]
  assert accepted[0] == len(outs[0]) and accepted[1] == 6, accepted  # right; right for 6 tokens
  # the two edited tokens and the one after them, where the output finds its place again, are not counted
  assert accepted[2] == len(outs[2]) - 3 and accepted[3] == len(outs[3]) and accepted[4] == 0, accepted
  drafted, taken = (
    eng.stats.drafted_tokens - drafts_before[0],
    eng.stats.accepted_tokens - drafts_before[1],
  )
  assert 0 < taken < drafted, (taken, drafted)
  if eng.config.decode_steps == 1:
    assert eng.stats.steps - before < steps_plain  # right drafts: fewer model calls for the same tokens


def test_prediction_over_http_same_reply_and_usage_counts(spec_engine):
  """OpenAI's `prediction` on /v1/completions and /v1/chat/completions: the same reply as without one,
  usage.completion_tokens_details counting the accepted and rejected prediction tokens; a malformed or too
  long prediction is a 400 naming the field and the bound."""
  tok = sf.gpt2_tokenizer()
  lim = sf.limits(tok, spec_engine, max_tokens=64, max_prompt_tokens=1000, max_prediction_tokens=40)
  on_deliver = spec_engine.on_deliver  # the server takes the engine's deliveries while it serves
  with sf.serving(spec_engine, tok, lim) as (url, _):
    body = {"prompt": "In the beginning", "max_tokens": 24, "temperature": 0.7, "seed": 3, "ignore_eos": True}
    st, plain = sf.call(url, body=body)
    assert st == 200 and "completion_tokens_details" not in plain["usage"]
    text = plain["choices"][0]["text"]
    st, pred = sf.call(url, body={**body, "prediction": {"type": "content", "content": text}})
    assert st == 200 and pred["choices"][0]["text"] == text
    details = pred["usage"]["completion_tokens_details"]
    assert details["accepted_prediction_tokens"] >= 10, details
    assert details["rejected_prediction_tokens"] <= 2, (
      details
    )  # the reply's text re-tokenized, nearly all taken
    chat = {"messages": [{"role": "user", "content": "Say something."}], "max_tokens": 16, "temperature": 0}
    st, a = sf.call(url, path="/v1/chat/completions", body=chat)
    said = a["choices"][0]["message"]["content"]
    parts = [{"type": "text", "text": said[:5]}, {"type": "text", "text": said[5:]}]
    st, b = sf.call(
      url, path="/v1/chat/completions", body={**chat, "prediction": {"type": "content", "content": parts}}
    )
    assert st == 200 and b["choices"][0]["message"]["content"] == said
    assert b["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] > 0
    st, text = sf.call(url, method="GET", path="/metrics")
    m = dict(line.split(" ") for line in text.splitlines() if not line.startswith("#"))
    assert int(m["laplace_serve_accepted_draft_tokens_total"]) >= details["accepted_prediction_tokens"]
    assert int(m["laplace_serve_drafted_tokens_total"]) >= int(m["laplace_serve_accepted_draft_tokens_total"])
    ratios = {k: float(v) for k, v in m.items() if k.startswith("laplace_serve_verify_cost_ratio{bucket=")}
    assert len(ratios) == len(spec_engine.fns.buckets) and all(v > 0 for v in ratios.values()), ratios
    for bad, needle in (
      ({"type": "text", "content": "x"}, "expected"),
      ({"type": "content", "content": 3}, "expected"),
      ({"type": "content", "content": "word " * 60}, "--max_prediction_tokens"),
    ):
      st, err = sf.call(url, body={**body, "prediction": bad})
      assert st == 400 and err["error"]["param"] == "prediction" and needle in err["error"]["message"], err
  spec_engine.on_deliver = on_deliver


def lookup_drafts(prompt_ids, output_ids, k):
  return LookupIndex().drafts(prompt_ids, output_ids, k)


def test_prompt_lookup_drafts_follow_the_latest_earlier_match():
  assert lookup_drafts([1, 2, 3, 4, 1, 2], [3], 2) == [4, 1]  # last 3 tokens (1 2 3) seen at 0: 4 1 followed
  assert lookup_drafts([7, 1, 2, 9, 1, 2, 5], [1, 2], 3) == [5, 1, 2]  # the latest earlier match wins
  assert lookup_drafts([5, 6], [7], 4) == [] and lookup_drafts([4], [], 4) == []  # nothing seen before
  assert lookup_drafts([8, 3, 8], [], 4) == [3, 8]  # falls back to one token; drafts stop at the end


def test_lookup_index_kept_up_to_date_gives_a_fresh_search(monkeypatch):
  """One LookupIndex fed a growing output (1 to 4 tokens at a time, as generate and verify steps add them)
  drafts what a plain search of the last LOOKUP_WINDOW tokens finds, also once the window has moved past
  the prompt (a 5-token vocabulary, so n-grams recur; a window of 24)."""
  monkeypatch.setattr(drafting, "LOOKUP_WINDOW", 24)
  rng = np.random.default_rng(1)

  def search(prompt, output, k):  # the latest earlier occurrence of the last 3 / 2 / 1 tokens in the window
    seq = [*prompt, *output][-24:]
    for n in range(min(3, len(seq)), 0, -1):
      for i in range(len(seq) - 1 - n, -1, -1):
        if seq[i : i + n] == seq[len(seq) - n :]:
          return seq[i + n : i + n + k]
    return []

  for _ in range(5):
    prompt, output, index = rng.integers(0, 5, rng.integers(1, 30)).tolist(), [], drafting.LookupIndex()
    while len(output) < 60:
      assert index.drafts(prompt, output, 4) == search(prompt, output, 4), (prompt, output)
      output += rng.integers(0, 5, rng.integers(1, 5)).tolist()


def test_prediction_index_finds_the_first_occurrence_of_the_longest_tail():
  """PredictionIndex.find against a plain search: just past the first occurrence of the tail's last 3 tokens,
  else its last 2, else its last 1 (a 4-token vocabulary, so every n-gram recurs)."""
  rng = np.random.default_rng(0)
  pred = rng.integers(0, 4, 60).tolist()
  index = PredictionIndex(pred)

  def search(tail):
    for n in range(min(3, len(tail)), 0, -1):
      for i in range(len(pred) - n + 1):
        if pred[i : i + n] == tail[-n:]:
          return i + n
    return None

  for _ in range(200):
    tail = rng.integers(0, 5, rng.integers(1, 4)).tolist()  # 4 never occurs in the prediction
    assert index.find(tail) == search(tail), tail
  assert PredictionIndex([]).find([1, 2]) is None


def test_prompt_lookup_gives_the_same_outputs(served):
  """With prompt lookup on, requests without a prediction draft from their own prompt and output (a prompt
  quoting a passage; a 256-token vocabulary, so that a random model's tokens recur and lookups find
  something): the same tokens and logprobs as without, and drafts are verified. The engine runs on the
  slot functions the tests above compiled (same model, slots and K)."""
  fns, params = served[:2]
  config = EngineConfig(
    n_slots=S,
    prefill_batch=S,
    max_stop_ids=fns.n_stop,
    speculative_tokens=K,
    speculative_rule="always",
    max_context=MAX_CONTEXT,
    slot_buckets="table",
  )
  eng = Engine(params, CFG, config, make_slots=lambda *args, **kw: fns)
  eng.warmup()
  rng = np.random.default_rng(5)
  passage = rng.integers(0, CFG.vocab_size, 40).tolist()
  specs = [
    dict(prompt_ids=passage + [11, 12] + passage[:6], max_tokens=24, temperature=0.0, logprobs=1),
    dict(prompt_ids=passage + passage[:3], max_tokens=24, temperature=1.0, seed=4),
  ]
  plain = [Request(**spec) for spec in specs]
  eng.generate(plain)
  assert eng.stats.drafted_tokens == 0
  eng.drafter.prompt_lookup = True
  looked = [Request(**spec) for spec in specs]
  eng.generate(looked)
  assert eng.stats.drafted_tokens > 0
  for want, got in zip(plain, looked):
    assert got.progress.output_ids == want.progress.output_ids
    assert got.progress.finish_reason == want.progress.finish_reason
    for (a, _), (b, _) in zip(got.progress.token_logprobs, want.progress.token_logprobs):
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    assert got.progress.accepted_prediction_tokens == 0  # no prediction


class _FixedCost(VerifyCost):
  """A verify costing `ratio` generate steps, whatever the engine measures."""

  def __init__(self, ratio: float):
    super().__init__()
    self.fixed = ratio

  def ratio(self, bucket: int = 0) -> float:
    return self.fixed


def test_verify_cost_rule_weighs_expected_tokens_against_the_measured_cost():
  rec = DraftRecord()
  assert rec.expected_extra(8, now=0) == 8  # untried: its drafts count as right
  rec.add_verify(0, now=9)
  assert rec.expected_extra(8, now=9) == pytest.approx(
    4 / 1.5
  )  # one verify took none: (0 + 0.5·8) / (1 + 0.5)
  rec.add_verify(8, now=18)
  assert rec.expected_extra(8, now=18) == pytest.approx((8 + 4) / (1 + FORGET**9 + 0.5))
  assert rec.expected_extra(2, now=18) == 2  # never more than the drafts
  wrong = DraftRecord()
  for t in range(4):
    wrong.add_verify(0, now=t + 1)
  stale = wrong.expected_extra(8, now=4)
  assert stale < 1 < wrong.expected_extra(8, now=40)  # tried again some tokens later
  lookups = DraftRecord()
  for found in (True, False, False):
    lookups.add_lookup(found, now=0)
  assert lookups.expected_extra(8, now=0, may_find_none=True) == pytest.approx(8 * 1.5 / 3.5)
  cost = VerifyCost()
  assert cost.ratio() == 1.0 and cost.pays(64, 0.1)  # unmeasured: a verify is tried
  assert not cost.pays(4, 0.0)  # nothing expected from the drafts
  for gen, ver in ((1.0, 3.0), (1.2, 2.9), (0.9, 3.1)):
    assert cost.ratio() == 1.0  # fewer than 3 of each measured
    cost.record("gen", gen)
    cost.record("verify", ver)
  assert cost.ratio() == pytest.approx(3.0)  # medians: 3.0 / 1.0
  assert not cost.pays(4, 6.0) and cost.pays(4, 8.0)  # 4 + extra tokens for the cost of 12 steps' 4
  assert cost.pays(1, 2.0) and not cost.pays(1, stale)  # batch 1: a failing prediction pauses


def test_engine_verifies_only_when_the_cost_rule_says_it_pays(spec_engine):
  """With speculative_rule 'cost' a right prediction is verified where a verify costs what a step does and
  not where it costs 100 steps: the same tokens both ways; the engine times its own calls as it runs them."""
  eng = spec_engine
  spec = dict(prompt_ids=[3, 1, 4, 1, 5], max_tokens=12, temperature=0.0)
  plain = Request(**spec)
  eng.generate([plain])
  want = plain.progress.output_ids
  eng.drafter.rule = "cost"
  try:
    for ratio, verified in ((100.0, False), (1.0, True)):
      eng.drafter.cost = _FixedCost(ratio)
      r = Request(**spec, prediction_ids=want)
      eng.generate([r])
      assert r.progress.output_ids == want
      assert (r.progress.drafts.verifies > 0) is verified, (ratio, r.progress.drafts)
    eng.drafter.cost = VerifyCost()
    eng.generate([Request(**spec, prediction_ids=want[:6] + [0] * 6), Request(**spec)])
    measured = eng.drafter.cost.seconds  # (kind, bucket) -> times: one request's bucket, then two's
    assert {k for k, _ in measured} == {"gen", "verify"} and {b for _, b in measured} <= set(eng.fns.buckets)
    assert all(0 < eng.drafter.cost.ratio(b) < float("inf") for _, b in measured)
  finally:
    eng.drafter.rule, eng.drafter.cost = "always", VerifyCost()
