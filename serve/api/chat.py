"""POST /v1/chat/completions: OpenAI's chat format over the completion path of serve.api.completions.

The messages are rendered to one prompt by a chat template, then the request runs as a completion of that
prompt (same engine path, same field checks, same stop strings and usage); only the reply's shape differs
(`message` / streamed `delta`, chat-style logprobs).

Templates are Jinja, as Hugging Face tokenizers write them (`messages`, `add_generation_prompt`,
`bos_token`, `eos_token`, `raise_exception`), rendered in jinja2's immutable sandbox. The default, for this
base model (trained on plain text, no chat tokens), is plain text:

    System: {system}\\n\\nUser: {user}\\n\\nAssistant: {assistant}\\n\\nUser: {user}\\n\\nAssistant:

(an assistant message that begins with a space or a newline, as a reply generated after "Assistant:" does,
follows the colon as it is: the history a client re-sends renders into the text the model produced), and,
with it, every request also stops at "\\n\\nUser:" (where a base model starts the next turn). With tools, a
system message listing them and the call format (serve/api/toolcalls.py) comes first; an assistant message's
`tool_calls` follow its content in that format, and `tool` messages (results) are "Tool: ..." turns. A
Hugging Face template gets `tools` and the messages' `tool_calls` (arguments as objects) as HF passes them.
Special-token text the rendered prompt holds ("<|endoftext|>") becomes the special token, as in
Hugging Face's and vLLM's chat paths.
"""

from __future__ import annotations

import asyncio
import json

import jinja2
from aiohttp import web
from jinja2.sandbox import ImmutableSandboxedEnvironment

from serve.api import completions, constraints, grammar, protocol, toolcalls
from serve.api.protocol import ApiError

# A reply is rendered after "Assistant:" as it was generated (it begins with its own space), so a re-sent
# history tokenizes into the ids the model consumed; other content gets one space after the colon.
DEFAULT_TEMPLATE = (
  "{% for m in messages %}"
  "{{ m['role'] | capitalize }}:"
  "{% if m['role'] == 'assistant' and m['content'][:1] in [' ', '\n'] %}{{ m['content'] }}"
  "{% else %}{{ ' ' + m['content'] }}{% endif %}"
  "{% if not loop.last or add_generation_prompt %}{{ '\\n\\n' }}{% endif %}"
  "{% endfor %}"
  "{% if add_generation_prompt %}Assistant:{% endif %}"
)
DEFAULT_STOP = "\n\nUser:"
ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_MESSAGES = 4096
DEFAULT_MAX_TOKENS = 256
# Chat fields that change the output and that this server does not do: refused unless absent or "off".
UNSUPPORTED = {
  "functions": [],
  "function_call": "none",
  "audio": None,
  "modalities": ["text"],
}
# Completion fields that are not chat fields.
NOT_CHAT = ("prompt", "echo", "suffix", "best_of", "return_token_ids")


def _raise(message):
  raise jinja2.TemplateError(str(message))


