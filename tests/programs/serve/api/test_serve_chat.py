"""serve.api.chat and serve.api.tokenize_api over loopback: a chat request is the completion of its rendered prompt
(same tokens, logprobs and usage; streamed deltas add up to the whole reply), its fields are checked with
400s, Hugging Face-style Jinja templates render sandboxed, and /tokenize, /detokenize, /tokenizer_info
answer in vLLM's shapes."""

import json

import pytest
from helpers import serve_fixtures as sf
from helpers.serve_fixtures import KEY, call

from serve.api import chat, protocol
from serve.engine.state_cache import StateCache

HI = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
RENDERED = "System: Be brief.\n\nUser: Hello there\n\nAssistant:"


@pytest.fixture(scope="module")
def tok():
  return sf.gpt2_tokenizer()


@pytest.fixture(scope="module")
def served(tok):
  engine = sf.fake_engine(n_slots=4, prefill_batch=2, max_queue=4)
  with sf.serving(
    engine, tok, sf.limits(tok, engine, max_tokens=64, max_prompt_tokens=1000, max_prompts=8), api_key=KEY
  ) as served:
    yield served


def _chat(url, **body):
  return call(url, path="/v1/chat/completions", body={"messages": HI, "temperature": 0, **body})


def test_chat_is_the_completion_of_the_rendered_prompt(served):
  url, _ = served
  st, ref = call(
    url, body={"prompt": RENDERED, "max_tokens": 12, "temperature": 0, "logprobs": 2, "stop": ["\n\nUser:"]}
  )
  assert st == 200, ref
  st, out = _chat(url, max_completion_tokens=12, logprobs=True, top_logprobs=2)
  assert st == 200, out
  assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-")
  (c,) = out["choices"]
  assert c["message"] == {"role": "assistant", "content": ref["choices"][0]["text"]}
  assert c["finish_reason"] == ref["choices"][0]["finish_reason"] and out["usage"] == ref["usage"]
  lp = c["logprobs"]["content"]
  assert [e["token"] for e in lp] == ref["choices"][0]["logprobs"]["tokens"]
  assert [e["logprob"] for e in lp] == ref["choices"][0]["logprobs"]["token_logprobs"]
  assert all(
    len(e["top_logprobs"]) == 2 and bytes(e["bytes"]).decode("utf-8", "replace") == e["token"] for e in lp
  )
  assert lp[0]["top_logprobs"][0]["logprob"] >= lp[0]["logprob"] - 1e-6  # greedy: the chosen is the top


def test_streamed_deltas_add_up_to_the_whole_reply(served):
  url, _ = served
  st, whole = _chat(url, max_tokens=10, n=2, seed=3, temperature=1.0)
  assert st == 200, whole
  st, events = _chat(
    url, max_tokens=10, n=2, seed=3, temperature=1.0, stream=True, stream_options={"include_usage": True}
  )
  assert st == 200 and events[-1] == "[DONE]", events
  chunks = [json.loads(e) for e in events[:-1]]
  assert all(ch["object"] == "chat.completion.chunk" for ch in chunks)
  text, finish, roles = {0: "", 1: ""}, {}, []
  for ch in chunks[:-1]:
    (c,) = ch["choices"]
    roles += [c["index"]] if c["delta"].get("role") == "assistant" else []
    text[c["index"]] += c["delta"].get("content", "")
    if c["finish_reason"]:
      finish[c["index"]] = c["finish_reason"]
  assert roles == [0, 1]
  assert [text[i] for i in (0, 1)] == [c["message"]["content"] for c in whole["choices"]]
  assert [finish[i] for i in (0, 1)] == [c["finish_reason"] for c in whole["choices"]]
  assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]


