"""serve.api.responses over loopback: OpenAI's Responses API as a peer of chat (the same reply as the chat
completion of the same messages), continuations that prefill only the new turn after the previous response's
exact ids (tokens equal to the engine's over the same ids), streamed events in OpenAI's order, stored
responses kept per key and within a budget, refused fields, and stored responses that survive a restart
(serve.api.response_store's files, beside a state cache in the same directory)."""

import array
import asyncio
import json
import os
import stat

import aiohttp
import numpy as np
import pytest
from helpers import serve_fixtures as sf
from helpers.fake_slots import reference
from helpers.serve_fixtures import AUTH, GPT2_VOCAB, KEY, call

from laplace_jax import sharding
from serve.api import chat, protocol, response_store, responses
from serve.api.response_store import Record, ResponseStore
from serve.api.tenants import Tenants, name_of_key
from serve.engine import state_cache
from serve.engine.state_cache import StateCache

OTHER = {"Authorization": "Bearer other-key"}
KEY_TENANT = name_of_key(KEY)  # the tenant of a bare api_key


@pytest.fixture(scope="module")
def tok():
  return sf.gpt2_tokenizer()


@pytest.fixture(scope="module")
def served(tok):
  """The fake engine (no state cache: every prompt is prefilled whole, so tokens equal fake_slots.reference)
  behind two keys; at most 3 stored responses per key."""
  engine = sf.fake_engine(n_slots=4, prefill_batch=2, max_queue=4)
  tenants = Tenants([("a", KEY), ("b", "other-key")])
  lim = sf.limits(tok, engine, max_tokens=64, max_prompt_tokens=2000, max_prompts=8)
  with sf.serving(engine, tok, lim, tenants=tenants, response_store=ResponseStore(3)) as served:
    yield served


def _create(url, headers=AUTH, **body):
  return call(
    url, path="/v1/responses", body={"temperature": 0, "max_output_tokens": 8, **body}, headers=headers
  )


def _events(url, body, headers=AUTH):
  """A streamed /v1/responses: [(event name, data)]."""

  async def go():
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
      async with s.post(url + "/v1/responses", json=body, headers=headers) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        text = await r.text()
    out = []
    for block in filter(None, text.split("\n\n")):
      name, data = block.split("\n")
      assert name.startswith("event: ") and data.startswith("data: "), block
      out.append((name[len("event: ") :], json.loads(data[len("data: ") :])))
    return out

  return asyncio.run(go())


def test_a_response_is_the_chat_completion_of_the_same_messages(served):
  url, _ = served
  msgs = [{"role": "user", "content": "Hello there"}]
  st, ref = call(
    url,
    path="/v1/chat/completions",
    body={"messages": [{"role": "system", "content": "Be brief."}, *msgs], "max_tokens": 8, "temperature": 0},
  )
  assert st == 200, ref
  st, out = _create(url, input="Hello there", instructions="Be brief.", metadata={"k": "v"})
  assert st == 200, out
  assert out["id"].startswith("resp_") and out["object"] == "response"
  assert out["status"] == "incomplete" and out["incomplete_details"] == {"reason": "max_output_tokens"}
  (msg,) = out["output"]
  assert msg["type"] == "message" and msg["role"] == "assistant" and msg["id"].startswith("msg_")
  assert msg["content"] == [
    {
      "type": "output_text",
      "text": ref["choices"][0]["message"]["content"],
      "annotations": [],
      "logprobs": [],
    }
  ]
  u = ref["usage"]
  assert out["usage"] == {
    "input_tokens": u["prompt_tokens"],
    "input_tokens_details": {"cached_tokens": 0},
    "output_tokens": u["completion_tokens"],
    "output_tokens_details": {"reasoning_tokens": 0},
    "total_tokens": u["total_tokens"],
  }
  assert (out["instructions"], out["metadata"], out["store"], out["max_output_tokens"]) == (
    "Be brief.",
    {"k": "v"},
    True,
    8,
  )
  # The same input as message items, with parts and "type": "message"
  items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello there"}]}]
  st, again = _create(url, input=items, instructions="Be brief.")
  assert st == 200 and again["output"][0]["content"] == msg["content"], again


