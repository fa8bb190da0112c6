"""Multi-turn conversations through the official `openai` client, as agents send them: each turn re-sends the
history with the replies as received (chat, with the default template and a ChatML one, with and without a
stop string; text completions that append the reply's text), or continues a stored response
(`previous_response_id`). Per turn: the share of the previous turn's whole context (its prompt and reply
tokens) restored from the state cache, and the time to first token, with the cache on and off; per
conversation: the states it keeps.

Run it from a venv that has `openai` (not a project dependency); it starts `python -m serve` itself:

    /path/to/venv/bin/python -m benchmarks conversations [--checkpoint RUN/export/step_N] [--turns 20]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
import urllib.request

import numpy as np
import openai

from benchmarks.server_process import ROOT, start_server

CHATML = (
  "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WORDS = (
  "the of and to in that he shall unto for his a lord they be is him not them it with all thou thy was god "
  "which my me said but ye their have will thee from as are when this out were upon man by you israel king "
  "son up there hath then people came had house into on her come one we children s before your also day "
  "land men shalt against"
).split()


def metric(url, name):
  with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
    m = re.search(rf"^laplace_serve_{name}(?:{{[^}}]*}})? (\S+)$", r.read().decode(), re.M)
  return float(m.group(1)) if m else 0.0


def user_text(rng, words):
  return " ".join(rng.choice(WORDS, words)).capitalize() + "?"


def _read(stream, t0, text_of):
  """(reply text, time to first text or to the finish of an empty reply, usage) of a streamed reply."""
  reply, ttft, usage = "", None, None
  for chunk in stream:
    usage = chunk.usage or usage
    for ch in chunk.choices:
      piece = text_of(ch) or ""
      if piece or ch.finish_reason:
        ttft = ttft or time.perf_counter() - t0
      reply += piece
  return reply, ttft, usage


def _turn(usage, ttft):
  return usage.prompt_tokens, usage.completion_tokens, usage.prompt_tokens_details.cached_tokens, ttft


def chat_turns(client, model, turns, words, stop, max_tokens):
  rng = np.random.default_rng(0)
  messages = [{"role": "system", "content": f"You answer briefly{'' if stop is None else ' (stop)'}."}]
  for _ in range(turns):
    messages.append({"role": "user", "content": user_text(rng, words)})
    t0 = time.perf_counter()
    stream = client.chat.completions.create(
      model=model, messages=messages, max_tokens=max_tokens, temperature=0, stop=stop, stream=True,
      stream_options={"include_usage": True},
    )  # fmt: skip
    reply, ttft, usage = _read(stream, t0, lambda ch: ch.delta.content)
    messages.append({"role": "assistant", "content": reply})
    yield _turn(usage, ttft)


def text_turns(client, model, turns, words, stop, max_tokens):
  rng = np.random.default_rng(0)
  prompt = f"You answer briefly{'' if stop is None else ' (stop)'}.\n\n"
  for _ in range(turns):
    prompt += user_text(rng, words) + "\n\n"
    t0 = time.perf_counter()
    stream = client.completions.create(
      model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stop=stop, stream=True,
      stream_options={"include_usage": True},
    )  # fmt: skip
    reply, ttft, usage = _read(stream, t0, lambda ch: ch.text)
    prompt += reply + "\n\n"
    yield _turn(usage, ttft)


def response_turns(client, model, turns, words, stop, max_tokens):
  del stop
  rng = np.random.default_rng(0)
  previous = None
  for i in range(turns):
    t0 = time.perf_counter()
    kw = {"previous_response_id": previous} if previous else {"instructions": "You answer briefly."}
    ttft, final = None, None
    # (not responses.stream: its get_final_response wants response.completed, and a reply cut by
    # max_output_tokens ends with response.incomplete, as OpenAI's does)
    stream = client.responses.create(
      model=model, input=user_text(rng, words), max_output_tokens=max_tokens, temperature=0, stream=True, **kw
    )
    for event in stream:
      if event.type == "response.output_text.delta" and event.delta:
        ttft = ttft or time.perf_counter() - t0
      elif event.type in ("response.completed", "response.incomplete"):
        final = event.response
    previous = final.id
    u = final.usage
    yield u.input_tokens, u.output_tokens, u.input_tokens_details.cached_tokens, ttft  # (responses' names)
    del i


STOP = ","  # a stop string the `train/demo.sh` model writes in most replies (", and the LORD ...")
PATHS = {
  "chat": (chat_turns, None),
  f"chat, stop {STOP!r}": (chat_turns, [STOP]),
  "text": (text_turns, None),
  f"text, stop {STOP!r}": (text_turns, [STOP]),
  "responses": (response_turns, None),
}


def run(args):
  weights = ["--checkpoint", args.checkpoint] if args.checkpoint else ["--random_init", "--seed", "0"]
  rows = []
  tmp = tempfile.mkdtemp()
  chatml = os.path.join(tmp, "chatml.jinja")
  with open(chatml, "w") as f:
    f.write(CHATML)
  for template in ("default", "chatml"):
    for cache in ("on", "off"):
      extra = ["--preset", args.preset, *weights, "--n_slots", str(args.n_slots)]
      extra += [] if template == "default" else ["--chat_template", chatml]
      extra += [] if cache == "on" else ["--state_cache_gb", "0"]
      log: list[str] = []
      proc, url = start_server(args.python, extra, log=log)
      try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        model = client.models.list().data[0].id
        for name, (turns_of, stop) in PATHS.items():
          if template == "chatml" and not name.startswith("chat"):
            continue  # text and responses do not depend on the chat template
          before = metric(url, "state_cache_entries")
          turns = list(turns_of(client, model, args.turns, args.words, stop, args.max_tokens))
          stopped = sum(o < args.max_tokens for _, o, _, _ in turns)
          kept = metric(url, "state_cache_entries") - before
          shares = [
            c / (p0 + o0) for (p0, o0, _, _), (_, _, c, _) in zip(turns, turns[1:])
          ]  # of the previous turn's prompt and reply
          prev_prompt = [c >= p0 for (p0, _, _, _), (_, _, c, _) in zip(turns, turns[1:])]
          rows.append(
            {
              "path": name,
              "template": template if name.startswith("chat") or name == "responses" else "-",
              "cache": cache,
              "min_share": min(shares),
              "median_share": statistics.median(shares),
              "all_restore_prev_prompt": all(prev_prompt),
              "ttft_turn2_ms": 1e3 * turns[1][3],
              "ttft_last_ms": 1e3 * turns[-1][3],
              "median_ttft_ms": 1e3 * statistics.median(t[3] for t in turns[1:]),
              "last_prompt_tokens": turns[-1][0],
              "states_kept": kept,
              "replies_cut_short": stopped,
              "turns": turns,
            }
          )
          r = rows[-1]
          print(
            f"{name:16s} {template:7s} cache {cache:3s}: restored min {r['min_share']:.1%} median "
            f"{r['median_share']:.1%}, prev prompt always: {r['all_restore_prev_prompt']}, ttft turn 2 "
            f"{r['ttft_turn2_ms']:.0f} ms, turn {args.turns} {r['ttft_last_ms']:.0f} ms "
            f"({r['last_prompt_tokens']} prompt tokens), states kept {kept:.0f}, replies cut short {stopped}",
            flush=True,
          )
      finally:
        proc.terminate()
        proc.wait()
  if args.json:
    with open(args.json, "w") as f:
      json.dump(rows, f, indent=1)


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--python", default=os.path.join(ROOT, ".venv", "bin", "python"), help="the project's venv")
  p.add_argument("--preset", default="tiny")
  p.add_argument("--checkpoint", help="an export (RUN/export/step_N); default: random weights")
  p.add_argument("--turns", type=int, default=20)
  p.add_argument("--words", type=int, default=150, help="words per user message")
  p.add_argument("--max_tokens", type=int, default=40, help="tokens per reply")
  p.add_argument("--n_slots", type=int, default=8)
  p.add_argument("--json", help="write every turn's figures here")
  run(p.parse_args())


if __name__ == "__main__":
  sys.exit(main())