class ChatTemplate:
  """A compiled chat template and the special tokens it may name."""

  def __init__(self, source: str | None, tokenizer, *, where: str = "--chat_template"):
    self.source = DEFAULT_TEMPLATE if source is None else source
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    try:
      self.template = env.from_string(self.source)
    except jinja2.TemplateSyntaxError as e:
      raise ValueError(
        f"{where}: not a Jinja template (line {e.lineno}: {e.message}). Pass a chat template "
        "as Hugging Face tokenizer_config.json's 'chat_template' holds it."
      ) from None
    self.tok = tokenizer
    self.eos = tokenizer.token_bytes([tokenizer.eos_id]).decode()
    self.is_default = source is None
    self.stop = [DEFAULT_STOP] if source is None else []
    # what the model writes before a call it must make: the default template's space after "Assistant:"
    self.call_lead = " " if source is None else ""

  @classmethod
  def from_file(cls, path: str | None, tokenizer) -> ChatTemplate:
    if path is None:
      return cls(None, tokenizer)
    try:
      with open(path, encoding="utf-8") as f:
        source = f.read()
    except (OSError, UnicodeDecodeError) as e:
      raise ValueError(f"--chat_template {path}: cannot read it ({e}). Pass a UTF-8 Jinja file.") from None
    if source.lstrip().startswith("{") and path.endswith(".json"):  # a tokenizer_config.json
      try:
        source = json.loads(source)["chat_template"]
      except (ValueError, KeyError, TypeError):
        raise ValueError(
          f"--chat_template {path}: a JSON file without a 'chat_template' string. Pass the "
          "template itself or a tokenizer_config.json that has one."
        ) from None
    return cls(source, tokenizer, where=f"--chat_template {path}")

  def render(self, messages: list, add_generation_prompt: bool = True, tools: list | None = None) -> str:
    """The prompt of `messages` (parse_messages' shape); `tools`: Hugging Face's tool list, or None."""
    messages = _plain(messages, tools) if self.is_default else [_hf(m) for m in messages]
    try:
      return self.template.render(
        messages=messages,
        add_generation_prompt=add_generation_prompt,
        bos_token=self.eos,
        eos_token=self.eos,
        tools=tools or None,
      )
    except jinja2.TemplateError as e:  # raise_exception(...) in the template, or the sandbox refusing
      raise ApiError(400, f"the chat template refused these messages: {e}", "messages") from None
    except Exception as e:  # a template bug met by these messages
      raise ApiError(
        400, f"the chat template failed on these messages ({type(e).__name__}: {e}).", "messages"
      ) from None

  def encode(self, text: str) -> list:
    """Token ids of a rendered prompt: the EOS token's text becomes its id, the rest is ordinary text."""
    ids = []
    for i, part in enumerate(text.split(self.eos)):
      if i:
        ids.append(self.tok.eos_id)
      if part:
        ids += self.tok.encode(part)
    return ids


TOOLS_PREAMBLE = (
  "You can call these functions. To call one, write " + toolcalls.call_text("NAME", "ARGUMENTS") + " with "
  "ARGUMENTS a JSON object that follows its parameters:\n"
)


def _plain(messages: list, tools: list | None) -> list:
  """Messages for the default template: the tools as a first system message, each assistant message's
  calls after its content as the model writes them."""
  out = []
  if tools:
    listing = "\n".join(json.dumps(t["function"]) for t in tools)
    out.append({"role": "system", "content": TOOLS_PREAMBLE + listing})
  for m in messages:
    if m.get("tool_calls"):
      calls = toolcalls.calls_text(
        [(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]]
      )
      m = {"role": m["role"], "content": m["content"] + calls}
    out.append(m)
  return out


def _hf(m: dict) -> dict:
  """A message as Hugging Face templates take it: tool call arguments as objects (the string when it is
  not JSON)."""
  if not m.get("tool_calls"):
    return m
  calls = []
  for c in m["tool_calls"]:
    try:
      args = json.loads(c["function"]["arguments"])
    except ValueError:
      args = c["function"]["arguments"]
    calls.append({**c, "function": {"name": c["function"]["name"], "arguments": args}})
  return {**m, "tool_calls": calls}


def _tool_calls(v, where: str) -> list:
  """An assistant message's `tool_calls`, checked: [{"id", "type": "function", "function": {"name",
  "arguments": a string}}]."""
  want = '[{"id": ..., "type": "function", "function": {"name": ..., "arguments": a JSON string}}]'
  if not isinstance(v, list) or len(v) > grammar.LIMITS.max_tools:
    raise ApiError(400, f"'{where}' is {protocol.show(v, 40)}: expected {want}.", "messages")
  out = []
  for c in v:
    fn = c.get("function") if isinstance(c, dict) else None
    if (
      not isinstance(fn, dict)
      or c.get("type", "function") != "function"
      or not isinstance(fn.get("name"), str)
      or not isinstance(fn.get("arguments"), str)
      or not isinstance(c.get("id", ""), str)
    ):
      raise ApiError(400, f"'{where}' has {protocol.show(c, 60)}: expected {want}.", "messages")
    out.append(
      {
        "id": c.get("id", ""),
        "type": "function",
        "function": {"name": fn["name"], "arguments": fn["arguments"]},
      }
    )
  return out


