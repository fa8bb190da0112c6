"""No request can stop, freeze or flood the server: every field is bounded
before the engine sees it, a failure inside the engine fails only the requests it touches, a dead engine
answers 503 at once, stop strings cost linear time, one request cannot hold every slot or build a huge
reply, and the HTTP edge refuses what a browser page or a malformed request could send."""

import asyncio
import dataclasses
import json
import socket
import threading
import time

import aiohttp
import pytest
from helpers import serve_fixtures as sf
from helpers.serve_fixtures import AUTH, KEY, call

from serve.api.text import TextStream
from serve.engine import prefill

MAX_CHOICES = 6
MAX_REPLY = 20_000


@pytest.fixture(scope="module")
def tok():
  return sf.gpt2_tokenizer()


@pytest.fixture(scope="module")
def served(tok):
  """A tiny model behind the server: 4 slots, a queue of 4, at most 6 choices and 20,000 reply entries
  per request, an API key."""
  eng = sf.fake_engine(n_slots=4, prefill_batch=2, max_queue=4)
  lim = sf.limits(tok, eng, max_tokens=64, max_prompt_tokens=1000, max_prompts=8)
  lim.max_choices, lim.max_reply_entries = MAX_CHOICES, MAX_REPLY  # attributes: old code ignores them
  with sf.serving(eng, tok, lim, api_key=KEY) as served:
    yield served


def _still_serving(url):
  st, out = call(url, body={"prompt": "still there?", "max_tokens": 2})
  assert st == 200, out
  assert call(url, "GET", "/health", headers={})[0] == 200


# ---- finding 1: fields bounded before the engine; engine failures stay local ----


@pytest.mark.parametrize(
  "path, body, param",
  [
    ("/v1/completions", {"top_k": 2**31}, "top_k"),  # overflowed int32 inside the engine
    ("/v1/completions", {"top_k": 10**30}, "top_k"),
    ("/v1/completions", {"top_k": -2}, "top_k"),
    ("/v1/completions", {"temperature": float("nan")}, "temperature"),
    ("/v1/completions", {"temperature": float("inf")}, "temperature"),
    ("/v1/completions", {"top_p": float("nan")}, "top_p"),
    ("/v1/completions", {"min_p": 0.5}, "min_p"),  # not done here: refused, not ignored
    ("/v1/completions", {"repetition_penalty": 1.3}, "repetition_penalty"),
    ("/v1/completions", {"seed": 2**64}, "seed"),
    ("/v1/completions", {"seed": -(2**63) - 1}, "seed"),
    ("/v1/completions", {"stop_token_ids": [2**40]}, "stop_token_ids"),
    ("/v1/completions", {"ignore_eos": 0}, "ignore_eos"),
    ("/v1/completions", {"stream_options": {"include_usage": "yes"}}, "include_usage"),
    ("/v1/chat/completions", {"top_k": 2**31}, "top_k"),
    ("/v1/chat/completions", {"top_logprobs": 2**63, "logprobs": True}, "top_logprobs"),
    ("/v1/chat/completions", {"n": 2**63}, "n"),
    ("/tokenize", {"prompt": " x" * 1100}, "prompt"),  # more tokens than a request may hold
    ("/detokenize", {"tokens": [2**63]}, "tokens"),
  ],
)
def test_every_field_is_bounded_before_the_engine(served, path, body, param):
  url, _ = served
  base = (
    {"messages": [{"role": "user", "content": "hi"}]}
    if "chat" in path
    else {}
    if "tokenize" in path
    else {"prompt": "hi", "max_tokens": 2}
  )
  st, err = call(url, path=path, body={**base, **body})
  assert st == 400, err
  assert err["error"]["param"] == param and err["error"]["message"]
  _still_serving(url)