def test_a_continuation_prefills_only_the_new_turn_after_the_exact_ids(served, tok):
  url, server = served
  store = server.response_store
  st, first = _create(url, input="Hi", instructions="Terse.")
  assert st == 200, first
  rec1 = store.get("a", first["id"])
  prompt1 = tok.encode("System: Terse.\n\nUser: Hi\n\nAssistant:")
  assert rec1.ids.tolist() == prompt1 + reference(prompt1, 8, GPT2_VOCAB)
  turns = [
    ({"instructions": "Terse."}, "\n\nUser: And then?\n\nAssistant:"),  # the same instructions: not repeated
    ({}, "\n\nUser: And then?\n\nAssistant:"),
    ({"instructions": "Verbose."}, "\n\nSystem: Verbose.\n\nUser: And then?\n\nAssistant:"),
  ]
  for extra, delta in turns:
    st, nxt = _create(url, input="And then?", previous_response_id=first["id"], **extra)
    assert st == 200, nxt
    assert nxt["previous_response_id"] == first["id"]
    prompt2 = rec1.ids.tolist() + tok.encode(delta)
    assert nxt["usage"]["input_tokens"] == len(prompt2)
    want = reference(prompt2, 8, GPT2_VOCAB)  # the engine's tokens over the same full ids
    assert store.get("a", nxt["id"]).ids.tolist() == prompt2 + want
    assert nxt["output"][0]["content"][0]["text"] == tok.token_bytes(want).decode("utf-8", "replace")
  # GET answers the stored object; DELETE removes it, then GET and a continuation answer 404.
  st, got = call(url, "GET", f"/v1/responses/{nxt['id']}")
  assert st == 200 and got == nxt
  st, gone = call(url, "DELETE", f"/v1/responses/{nxt['id']}")
  assert st == 200 and gone == {"id": nxt["id"], "object": "response.deleted", "deleted": True}
  assert call(url, "GET", f"/v1/responses/{nxt['id']}")[0] == 404
  assert call(url, "DELETE", f"/v1/responses/{nxt['id']}")[0] == 404
  st, err = _create(url, input="x", previous_response_id=nxt["id"])
  assert st == 404 and err["error"]["param"] == "previous_response_id", err


def test_a_reply_ended_by_a_stop_id_is_continued_without_it(tok):
  """The stored ids are the prompt and the reply's kept tokens: a stop id (EOS here) is not one of them."""
  prompt = tok.encode("User: Hi\n\nAssistant:")
  ref = reference(prompt, 8, GPT2_VOCAB)
  eos = next(t for i, t in enumerate(ref) if i >= 3 and t not in ref[:i])
  engine = sf.fake_engine(n_slots=2, prefill_batch=2)
  with sf.serving(engine, tok, sf.limits(tok, engine, eos_id=eos), api_key=KEY) as (url, server):
    st, first = _create(url, input="Hi")
    assert st == 200 and first["status"] == "completed" and first["incomplete_details"] is None, first
    kept = ref[: ref.index(eos)]
    assert first["usage"]["output_tokens"] == len(kept) + 1  # the stop id is counted, as chat counts it
    assert server.response_store.get(KEY_TENANT, first["id"]).ids.tolist() == prompt + kept
    st, nxt = _create(url, input="Go on", previous_response_id=first["id"])
    assert st == 200 and nxt["usage"]["input_tokens"] == len(
      prompt + kept + tok.encode("\n\nUser: Go on\n\nAssistant:")
    )


def test_keys_are_kept_apart_and_store_false_and_the_budget_drop_cleanly(served):
  url, _ = served
  st, mine = _create(url, input="Mine")
  assert st == 200, mine
  st, unknown = call(url, "GET", "/v1/responses/resp_" + "0" * 32)
  assert st == 404 and "--max_stored_responses" in unknown["error"]["message"]
  rid = mine["id"]
  for method in ("GET", "DELETE"):  # another key's id answers exactly as an unknown one
    st, err = call(url, method, f"/v1/responses/{rid}", headers=OTHER)
    assert (st, err["error"]["message"]) == (
      404,
      unknown["error"]["message"].replace("resp_" + "0" * 32, rid),
    )
  st, err = _create(url, headers=OTHER, input="x", previous_response_id=rid)
  assert st == 404, err
  st, off = _create(url, input="Not kept", store=False)
  assert st == 200 and off["store"] is False
  assert call(url, "GET", f"/v1/responses/{off['id']}")[0] == 404
  # A budget of 3 per key: three more responses drop `mine`, the oldest; the other key's are its own.
  st, theirs = _create(url, headers=OTHER, input="Theirs")
  for i in range(3):
    assert _create(url, input=f"more {i}")[0] == 200
  st, err = _create(url, input="late", previous_response_id=rid)
  assert st == 404 and "budget of 3" in err["error"]["message"], err
  assert call(url, "GET", f"/v1/responses/{theirs['id']}", headers=OTHER)[0] == 200


