"""The official openai client against `python -m serve` with structured outputs and tool calls: every reply
must parse and validate (checked here, without the server's library) for `json_object`, a strict
`json_schema` that bounds its size (an enum, bounded integers, maxLength, maxItems), and tool calls under
`required`, a named function and `parallel_tool_calls`, through chat completions and the Responses API,
whole and streamed; `tools` under `auto` and plain requests still answer text. With random weights the
grammar alone makes the replies valid. Run it from a venv that has `openai`, the server already up:

    python -m serve --preset tiny --random_init --port 8131 &
    /path/to/venv/bin/python -m benchmarks openai_tools_check http://127.0.0.1:8131 [--max_tokens 256]
"""

import argparse
import json

SCHEMA = {
  "type": "object",
  "properties": {
    "colour": {"type": "string", "enum": ["red", "green", "blue"]},
    "count": {"type": "integer", "minimum": 0, "maximum": 99},
    "name": {"type": "string", "maxLength": 8},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}, "maxItems": 3},
  },
  "required": ["colour", "count", "name", "tags"],
  "additionalProperties": False,
}
WEATHER = {
  "type": "object",
  "properties": {
    "city": {"type": "string", "maxLength": 12},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
  },
  "required": ["city", "days"],
  "additionalProperties": False,
}
ADD = {
  "type": "object",
  "properties": {
    "a": {"type": "integer", "minimum": 0, "maximum": 9},
    "b": {"type": "integer", "enum": [1, 2]},
  },
  "required": ["a", "b"],
  "additionalProperties": False,
}
FUNCTIONS = {"get_weather": WEATHER, "add": ADD}


def validate(value, schema: dict, at: str = "$") -> list[str]:
  """What in `value` breaks `schema` (the keywords the schemas above use; [] when it validates)."""
  kind = schema.get("type")
  kinds = {"object": dict, "array": list, "string": str, "integer": int}
  if kind in kinds and (not isinstance(value, kinds[kind]) or isinstance(value, bool)):
    return [f"{at}: {value!r} is not of type {kind}"]
  errors = []
  if "enum" in schema and value not in schema["enum"]:
    errors.append(f"{at}: {value!r} not in {schema['enum']}")
  if "minimum" in schema and value < schema["minimum"] or "maximum" in schema and value > schema["maximum"]:
    errors.append(f"{at}: {value!r} outside [{schema.get('minimum')}, {schema.get('maximum')}]")
  if "maxLength" in schema and len(value) > schema["maxLength"]:
    errors.append(f"{at}: {len(value)} characters, more than {schema['maxLength']}")
  if "maxItems" in schema and len(value) > schema["maxItems"]:
    errors.append(f"{at}: {len(value)} items, more than {schema['maxItems']}")
  if kind == "array":
    for i, item in enumerate(value):
      errors += validate(item, schema.get("items", {}), f"{at}[{i}]")
  if kind == "object":
    props = schema.get("properties", {})
    errors += [f"{at}: {k!r} missing" for k in schema.get("required", []) if k not in value]
    if schema.get("additionalProperties") is False:
      errors += [f"{at}: {k!r} not allowed" for k in value if k not in props]
    for k, v in value.items():
      if k in props:
        errors += validate(v, props[k], f"{at}.{k}")
  return errors


def check_json(text: str, schema: dict | None) -> dict:
  """The reply parsed as a JSON object valid under `schema` (None: any object), else AssertionError."""
  value = json.loads(text)
  assert isinstance(value, dict), text
  errors = [] if schema is None else validate(value, schema)
  assert not errors, (errors, text)
  return value


def check_calls(calls: list[tuple[str, str]], names: set[str], most: int | None = None) -> None:
  """Tool calls as (name, arguments JSON): each names one of `names` and its arguments validate."""
  assert calls and (most is None or len(calls) <= most), calls
  for name, arguments in calls:
    assert name in names, (name, names)
    check_json(arguments, FUNCTIONS[name])


def chat_tools():
  return [
    {"type": "function", "function": {"name": n, "parameters": s, "strict": True}}
    for n, s in FUNCTIONS.items()
  ]


def flat_tools():
  return [{"type": "function", "name": n, "parameters": s, "strict": True} for n, s in FUNCTIONS.items()]


def streamed_chat(stream) -> tuple[str, list[tuple[str, str]], str | None]:
  """(content, [(name, arguments)], finish_reason) from chat chunks, accumulated as clients do."""
  content, calls, finish = "", {}, None
  for chunk in stream:
    for ch in chunk.choices:
      content += ch.delta.content or ""
      for tc in ch.delta.tool_calls or []:
        slot = calls.setdefault(tc.index, ["", ""])
        slot[0] += tc.function.name or ""
        slot[1] += tc.function.arguments or ""
      finish = ch.finish_reason or finish
  return content, [tuple(calls[i]) for i in sorted(calls)], finish