def parse_messages(obj: dict) -> list:
  """The `messages` list, checked: roles, and content as a string or text parts (joined)."""
  msgs = obj.get("messages")
  if not isinstance(msgs, list) or not msgs:
    raise ApiError(
      400,
      f"'messages' is {protocol.show(msgs)}: expected a non-empty list of "
      '{"role": ..., "content": ...} objects.',
      "messages",
    )
  if len(msgs) > MAX_MESSAGES:
    raise ApiError(400, f"'messages' has {len(msgs)} messages: at most {MAX_MESSAGES}.", "messages")
  out = []
  for i, m in enumerate(msgs):
    where = f"messages[{i}]"
    if not isinstance(m, dict):
      raise ApiError(
        400, f"'{where}' is a {type(m).__name__}: expected an object with 'role' and 'content'.", "messages"
      )
    role = m.get("role")
    if role not in ROLES:
      raise ApiError(
        400, f"'{where}.role' is {protocol.show(role, 40)}: expected one of {list(ROLES)}.", "messages"
      )
    calls = m.get("tool_calls")
    if calls and role != "assistant":
      raise ApiError(400, f"'{where}.tool_calls': only assistant messages carry tool calls.", "messages")
    content = m.get("content")
    if isinstance(content, list):
      if not all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
      ):
        raise ApiError(
          400,
          f'\'{where}.content\' has a part that is not {{"type": "text", "text": ...}}: '
          "this server takes text only.",
          "messages",
        )
      content = "".join(p["text"] for p in content)
    elif content is None and role == "assistant":
      content = ""
    elif not isinstance(content, str):
      raise ApiError(
        400,
        f"'{where}.content' is {protocol.show(content, 40)}: expected a string or a list of text parts.",
        "messages",
      )
    msg = {"role": role, "content": content}
    if isinstance(m.get("name"), str):
      msg["name"] = m["name"]
    if calls:
      msg["tool_calls"] = _tool_calls(calls, f"{where}.tool_calls")
    if role == "tool" and isinstance(m.get("tool_call_id"), str):
      msg["tool_call_id"] = m["tool_call_id"]
    out.append(msg)
  return out


def _check_chat_fields(obj: dict):
  """400 for a /v1/completions field and for a field whose non-default value is not served."""
  for name in NOT_CHAT:
    if name in obj:
      raise ApiError(
        400,
        f"'{name}' is a /v1/completions field, not a chat one: omit it (or POST to /v1/completions).",
        name,
      )
  for name, off in UNSUPPORTED.items():
    if obj.get(name) not in (None, off):
      raise ApiError(
        400, f"'{name}'={protocol.show(obj[name])} is not supported by this server: omit it.", name
      )


def _chat_logprobs(obj: dict) -> int | None:
  """The chat format's `logprobs` (true or false) and `top_logprobs` (0..5) as the completion format's one
  count of alternatives (None: no logprobs)."""
  want = obj.get("logprobs")
  if want is not None and not isinstance(want, bool):
    raise ApiError(
      400,
      f"'logprobs' is {protocol.show(want, 40)}: expected true or false (chat format; "
      "'top_logprobs' sets how many alternatives).",
      "logprobs",
    )
  top = obj.get("top_logprobs")
  if top is not None and (not protocol.is_int(top) or not 0 <= top <= 5):
    raise ApiError(
      400, f"'top_logprobs' is {protocol.show(top, 40)}: expected an integer in [0, 5].", "top_logprobs"
    )
  if top is not None and not want:
    raise ApiError(400, "'top_logprobs' needs 'logprobs': true.", "top_logprobs")
  return (top or 0) if want else None


# The chat fields parse_chat reads itself; the rest are the completion format's sampling settings.
CHAT_FIELDS = (
  "messages",
  "logprobs",
  "top_logprobs",
  "max_tokens",
  "max_completion_tokens",
  "response_format",
  "tools",
  "tool_choice",
  "parallel_tool_calls",
)