def test_streamed_events_follow_openai_and_add_up_to_the_response(served):
  url, _ = served
  events = _events(url, {"input": "Tell me", "temperature": 0, "max_output_tokens": 10, "stream": True})
  names = [n for n, _ in events]
  assert names[:4] == [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
  ]
  assert names[-4:] == [
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
    "response.incomplete",
  ]
  assert set(names[4:-4]) == {"response.output_text.delta"}
  assert [d["type"] for _, d in events] == names
  assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
  final = events[-1][1]["response"]
  text = "".join(d["delta"] for n, d in events if n == "response.output_text.delta")
  assert text == final["output"][0]["content"][0]["text"] == events[-4][1]["text"]
  assert events[0][1]["response"]["status"] == "in_progress" and events[0][1]["response"]["id"] == final["id"]
  st, got = call(url, "GET", f"/v1/responses/{final['id']}")
  assert st == 200 and got == final
  st, whole = _create(url, input="Tell me", max_output_tokens=10)
  assert whole["output"][0]["content"] == final["output"][0]["content"]


@pytest.mark.parametrize(
  "field,value",
  [
    ("tools", [{"type": "web_search"}]),
    ("tools", [{"type": "function", "function": {"name": "f"}}]),  # chat's nested shape
    ("tool_choice", "required"),
    ("text", {"format": {"type": "json_schema", "schema": {}}}),
    ("text", {"verbosity": "high"}),
    ("reasoning", {"effort": "high"}),
    ("include", ["message.output_text.logprobs"]),
    ("background", True),
    ("conversation", "conv_1"),
    ("prompt", {"id": "pmpt_1"}),
    ("truncation", "middle"),
    ("top_logprobs", 3),
    ("seed", 1),
    ("max_output_tokens", 65),
    ("metadata", {"k": 1}),
    ("previous_response_id", 7),
    ("input", [{"type": "function_call_output", "call_id": "c", "output": 5}]),
    ("input", [{"type": "function_call", "call_id": "c", "name": "f"}]),
    ("input", [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]),
    ("input", [{"role": "tool", "content": "x"}]),
    ("input", ""),
  ],
)
def test_fields_not_served_are_refused_by_name(served, field, value):
  url, _ = served
  body = {"input": "hi", field: value}
  st, err = call(url, path="/v1/responses", body=body)
  assert st == 400 and err["error"]["param"] == field, err


def test_accepted_fields_that_change_nothing(served):
  url, _ = served
  st, out = _create(
    url,
    input="hi",
    tools=[],
    tool_choice="auto",
    text={"format": {"type": "text"}},
    truncation="auto",
    reasoning={},
    user="u1",
    parallel_tool_calls=False,
    service_tier="auto",
    prompt_cache_key="k",
  )
  assert st == 200 and out["user"] == "u1" and out["parallel_tool_calls"] is False, out


def test_a_template_that_renders_history_differently_falls_back_to_the_whole_conversation(tok, caplog):
  """A template whose earlier turns change once more follow: the continuation is the whole conversation
  rendered and tokenized again (logged), not the previous ids plus a difference that is not one."""
  template = chat.ChatTemplate(
    "{% for m in messages %}{% if loop.last %}Last {% endif %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}",
    tok,
  )
  lim = protocol.Limits(model_name="m", vocab_size=tok.vocab_size, eos_id=tok.eos_id, max_stop_ids=4)
  store = ResponseStore()
  msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": " Hello"}]
  prev = Record("resp_" + "1" * 32, "", 0, array.array("i", [1, 2, 3]), msgs, None, {})
  store.put(prev)
  c, turn = responses.parse_request(
    {"input": "Bye", "previous_response_id": prev.id}, lim, template, store, ""
  )
  assert turn.messages == [*msgs, {"role": "user", "content": "Bye"}]
  assert c.prompt_ids == tok.encode("user: Hi\nassistant:  Hello\nLast user: Bye\n")
  assert "rendered and tokenized whole" in caplog.text