def test_a_failure_inside_the_engine_fails_only_the_requests_it_touches(served, monkeypatch):
  """A request whose insert raises (here: a planted fault on seed 4242) gets a 500 error object, or an
  error event when streaming; a request decoding meanwhile finishes untouched, and the engine serves on."""
  url, server = served
  real = prefill.host_settings

  def faulty(rows, *a, **kw):
    if any(r.seed == 4242 for r in rows):
      raise RuntimeError("planted fault")
    return real(rows, *a, **kw)

  monkeypatch.setattr(prefill, "host_settings", faulty)

  async def go():
    async with aiohttp.ClientSession() as s:
      long = {
        "prompt": "A long story:",
        "max_tokens": 64,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
        "temperature": 0,
      }
      bystander = await s.post(url + "/v1/completions", json=long, headers=AUTH)
      await bystander.content.readuntil(b"\n\n")  # it is decoding
      async with s.post(url + "/v1/completions", json={"prompt": "x", "seed": 4242}, headers=AUTH) as r:
        whole = r.status, await r.json()
      async with s.post(
        url + "/v1/completions", json={"prompt": "x", "seed": 4242, "stream": True}, headers=AUTH
      ) as r:
        events = [e for e in (await r.text()).split("\n\n") if e]
      rest = (await bystander.text()).split("\n\n")
      return whole, events, rest

  (st, err), events, rest = asyncio.run(asyncio.wait_for(go(), 60))
  assert st == 500 and err["error"]["type"] == "server_error" and "planted" not in json.dumps(err)
  assert json.loads(events[-2][len("data: ") :])["error"]["code"] == 500 and events[-1] == "data: [DONE]"
  chunks = [json.loads(e[len("data: ") :]) for e in rest if e.startswith("data: {")]
  assert chunks[-1]["choices"][0]["finish_reason"] == "length"
  assert sum(len(c["choices"][0]["token_ids"]) for c in chunks) == 63  # the first event was read above
  monkeypatch.undo()
  _still_serving(url)


def test_a_dead_engine_answers_503_at_once_and_health_shows_no_internals(served, monkeypatch):
  url, server = served
  eng = server.engine

  def broken():
    raise RuntimeError("internal detail /secret/path")

  monkeypatch.setattr(eng, "step", broken)
  deadline = time.time() + 20
  while time.time() < deadline and call(url, "GET", "/health", headers={})[0] == 200:
    time.sleep(0.1)
  try:
    st, body = call(url, "GET", "/health", headers={})
    assert st == 503 and "secret" not in json.dumps(body) and "Error" not in json.dumps(body), body
    t = time.perf_counter()
    st, err = asyncio.run(asyncio.wait_for(_post(url, {"prompt": "hi", "max_tokens": 2}), 10))
    assert st == 503 and time.perf_counter() - t < 5, err
    assert "secret" not in json.dumps(err)
  finally:
    monkeypatch.undo()
    eng.stop()
    eng.loop.error = None
    eng.start()
  _still_serving(url)


async def _post(url, body, path="/v1/completions"):
  async with aiohttp.ClientSession() as s:
    async with s.post(url + path, json=body, headers=AUTH) as r:
      return r.status, await r.json()


# ---- finding 2: stop strings bounded, matched in linear time ----


def test_a_huge_stop_string_is_refused_and_health_stays_responsive(served):
  url, _ = served

  async def go():
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
      body = {"prompt": "hi", "stop": ["\u2603" * 20000], "n": 2, "max_tokens": 64, "ignore_eos": True}
      task = asyncio.ensure_future(s.post(url + "/v1/completions", json=body, headers=AUTH))
      await asyncio.sleep(0.05)
      t = time.perf_counter()
      async with s.get(url + "/health") as h:
        health = h.status, time.perf_counter() - t
      r = await task
      return r.status, await r.json(), health

  st, err, (hst, lag) = asyncio.run(go())
  assert st == 400 and err["error"]["param"] == "stop" and "512" in err["error"]["message"], err
  assert hst == 200 and lag < 1.0


def _reference_cut(text, stops):
  """Where generation stops: at the first position where some stop string has been completed (the longest
  one completed there), cut at its start; None if none occurs."""
  for end in range(1, len(text) + 1):
    done = [s for s in stops if text[:end].endswith(s)]
    if done:
      return end - max(map(len, done))
  return None


