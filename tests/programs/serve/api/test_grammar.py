"""serve.api.grammar and serve.api.constraints: a request's constraint compiled by llguidance into per-choice Matchers
whose masks, walked with GPT-2's tokens, let valid documents through and stop at their end; rollback undoes
advances; with random logits sampled under the masks (serve.slots.sampling, the engine's sampler) every reply
parses and validates; the limits, the library's refusals and the compile time limit are 400s naming them;
compiled grammars are cached per tenant scope, never across."""

import asyncio
import functools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from laplace_jax import get_config
from laplace_jax.data.tokenizer import EOS_ID, VOCAB_SIZE, get_tokenizer
from serve.api import constraints, grammar, toolcalls
from serve.api.protocol import ApiError
from serve.slots import sampling

V = get_config("tiny").vocab_size
W = -(-V // 32)
ENC = get_tokenizer()

BOUNDED = {  # every size bounded: a reply under it always ends
  "type": "object",
  "properties": {
    "name": {"type": "string", "maxLength": 12},
    "kind": {"enum": ["person", "place", "thing"]},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    "ok": {"type": "boolean"},
    "where": {
      "type": "object",
      "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
      "required": ["zip"],
      "additionalProperties": False,
    },
  },
  "required": ["name", "kind", "age", "tags", "ok", "where"],
  "additionalProperties": False,
}
ADD = grammar.Tool(
  "add",
  {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99}, "b": {"enum": [1, 2, 3]}},
    "required": ["a", "b"],
    "additionalProperties": False,
  },
  strict=True,
)
ECHO = grammar.Tool(
  "echo",
  {
    "type": "object",
    "properties": {"text": {"type": "string", "maxLength": 8}},
    "required": ["text"],
    "additionalProperties": False,
  },
  strict=True,
)


def valid(v, s) -> bool:
  """The JSON-schema subset above: type, enum, properties/required/additionalProperties, items/maxItems,
  maxLength, pattern, minimum/maximum."""
  if "enum" in s:
    return v in s["enum"]
  t = s.get("type")
  if t == "object":
    props = s.get("properties", {})
    return (
      isinstance(v, dict)
      and all(k in v for k in s.get("required", []))
      and (s.get("additionalProperties", True) is not False or set(v) <= set(props))
      and all(valid(v[k], props[k]) for k in v if k in props)
    )
  if t == "array":
    return (
      isinstance(v, list) and len(v) <= s.get("maxItems", len(v)) and all(valid(x, s["items"]) for x in v)
    )
  if t == "string":
    return (
      isinstance(v, str)
      and len(v) <= s.get("maxLength", len(v))
      and ("pattern" not in s or re.search(s["pattern"], v) is not None)
    )
  if t == "integer":
    return isinstance(v, int) and not isinstance(v, bool) and s.get("minimum", v) <= v <= s.get("maximum", v)
  if t == "boolean":
    return isinstance(v, bool)
  raise AssertionError(f"schema {s} is outside the subset")


