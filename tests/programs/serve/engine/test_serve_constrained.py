"""Constrained decoding through the engine: over the numpy fake (tests/helpers/fake_slots.py, whose sampler honours
the masks as the real one does), a constrained reply follows its grammar and ends "stop" by it ("length" when
max_tokens cuts it), free requests beside constrained ones get exactly the tokens they get alone, constrained
slots take single steps and are never verified; over HTTP, json_schema replies validate and tool calls
parse, whole and streamed; one small real engine's constrained reply (random weights) validates. The
validator is the openai check's (benchmarks/openai_tools_check.py), not the grammar library."""

import json

import pytest
from helpers import serve_fixtures as sf
from helpers.fake_slots import reference
from helpers.serve_fixtures import GPT2_VOCAB, KEY, call

from benchmarks.openai_tools_check import ADD, FUNCTIONS, SCHEMA, WEATHER, check_calls, check_json, validate
from laplace_jax.data.tokenizer import EOS_ID, get_tokenizer
from serve.api import grammar, toolcalls
from serve.engine.engine import Engine, Request
from serve.engine.engine_config import EngineConfig

COMPILER = grammar.Compiler()
TOOLS = tuple(grammar.Tool(n, s, strict=True) for n, s in FUNCTIONS.items())


def matcher(kind: str, **kw) -> grammar.Matcher:
  return COMPILER.compile_now(grammar.Constraint(kind=kind, strict=True, **kw)).matcher()


def constrained(prompt_ids, m: grammar.Matcher, **kw) -> Request:
  """A request whose output m constrains (its stop id among its stop ids, room for its grammar to end)."""
  return Request(prompt_ids=prompt_ids, **{"max_tokens": 200, "stop_ids": [EOS_ID], "constraint": m, **kw})


def text_of(r: Request) -> str:
  ids = r.progress.output_ids
  return get_tokenizer().decode(ids[:-1] if ids and ids[-1] == EOS_ID else ids)


def test_the_validator_refuses_what_breaks_the_schema():
  good = {"colour": "red", "count": 3, "name": "ab", "tags": ["a"]}
  assert validate(good, SCHEMA) == []
  for bad in (
    {**good, "colour": "pink"},
    {**good, "count": 100},
    {**good, "name": "x" * 9},
    {**good, "tags": ["a"] * 4},
    {**good, "extra": 1},
    {k: v for k, v in good.items() if k != "count"},
    {**good, "count": True},
  ):
    assert validate(bad, SCHEMA), bad
  assert validate({"a": 1, "b": 2}, ADD) == [] and validate({"a": 1, "b": 3}, ADD)


def _free(i: int, max_tokens: int = 12) -> dict:
  return dict(
    prompt_ids=[5 + i, 77, 300 + i], max_tokens=max_tokens, temperature=[0.0, 0.9][i % 2], top_k=i % 3, seed=i
  )


def test_constrained_and_free_requests_share_the_steps():
  eng = sf.fake_engine(n_slots=8, prefill_batch=2, max_queue=64)
  free = [Request(**_free(i)) for i in range(5)]
  schema = [
    constrained([9, i], matcher("json_schema", schema=SCHEMA), temperature=t, seed=i)
    for i, t in enumerate((0.0, 1.0))
  ]
  tools = matcher("tools", tools=TOOLS, choice="required", parallel=False, lead=" ")
  calls = constrained([4], tools, temperature=1.0, seed=7)
  cut = constrained([3], matcher("json_object"), max_tokens=4)
  eng.generate([free[0], schema[0], free[1], calls, free[2], schema[1], free[3], cut, free[4]])
  for i, r in enumerate(free):  # the tokens each gets alone, unchanged by its constrained neighbours
    f = _free(i)
    want = reference(
      f["prompt_ids"], f["max_tokens"], GPT2_VOCAB, temperature=f["temperature"], top_k=f["top_k"], seed=i
    )
    assert r.progress.output_ids == want, i
  for r in schema:
    assert r.progress.finish_reason == "stop" and r.progress.output_ids[-1] == EOS_ID
    check_json(text_of(r), SCHEMA)
  content, parsed = toolcalls.parse(text_of(calls))
  assert calls.progress.finish_reason == "stop" and content == ""
  check_calls([(c.name, c.arguments) for c in parsed], set(FUNCTIONS), 1)
  assert cut.progress.finish_reason == "length" and len(cut.progress.output_ids) == 4
  assert text_of(cut).startswith("{")
  assert eng.fns.masked_rows >= sum(len(r.progress.output_ids) for r in [*schema, calls, cut])


def test_constrained_slots_take_single_steps_and_free_ones_go_on_with_several():
  eng = sf.fake_engine(n_slots=4, prefill_batch=2, max_queue=8, decode_steps=4)
  eng.generate([Request(prompt_ids=[1], max_tokens=9)])
  assert 4 in eng.fns.steps_run
  eng.fns.steps_run.clear()
  r = constrained([2], matcher("json_schema", schema=WEATHER))
  free = Request(**_free(1, 40))
  eng.generate([r, free])
  check_json(text_of(r), WEATHER)
  singles = eng.fns.steps_run.count(1)  # while r decodes; the free request then goes on 4 steps a call
  assert eng.fns.steps_run == [1] * singles + [4] * (len(eng.fns.steps_run) - singles)
  assert len(r.progress.output_ids) - 1 <= singles < 40 - 4
  assert free.progress.output_ids == reference([6, 77, 301], 40, GPT2_VOCAB, temperature=0.9, top_k=1, seed=1)


