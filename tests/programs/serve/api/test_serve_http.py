"""serve.api.server over loopback: completions with and without streaming, stop strings, auth, 4xx for
malformed input (and the server keeps serving), 429 past the queue, disconnects free their slots."""

import asyncio
import json
import time

import aiohttp
import pytest
from helpers import serve_fixtures as sf
from helpers.serve_fixtures import AUTH, KEY, call

from serve.api import protocol
from serve.api.server import Server


@pytest.fixture(scope="module")
def tok():
  return sf.gpt2_tokenizer()


@pytest.fixture(scope="module")
def served(tok):
  """A tiny model behind the server: 4 slots, a queue of 2, max_tokens <= 64, an API key."""
  engine = sf.fake_engine(n_slots=4, prefill_batch=2, max_queue=2, step_s=0.005)
  with sf.serving(
    engine, tok, sf.limits(tok, engine, max_tokens=64, max_prompt_tokens=1000, max_prompts=4 + 2), api_key=KEY
  ) as served:
    yield served


def test_round_trip_text_and_ids(served, tok):
  url, _ = served
  st, a = call(
    url,
    body={
      "model": "laplace-tiny",
      "prompt": "Hello world",
      "max_tokens": 12,
      "temperature": 0,
      "return_token_ids": True,
      "ignore_eos": True,
    },
  )
  assert st == 200, a
  ch = a["choices"][0]
  assert ch["finish_reason"] == "length" and len(ch["token_ids"]) == 12
  assert ch["text"] == tok.token_bytes(ch["token_ids"]).decode("utf-8", "replace")
  assert a["usage"] == {
    "prompt_tokens": 2,
    "completion_tokens": 12,
    "total_tokens": 14,
    "prompt_tokens_details": {"cached_tokens": 0},
  }
  st, b = call(
    url,
    body={
      "prompt": [15496, 995],
      "max_tokens": 12,
      "temperature": 0,
      "ignore_eos": True,
      "return_token_ids": True,
    },
  )
  assert st == 200 and b["choices"][0]["token_ids"] == ch["token_ids"]


def test_streaming_matches_non_streaming(served):
  url, _ = served
  body = {
    "prompt": "The King James Bible",
    "max_tokens": 20,
    "temperature": 0.8,
    "top_k": 50,
    "seed": 11,
    "ignore_eos": True,
  }
  st, whole = call(url, body=body)
  assert st == 200
  st, events = call(url, body={**body, "stream": True, "stream_options": {"include_usage": True}})
  assert st == 200 and events[-1] == "[DONE]"
  chunks = [json.loads(e) for e in events[:-1]]
  usage = chunks[-1]
  assert usage["choices"] == [] and usage["usage"] == whole["usage"]
  text = "".join(c["choices"][0]["text"] for c in chunks[:-1])
  assert text == whole["choices"][0]["text"]
  assert chunks[-2]["choices"][0]["finish_reason"] == "length"
  assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-2])