def allowed(row) -> set:
  return set(np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")).tolist())


def walk(m, ids) -> list:
  """Fill and advance along ids; each position's allowed set."""
  row, sets = np.zeros(W, np.int32), []
  for t in ids:
    m.fill(row)
    sets.append(allowed(row))
    assert t in sets[-1], f"token {t} ({ENC.decode([t])!r}) masked out after {len(sets) - 1} tokens"
    assert m.advance([t]) == 1
  return sets


COMPILER = grammar.Compiler()


def compiled(c: grammar.Constraint) -> grammar.Grammar:
  return COMPILER.compile_now(c)


def test_a_valid_document_walks_through_and_the_grammar_ends_it():
  doc = {
    "name": "Ada",
    "kind": "person",
    "age": 36,
    "tags": ["a", "bc"],
    "ok": True,
    "where": {"zip": "12345"},
  }
  m = compiled(grammar.Constraint("json_schema", schema=BOUNDED, strict=True)).matcher()
  sets = walk(m, ENC.encode(json.dumps(doc)))
  assert all(max(s) < VOCAB_SIZE for s in sets) and EOS_ID not in sets[0]
  assert m.done and m.error is None
  row = np.full(W, -1, np.int32)
  m.fill(row)
  assert allowed(row) == {m.stop_id}  # ended: only the end token (the padded ids never)


def test_masks_refuse_what_breaks_the_schema_and_rollback_undoes_advances():
  m = compiled(grammar.Constraint("json_schema", schema=BOUNDED, strict=True)).matcher()
  head = ENC.encode('{"name": "Ada", "kind": "')
  walk(m, head)
  row = np.zeros(W, np.int32)
  m.fill(row)
  at_kind = allowed(row)
  assert ENC.encode("person")[0] in at_kind and ENC.encode("zebra")[0] not in at_kind
  assert m.advance(ENC.encode("zebra")) == 0  # refused, and the matcher is where it was
  assert m.advance(ENC.encode("pers")) == len(ENC.encode("pers"))
  m.rollback(len(ENC.encode("pers")))
  m.fill(row)
  assert allowed(row) == at_kind
  m2 = compiled(grammar.Constraint("json_object")).matcher()
  sets = walk(m2, ENC.encode('{"a": [1, {"b": null}], "c": "d"}'))
  assert ENC.encode("[")[0] not in sets[0]  # json_object: an object, not any value
  assert m2.done


def test_tool_calls_auto_required_and_named():
  two = toolcalls.calls_text([("add", '{"a": 1, "b": 2}'), ("echo", '{"text": "hi"}')])
  auto = compiled(grammar.Constraint("tools", tools=(ADD, ECHO), choice="auto")).matcher()
  free = walk(auto, ENC.encode(" Let me add those up."))
  assert all(len(s) > 50_000 for s in free)  # free text stays free until a call starts
  walk(auto, ENC.encode(" " + two))
  row = np.zeros(W, np.int32)
  auto.fill(row)
  assert allowed(row) == {ENC.encode("\n")[0], EOS_ID}  # another call, or the end
  required = compiled(grammar.Constraint("tools", tools=(ADD, ECHO), choice="required", lead=" ")).matcher()
  walk(required, ENC.encode(" " + two))
  single = compiled(grammar.Constraint("tools", tools=(ADD, ECHO), choice="echo", parallel=False)).matcher()
  sets = walk(single, ENC.encode(toolcalls.call_text("echo", '{"text": "hi"}')))
  assert single.done
  name_at = len(ENC.encode(toolcalls.OPEN + '\n{"name": "'))
  assert all(len(s) == 1 for s in sets[:name_at])  # the format and the only name are forced


@functools.cache
def _sampler():
  return jax.jit(functools.partial(sampling.sample, valid_vocab=VOCAB_SIZE))


def test_random_logits_under_the_masks_always_give_valid_output():
  """The engine's loop on the host: fill each row's mask, sample random logits under it, advance by the
  token, until the grammar ends; then every reply parses and validates (the grammar alone guarantees it)."""
  cases = [(grammar.Constraint("json_schema", schema=BOUNDED, strict=True), BOUNDED)] * 4
  cases += [(grammar.Constraint("tools", tools=(ADD, ECHO), choice="required", parallel=True), None)] * 2
  cases += [(grammar.Constraint("tools", tools=(ADD, ECHO), choice="add", parallel=False), None)] * 2
  S = len(cases)
  ms = [compiled(c).matcher() for c, _ in cases]
  out: list[list[int]] = [[] for _ in range(S)]
  rng = np.random.default_rng(0)
  temperature = jnp.asarray([0.0, 1.0] * (S // 2), jnp.float32)  # greedy and sampled rows
  rows = np.zeros((S, W), np.int32)
  for step in range(400):
    live = [i for i in range(S) if not ms[i].done]
    if not live:
      break
    for i in range(S):
      ms[i].fill(rows[i])
    logits = rng.normal(0, 4, (S, V)).astype(np.float32)
    tok = np.asarray(
      _sampler()(
        jnp.asarray(logits),
        temperature,
        jnp.zeros(S, jnp.int32),
        jnp.ones(S, jnp.float32),
        jnp.arange(S, dtype=jnp.uint32),
        jnp.full(S, step, jnp.int32),
        allowed_SxG=jnp.asarray(rows),
      )
    )
    for i in live:
      assert ms[i].advance([int(tok[i])]) == 1
      out[i].append(int(tok[i]))
  assert all(m.done for m in ms), "a bounded grammar did not end in 400 tokens"
  for (c, schema), ids in zip(cases, out):
    text = ENC.decode(ids[:-1] if ids[-1] == EOS_ID else ids)  # the end token is a stop id, not text
    if schema is not None:
      assert valid(json.loads(text), schema), text
      continue
    content, calls = toolcalls.parse(text)
    assert content == "" and calls and (c.parallel or len(calls) == 1), text
    for call in calls:
      tool = {t.name: t for t in c.tools}[call.name]
      assert c.choice in ("required", call.name) and valid(json.loads(call.arguments), tool.parameters), text


def test_limits_and_refusals_are_400s_naming_them():
  lim = grammar.GrammarLimits(max_schema_bytes=2000, max_schema_depth=6, max_tools=3)

  def refused(fn, *words):
    with pytest.raises(ApiError) as e:
      fn()
    assert e.value.status == 400 and all(w in e.value.message for w in words), e.value.message
    return e.value

  fmt = lambda schema: {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
  big = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(100)}}
  refused(lambda: constraints.json_format(fmt(big), "response_format", False, lim), "schema bytes")
  deep: dict = {"type": "string"}
  for _ in range(4):
    deep = {"type": "object", "properties": {"x": deep}}
  refused(lambda: constraints.json_format(fmt(deep), "response_format", False, lim), "nesting depth")
  tools = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(4)]
  refused(lambda: constraints.tools({"tools": tools}, False, lim), "tools per request")
  refused(lambda: constraints.tools({"tools": tools[:1], "tool_choice": "g"}, False, lim), "tool_choice")
  named = {"type": "function", "function": {"name": "zz"}}
  e = refused(lambda: constraints.tools({"tools": tools[:1], "tool_choice": named}, False, lim), "'zz'")
  assert e.param == "tool_choice"
  # the library's own refusal, with its reason
  bad = grammar.Constraint("json_schema", schema={"type": "object", "properties": {"x": {"type": "wat"}}})
  refused(lambda: grammar.Compiler().compile_now(bad, param="response_format"), "refused", "wat")
  flat = constraints.tools(
    {
      "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
      "tool_choice": "required",
    },
    True,
    lim,
  )[0]
  assert flat is not None and flat.choice == "required" and flat.tools[0].name == "f"


def test_compiles_are_cached_per_tenant_and_bounded_in_time():
  comp = grammar.Compiler(grammar.GrammarLimits(cache_entries=2))
  c = grammar.Constraint("json_schema", schema=BOUNDED, strict=True)

  async def go():
    a = await comp.compile(c, ("alice", None))
    assert (
      await comp.compile(
        grammar.Constraint("json_schema", schema=dict(BOUNDED), strict=True), ("alice", None)
      )
      is a
    )
    b = await comp.compile(c, ("bob", None))
    assert b is not a  # another tenant never gets alice's grammar
    await comp.compile(grammar.Constraint("json_object"), ("bob", None))
    assert comp.cached(("alice", None), c) is None  # LRU: the oldest left
    slow = grammar.Compiler(grammar.GrammarLimits(compile_seconds=0))
    with pytest.raises(ApiError) as e:
      await slow.compile(grammar.Constraint("json_object"), ("alice", None), "response_format")
    assert e.value.status == 400 and "grammar compile time" in e.value.message
    slow.close()

  asyncio.run(go())
  assert comp.stats.hits == 1 and comp.stats.misses == 3
  comp.close()