@pytest.mark.parametrize("seed", range(40))
def test_the_incremental_stop_matcher_agrees_with_a_plain_search(seed):
  import random

  rng = random.Random(seed)
  alphabet = "ab\u2603"
  stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 4))]
  text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
  data = text.encode()
  cuts = sorted(rng.sample(range(len(data) + 1), min(len(data) + 1, rng.randint(0, 8))))
  pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)])]
  ts = TextStream(lambda chunk: bytes(chunk), stops)
  sent = ""
  for p in pieces:
    sent += ts.feed(list(p))
    if not ts.stopped:  # what is held back is the longest tail of the text that could still begin a stop
      held, so_far = ts.held, sent + ts.held
      assert held == "" or any(s.startswith(held) for s in stops)
      assert not any(s.startswith(so_far[-k:]) for s in stops for k in range(len(held) + 1, len(so_far) + 1))
  sent += ts.close()
  cut = _reference_cut(text, stops)
  assert (sent, ts.stopped) == ((text, False) if cut is None else (text[:cut], True)), (text, stops, pieces)


def _feed(stops, token: str, n: int):
  """(seconds, text sent, stream) after feeding `n` tokens that each decode to `token`."""
  ts = TextStream(lambda ids: token.encode() * len(ids), stops)
  t = time.perf_counter()
  sent = "".join(ts.feed([0]) for _ in range(n))
  return time.perf_counter() - t, sent, ts


def test_stop_matching_costs_linear_time():
  """Stop strings of 20,000 characters (past what the server accepts, to show the cost does not grow with
  their length) cost what stop strings of 5 do, on tokens that each extend and then break a partial match.
  The old matcher sliced the text for every possible overlap on every token: about 20,000² / 2 character
  copies per token, seconds for these 300 tokens. Times are compared within the run (the machine is shared)."""
  token = "\u2603" * 50 + "x"
  long, short = (["\u2603" * (k - 1) + c for c in "abcd"] for k in (20_000, 5))
  t_long = min(_feed(long, token, 300)[0] for _ in range(2))
  t_short = min(_feed(short, token, 300)[0] for _ in range(2))
  assert t_long < 3 * t_short + 0.05, (t_long, t_short)
  _, sent, ts = _feed(long, token, 300)
  assert sent == token * 300 and ts.held == "" and not ts.stopped
  _, sent, ts = _feed(long, "\u2603" * 100, 300)  # a partial match is held back
  assert sent == "\u2603" * (30_000 - 19_999) and len(ts.held) == 19_999
  assert sent + ts.close() == "\u2603" * 30_000 and ts.held == "" and not ts.stopped


# ---- finding 4: one request cannot take the whole server or blow up its reply ----


def test_choices_per_request_are_capped(served):
  url, _ = served
  st, err = call(url, body={"prompt": ["a", "b"], "n": 4, "max_tokens": 2})  # 8: fits the slots + queue
  assert st == 400 and err["error"]["param"] == "n" and "--max_choices" in err["error"]["message"], err
  st, err = call(url, body={"prompt": ["a"] * 7, "max_tokens": 2})
  assert st == 400 and err["error"]["param"] == "prompt" and "--max_choices" in err["error"]["message"], err
  st, out = call(url, body={"prompt": ["a", "b", "c"], "n": 2, "max_tokens": 2})
  assert st == 200 and len(out["choices"]) == MAX_CHOICES


def test_a_reply_too_big_to_build_is_refused_upfront(served):
  url, _ = served
  ids = list(range(1000, 2000))
  # 6 choices x (1,000 echoed + 64 new tokens) x (1 + 1 + 5 logprobs) entries: 44,688 > 20,000.
  st, err = call(url, body={"prompt": [ids, ids], "n": 3, "echo": True, "logprobs": 5, "max_tokens": 64})
  assert (
    st == 400 and err["error"]["param"] == "max_tokens" and "--max_reply_entries" in err["error"]["message"]
  )
  st, out = call(url, body={"prompt": [ids], "echo": True, "logprobs": 1, "max_tokens": 1})  # 3,003
  assert st == 200 and len(out["choices"][0]["logprobs"]["tokens"]) == 1001