def test_stop_string_cuts_the_text(served):
  url, _ = served
  body = {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
  full = call(url, body=body)[1]["choices"][0]["text"]
  stop = full[len(full) // 2 : len(full) // 2 + 3]
  cut = full[: full.index(stop)]
  for stream in (False, True):
    st, out = call(url, body={**body, "stop": [stop], "stream": stream})
    assert st == 200
    if stream:
      chunks = [json.loads(e)["choices"][0] for e in out[:-1]]
      text, reason = "".join(c["text"] for c in chunks), chunks[-1]["finish_reason"]
    else:
      text, reason = out["choices"][0]["text"], out["choices"][0]["finish_reason"]
    assert (text, reason) == (cut, "stop")


def test_models_health_metrics_and_auth(served):
  url, _ = served
  st, m = call(url, "GET", "/v1/models")
  assert st == 200 and m["data"][0]["id"] == "laplace-tiny"
  assert call(url, "GET", "/health", headers={})[0] == 200
  assert call(url, "GET", "/metrics", headers={})[0] == 401  # with keys, /metrics needs one too
  st, text = call(url, "GET", "/metrics")
  assert st == 200
  for name in ("tokens_per_second", "active_slots", "queue_depth", "generated_tokens_total"):
    assert f"\nlaplace_serve_{name} " in text
  st, err = call(url, body={"prompt": "hi"}, headers={})
  assert st == 401 and "API key" in err["error"]["message"]
  st, err = call(url, body={"prompt": "hi"}, headers={"Authorization": "Bearer wrong"})
  assert st == 401


@pytest.mark.parametrize(
  "body, status, param",
  [
    (None, 400, None),  # malformed JSON (raw below)
    ([1, 2], 400, None),  # not an object
    ({}, 400, "prompt"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": 5}, 400, "prompt"),
    ({"prompt": ["a", 1]}, 400, "prompt"),
    ({"prompt": ["a"] * 7}, 400, "prompt"),  # more prompts than slots + queue
    ({"prompt": ["a", "b"], "n": 4}, 400, "n"),
    ({"prompt": [1, 50257]}, 400, "prompt"),
    ({"prompt": [1, -1]}, 400, "prompt"),
    ({"prompt": [1] * 1001}, 400, "prompt"),  # over max_prompt_tokens
    ({"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 65}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 2.5}, 400, "max_tokens"),
    ({"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ({"prompt": "hi", "top_k": True}, 400, "top_k"),
    ({"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"prompt": "hi", "stop": 3}, 400, "stop"),
    ({"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ({"prompt": "hi", "n": 7}, 400, "n"),
    ({"prompt": "hi", "n": 5}, 400, None),  # more choices than the 4 slots
    ({"prompt": "hi", "logprobs": 6}, 400, "logprobs"),
    ({"prompt": "hi", "logprobs": True}, 400, "logprobs"),
    ({"prompt": "hi", "echo": 1}, 400, "echo"),
    ({"prompt": "hi", "seed": 2**64}, 400, "seed"),
    ({"prompt": "hi", "best_of": 3}, 400, "best_of"),
    ({"prompt": "hi", "model": "gpt-4"}, 404, "model"),
  ],
)
def test_malformed_requests_get_4xx_and_the_server_keeps_serving(served, body, status, param):
  url, _ = served
  st, err = call(url, body=body, raw="{not json" if body is None else None)
  assert st == status, err
  assert err["error"]["param"] == param and err["error"]["message"]
  assert call(url, body={"prompt": "still there?", "max_tokens": 2})[0] == 200


def test_wrong_method_and_route(served):
  url, _ = served
  assert call(url, "GET", "/v1/completions")[0] == 405
  assert call(url, "GET", "/v2/nothing")[0] == 404


def test_full_queue_gives_429_and_disconnects_free_slots(served):
  url, server = served
  engine = server.engine

  async def go():
    async with aiohttp.ClientSession() as s:
      body = {"prompt": "Long story:", "max_tokens": 64, "stream": True, "ignore_eos": True}
      opened = [await s.post(url + "/v1/completions", json=body, headers=AUTH) for _ in range(6)]
      assert [r.status for r in opened] == [200] * 6  # 4 slots + 2 queued
      r = await s.post(url + "/v1/completions", json=body, headers=AUTH)
      assert r.status == 429 and r.headers["Retry-After"] == "1"
      await r.release()
      for r in opened[:4]:
        await r.content.readuntil(b"\n\n")  # decoding has started
      for r in opened:
        r.close()  # the client goes away mid-stream

  asyncio.run(go())
  deadline = time.time() + 20
  while time.time() < deadline and (engine.active_slots or engine.queue_depth):
    time.sleep(0.05)
  assert engine.active_slots == 0 and engine.queue_depth == 0
  assert call(url, body={"prompt": "after", "max_tokens": 3})[0] == 200


def test_merged_delivery_counts_tokens_only_up_to_the_stop_string(tok):
  """Every step's delivery queued before the handler runs (as under load): the handler sees one merged
  batch and must still stop counting at the token that completes the stop string."""
  ids = tok.encode(" alpha beta gamma delta epsilon zeta eta theta")
  stop = " gam"
  first = next(i for i in range(len(ids)) if stop in tok.token_bytes(ids[: i + 1]).decode())
  assert first + 1 < len(ids)

  class StubEngine:
    cancelled = []

    def cancel(self, req, keep=None):
      self.cancelled.append(req)

    def keep_state(self, ids, tenant="", cache_salt=None):
      pass

  limits = protocol.Limits(
    model_name="m",
    vocab_size=tok.vocab_size,
    eos_id=tok.eos_id,
    max_tokens=64,
    max_prompt_tokens=100,
    max_stop_ids=8,
  )
  server = Server(StubEngine(), tok, limits)
  c = protocol.parse_completion(
    {"prompt": [1], "max_tokens": len(ids), "stop": stop, "ignore_eos": True}, limits, tok.encode
  )

  from serve.api.completions import Choice
  from serve.api.text import TextStream

  async def go():
    ch = Choice(0, 0, asyncio.Queue())
    ch.req, ch.text = _req(), TextStream(tok.token_bytes, c.stop)
    for i, t in enumerate(ids):
      ch.put_nowait(([t], "length" if i == len(ids) - 1 else None))
    resp = await server._whole([ch], c, {})
    return json.loads(resp.text), ch.req

  out, req = asyncio.run(go())
  assert out["usage"]["completion_tokens"] == first + 1
  assert out["choices"][0]["text"] == tok.token_bytes(ids[: first + 1]).decode().split(stop)[0]
  assert out["choices"][0]["finish_reason"] == "stop" and StubEngine.cancelled == [req]


def _req():
  from serve.engine.engine import Request

  return Request(prompt_ids=[1])


def test_prompts_are_tokenized_off_the_event_loop(served, tok):
  import dataclasses as dc
  import threading

  url, server = served
  threads = []

  def encode(text):
    threads.append(threading.get_ident())
    return tok.encode(text)

  server.tok = dc.replace(tok, encode=encode)
  try:
    assert call(url, body={"prompt": "a prompt to encode", "max_tokens": 2})[0] == 200
  finally:
    server.tok = tok
  loop_thread = server.loop._thread_id if hasattr(server.loop, "_thread_id") else None
  assert threads and loop_thread is not None and loop_thread not in threads


def test_n_choices_prompt_lists_seeds_and_model_info(served):
  url, _ = served
  body = {"max_tokens": 6, "temperature": 1.0, "ignore_eos": True, "return_token_ids": True, "logprobs": 2}
  alone = [
    call(url, body={**body, "prompt": p, "seed": s})[1]["choices"][0]["token_ids"]
    for p in ("one", "two")
    for s in (2**63 + 5, 2**63 + 6)
  ]
  st, out = call(url, body={**body, "prompt": ["one", "two"], "n": 2, "seed": 2**63 + 5})
  assert st == 200, out
  assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
  assert [c["token_ids"] for c in out["choices"]] == alone
  assert all(len(c["logprobs"]["top_logprobs"][0]) == 2 for c in out["choices"])
  assert out["usage"]["completion_tokens"] == 24
  st, neg = call(url, body={**body, "prompt": "one", "seed": -(2**63) + 5})
  assert st == 200 and neg["choices"][0]["token_ids"] == alone[0]  # -2**63 + 5 is 2**63 + 5 as 64 bits
  st, events = call(url, body={**body, "prompt": ["one", "two"], "n": 2, "seed": 2**63 + 5, "stream": True})
  got = {}
  for e in events[:-1]:
    c = json.loads(e)["choices"][0]
    got.setdefault(c["index"], []).extend(c["token_ids"])
  assert [got[i] for i in range(4)] == alone
  st, m = call(url, "GET", "/v1/models/laplace-tiny")
  assert st == 200 and m["id"] == "laplace-tiny"
  st, err = call(url, "GET", "/v1/models/gpt-4")
  assert st == 404 and "laplace-tiny" in err["error"]["message"]


def test_streamed_echo_and_logprobs_match_the_whole_response(served):
  url, _ = served
  body = {
    "prompt": "Once upon a time there",
    "max_tokens": 8,
    "temperature": 0,
    "ignore_eos": True,
    "echo": True,
    "logprobs": 2,
  }
  st, whole = call(url, body=body)
  assert st == 200
  st, events = call(url, body={**body, "stream": True})
  chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
  assert "".join(c["text"] for c in chunks) == whole["choices"][0]["text"]
  want = whole["choices"][0]["logprobs"]
  for key in ("tokens", "token_logprobs", "text_offset"):
    assert sum((c["logprobs"][key] for c in chunks), []) == want[key]
  assert want["token_logprobs"][0] is None and len(want["tokens"]) == 5 + 8
