"""Tenants: API keys each naming a tenant, the state cache scoped by
(tenant, cache_salt) so a prefix cached for one is never restored for another, usage.prompt_tokens_details.
cached_tokens, per-tenant cache counters behind the key, and slots shared fairly between tenants. One tiny
engine (4 slots, a state cache with a directory) serves every test here."""

import json
import os
import time

import numpy as np
import pytest
from helpers import serve_fixtures as sf

from laplace_jax.model.state import DecodeState
from serve.api.tenants import Tenants, name_of_key, read_keys_file
from serve.engine import state_cache
from serve.engine.engine import QueueFull, Request
from serve.engine.state_cache import StateCache

KEYS = {"alice": "key-alice-0123", "bob": "key-bob-4567"}
ALICE, BOB = ({"Authorization": f"Bearer {KEYS[t]}"} for t in ("alice", "bob"))


# ---- keys ----


def test_keys_name_tenants_and_wrong_keys_get_none():
  t = Tenants([("alice", "k1"), ("alice", "k2"), ("bob", "k3")])
  assert [
    t.authenticate(h)
    for h in ("Bearer k1", "bearer k2", "Bearer k3", "Bearer k4", "k1", None, "Bearer ", "Bearer \udcff")
  ] == ["alice", "alice", "bob", None, None, None, None, None]
  assert Tenants().authenticate(None) == ""  # no keys: the anonymous tenant
  with pytest.raises(ValueError, match="two tenants"):
    Tenants([("alice", "k1"), ("bob", "k1")])
  with pytest.raises(ValueError, match="tenant name"):
    Tenants([("a b", "k1")])
  assert name_of_key("k1") == name_of_key("k1") != name_of_key("k2")


def test_keys_file(tmp_path):
  f = tmp_path / "keys"
  f.write_text("# tenants\nalice:secret:with:colons\n\nbob : s2 \n")
  assert read_keys_file(str(f)) == [("alice", "secret:with:colons"), ("bob", "s2")]
  f.write_text("alice:ok\njust-a-key-no-tenant\n")
  with pytest.raises(ValueError, match="line 2") as e:
    read_keys_file(str(f))
  assert "just-a-key" not in str(e.value)  # a key is never echoed
  f.write_text("# nothing\n")
  with pytest.raises(ValueError, match="no 'tenant:key'"):
    read_keys_file(str(f))


def test_help_and_errors_never_print_a_key(monkeypatch, capsys, tmp_path):
  from serve.__main__ import parse_args, tenant_keys

  monkeypatch.setenv("LAPLACE_API_KEY", "sekrit-from-env")
  with pytest.raises(SystemExit):
    parse_args(["--help"])
  assert "sekrit" not in capsys.readouterr().out
  args = parse_args(["--random-init", "--preset", "tiny"])
  assert args.api_key == ["sekrit-from-env"]
  f = tmp_path / "keys"
  f.write_text("carol:k9\n")
  args = parse_args(["--random-init", "--api-key", "k7", "--api-key", "k8", "--api-keys-file", str(f)])
  assert tenant_keys(args).names == sorted([name_of_key("k7"), name_of_key("k8"), "carol"])


# ---- the cache's scopes ----


def _state(fill):
  return {"gla": np.full((2, 3, 4), fill, np.float32), "conv": np.full((2, 2), fill, np.float32)}


def test_a_state_is_restored_only_in_the_scope_that_cached_it(tmp_path):
  d = str(tmp_path / "c")
  c = StateCache("m", 1 << 20, directory=d)
  ids = list(range(100, 300))
  c.put(ids, _state(1), tenant="alice")
  c.put(ids, _state(2), tenant="alice", salt="s")
  c.put(ids[:70], _state(3))  # the anonymous tenant
  probe = ids + [5]
  assert c.lookup(probe, 500, tenant="alice")[0] == 200
  assert c.lookup(probe, 500, tenant="alice", salt="s")[1]["gla"][0, 0, 0] == 2
  assert c.lookup(probe, 500, tenant="bob") == (0, None)
  assert c.lookup(probe, 500, tenant="alice", salt="t") == (0, None)
  assert c.lookup(probe, 500, tenant="bob", salt="s") == (0, None)
  assert c.lookup(probe, 500)[0] == 70
  assert c.tenant_stats["alice"].hits == 2 and c.tenant_stats["bob"].misses == 2
  c.flush()
  again = StateCache("m", 1 << 20, directory=d)  # the scopes survive a restart
  assert again.lookup(probe, 500, tenant="alice", salt="s")[1]["gla"][0, 0, 0] == 2
  assert again.lookup(probe, 500, tenant="bob") == (0, None)
  for name in os.listdir(d):  # the salt itself is never written down
    with open(os.path.join(d, name), "rb") as f:
      assert b'"s"' not in f.read()


