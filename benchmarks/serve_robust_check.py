"""The abusive requests the server must survive against a tiny random-init server on loopback, each
answered while /health is polled every 20 ms: what each got and the slowest /health reply meanwhile.

    python -m benchmarks serve_robust_check [--slots 8] [--queue 64]

Engine: `tiny` with random weights (what matters here is the HTTP side and the event loop, not the model).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import aiohttp

from benchmarks.serve_bench_common import table

sys.path.insert(0, "tests")
from helpers import serve_fixtures as sf  # noqa: E402  (tests/helpers: the numpy fake engine)


async def _probe(session, url, body, label):
  """Send `body` while polling /health; (label, status, reply bytes, seconds, slowest /health)."""
  worst, done = 0.0, asyncio.Event()

  async def poll():
    nonlocal worst
    while not done.is_set():
      t = time.perf_counter()
      async with session.get(url + "/health") as h:
        await h.read()
      worst = max(worst, time.perf_counter() - t)
      await asyncio.sleep(0.02)

  poller = asyncio.ensure_future(poll())
  t = time.perf_counter()
  async with session.post(url + "/v1/completions", json=body, headers=sf.AUTH) as r:
    data = await r.read()
    status = r.status
  if status != 200:
    status = f"{status} ({json.loads(data)['error']['param']})"
  took = time.perf_counter() - t
  done.set()
  await poller
  return label, status, len(data), f"{took:.2f}", f"{worst * 1e3:.0f} ms"


async def run(url, lim):
  ids = list(range(1000, 1000 + min(8192, lim.max_prompt_tokens)))
  cases = [
    ("top_k 2**31 (finding 1)", {"prompt": "hi", "top_k": 2**31}),
    (
      "stop ['☃' x 20000], n 2, max_tokens 2048 (finding 2)",
      {"prompt": "hi", "stop": ["\u2603" * 20000], "n": 2, "max_tokens": 2048, "ignore_eos": True},
    ),
    (
      "4 stops of 512 ☃, n 4, max_tokens 1024, streamed (the most allowed)",
      {
        "prompt": "hi",
        "stop": ["\u2603" * 511 + c for c in "abcd"],
        "n": 4,
        "max_tokens": 1024,
        "ignore_eos": True,
        "stream": True,
      },
    ),
    ("129 prompts x n 8 x 4096 tokens (finding 4)", {"prompt": ["hi"] * 129, "n": 8, "max_tokens": 4096}),
    (
      "echo + logprobs 5 + n 8 over 4 x 8192 ids (finding 4)",
      {"prompt": [ids] * 4, "n": 8, "echo": True, "logprobs": 5, "max_tokens": 1},
    ),
    (
      "echo + logprobs 5 + n 4 over 4 x 8192 ids (16 choices: within --max-choices)",
      {"prompt": [ids] * 4, "n": 4, "echo": True, "logprobs": 5, "max_tokens": 1},
    ),
    (
      "echo + logprobs 5 over 1 x 8192 ids (allowed)",
      {"prompt": [ids], "echo": True, "logprobs": 5, "max_tokens": 1},
    ),
  ]
  rows = []
  async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
    for label, body in cases:
      rows.append(await _probe(s, url, body, label))
  return rows


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--slots", type=int, default=8)
  p.add_argument("--queue", type=int, default=64)
  args = p.parse_args()
  tok = sf.gpt2_tokenizer()
  cfg, params = sf.tiny(0)
  eng = sf.engine(params, cfg, n_slots=args.slots, prefill_batch=4, max_queue=args.queue)
  # The server's defaults (python -m serve): --max-tokens 4096, --max-prompt-tokens 32768.
  lim = sf.limits(tok, eng, max_tokens=4096, max_prompt_tokens=32768, max_prompts=args.slots + args.queue)
  with sf.serving(eng, tok, lim, api_key=sf.KEY) as (url, _):
    rows = asyncio.run(run(url, lim))
  table(
    "abusive requests (tiny, random weights)",
    ["request", "status (param)", "reply bytes", "seconds", "slowest /health meanwhile"],
    rows,
  )
  print(json.dumps({"slots": args.slots, "queue": args.queue}))


if __name__ == "__main__":
  main()
