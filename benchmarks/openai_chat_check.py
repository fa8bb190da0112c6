"""The official openai client against `python -m serve`: chat.completions.create, whole and streamed (the
deltas must add up to the whole reply at temperature 0), with logprobs; then the tokenizer endpoints.
Run it from a venv that has `openai` (not a project dependency), the server already up:

    python -m serve --preset tiny --random-init --port 8131 &
    /path/to/venv/bin/python -m benchmarks openai_chat_check http://127.0.0.1:8131
"""

import json
import sys
import urllib.request

import openai


def main():
  base = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8131"
  client = openai.OpenAI(base_url=base + "/v1", api_key="none")
  model = client.models.list().data[0].id
  msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
  whole = client.chat.completions.create(
    model=model, messages=msgs, max_completion_tokens=12, temperature=0, logprobs=True, top_logprobs=2
  )
  c = whole.choices[0]
  print(f"openai {openai.__version__}; model {model}")
  print(
    f"whole: finish={c.finish_reason} usage={whole.usage.model_dump(exclude_none=True)} "
    f"logprobs={len(c.logprobs.content)} tokens x top {len(c.logprobs.content[0].top_logprobs)}"
  )
  print(f"  content={c.message.content!r}")
  stream = client.chat.completions.create(
    model=model,
    messages=msgs,
    max_tokens=12,
    temperature=0,
    stream=True,
    stream_options={"include_usage": True},
  )
  text, finish, usage, n = "", None, None, 0
  for chunk in stream:
    n += 1
    usage = chunk.usage or usage
    for ch in chunk.choices:
      text += ch.delta.content or ""
      finish = ch.finish_reason or finish
  print(
    f"stream: {n} chunks, finish={finish}, usage={usage.model_dump(exclude_none=True)}, "
    f"same text as whole: {text == c.message.content}"
  )
  assert (
    text == c.message.content and finish == c.finish_reason and usage.total_tokens == whole.usage.total_tokens
  )
  two = client.chat.completions.create(model=model, messages=msgs, max_tokens=5, n=2, seed=1)
  print(f"n=2 seed=1: {[x.message.content for x in two.choices]}")

  def post(path, body):
    req = urllib.request.Request(base + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(req))

  tok = post("/tokenize", {"messages": msgs, "add_generation_prompt": True})
  print(
    f"/tokenize messages: count={tok['count']} max_model_len={tok['max_model_len']}; /detokenize: "
    f"{post('/detokenize', {'tokens': tok['tokens']})['prompt']!r}"
  )
  print("ok")


if __name__ == "__main__":
  main()
