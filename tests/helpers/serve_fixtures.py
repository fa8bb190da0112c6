"""What the serving tests share: the tiny model, a warmed-up engine (real, or over the numpy fake of
tests/helpers/fake_slots.py for the tests of scheduling and HTTP), a server on loopback, one HTTP call and a compile
counter (imported by tests/test_serve_*.py; fixtures stay in each file, built from these)."""

import asyncio
import contextlib
import dataclasses
import functools
import json

import aiohttp
import jax

from helpers.fake_slots import FakeSlots
from laplace_jax import get_config, model
from laplace_jax.data.tokenizer import VOCAB_SIZE as GPT2_VOCAB
from serve.api import protocol
from serve.api.server import InThread, Server
from serve.engine.engine import Engine
from serve.engine.engine_config import EngineConfig
from serve.slots import loading
from serve.slots.slot_functions import SlotFunctions

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


def tiny(seed: int):
  """(cfg, params) of the tiny preset, weights from `seed`."""
  cfg = get_config("tiny")
  return cfg, model.init_params(cfg, jax.random.key(seed))


def split_config(kw: dict) -> tuple[EngineConfig, dict]:
  """Keyword arguments as (the EngineConfig of those that name its fields, the rest: Engine's own)."""
  fields = {f.name for f in dataclasses.fields(EngineConfig)}
  return EngineConfig(**{k: v for k, v in kw.items() if k in fields}), {
    k: v for k, v in kw.items() if k not in fields
  }


def engine(params, cfg, **kw):
  """A warmed-up engine (GPT-2 vocabulary) with EngineConfig's fields and Engine's keyword arguments; unless told otherwise, one
  compiled program over the whole slot table (`slot_buckets="table"`: each bucket is a compile of its own,
  and the buckets' own behaviour is tested over the fake and in tests/programs/serve/slots/test_slot_writes.py)."""
  kw.setdefault("slot_buckets", "table")
  config, rest = split_config(kw)
  eng = Engine(params, cfg, config, valid_vocab=GPT2_VOCAB, **rest)
  eng.warmup()
  return eng


def reused_slots():
  """A `make_slots` for engines that may share compiled functions: the first engine built with it makes the
  SlotFunctions, every later one with the same arguments gets that same object (pure jitted functions,
  nothing of an engine's state lives in them), so it neither traces nor compiles again."""
  made = {}

  def make(model, cfg, **kw):
    key = (model, cfg, tuple(sorted(kw.items())))
    if key not in made:
      made[key] = SlotFunctions(model, cfg, **kw)
    return made[key]

  return make


def fake_engine(step_s: float = 0.0, **kw):
  """A warmed-up engine over FakeSlots (tiny's config, GPT-2 vocabulary): the scheduler, the state cache
  and the server run for real, the model is a hash (tests/helpers/fake_slots.py); nothing compiles. Each generate
  step takes `step_s` seconds, as a model's would (tests that need requests to overlap)."""
  make = functools.partial(FakeSlots, step_s=step_s)
  return engine(None, get_config("tiny"), make_slots=make, **{"slot_buckets": "doubling", **kw})


def limits(tok, eng, **kw):
  """Request limits for `eng` (model name laplace-tiny), overridden by `kw`."""
  return protocol.Limits(
    **{
      "model_name": "laplace-tiny",
      "vocab_size": tok.vocab_size,
      "eos_id": tok.eos_id,
      "max_stop_ids": eng.fns.n_stop,
      **kw,
    }
  )


@contextlib.contextmanager
def serving(eng, tok, lim, **server_kw):
  """A Server over `eng` listening on a free loopback port: yields (url, server)."""
  server = Server(eng, tok, lim, **server_kw)
  with InThread(server) as port:
    yield f"http://127.0.0.1:{port}", server


def call(
  url,
  method="POST",
  path="/v1/completions",
  body=None,
  headers=AUTH,
  raw=None,
  content_type="application/json",
  timeout=120,
):
  """One request: (status, parsed JSON, SSE event list, or text). A body goes with `content_type`
  unless `headers` name one (content_type None: aiohttp's own, text/plain); a server that does not answer
  within `timeout` seconds fails the test instead of hanging it."""

  async def go():
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as s:
      data = raw if raw is not None else (None if body is None else json.dumps(body))
      hdrs = dict(headers)
      if data is not None and content_type and not any(k.lower() == "content-type" for k in hdrs):
        hdrs["Content-Type"] = content_type
      async with s.request(method, url + path, data=data, headers=hdrs) as r:
        text = await r.text()
        if r.headers.get("Content-Type", "").startswith("text/event-stream"):
          return r.status, [e[len("data: ") :] for e in text.split("\n\n") if e]
        return r.status, (json.loads(text) if "json" in r.headers.get("Content-Type", "") else text)

  return asyncio.run(go())


class CompileCounter:
  """Counts XLA backend compiles while `on`."""

  def __init__(self):
    self.n, self.on = 0, False
    jax.monitoring.register_event_duration_secs_listener(self._event)

  def _event(self, event, duration, **kw):
    if self.on and event == "/jax/core/compile/backend_compile_duration":
      self.n += 1


gpt2_tokenizer = loading.gpt2_tokenizer
