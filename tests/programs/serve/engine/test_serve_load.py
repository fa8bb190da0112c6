"""Load on loopback: waves of 240 concurrent streaming requests, a quarter of whose clients hang up
mid-stream. Every well-formed request that stays connected completes; every slot is free at the end;
no request object outlives its wave and the process does not grow from wave to wave."""

import asyncio
import gc
import json
import os
import random
import time

import aiohttp
import pytest
from helpers import serve_fixtures as sf

from serve.engine.engine import Request

N_CONCURRENT = 240


def _rss_bytes():
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.fixture(scope="module")
def served():
  tok = sf.gpt2_tokenizer()
  engine = sf.fake_engine(n_slots=32, prefill_batch=4, max_queue=N_CONCURRENT, step_s=0.002)
  with sf.serving(engine, tok, sf.limits(tok, engine, max_tokens=64, max_prompt_tokens=2048)) as served:
    yield served


async def _client(session, url, rng, i):
  """One streaming request; some hang up after a few events. Returns 'done', 'hung up' or an error."""
  prompt = (
    " ".join(rng.choice(["the", "light", "word", "and", "was", "in"]) for _ in range(rng.randint(1, 60)))
    if i % 2
    else [rng.randrange(50257) for _ in range(rng.randint(1, 300))]
  )
  body = {
    "prompt": prompt,
    "max_tokens": rng.randint(1, 24),
    "stream": True,
    "temperature": rng.choice([0, 0.7, 1.0]),
    "top_k": rng.choice([0, 0, 40]),
    "seed": i,
    "stop": rng.choice([None, ["\n\n"], ["the"]]),
  }
  hang_up_after = rng.randint(1, 4) if rng.random() < 0.25 else None
  async with session.post(url + "/v1/completions", json=body) as r:
    if r.status != 200:
      return f"status {r.status}: {await r.text()}"
    events = 0
    async for line in r.content:
      if not line.startswith(b"data: "):
        continue
      data = line[len(b"data: ") :].strip()
      if data == b"[DONE]":
        return "done"
      if "error" in json.loads(data):  # an error event (the text of a chunk may say "error" too)
        return f"error event {data[:200]!r}"
      events += 1
      if hang_up_after is not None and events >= hang_up_after:
        r.close()
        return "hung up"
  return "stream ended without [DONE]"


async def _wave(url, seed):
  rng = random.Random(seed)
  async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
    return await asyncio.gather(
      *(_client(s, url, random.Random(rng.random()), i) for i in range(N_CONCURRENT))
    )


def _settle(server, timeout=30):
  """Wait for the engine to go idle and the server to close every connection of the wave."""
  engine = server.engine
  deadline = time.time() + timeout
  while time.time() < deadline and not (
    engine.active_slots == 0
    and engine.queue_depth == 0
    and engine.prefill is None
    and not engine.slot_map.reserved
    and not engine.pending  # (the call dispatched before the last slot finished, read back a step later)
    and server.open_connections == 0
  ):
    time.sleep(0.05)


def _live_requests(earlier, timeout=10):
  """Request objects still alive once the handlers of the wave have wound down, but those in `earlier`
  (made before the waves, by other tests of this process: held, so that no new object takes their id)."""
  known = {id(r) for r in earlier}
  deadline = time.time() + timeout
  while True:
    gc.collect()
    n = sum(isinstance(o, Request) and id(o) not in known for o in gc.get_objects())
    if n == 0 or time.time() > deadline:
      return n
    time.sleep(0.1)


def test_concurrent_streams_with_disconnects(served):
  url, server = served
  engine = server.engine
  rss, n_objects = [], []
  gc.collect()
  earlier = [o for o in gc.get_objects() if isinstance(o, Request)]
  for wave in range(3):
    results = asyncio.run(_wave(url, wave))
    bad = [r for r in results if r not in ("done", "hung up")]
    assert not bad, bad[:5]
    assert results.count("done") >= N_CONCURRENT // 2 and results.count("hung up") >= N_CONCURRENT // 10
    _settle(server)
    assert server.open_connections == 0
    assert engine.active_slots == 0 and engine.queue_depth == 0 and not engine.slot_map.reserved
    assert all(r is None for r in engine.slot_map.req) and not engine.pending
    assert _live_requests(earlier) == 0
    rss.append(_rss_bytes())
    n_objects.append(len(gc.get_objects()))
  # Wave 1 may still fill caches and pools. After it: no Python objects pile up (a leak of anything per
  # request would add >= 240 per wave), and the resident size stays within the allocator's jitter.
  assert n_objects[2] - n_objects[1] < 200, n_objects
  assert rss[2] - rss[1] < 64 << 20, f"RSS grew {(rss[2] - rss[1]) >> 20} MiB between waves 2 and 3"
  assert engine.error is None and engine.stats.finished == engine.stats.requests
