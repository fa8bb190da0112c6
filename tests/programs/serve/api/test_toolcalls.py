"""serve.api.toolcalls and the chat layer around it: the documented call format parses into OpenAI tool_calls
(whole, and as streamed deltas however the text is split), free text before a call is content, parallel
calls keep their order; templates render tools, assistant tool calls and tool results (the default template
into the text the model wrote; a Hugging Face template gets `tools` and `tool_calls` as HF passes them); a
constrained request reaches the engine as a Matcher per choice once the engine honours constraints, and is
refused with 501 before."""

import json
import random

import pytest
from helpers import serve_fixtures as sf
from helpers.serve_fixtures import KEY, call

from serve.api import chat, constraints, grammar, toolcalls
from serve.api.protocol import ApiError

CALLS = [
  ("get_weather", '{"city": "Paris \\"north\\"", "days": [1, {"x": "}"}]}'),
  ("add", '{"a": 1, "b": 2}'),
]
TEXT = " Let me look that up. " + toolcalls.calls_text(CALLS)


def test_a_whole_reply_parses_into_content_and_calls():
  content, calls = toolcalls.parse(TEXT)
  assert content == " Let me look that up. "
  assert [(k.name, k.arguments) for k in calls] == CALLS
  assert all(k.id.startswith("call_") for k in calls) and len({k.id for k in calls}) == 2
  assert toolcalls.parse(" " + toolcalls.call_text("f", "{}"))[0] == ""  # the lead space is not content
  plain = "x < y and <tool_call is not a call </tool_call> at all"
  assert toolcalls.parse(plain) == (plain, [])
  message, finish = chat.reply_message(TEXT, "stop", True)
  assert finish == "tool_calls" and message["content"] == " Let me look that up. "
  assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == [
    json.loads(a) for _, a in CALLS
  ]
  assert chat.reply_message(TEXT, "length", True)[1] == "length"
  assert chat.reply_message(TEXT, "stop", False) == ({"role": "assistant", "content": TEXT}, "stop")


@pytest.mark.parametrize("seed", range(5))
def test_streamed_deltas_add_up_to_the_whole_reply_however_split(seed):
  rng = random.Random(seed)
  stream, deltas, i = toolcalls.CallStream(), [], 0
  while i < len(TEXT):
    j = i + rng.randint(1, 9)
    deltas += [chat.call_delta(e) for e in stream.feed(TEXT[i:j])]
    i = j
  deltas += [chat.call_delta(e) for e in stream.close()]
  content, calls = "", {}
  for d in deltas:  # as an OpenAI client accumulates them
    content += d.get("content", "")
    for tc in d.get("tool_calls", []):
      if "id" in tc:
        assert tc["type"] == "function" and tc["index"] not in calls and tc["function"]["arguments"] == ""
        calls[tc["index"]] = {"id": tc["id"], "name": tc["function"]["name"], "arguments": ""}
      calls[tc["index"]]["arguments"] += tc["function"]["arguments"]
  assert content == " Let me look that up. "
  assert [(calls[k]["name"], calls[k]["arguments"]) for k in sorted(calls)] == CALLS
  assert not any("content" in d for d in deltas[[("tool_calls" in d) for d in deltas].index(True) :])


def test_templates_render_tools_calls_and_results():
  tok = sf.gpt2_tokenizer()
  tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
  history = [
    {"role": "user", "content": "Add 1 and 2."},
    {
      "role": "assistant",
      "content": "",
      "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
      ],
    },
    {"role": "tool", "content": "3", "tool_call_id": "call_1"},
  ]
  msgs = chat.parse_messages({"messages": history})
  default = chat.ChatTemplate(None, tok)
  text = default.render(msgs, tools=tools)
  assert text.startswith("System: " + chat.TOOLS_PREAMBLE + json.dumps(tools[0]["function"]))
  # the reply a required call writes after "Assistant:" (the lead space, then the call) renders back as is
  written = " " + toolcalls.call_text("add", '{"a": 1}')
  assert "User: Add 1 and 2.\n\nAssistant:" + written + "\n\nTool: 3\n\nAssistant:" in text
  hf = chat.ChatTemplate(
    "{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}{{ m.role }}:"
    "{% for c in m.tool_calls or [] %}{{ c.function.name }}({{ c.function.arguments.a }}){% endfor %}"
    "{{ m.content }};{% endfor %}",
    tok,
  )
  assert hf.render(msgs, tools=tools) == "[add]user:Add 1 and 2.;assistant:add(1);tool:3;"