def test_a_full_server_answers_429_before_tokenizing(served, monkeypatch):
  url, server = served
  eng = server.engine
  gate, real_step = threading.Event(), eng.step
  monkeypatch.setattr(eng, "step", lambda: (gate.wait(), real_step())[1])  # the engine holds still
  encoded = []
  monkeypatch.setattr(
    server, "tok", dataclasses.replace(server.tok, encode=lambda t: encoded.append(t) or [1])
  )

  async def go():
    async with aiohttp.ClientSession() as s:
      body = {"prompt": [5, 6], "max_tokens": 8, "stream": True}
      opened = [await s.post(url + "/v1/completions", json=body, headers=AUTH) for _ in range(8)]
      assert [r.status for r in opened] == [200] * 8  # 4 slots + 4 queued
      async with s.post(url + "/v1/completions", json={"prompt": "a new prompt"}, headers=AUTH) as r:
        status = r.status
      gate.set()
      for r in opened:
        await r.text()
      return status

  try:
    assert asyncio.run(asyncio.wait_for(go(), 60)) == 429
  finally:
    gate.set()
  assert encoded == []
  monkeypatch.undo()
  _still_serving(url)


def test_a_body_over_the_limit_gets_413(served):
  url, _ = served
  st, err = call(url, raw=json.dumps({"prompt": "x" * (5 << 20)}))
  assert st == 413 and err["error"]["code"] == 413


# ---- finding 6: the HTTP edge ----


def test_deeply_nested_json_gets_400(served):
  url, _ = served
  for raw in (
    "[" * 100_000 + "]" * 100_000,
    json.dumps({"prompt": "hi"})[:-1] + ', "stop": ' + "[" * 5000 + "]" * 5000 + "}",
  ):
    st, err = call(url, raw=raw)
    assert st == 400 and "nest" in err["error"]["message"], err
  _still_serving(url)


def test_a_non_utf8_authorization_header_gets_401(served):
  url, _ = served
  host, port = url.rsplit("/", 1)[1].split(":")
  body = b'{"prompt": "hi"}'
  with socket.create_connection((host, int(port)), timeout=10) as s:
    s.sendall(
      b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
      b"Authorization: Bearer \xff\xfe\xc3\r\nContent-Length: "
      + str(len(body)).encode()
      + b"\r\nConnection: close\r\n\r\n"
      + body
    )
    reply = b""
    while chunk := s.recv(65536):
      reply += chunk
  assert reply.startswith(b"HTTP/1.1 401"), reply[:200]


@pytest.mark.parametrize(
  "content_type", ["text/plain", "application/x-www-form-urlencoded", "application/jsonx"]
)
def test_json_posts_need_a_json_content_type(served, content_type):
  url, _ = served
  headers = {**AUTH, "Content-Type": content_type}
  for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
    st, err = call(url, path=path, raw=json.dumps({"prompt": "hi"}), headers=headers, content_type=None)
    assert st == 415 and "application/json" in err["error"]["message"], (path, err)
  st, _ = call(
    url,
    raw=json.dumps({"prompt": "hi", "max_tokens": 1}),
    headers={**AUTH, "Content-Type": "application/json; charset=utf-8"},
    content_type=None,
  )
  assert st == 200


def test_host_and_origin_must_name_this_server(served):
  url, _ = served
  port = url.rsplit(":", 1)[1]
  body = {"prompt": "hi", "max_tokens": 1}
  for host in (
    "evil.example",
    f"evil.example:{port}",
    "10.0.0.1",
  ):  # DNS rebinding: a name that resolves here
    st, err = call(url, body=body, headers={**AUTH, "Host": host})
    assert st == 421 and "--allowed_host" in err["error"]["message"], (host, err)
    assert call(url, "GET", "/health", headers={"Host": host})[0] == 421
  for host in (f"localhost:{port}", f"127.0.0.1:{port}", "LOCALHOST", f"[::1]:{port}"):
    assert call(url, body=body, headers={**AUTH, "Host": host})[0] == 200, host
  for origin in ("http://evil.example", f"http://evil.example:{port}", "null"):
    st, err = call(url, body=body, headers={**AUTH, "Origin": origin})
    assert st == 403 and "Origin" in err["error"]["message"], (origin, err)
  assert call(url, body=body, headers={**AUTH, "Origin": f"http://localhost:{port}"})[0] == 200