def _settings(obj: dict, limits: protocol.Limits) -> dict:
  """The request as the completion format's settings (protocol.parse_settings): its sampling fields,
  max_tokens (from max_completion_tokens or max_tokens) and logprobs."""
  logprobs = _chat_logprobs(obj)
  body = {k: v for k, v in obj.items() if k not in CHAT_FIELDS}
  for name in ("max_completion_tokens", "max_tokens"):  # the newer name wins
    if obj.get(name) is not None:
      v = obj[name]
      if not protocol.is_int(v) or not 1 <= v <= limits.max_tokens:
        raise ApiError(
          400, f"'{name}' is {protocol.show(v, 40)}: expected an integer in [1, {limits.max_tokens}].", name
        )
      body["max_tokens"] = v
      break
  else:
    body["max_tokens"] = min(DEFAULT_MAX_TOKENS, limits.max_tokens)
  if logprobs is not None:
    body["logprobs"] = logprobs
  return body


def parse_chat(obj: dict, limits: protocol.Limits, template: ChatTemplate) -> protocol.Completion:
  """A chat request checked and turned into the completion of its rendered prompt."""
  _check_chat_fields(obj)
  messages = parse_messages(obj)
  tool_constraint, tools = constraints.tools(obj, False, grammar.LIMITS, template.call_lead)
  fmt = constraints.json_format(obj.get("response_format"), "response_format", False, grammar.LIMITS)
  if fmt is not None and tool_constraint is not None:
    raise ApiError(
      400,
      "'response_format' and 'tools' (with a tool_choice other than \"none\") are not served together: "
      "send one of them.",
      "response_format",
    )
  # every field checked before the messages are rendered
  c = protocol.parse_settings(_settings(obj, limits), limits)
  try:
    prompt = template.render(messages, tools=constraints.hf_tools(tools) if tools else None)
    ids, _ = protocol.prompt_ids_of(template.encode(prompt), limits, template.encode)
    c = protocol.with_prompts(c, [ids], [None], limits)
    c.resent_as_text = True
    c = protocol.with_prediction(c, obj, limits, template.tok.encode)
  except ApiError as e:
    if e.param == "prompt":
      e.param = "messages"
      e.message = e.message.replace("'prompt'", "the rendered messages")
    raise
  for s in template.stop:
    if s not in c.stop:
      c.stop.append(s)
  return protocol.with_constraint(c, fmt or tool_constraint, limits)


def calls_expected(c: protocol.Completion) -> bool:
  """Whether the reply's text is parsed for tool calls (the request's tools may be called)."""
  return c.constraint is not None and c.constraint.kind == "tools"


def reply_message(text: str, finish: str | None, with_calls: bool) -> tuple[dict, str | None]:
  """The assistant message of a whole reply and its finish_reason ("tool_calls" when it ended by calling)."""
  if not with_calls:
    return {"role": "assistant", "content": text}, finish
  content, calls = toolcalls.parse(text)
  message: dict = {"role": "assistant", "content": content or None}
  if not calls:
    return message, finish
  message["tool_calls"] = [
    {"id": k.id, "type": "function", "function": {"name": k.name, "arguments": k.arguments}} for k in calls
  ]
  return message, "tool_calls" if finish == "stop" else finish


def call_delta(e) -> dict:
  """OpenAI's streamed delta of a toolcalls event: content, a call's start (index, id, type, name) or a
  fragment of its arguments."""
  if isinstance(e, toolcalls.Content):
    return {"content": e.text}
  if isinstance(e, toolcalls.CallStart):
    fn = {"name": e.call.name, "arguments": ""}
    return {"tool_calls": [{"index": e.index, "id": e.call.id, "type": "function", "function": fn}]}
  return {"tool_calls": [{"index": e.index, "function": {"arguments": e.text}}]}