# ---- one engine for the rest ----


@pytest.fixture(scope="module")
def tok():
  return sf.gpt2_tokenizer()


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
  return str(tmp_path_factory.mktemp("states"))


PLANTED = list(range(500, 600))


@pytest.fixture(scope="module")
def eng(cache_dir):
  ident = "fake-model"  # the engine runs over tests/helpers/fake_slots.py
  # A file of this model whose state has the wrong shape (as if planted, or written by another build):
  # restoring it would break the prefill; the engine must skip it and serve on.
  StateCache(ident, 1 << 30, cache_dir).put(PLANTED, {"gla": np.ones((3, 5), np.float32)})
  cache = StateCache(ident, 1 << 30, cache_dir)
  return sf.fake_engine(n_slots=4, prefill_batch=1, max_queue=8, state_cache=cache, cache_min_tokens=16)


def _server(eng, tok):
  tenants = Tenants(list(KEYS.items()))
  return sf.serving(
    eng, tok, sf.limits(tok, eng, max_tokens=64, max_prompt_tokens=2000, max_prompts=12), tenants=tenants
  )


def _complete(url, prompt, headers, **kw):
  body = {
    "prompt": prompt,
    "max_tokens": 4,
    "temperature": 0,
    "ignore_eos": True,
    "return_token_ids": True,
    **kw,
  }
  st, out = sf.call(url, body=body, headers=headers)
  assert st == 200, out
  return out