def test_verified_drafts_follow_the_grammar():
  """Speculative decoding with per-position masks gives a constrained reply the tokens it gets without it: a
  prediction of that reply with a token its grammar forbids is taken up to that token, never past it."""

  def run(speculative: bool, prediction=()):
    eng = sf.fake_engine(
      n_slots=4,
      prefill_batch=2,
      max_queue=8,
      speculative_tokens=3 if speculative else 0,
      speculative_rule="always",
    )
    r = constrained(
      [2], matcher("json_schema", schema=SCHEMA), temperature=1.0, seed=3, prediction_ids=prediction
    )
    free = Request(prompt_ids=[8], max_tokens=8, prediction_ids=reference([8], 8, GPT2_VOCAB))
    eng.generate([r, free])
    assert free.progress.output_ids == reference([8], 8, GPT2_VOCAB)
    return eng, r.progress.output_ids

  _, plain = run(False)
  check_json(get_tokenizer().decode(plain[:-1]), SCHEMA)
  newline = get_tokenizer().encode("\n")[0]  # never allowed in strict JSON without flexible whitespace
  eng, got = run(True, plain[:6] + [newline] + plain[7:])
  assert got == plain
  assert eng.stats.accepted_tokens >= 7 + 5  # the free request's at most 7, the constrained one's too


def test_a_constrained_request_needs_its_stop_id():
  eng = sf.fake_engine(n_slots=2, prefill_batch=2, max_queue=4)
  with pytest.raises(ValueError, match="stop id"):
    eng.submit(Request(prompt_ids=[1], constraint=matcher("json_object")))


def test_constrained_replies_over_http_validate_whole_and_streamed():
  tok = sf.gpt2_tokenizer()
  eng = sf.fake_engine(n_slots=4, prefill_batch=2, max_queue=16)
  msgs = [{"role": "user", "content": "hi"}]
  fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
  tools = [
    {"type": "function", "function": {"name": n, "parameters": s, "strict": True}}
    for n, s in FUNCTIONS.items()
  ]
  with sf.serving(eng, tok, sf.limits(tok, eng, max_tokens=256), api_key=KEY) as (url, _):
    body = {
      "messages": msgs,
      "max_tokens": 200,
      "response_format": fmt,
      "temperature": 1.0,
      "seed": 3,
      "n": 2,
    }
    st, out = call(url, path="/v1/chat/completions", body=body)
    assert st == 200, out
    for c in out["choices"]:
      assert c["finish_reason"] == "stop"
      check_json(c["message"]["content"], SCHEMA)
    st, events = call(url, path="/v1/chat/completions", body={**body, "n": 1, "stream": True})
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    text = "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks if ch["choices"])
    assert st == 200 and text == out["choices"][0]["message"]["content"]
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice, names, parallel in (("required", set(FUNCTIONS), False), (named, {"get_weather"}, False)):
      body = {
        "messages": msgs,
        "max_tokens": 200,
        "tools": tools,
        "tool_choice": choice,
        "parallel_tool_calls": parallel,
        "seed": 5,
      }
      st, out = call(url, path="/v1/chat/completions", body=body)
      c = out["choices"][0]
      assert st == 200 and c["finish_reason"] == "tool_calls", out
      got = [(t["function"]["name"], t["function"]["arguments"]) for t in c["message"]["tool_calls"]]
      check_calls(got, names, None if parallel else 1)
      st, events = call(url, path="/v1/chat/completions", body={**body, "stream": True})
      streamed: dict = {}
      for ch in (json.loads(e) for e in events if e != "[DONE]"):
        for tc in ch["choices"][0]["delta"].get("tool_calls", []) if ch["choices"] else []:
          slot = streamed.setdefault(tc["index"], ["", ""])
          slot[0] += tc["function"].get("name") or ""
          slot[1] += tc["function"].get("arguments") or ""
      assert [tuple(streamed[i]) for i in sorted(streamed)] == got


def test_a_real_engine_constrained_reply_validates_with_random_weights():
  cfg, params = sf.tiny(0)
  eng = Engine(params, cfg, EngineConfig(n_slots=2, prefill_batch=2, max_queue=4), valid_vocab=GPT2_VOCAB)
  reqs = [
    constrained([11, 12], matcher("json_schema", schema=SCHEMA), temperature=t, seed=1) for t in (0.0, 1.0)
  ]
  eng.generate(reqs)
  for r in reqs:
    assert r.progress.finish_reason == "stop", text_of(r)
    check_json(text_of(r), SCHEMA)
  before = (
    eng.fns.programs.sample._cache_size()
  )  # free requests run the same compiled programs: nothing more is made
  eng.generate([Request(prompt_ids=[11, 12], max_tokens=6, seed=s) for s in range(2)])
  assert eng.fns.programs.sample._cache_size() == before
