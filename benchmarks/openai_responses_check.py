"""The official openai client against `python -m serve`'s Responses API, as its users call it: create, a
continuation with previous_response_id (its cached_tokens must cover >= 98% of the previous context), streams
through client.responses.stream and create(stream=True) (the deltas must add up to the whole reply at
temperature 0), retrieve, delete, two API keys kept apart, then a kill -9 of the server and a restart over
the same --state_cache_dir: the stored responses are still there and a continuation gives the same text as
the same continuation before the kill.

It starts the server itself (it must kill it): run it from a venv that has `openai` (not a project
dependency), naming the project's interpreter:

    /path/to/venv/bin/python -m benchmarks openai_responses_check --server_python .venv/bin/python
"""

import argparse
import os
import re
import signal
import tempfile
import time
import urllib.request

import openai

from benchmarks.server_process import ROOT, start_server

KEYS = ("key-a", "key-b")
LONG = (
  "The lighthouse keeper wrote in his log every evening: the height of the waves, the colour of the sky, "
  "the ships that passed and the birds that rested on the rail. "
) * 8


def start(python: str, cache_dir: str):
  flags = ["--preset", "tiny", "--random_init", "--n_slots", "8", "--state_cache_dir", cache_dir]
  flags += ["--api_key", KEYS[0], "--api_key", KEYS[1]]

  def show(line: str):
    if "stored responses" in line:
      print("  server:", line.strip().split(": ", 1)[-1])

  return start_server(python, flags, on_line=show)


def metric(url: str, name: str) -> float:
  req = urllib.request.Request(url + "/metrics", headers={"Authorization": f"Bearer {KEYS[0]}"})
  text = urllib.request.urlopen(req, timeout=30).read().decode()
  return float(re.search(rf"^laplace_serve_{name}(?:{{[^}}]*}})? (\S+)$", text, re.M).group(1))


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument(
    "--server_python",
    default=os.path.join(ROOT, ".venv", "bin", "python"),
    help="the interpreter that runs python -m serve (default: the project's .venv)",
  )
  p.add_argument("--state_cache_dir", help="default: a new temporary directory")
  args = p.parse_args()
  cache_dir = args.state_cache_dir or tempfile.mkdtemp(prefix="responses-check-")
  proc, url = start(args.server_python, cache_dir)
  a, b = (openai.OpenAI(base_url=url + "/v1", api_key=k) for k in KEYS)
  model = a.models.list().data[0].id
  print(f"openai {openai.__version__}; model {model}; --state_cache_dir {cache_dir}")
  greedy = dict(model=model, temperature=0, max_output_tokens=16)
  try:
    r1 = a.responses.create(input=LONG + "What did he write?", instructions="Answer briefly.", **greedy)
    print(f"create: {r1.id} status={r1.status} usage={r1.usage.model_dump()}")
    print(f"  output_text={r1.output_text!r}")
    r2 = a.responses.create(
      input="And in the morning?", previous_response_id=r1.id, instructions="Answer briefly.", **greedy
    )
    before = r1.usage.input_tokens + r1.usage.output_tokens
    cached = r2.usage.input_tokens_details.cached_tokens
    print(
      f"continue: {r2.id} input_tokens={r2.usage.input_tokens} cached_tokens={cached} of the previous "
      f"context's {before} ({cached / before:.1%}); prefilled {r2.usage.input_tokens - cached}"
    )
    assert r2.previous_response_id == r1.id and cached >= 0.98 * before

    with a.responses.stream(input="Tell a story.", **greedy) as s:
      deltas, final = [], None
      for event in s:
        if event.type == "response.output_text.delta":
          deltas.append(event.delta)
        elif event.type in ("response.completed", "response.incomplete"):
          final = event.response
    events = list(a.responses.create(input="Tell a story.", stream=True, **greedy))
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    whole = a.responses.create(input="Tell a story.", **greedy)
    print(
      f"stream: responses.stream {len(deltas)} deltas, final {final.status}; create(stream=True) "
      f"{len(events)} events ({events[0].type} ... {events[-1].type}); deltas == final text == whole "
      f"text: {''.join(deltas) == final.output_text == streamed == whole.output_text}"
    )
    assert "".join(deltas) == final.output_text == streamed == whole.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))

    got = a.responses.retrieve(r2.id)
    a.responses.delete(whole.id)
    try:
      a.responses.retrieve(whole.id)
      raise AssertionError("a deleted response was retrieved")
    except openai.NotFoundError:
      pass
    print(f"retrieve: same text {got.output_text == r2.output_text}; delete: then retrieve is 404")
    assert got.output_text == r2.output_text
    for call in (
      lambda: b.responses.retrieve(r1.id),
      lambda: b.responses.create(input="x", previous_response_id=r1.id, **greedy),
    ):
      try:
        call()
        raise AssertionError("key B reached key A's response")
      except openai.NotFoundError as e:
        message = e.body["message"] if isinstance(e.body, dict) else str(e)
    print(f"two keys: key B gets 404 for key A's response: {message[:100]!r}...")

    deadline = time.time() + 60  # the states of r1, r2 reach the directory (the engine writes them)
    while metric(url, "state_cache_files_written_total") < 2 and time.time() < deadline:
      time.sleep(0.2)
    cont = dict(input="What about the birds?", previous_response_id=r1.id, **greedy)
    c_before = a.responses.create(**cont)
    last = a.responses.create(input="One more.", previous_response_id=c_before.id, **greedy)
  finally:
    os.kill(proc.pid, signal.SIGKILL)  # right after the last reply
    proc.wait()
  print(f"kill -9 right after storing {last.id}")
  proc, url = start(args.server_python, cache_dir)
  try:
    a = openai.OpenAI(base_url=url + "/v1", api_key=KEYS[0])
    c_after = a.responses.create(**cont)
    print(
      f"after restart: continuation of {r1.id} gives the same text as before the kill: "
      f"{c_after.output_text == c_before.output_text} (cached_tokens "
      f"{c_after.usage.input_tokens_details.cached_tokens} of {c_after.usage.input_tokens})"
    )
    assert c_after.output_text == c_before.output_text
    assert a.responses.retrieve(last.id).output_text == last.output_text
    nxt = a.responses.create(input="Go on.", previous_response_id=last.id, **greedy)
    print(f"  the last response before the kill: retrieved, and continued ({nxt.status})")
  finally:
    os.kill(proc.pid, signal.SIGTERM)
    proc.wait()
  print("ok")


if __name__ == "__main__":
  main()