def test_allowed_hosts_follow_the_bind_address():
  from serve.api.server import allowed_hosts

  assert {"localhost", "127.0.0.1", "::1"} <= allowed_hosts("127.0.0.1", [])
  assert allowed_hosts("0.0.0.0", []) is None  # exposed on every address: Host is not checked
  assert allowed_hosts("0.0.0.0", ["api.example.com"]) == {"api.example.com"}
  assert allowed_hosts("10.1.2.3", []) == {"10.1.2.3"}
  assert "api.example.com" in allowed_hosts("127.0.0.1", ["API.example.com"])


# ---- the fuzz: every field, extreme and wrong-typed values: only 4xx (or 200), and serving after ----

WILD = [
  2**63,
  -(2**63) - 1,
  -1,
  0,
  10**30,
  float("nan"),
  float("inf"),
  float("-inf"),
  0.5,
  "",
  "x\ud800",
  [],
  [1, 2],
  [[[]]],
  {"a": 1},
  True,
  [float("nan")],
  ["\u2603" * 600],
]
COMPLETION_FIELDS = [
  "prompt",
  "model",
  "max_tokens",
  "temperature",
  "top_p",
  "top_k",
  "min_p",
  "n",
  "logprobs",
  "echo",
  "seed",
  "stop",
  "stop_token_ids",
  "ignore_eos",
  "stream",
  "stream_options",
  "return_token_ids",
  "best_of",
  "suffix",
  "presence_penalty",
  "frequency_penalty",
  "logit_bias",
  "repetition_penalty",
  "user",
]
# Chat requests share the completion fields' checks (serve.api.protocol.parse_settings): only their own here.
CHAT_FIELDS = [
  "messages",
  "max_tokens",
  "max_completion_tokens",
  "n",
  "logprobs",
  "top_logprobs",
  "stop",
  "tools",
  "tool_choice",
  "response_format",
]


def test_fuzz_every_field_gets_only_4xx_and_the_server_keeps_serving(served):
  url, _ = served
  chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
  cases = [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1, field: v})
    for field in COMPLETION_FIELDS
    for v in WILD
  ]
  cases += [("/v1/chat/completions", {**chat, field: v}) for field in CHAT_FIELDS for v in WILD]
  cases += [
    ("/v1/chat/completions", {**chat, "messages": [{"role": "user", k: v}]})
    for k in ("role", "content")
    for v in WILD
  ]
  cases += [
    (p, {k: v})
    for p, k in (
      ("/tokenize", "prompt"),
      ("/tokenize", "messages"),
      ("/tokenize", "return_token_strs"),
      ("/detokenize", "tokens"),
    )
    for v in WILD
  ]
  assert len(cases) < 800

  async def go():
    statuses, bad, todo = [], [], iter(cases)
    async with aiohttp.ClientSession() as s:

      async def worker():
        for path, body in todo:
          data = json.dumps(body)  # NaN and Infinity as Python's json writes them
          async with s.post(url + path, data=data, headers={**AUTH, "Content-Type": "application/json"}) as r:
            await r.read()
            statuses.append(r.status)
            if not 200 <= r.status < 500:
              bad.append((r.status, path, data[:120]))

      await asyncio.gather(*(worker() for _ in range(4)))
    return statuses, bad

  statuses, bad = asyncio.run(asyncio.wait_for(go(), 300))
  assert bad == [], bad[:10]
  assert statuses.count(400) > len(cases) // 2
  _still_serving(url)