@pytest.mark.parametrize(
  "body, param",
  [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages"),
    (
      {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
      "messages",
    ),
    ({"messages": HI, "logprobs": 3}, "logprobs"),
    ({"messages": HI, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": HI, "logprobs": True, "top_logprobs": 6}, "top_logprobs"),
    ({"messages": HI, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": HI, "max_tokens": 2**64}, "max_tokens"),
    ({"messages": HI, "prompt": "hi"}, "prompt"),
    ({"messages": HI, "tools": [{"type": "retrieval"}]}, "tools"),
    ({"messages": HI, "tools": [{"type": "function", "function": {"name": "f g"}}]}, "tools"),
    ({"messages": HI, "tool_choice": "required"}, "tool_choice"),
    ({"messages": HI, "response_format": {"type": "xml"}}, "response_format"),
    (
      {"messages": HI, "response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
      "response_format",
    ),
    ({"messages": HI, "temperature": "hot"}, "temperature"),
    ({"messages": [{"role": "user", "content": " x" * 1100}]}, "messages"),
  ],
)
def test_bad_chat_fields_get_400_naming_the_field(served, body, param):
  url, _ = served
  st, out = call(url, path="/v1/chat/completions", body=body)
  assert st == 400 and out["error"]["param"] == param, out
  assert _chat(url, max_tokens=1)[0] == 200


def test_tokenizer_endpoints_in_vllms_shapes(served, tok):
  url, server = served
  st, out = call(url, path="/tokenize", body={"prompt": "Hello world", "return_token_strs": True})
  assert st == 200 and out["tokens"] == tok.encode("Hello world") and out["count"] == len(out["tokens"])
  assert out["token_strs"] == ["Hello", " world"] and out["max_model_len"] == 1000 + 64
  st, msg = call(url, path="/tokenize", body={"messages": HI})
  assert st == 200 and msg["tokens"] == tok.encode(RENDERED)
  st, bare = call(url, path="/tokenize", body={"messages": HI, "add_generation_prompt": False})
  assert bare["tokens"] == tok.encode("System: Be brief.\n\nUser: Hello there")
  st, back = call(url, path="/detokenize", body={"tokens": msg["tokens"]})
  assert st == 200 and back == {"prompt": RENDERED}
  st, info = call(url, "GET", "/tokenizer_info")
  assert st == 200 and info["eos_token"] == "<|endoftext|>" and info["chat_template"] == chat.DEFAULT_TEMPLATE
  for path, body in [
    ("/tokenize", {"prompt": 5}),
    ("/tokenize", {}),
    ("/detokenize", {"tokens": [50257]}),
    ("/detokenize", {"tokens": "1 2"}),
    ("/tokenize", {"prompt": "x", "model": "other"}),
  ]:
    assert call(url, path=path, body=body)[0] in (400, 404), (path, body)
  assert call(url, path="/tokenize", body={"prompt": "x"}, headers={})[0] == 401
  assert call(url, "GET", "/tokenizer_info", headers={})[0] == 401


def _limits(tok):
  return protocol.Limits(
    model_name="m",
    vocab_size=tok.vocab_size,
    eos_id=tok.eos_id,
    max_tokens=16,
    max_prompt_tokens=100,
    max_stop_ids=4,
  )


HF_STYLE = """{{ bos_token }}{% for message in messages %}
{% if message['role'] == 'system' %}{{ raise_exception('System messages are not supported.') }}{% endif %}
{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token }}{% endfor %}
{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"""


def test_hugging_face_style_templates_render_sandboxed(tok, tmp_path):
  f = tmp_path / "t.jinja"
  f.write_text(HF_STYLE)
  t = chat.ChatTemplate.from_file(str(f), tok)
  msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
  text = t.render(msgs)
  assert text == "<|endoftext|><|user|>\nHi<|endoftext|><|assistant|>\nYo<|endoftext|><|assistant|>\n"
  ids = t.encode(text)
  assert ids.count(tok.eos_id) == 3 and ids[0] == tok.eos_id and tok.token_bytes(ids).decode() == text
  c = chat.parse_chat({"messages": msgs, "max_tokens": 3}, _limits(tok), t)
  assert c.prompts == [ids] and c.max_tokens == 3 and c.stop == []  # no default stop with a custom template
  with pytest.raises(protocol.ApiError, match="System messages are not supported"):
    t.render([{"role": "system", "content": "x"}])
  evil = chat.ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}", tok)
  with pytest.raises(protocol.ApiError, match="chat template"):
    evil.render(msgs)
  cfg = tmp_path / "tokenizer_config.json"
  cfg.write_text(json.dumps({"chat_template": HF_STYLE}))
  assert chat.ChatTemplate.from_file(str(cfg), tok).render(msgs) == text
  (tmp_path / "bad.jinja").write_text("{% for %}")
  with pytest.raises(ValueError, match="not a Jinja template"):
    chat.ChatTemplate.from_file(str(tmp_path / "bad.jinja"), tok)
  with pytest.raises(ValueError, match="cannot read"):
    chat.ChatTemplate.from_file(str(tmp_path / "missing.jinja"), tok)


def test_a_bad_chat_template_stops_the_server_before_it_loads(tmp_path):
  from serve.__main__ import main

  with pytest.raises(SystemExit, match="--chat_template .*cannot read"):
    main(["--preset", "tiny", "--random-init", "--chat-template", str(tmp_path / "missing.jinja")])


CHATML = (
  "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.mark.parametrize(
  "template, stop, stream",
  [(None, None, False), (None, ["e"], True), (CHATML, None, True), (CHATML, ["e"], False)],
  ids=["default", "default-stop-streamed", "chatml-streamed", "chatml-stop"],
)
def test_each_later_turn_restores_the_previous_prompt_and_the_replys_text(tok, template, stop, stream):
  """A client re-sends each reply as received. The fake's replies are random ids, which re-tokenize into
  other ids, as a model with random weights gives: each later turn still restores the whole previous
  prompt from the state cache, with and without stop strings, with either template; appended text
  restores the previous prompt and reply as their text tokenizes (CompletionRunner.keep_resent)."""
  engine = sf.fake_engine(n_slots=2, prefill_batch=2, state_cache=StateCache("fake", 1 << 30))
  lim = sf.limits(tok, engine, max_tokens=64, max_prompt_tokens=4000, max_prompts=8)
  tmpl = chat.ChatTemplate(template, tok)
  with sf.serving(engine, tok, lim, api_key=KEY, chat_template=tmpl) as (url, _):
    messages = [{"role": "system", "content": "Be brief."}]
    previous = 0
    for turn in range(4):
      messages.append({"role": "user", "content": f"Question {turn}: what follows " + "word " * 20})
      body = {"messages": messages, "max_tokens": 12, "temperature": 1.0, "seed": turn, "stop": stop}
      if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
      st, out = call(url, path="/v1/chat/completions", body=body)
      assert st == 200, out
      if stream:
        events = [json.loads(x) for x in out if x.startswith("{")]
        reply = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
        usage = events[-1]["usage"]
      else:
        reply, usage = out["choices"][0]["message"]["content"], out["usage"]
      assert usage["prompt_tokens_details"]["cached_tokens"] >= previous, (turn, usage, previous)
      previous = usage["prompt_tokens"]
      messages.append({"role": "assistant", "content": reply})
    # Appended text: each prompt is the last one, its reply's text and more. The engine kept the state of
    # the prompt and reply as their text tokenizes (all but its last token, which what follows may join).
    prompt, previous = "Once upon a time\n\n", 0
    for turn in range(3):
      st, out = call(url, body={"prompt": prompt, "max_tokens": 10, "temperature": 0, "stop": stop})
      assert st == 200, out
      assert out["usage"]["prompt_tokens_details"]["cached_tokens"] >= previous
      prompt += out["choices"][0]["text"]
      previous = len(tok.encode(prompt)) - 1
      prompt += f" and then {turn}\n\n"