def test_cached_tokens_never_cross_keys_or_salts(eng, tok):
  prompt = np.random.default_rng(0).integers(0, 50_000, 200).tolist()
  with _server(eng, tok) as (url, _):
    first = _complete(url, prompt, ALICE)
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    resumed = prompt + first["choices"][0]["token_ids"] + [11, 12, 13]
    cached = len(resumed) - 4  # all but the new ids and the last output token
    # Bob, and Alice under a salt, send Alice's conversation: nothing of hers is restored for them.
    assert _complete(url, resumed, BOB)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    salted = _complete(url, resumed, ALICE, cache_salt="tab-2")
    assert salted["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # Alice herself gets the hit, whole and streamed (the final usage chunk), and so does her salt.
    assert _complete(url, resumed, ALICE)["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
    st, events = sf.call(
      url,
      body={"prompt": resumed, "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}},
      headers=ALICE,
    )
    assert st == 200 and json.loads(events[-2])["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
    again = resumed + salted["choices"][0]["token_ids"] + [14]
    got = _complete(url, again, ALICE, cache_salt="tab-2")["usage"]
    assert got["prompt_tokens_details"]["cached_tokens"] == len(again) - 2 and got["prompt_tokens"] == len(
      again
    )
    # Chat: the same usage object.
    st, chat = sf.call(
      url,
      path="/v1/chat/completions",
      headers=BOB,
      body={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    )
    assert st == 200 and chat["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    st, err = sf.call(url, body={"prompt": "hi", "cache_salt": ""}, headers=ALICE)
    assert st == 400 and err["error"]["param"] == "cache_salt"


def test_metrics_need_a_key_and_show_only_the_callers_cache_counters(eng, tok):
  with _server(eng, tok) as (url, _):
    _complete(url, [5] * 40, BOB)
    assert sf.call(url, "GET", "/metrics", headers={})[0] == 401
    st, text = sf.call(url, "GET", "/metrics", headers=BOB)
    assert st == 200
    assert 'laplace_serve_state_cache_misses_total{tenant="bob"}' in text
    assert "alice" not in text, text
    assert "\nlaplace_serve_prompt_tokens_cached_total " not in text  # no server-wide hit counts
    assert "\nlaplace_serve_generated_tokens_total " in text  # load figures are server-wide


def test_one_tenants_burst_does_not_hold_every_slot(eng):
  eng.on_deliver = lambda deliveries: None  # no server
  long = dict(max_tokens=30, temperature=0.0)
  a = [Request(prompt_ids=[1, 2, i], tenant="alice", **long) for i in range(6)]
  b = [Request(prompt_ids=[3, 4, i], tenant="bob", **long) for i in range(2)]
  for r in a + b:  # Alice's burst is queued first
    eng.submit(r)
  while eng.active_slots < 4:
    eng.step()
  assert {r.id for r in eng.slot_map.req} == {
    a[0].id,
    a[1].id,
    b[0].id,
    b[1].id,
  }  # first come would be a[0:4]
  eng.run_until_idle()
  assert all(r.progress.finish_reason == "length" for r in a + b)


def test_a_tenant_fills_only_its_share_of_the_queue(eng):
  eng.on_deliver = lambda deliveries: None
  eng.admission.per_tenant = 2
  try:
    mine = [Request(prompt_ids=[1, i], max_tokens=8, tenant="alice") for i in range(6)]
    for r in mine:  # 4 free slots + 2 queued
      eng.submit(r)
    with pytest.raises(QueueFull, match="per tenant"):
      eng.submit(Request(prompt_ids=[1], max_tokens=8, tenant="alice"))
    eng.submit(Request(prompt_ids=[2], max_tokens=8, tenant="bob"))  # Bob still finds room to wait
    eng.run_until_idle()
  finally:
    eng.admission.per_tenant = eng.admission.max_queue


def test_a_planted_state_of_the_wrong_shape_is_never_restored(eng, tok):
  # Dropped when the engine set the cache's layout (the fake engine's states have no "gla" at all).
  assert not any(e.state.get("gla", np.empty(0)).shape == (3, 5) for e in eng.cache.entries.values())
  with _server(eng, tok) as (url, _):
    out = _complete(url, PLANTED + [7], {"Authorization": "Bearer " + KEYS["alice"]})
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert sf.call(url, "GET", "/health", headers={})[0] == 200


def test_stopping_the_server_writes_the_finished_conversations_state(eng, tok, cache_dir, monkeypatch):
  write = state_cache._atomic_write

  def slow_disk(path, data):
    time.sleep(1.0)
    write(path, data)

  monkeypatch.setattr(state_cache, "_atomic_write", slow_disk)
  prompt = np.random.default_rng(3).integers(0, 50_000, 60).tolist()
  with _server(eng, tok) as (url, _):
    out = _complete(url, prompt, ALICE)["choices"][0]["token_ids"]
  # What SIGTERM runs (serve_forever -> Server.stop -> Engine.stop): the state is on disk when it returns.
  ids = np.asarray(prompt + out[:-1], np.int32)  # a finished slot holds all but its last token
  key = eng.cache._key(ids, state_cache.scope_of("alice"))
  assert os.path.exists(os.path.join(cache_dir, key + ".state"))


class _InFlight:
  """A state copy still on its way to the host; landing it (a blocking wait) is recorded."""

  def __init__(self):
    self.waited = False

  def is_ready(self):
    return False

  def __array__(self, dtype=None, copy=None):
    self.waited = True
    return np.zeros((2, 1, 3), np.float32)


def test_a_request_never_waits_for_another_scopes_state(eng):
  # Waiting for a copy whose ids are a prompt's prefix would show in that prompt's time to first token.
  prompt = list(range(900, 990))
  leaf = _InFlight()
  copy = DecodeState(pos=_InFlight(), conv=leaf)  # the gathered rows of the fake engine's DecodeState
  io = eng.state_io
  io.copies.append(([(("alice", None), prompt[:80])], copy))
  try:
    for tenant, salt in (("bob", None), ("alice", "s")):
      io.restore([Request(prompt_ids=prompt, tenant=tenant, cache_salt=salt)])
      assert not leaf.waited and len(io.copies) == 1
    with pytest.raises(
      ValueError, match="layout"
    ):  # Alice's next turn waits for it (the fake lands, refused)
      io.restore([Request(prompt_ids=prompt, tenant="alice")])
    assert leaf.waited
  finally:
    io.copies.clear()