def streamed_response(stream):
  """(output text, [(name, arguments)], status) from Responses API events."""
  text, calls, status = "", [], None
  for ev in stream:
    if ev.type == "response.output_text.delta":
      text += ev.delta
    elif ev.type == "response.output_item.done" and ev.item.type == "function_call":
      calls.append((ev.item.name, ev.item.arguments))
    elif ev.type in ("response.completed", "response.incomplete"):
      status = ev.response.status
  return text, calls, status


def main():
  import openai

  ap = argparse.ArgumentParser()
  ap.add_argument("base", nargs="?", default="http://127.0.0.1:8131")
  ap.add_argument("--max_tokens", type=int, default=256)
  ap.add_argument("--api_key", default="none")
  args = ap.parse_args()
  client = openai.OpenAI(base_url=args.base + "/v1", api_key=args.api_key)
  model = client.models.list().data[0].id
  print(f"openai {openai.__version__}; model {model}")
  n = args.max_tokens
  msgs = [{"role": "user", "content": "Describe a thing as JSON."}]
  strict = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
  for fmt, schema in (({"type": "json_object"}, None), (strict, SCHEMA)):
    r = client.chat.completions.create(model=model, messages=msgs, max_tokens=n, response_format=fmt, seed=1)
    c = r.choices[0]
    if c.finish_reason == "length":  # only json_object is unbounded: a random model's string may not close
      assert schema is None, c
      print(f"chat {fmt['type']}: cut by max_tokens={n} (finish length): {c.message.content[:60]!r}...")
    else:
      check_json(c.message.content, schema)
      print(f"chat {fmt['type']}: {c.finish_reason} {c.message.content}")
    stream = client.chat.completions.create(
      model=model, messages=msgs, max_tokens=n, response_format=fmt, seed=1, stream=True
    )
    content, _, finish = streamed_chat(stream)
    assert (content, finish) == (c.message.content, c.finish_reason), (content, finish)
    print(f"  streamed: the same ({finish})")
  ask = [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 2?"}]
  named = {"type": "function", "function": {"name": "add"}}
  for choice, parallel, names, most in (
    ("required", True, set(FUNCTIONS), None),
    ("required", False, set(FUNCTIONS), 1),
    (named, True, {"add"}, None),
  ):
    kw = dict(model=model, messages=ask, max_tokens=n, tools=chat_tools(), tool_choice=choice, seed=3)
    kw["parallel_tool_calls"] = parallel
    r = client.chat.completions.create(**kw)
    c = r.choices[0]
    calls = [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []]
    assert c.finish_reason == "tool_calls", c
    check_calls(calls, names, most)
    assert all(t.id.startswith("call_") and t.type == "function" for t in c.message.tool_calls)
    content, streamed, finish = streamed_chat(client.chat.completions.create(**kw, stream=True))
    assert (streamed, finish) == (calls, "tool_calls"), (streamed, finish)
    label = choice if isinstance(choice, str) else "named add"
    print(f"chat tools {label} parallel={parallel}: {len(calls)} calls {calls}; streamed the same")
  r = client.chat.completions.create(model=model, messages=ask, max_tokens=16, tools=chat_tools(), seed=4)
  print(f"chat tools auto: finish={r.choices[0].finish_reason} content={r.choices[0].message.content!r}")
  assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
  r = client.chat.completions.create(model=model, messages=msgs, max_tokens=16, seed=4)
  assert r.choices[0].message.content is not None
  print(f"chat free: {r.choices[0].message.content!r}")

  text_fmt = {"format": {"type": "json_schema", "name": "thing", "schema": SCHEMA, "strict": True}}
  r = client.responses.create(
    model=model, input="Describe a thing.", max_output_tokens=n, text=text_fmt, temperature=0
  )
  assert r.status == "completed", r
  check_json(r.output_text, SCHEMA)
  print(f"responses json_schema: {r.output_text}")
  kw = dict(
    model=model, input="Describe a thing.", max_output_tokens=n, text=text_fmt, stream=True, temperature=0
  )
  text, _, status = streamed_response(client.responses.create(**kw))
  assert (text, status) == (r.output_text, "completed"), (text, status)
  for choice, names in (
    ("required", set(FUNCTIONS)),
    ({"type": "function", "name": "get_weather"}, {"get_weather"}),
  ):
    kw = dict(
      model=model,
      input="Weather in Paris?",
      max_output_tokens=n,
      tools=flat_tools(),
      tool_choice=choice,
      temperature=0,
      parallel_tool_calls=False,  # (greedy, a random model repeats its call until max_output_tokens)
    )
    r = client.responses.create(**kw)
    calls = [(i.name, i.arguments) for i in r.output if i.type == "function_call"]
    assert r.status == "completed", r
    check_calls(calls, names, 1)
    _, streamed, status = streamed_response(client.responses.create(**kw, stream=True))
    assert (streamed, status) == (calls, "completed"), (streamed, status)
    print(f"responses tools {choice}: {calls}; streamed the same")
  r = client.responses.create(model=model, input="Hello", max_output_tokens=16, tools=flat_tools())
  print(f"responses tools auto: {r.status} {[i.type for i in r.output]}")
  print("ok")


if __name__ == "__main__":
  main()