def test_stored_responses_survive_a_restart_beside_the_state_cache(tmp_path, caplog):
  """Files: private, reloaded oldest-first within the budget; damaged and planted files skipped; the state
  cache still opens its directory with the responses/ directory inside it."""
  d = str(tmp_path / "states")
  StateCache("m", 1 << 20, directory=d)
  sub = os.path.join(d, response_store.SUBDIR)
  store = ResponseStore(2, sub)
  recs = [
    Record(f"resp_{i:032x}", t, 100 + i, array.array("i", [i, 2]), [], None, {"id": i})
    for i, t in enumerate(["a", "a", "b", "a"])
  ]
  for r in recs:
    store.put(r)
  assert sorted(os.listdir(sub)) == [f"{r.id}.json" for r in recs[1:]]  # a's oldest dropped with its file
  assert stat.S_IMODE(os.stat(sub).st_mode) == 0o700
  assert all(stat.S_IMODE(os.stat(os.path.join(sub, n)).st_mode) == 0o600 for n in os.listdir(sub))
  (tmp_path / "states" / "responses" / f"resp_{9:032x}.json").write_text("{not json")
  (tmp_path / "states" / "responses" / f"resp_{8:032x}.json").write_text(recs[1].to_json().decode())
  (tmp_path / "states" / "responses" / f"resp_{7:032x}.json.tmp-1-2").write_text("partial")
  os.mkfifo(sub + f"/resp_{6:032x}.json")
  StateCache("m", 1 << 20, directory=d)  # the state cache still opens its directory
  again = ResponseStore(2, sub)
  assert again.stats.files_skipped == 3 and "skipping" in caplog.text
  assert [again.get("a", r.id) for r in recs] == [None, recs[1], None, recs[3]]
  assert again.get("b", recs[2].id) == recs[2] and again.get("a", recs[2].id) is None
  assert not any(".tmp-" in n for n in os.listdir(sub))
  assert ResponseStore(1, sub).get("a", recs[1].id) is None  # a smaller budget: the oldest go at start
  assert sorted(os.listdir(sub)) == sorted(f"resp_{i:032x}.json" for i in (2, 3, 6, 8, 9))


@pytest.mark.slow
def test_a_continuation_resumes_from_the_state_and_after_a_restart(tmp_path, tok):
  """The compiled tiny model with a state cache in a directory: a continuation restores the state the
  previous response ended with (cached_tokens covers its ids but at most the last) and gives the tokens of a
  full prefill of the same ids (the same server's completion under a cache_salt no state was stored for: a
  scope that misses, as with no cache); after a restart of the engine and server over the same directory the
  same continuation gives the same tokens."""
  cfg, params = sf.tiny(3)
  ident = state_cache.model_identity(cfg, params)
  make = sf.reused_slots()
  d = str(tmp_path / "states")
  # test_serve_state_cache's engine: within one run of the suite its programs come from the compile cache.
  mesh = sharding.make_mesh(data=1, fsdp=8)
  kw = dict(n_slots=8, prefill_batch=2, snapshot_every=2, cache_min_tokens=16, make_slots=make, mesh=mesh)

  def serve():
    eng = sf.engine(params, cfg, state_cache=StateCache(ident, 1 << 30, d), **kw)
    store = ResponseStore(10, os.path.join(d, response_store.SUBDIR))
    return sf.serving(eng, tok, sf.limits(tok, eng, max_tokens=64), api_key=KEY, response_store=store)

  words = " ".join(np.random.default_rng(0).choice(["alpha", "beta", "gamma", "delta"], 60))
  with serve() as (url, server):
    st, first = _create(url, input=words, max_output_tokens=12)
    assert st == 200 and first["status"] == "incomplete", first
    ids1 = server.response_store.get(KEY_TENANT, first["id"]).ids.tolist()
    st, second = _create(url, input="More.", previous_response_id=first["id"], max_output_tokens=12)
    assert st == 200, second
    ids2 = server.response_store.get(KEY_TENANT, second["id"]).ids.tolist()
    prompt2 = ids1 + tok.encode("\n\nUser: More.\n\nAssistant:")
    st, ref = call(
      url,
      body={
        "prompt": prompt2,
        "max_tokens": 12,
        "temperature": 0,
        "stop": ["\n\nUser:"],
        "cache_salt": "reference",
        "return_token_ids": True,
      },
    )
    assert st == 200 and ref["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, ref
  assert second["usage"]["input_tokens_details"]["cached_tokens"] >= len(ids1) - 1
  assert ids2 == prompt2 + ref["choices"][0]["token_ids"]
  with serve() as (url, server):
    st, again = _create(url, input="More.", previous_response_id=first["id"], max_output_tokens=12)
    assert st == 200 and again["output"][0]["content"] == second["output"][0]["content"], again
    assert again["usage"] == second["usage"]
    assert call(url, "GET", f"/v1/responses/{second['id']}") == (200, second)