class Chat:
  """The chat route over a Server: `Chat(server, template).register(app)`."""

  def __init__(self, server, template: ChatTemplate):
    self.server, self.template = server, template

  def register(self, app: web.Application):
    app.router.add_post("/v1/chat/completions", self.completions)

  async def completions(self, request):
    s = self.server
    tenant = s.check_key(request)
    obj = await completions.read_json(request)
    s.completion.admit(protocol.count_choices({"n": obj.get("n")}), tenant)
    c = await asyncio.get_running_loop().run_in_executor(
      None, lambda: parse_chat(obj, s.limits, self.template)
    )
    return await s.completion.run(request, c, self._whole, self._stream, "chatcmpl-")

  def _logprobs(self, ch, c, first: int):
    """OpenAI chat logprobs ({"content": [...]}) of output tokens [first:]."""
    if c.logprobs is None:
      return None
    tb = self.server.tok.token_bytes
    entry = lambda t, v: {"token": tb([t]).decode("utf-8", "replace"), "logprob": v, "bytes": list(tb([t]))}
    out = []
    for t, lp in zip(ch.out_ids[first:], ch.req.progress.token_logprobs[first : len(ch.out_ids)]):
      out.append(
        {**entry(t, lp.logprob), "top_logprobs": [entry(x.id, x.logprob) for x in lp.top[: c.logprobs]]}
      )
    return {"content": out}

  async def _whole(self, choices, c, meta):
    parts = {ch.index: [] for ch in choices}
    async for ch, piece, _, _ in self.server.completion.pieces(choices, c):
      parts[ch.index].append(piece)

    def build():
      out = []
      for ch in choices:
        message, finish = reply_message("".join(parts[ch.index]), ch.finish, calls_expected(c))
        out.append(
          {
            "index": ch.index,
            "message": message,
            "logprobs": self._logprobs(ch, c, 0),
            "finish_reason": finish,
          }
        )
      return {
        **meta,
        "object": "chat.completion",
        "choices": out,
        "usage": self.server.completion.usage(c, choices),
      }

    return await completions.json_reply(build)

  async def _stream(self, request, choices, c, meta):
    resp = web.StreamResponse(
      headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )
    await resp.prepare(request)
    chunk = lambda cs: {**meta, "object": "chat.completion.chunk", "choices": cs}
    send = lambda obj: resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
    try:
      try:
        for ch in choices:  # OpenAI's first chunk of each choice names the role
          await send(
            chunk(
              [
                {
                  "index": ch.index,
                  "delta": {"role": "assistant", "content": ""},
                  "logprobs": None,
                  "finish_reason": None,
                }
              ]
            )
          )
        calls = {ch.index: toolcalls.CallStream() for ch in choices} if calls_expected(c) else None
        async for ch, piece, reason, _ in self.server.completion.pieces(choices, c):
          events = [] if calls is None else calls[ch.index].feed(piece)
          if calls is not None and reason is not None:
            events += calls[ch.index].close()
          deltas = [{"content": piece}] if calls is None and piece else [call_delta(e) for e in events]
          for delta in deltas:
            first, ch.sent = ch.sent, len(ch.out_ids)
            await send(
              chunk(
                [
                  {
                    "index": ch.index,
                    "delta": delta,
                    "logprobs": self._logprobs(ch, c, first),
                    "finish_reason": None,
                  }
                ]
              )
            )
          if reason is not None and calls is not None and calls[ch.index].calls and reason == "stop":
            reason = "tool_calls"
          if reason is not None:
            first, ch.sent = ch.sent, len(ch.out_ids)
            await send(
              chunk(
                [
                  {
                    "index": ch.index,
                    "delta": {},
                    "finish_reason": reason,
                    "logprobs": self._logprobs(ch, c, first) if first < ch.sent else None,
                  }
                ]
              )
            )
      except ApiError as e:  # headers are out: report in the stream
        await send(e.body())
      if c.include_usage:
        await send(chunk([]) | {"usage": self.server.completion.usage(c, choices)})
      await resp.write(b"data: [DONE]\n\n")
      await resp.write_eof()
    except ConnectionResetError:  # the client left; CompletionRunner.run frees the slots
      pass
    return resp