def test_a_constrained_request_reaches_the_engine_only_when_it_applies_constraints(monkeypatch):
  tok = sf.gpt2_tokenizer()
  engine = sf.fake_engine(n_slots=2, prefill_batch=2, max_queue=4)
  body = {
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 3,
    "n": 2,
    "response_format": {"type": "json_object"},
  }
  monkeypatch.setattr(engine, "applies_constraints", False)  # an engine that does not apply them
  with sf.serving(engine, tok, sf.limits(tok, engine, max_tokens=16), api_key=KEY) as (url, server):
    st, out = call(url, path="/v1/chat/completions", body=body)
    assert st == 501 and out["error"]["param"] == "response_format", out
    tools = {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none"}
    assert call(url, path="/v1/chat/completions", body={**body, "response_format": None, **tools})[0] == 200
    seen = []
    submit = engine.submit_all
    monkeypatch.setattr(engine, "submit_all", lambda reqs: (seen.extend(reqs), submit(reqs))[1])
    monkeypatch.setattr(engine, "applies_constraints", True)
    st, out = call(url, path="/v1/chat/completions", body=body)
    assert st == 200, out
    reqs = [seen[0], *seen[0].siblings]
    assert (
      all(isinstance(r.constraint, grammar.Matcher) for r in reqs)
      and reqs[0].constraint is not reqs[1].constraint
    )
    assert tok.eos_id in reqs[0].stop_ids
    # the other routes' fields reach the engine the same way; with tools, replies are parsed for calls (the
    # fake model writes none: its text comes back as content, streamed and whole)
    st, _ = call(url, body={"prompt": "hi", "max_tokens": 2, "response_format": {"type": "json_object"}})
    assert st == 200 and isinstance(seen[-1].constraint, grammar.Matcher)
    auto = {"tools": [{"type": "function", "function": {"name": "f"}}], "max_tokens": 3}
    st, events = call(
      url, path="/v1/chat/completions", body={**auto, "messages": body["messages"], "stream": True}
    )
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    assert st == 200 and chunks[-1]["choices"][0]["finish_reason"] == "length"
    flat = {"tools": [{"type": "function", "name": "f"}], "max_output_tokens": 3, "input": "hi"}
    st, events = call(url, path="/v1/responses", body={**flat, "stream": True})
    kinds = [json.loads(e.split("data: ", 1)[1])["type"] for e in events]
    assert st == 200 and kinds[:2] == ["response.created", "response.in_progress"], kinds
    assert kinds[-2:] == ["response.output_item.done", "response.incomplete"], kinds
    st, out = call(url, path="/v1/responses", body=flat)
    assert st == 200 and [i["type"] for i in out["output"]] == ["message"] and out["tools"] == flat["tools"]
    assert isinstance(seen[-1].constraint, grammar.Matcher)


def test_fuzzed_schemas_get_a_grammar_or_a_400():
  rng = random.Random(0)
  words = [
    "type",
    "properties",
    "items",
    "enum",
    "required",
    "pattern",
    "maxLength",
    "minimum",
    "anyOf",
    "$ref",
  ]
  wild = [
    None,
    True,
    -1,
    2**70,
    0.5,
    "",
    "object",
    "string",
    "[",
    "#/x",
    [],
    {},
    ["a", 1],
    {"type": "integer"},
  ]

  def schema(depth):
    if depth > 3 or rng.random() < 0.3:
      return rng.choice(wild)
    return {rng.choice(words): schema(depth + 1) for _ in range(rng.randint(1, 4))}

  comp = grammar.Compiler()
  for i in range(150):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema(0), "strict": i % 2 == 0}}
    try:
      c = constraints.json_format(fmt, "response_format", False, grammar.LIMITS)
      assert c is not None
      comp.compile_now(c, param="response_format").matcher()
    except ApiError as e:
      assert e.status == 400 and e.param == "response_format", e.message
  comp.close()
