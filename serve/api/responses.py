"""POST /v1/responses, GET and DELETE /v1/responses/{id}: OpenAI's Responses API over the completion path
of serve.api.completions, a peer of serve.api.chat (it uses only the Server's public functions).

`input` (a string, or message items with text content) is rendered to a prompt by the server's chat template
(serve.api.chat.ChatTemplate), `instructions` first as a system message; the reply is a completion of that prompt
(same engine path, same stop strings as chat). Fields that would change the output and are not served here
(tools, reasoning, structured text formats, include, background, ...) get a 400 naming them; fields that
change nothing here (user, service_tier, prompt_cache_key, ...) are accepted and echoed; unknown ones get a 400.

A stored response (`store`, default true; serve.api.response_store) keeps the exact token ids its state has
consumed: its prompt and its reply's kept tokens (`Choice.kept`: without a stop id or a stop string's
tokens). A request naming it in `previous_response_id` continues from those ids, never a re-tokenized
history: its prompt is those ids followed by the tokens of only what the template renders after them, the
turn separator and the new input:

    render(conversation + new messages, add_generation_prompt=True)
      minus render(conversation, add_generation_prompt=False)

when the second is a prefix of the first (as text; the default template's is "\\n\\nUser: ...\\n\\nAssistant:").
So the state cache restores the state the previous response ended with and prefills only the new part. A
template for which it is not a prefix (one that renders earlier turns differently once more follow) falls back
to the whole conversation rendered again and tokenized: the tokens the template gives, prefilled from the
longest cached prefix there is.

Instructions: OpenAI does not carry a response's `instructions` over to the next one. A state cannot forget
what it has consumed, so here the instructions stay where they were given in the conversation: a continuation
whose `instructions` equal the previous response's adds nothing (exactly OpenAI's context), other instructions
are added as a system message before the new input, and without `instructions` the earlier ones stay in the
context. To drop them, start a new conversation with the history as `input`.
"""

from __future__ import annotations

import array
import asyncio
import dataclasses
import json
import logging
import time
import uuid
from typing import TYPE_CHECKING

from aiohttp import web

from serve.api import chat, completions, constraints, grammar, protocol, toolcalls
from serve.api.protocol import ApiError, show
from serve.api.response_store import Record, ResponseStore

if TYPE_CHECKING:
  from serve.api.server import Server

log = logging.getLogger(__name__)

ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text")
MAX_METADATA = 16  # OpenAI's bounds on metadata: pairs, key and value characters
MAX_METADATA_KEY, MAX_METADATA_VALUE = 64, 512
MAX_ID_CHARS = 64  # characters of an identifier field echoed back (user, prompt_cache_key, ...)
# Served fields.
SERVED = frozenset(
  {
    "model",
    "input",
    "instructions",
    "previous_response_id",
    "store",
    "max_output_tokens",
    "temperature",
    "top_p",
    "stream",
    "metadata",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "text",
  }
)
# Fields that change nothing here (no tools, one server tier, no routing): accepted, echoed.
ACCEPTED = frozenset(
  {
    "user",
    "safety_identifier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "service_tier",
    "max_tool_calls",
    "stream_options",
  }
)


# Fields that would change the output and are not served: refused unless absent or at their "off" value.
REFUSED = {
  "reasoning": (lambda v: isinstance(v, dict) and all(x is None for x in v.values()), "{}"),
  "include": (lambda v: v == [], "[]"),
  "background": (lambda v: v is False, "false"),
  "conversation": (lambda v: False, "nothing (use previous_response_id)"),
  "prompt": (lambda v: False, "nothing (prompt templates are not served)"),
  "truncation": (lambda v: v in ("disabled", "auto"), '"disabled" or "auto" (nothing is truncated)'),
  "top_logprobs": (lambda v: protocol.is_int(v) and v == 0, "0"),
  "context_management": (lambda v: v == [], "[]"),
  "moderation": (lambda v: False, "nothing"),
  "prompt_cache_options": (lambda v: False, "nothing"),
  "background_options": (lambda v: False, "nothing"),
  "access_programs": (lambda v: False, "nothing"),
  "image": (lambda v: False, "nothing (text only)"),
}
_prefix_fallback_logged = False


@dataclasses.dataclass
class Turn:
  """A parsed /v1/responses request: what the reply continues and what is stored with it."""

  tenant: str
  messages: list  # the conversation as rendered into the prompt (earlier turns, instructions, new input)
  instructions: str | None
  previous: Record | None
  store: bool
  echo: dict  # request fields the response object repeats


def unknown(rid, store: ResponseStore, param: str | None = None) -> ApiError:
  """The one answer for an id this key cannot see: never stored, deleted, dropped, or another key's."""
  n = store.max_per_tenant
  return ApiError(
    404,
    f"no stored response {show(rid, 60)} for this API key: it was never stored ('store': false), was "
    f"deleted, or was dropped as one of the key's oldest past the budget of {n} stored responses per key "
    f"(--max_stored_responses). Continue a conversation before {n} newer responses are stored (or ask for "
    "a larger budget), or send its history as 'input' without 'previous_response_id'.",
    param,
  )


def _call_item(item: dict, where: str, out: list):
  """A function_call item (a call the model made) as a tool call of the assistant message before it (or of
  a new one); a function_call_output item (its result) as a tool message."""
  if item["type"] == "function_call_output":
    call_id, output = item.get("call_id"), item.get("output")
    if not isinstance(call_id, str) or not isinstance(output, str):
      raise ApiError(
        400, f'\'{where}\' is {show(item, 60)}: expected {{"call_id": ..., "output": a string}}.', "input"
      )
    out.append({"role": "tool", "content": output, "tool_call_id": call_id})
    return
  name, args, call_id = item.get("name"), item.get("arguments"), item.get("call_id")
  if not all(isinstance(x, str) for x in (name, args, call_id)):
    raise ApiError(
      400,
      f'\'{where}\' is {show(item, 60)}: expected {{"call_id", "name", "arguments": a JSON string}}.',
      "input",
    )
  call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
  if out and out[-1]["role"] == "assistant":
    out[-1].setdefault("tool_calls", []).append(call)
  else:
    out.append({"role": "assistant", "content": "", "tool_calls": [call]})


def parse_input(v) -> list:
  """`input` as chat messages [{"role", "content"}]: a string is one user message; message items (with or
  without "type": "message") have a role and a string or a list of input_text / output_text parts;
  function_call and function_call_output items are an assistant's tool calls and their results."""
  if isinstance(v, str):
    if not v:
      raise ApiError(400, "'input' is an empty string: expected text or a list of message items.", "input")
    return [{"role": "user", "content": v}]
  if not isinstance(v, list) or not v:
    raise ApiError(
      400,
      f"'input' is {show(v, 40)}: expected a string or a non-empty list of message items "
      '({"role": "user", "content": ...}).',
      "input",
    )
  if len(v) > chat.MAX_MESSAGES:
    raise ApiError(400, f"'input' has {len(v)} items: at most {chat.MAX_MESSAGES}.", "input")
  out: list[dict] = []
  for i, item in enumerate(v):
    where = f"input[{i}]"
    if not isinstance(item, dict):
      raise ApiError(
        400, f"'{where}' is {show(item, 40)}: expected a message item with 'role' and 'content'.", "input"
      )
    kind = item.get("type", "message")
    if kind in ("function_call", "function_call_output"):
      _call_item(item, where, out)
      continue
    if kind != "message":
      raise ApiError(
        400,
        f"'{where}' is a {show(kind, 40)} item: this server takes message, function_call and "
        "function_call_output items (no reasoning or item references).",
        "input",
      )
    role = item.get("role")
    if role not in ROLES:
      raise ApiError(400, f"'{where}.role' is {show(role, 40)}: expected one of {list(ROLES)}.", "input")
    content = item.get("content")
    if isinstance(content, list):
      texts = []
      for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
          raise ApiError(
            400,
            f"'{where}.content[{j}]' is {show(kind if kind else part, 40)}: this server takes text only "
            '({"type": "input_text" or "output_text", "text": ...}).',
            "input",
          )
        texts.append(part["text"])
      content = "".join(texts)
    elif not isinstance(content, str):
      raise ApiError(
        400, f"'{where}.content' is {show(content, 40)}: expected a string or a list of text parts.", "input"
      )
    out.append({"role": role, "content": content})
  return out


def _check_fields(obj: dict):
  for name, v in obj.items():
    if name in SERVED or name in ACCEPTED or v is None:
      continue
    if name in REFUSED:
      ok, off = REFUSED[name]
      if not ok(v):
        raise ApiError(
          400,
          f"'{name}'={show(v)} is not supported by this server (it would change the output): omit it or "
          f"send {off}.",
          name,
        )
      continue
    raise ApiError(
      400,
      f"unknown parameter {show(name, 60)}: /v1/responses here takes {sorted(SERVED | ACCEPTED)} "
      "(see docs/SERVING.md).",
      name,
    )


def _echo(obj: dict, max_tokens: int, c: protocol.Completion) -> dict:
  """The request's settings as the response object repeats them (every identifier field checked)."""
  for name in ("user", "safety_identifier", "prompt_cache_key"):
    protocol.get_field(
      obj,
      name,
      None,
      lambda v: isinstance(v, str) and len(v) <= MAX_ID_CHARS,
      f"a string of at most {MAX_ID_CHARS} characters",
    )
  protocol.get_field(obj, "stream_options", {}, lambda v: isinstance(v, dict), "an object")
  protocol.get_field(obj, "max_tool_calls", None, lambda v: protocol.is_int(v) and v >= 0, "an integer >= 0")
  protocol.get_field(
    obj, "service_tier", None, lambda v: isinstance(v, str) and len(v) <= 32, "a service tier name"
  )
  protocol.get_field(
    obj, "prompt_cache_retention", None, lambda v: v in ("in_memory", "24h"), '"in_memory" or "24h"'
  )
  metadata = protocol.get_field(
    obj,
    "metadata",
    {},
    lambda v: (
      isinstance(v, dict)
      and len(v) <= MAX_METADATA
      and all(
        isinstance(k, str)
        and len(k) <= MAX_METADATA_KEY
        and isinstance(x, str)
        and len(x) <= MAX_METADATA_VALUE
        for k, x in v.items()
      )
    ),
    f"an object of at most {MAX_METADATA} string values of at most {MAX_METADATA_VALUE} characters, "
    f"keys of at most {MAX_METADATA_KEY}",
  )
  return {
    "max_output_tokens": max_tokens,
    "max_tool_calls": obj.get("max_tool_calls"),
    "metadata": metadata,
    "parallel_tool_calls": obj.get("parallel_tool_calls", True),
    "prompt_cache_key": obj.get("prompt_cache_key"),
    "safety_identifier": obj.get("safety_identifier"),
    "temperature": c.temperature,
    "tool_choice": obj.get("tool_choice") or "auto",
    "tools": obj.get("tools") or [],
    "text": {"format": (obj.get("text") or {}).get("format") or {"type": "text"}, "verbosity": "medium"},
    "top_p": c.top_p,
    "truncation": obj.get("truncation") or "disabled",
    "user": obj.get("user"),
  }


def parse_request(
  obj: dict, limits: protocol.Limits, template: chat.ChatTemplate, store: ResponseStore, tenant: str
) -> tuple[protocol.Completion, Turn]:
  """A /v1/responses request checked and turned into the completion of its prompt (blocking: it renders
  and tokenizes; run it off the event loop)."""
  _check_fields(obj)
  keep = protocol.get_field(obj, "store", True, lambda v: isinstance(v, bool), "true or false")
  instructions = protocol.get_field(obj, "instructions", None, lambda v: isinstance(v, str), "a string")
  max_tokens = protocol.get_field(
    obj,
    "max_output_tokens",
    min(chat.DEFAULT_MAX_TOKENS, limits.max_tokens),
    lambda v: protocol.is_int(v) and 1 <= v <= limits.max_tokens,
    f"an integer in [1, {limits.max_tokens}]",
  )
  body = {k: obj[k] for k in ("model", "temperature", "top_p", "stream") if k in obj}
  c = protocol.parse_settings({**body, "max_tokens": max_tokens}, limits)
  text = protocol.get_field(
    obj,
    "text",
    {},
    lambda v: isinstance(v, dict) and not set(v) - {"format", "verbosity"},
    '{"format": {...}}',
  )
  if text.get("verbosity") not in (None, "medium"):
    raise ApiError(
      400, f"'text.verbosity' is {show(text['verbosity'], 40)}: only \"medium\" is served.", "text"
    )
  fmt = constraints.json_format(text.get("format"), "text", True, grammar.LIMITS)
  tool_constraint, tools = constraints.tools(obj, True, grammar.LIMITS, template.call_lead)
  if fmt is not None and tool_constraint is not None:
    raise ApiError(
      400,
      "'text.format' and 'tools' (with a tool_choice other than \"none\") are not served together: send one "
      "of them.",
      "text",
    )
  hf_tools = constraints.hf_tools(tools) if tools else None
  echo = _echo(obj, max_tokens, c)
  if "input" not in obj:
    raise ApiError(400, "'input' is missing: expected a string or a list of message items.", "input")
  new = parse_input(obj["input"])
  prev_id = obj.get("previous_response_id")
  previous = None
  if prev_id is not None:
    if not isinstance(prev_id, str):
      raise ApiError(
        400, f"'previous_response_id' is {show(prev_id, 40)}: expected a response id.", "previous_response_id"
      )
    previous = store.get(tenant, prev_id)
    if previous is None:
      raise unknown(prev_id, store, "previous_response_id")
  if previous is None:
    messages = ([{"role": "system", "content": instructions}] if instructions is not None else []) + new
    ids = template.encode(template.render(messages, tools=hf_tools))
  else:
    so_far = previous.messages
    added = (
      [] if instructions in (None, previous.instructions) else [{"role": "system", "content": instructions}]
    )
    messages = so_far + added + new
    ids = _continuation_ids(previous, messages, template, hf_tools)
  try:
    ids, _ = protocol.prompt_ids_of(ids, limits, template.encode)
  except ApiError as e:
    e.param = "input"
    e.message = e.message.replace("the prompt", "the conversation").replace("'prompt'", "the conversation")
    raise
  c = protocol.with_prompts(c, [ids], [None], limits)
  for s in template.stop:
    if s not in c.stop:
      c.stop.append(s)
  c = protocol.with_constraint(c, fmt or tool_constraint, limits)
  return c, Turn(tenant, messages, instructions, previous, keep, echo)


def _continuation_ids(previous: Record, messages: list, template: chat.ChatTemplate, tools=None) -> list:
  """The previous response's exact ids, then the tokens of what the template renders after its reply (both
  rendered with this request's tools: a tool list stays where it was given, as instructions do)."""
  global _prefix_fallback_logged
  head = template.render(previous.messages, add_generation_prompt=False, tools=tools)
  full = template.render(messages, add_generation_prompt=True, tools=tools)
  if full.startswith(head):
    return previous.ids.tolist() + template.encode(full[len(head) :])
  if not _prefix_fallback_logged:
    _prefix_fallback_logged = True
    log.warning(
      "responses: the chat template renders a conversation differently once more turns follow, so "
      "continuations (previous_response_id) are rendered and tokenized whole, not resumed from the state "
      "the previous response ended with (logged once)"
    )
  return template.encode(full)


class Responses:
  """The Responses routes over a Server: `Responses(server, template, store).register(app)`."""

  def __init__(self, server: Server, template: chat.ChatTemplate, store: ResponseStore):
    self.server, self.template, self.store = server, template, store

  def register(self, app: web.Application):
    app.router.add_post("/v1/responses", self.create)
    app.router.add_get("/v1/responses/{response_id}", self.retrieve)
    app.router.add_delete("/v1/responses/{response_id}", self.delete)

  async def create(self, request):
    s = self.server
    tenant = s.check_key(request)
    obj = await completions.read_json(request)
    s.completion.admit(1, tenant)
    c, turn = await asyncio.get_running_loop().run_in_executor(
      None, lambda: parse_request(obj, s.limits, self.template, self.store, tenant)
    )
    whole = lambda choices, c, meta: self._whole(turn, choices, c, meta)
    stream = lambda request, choices, c, meta: self._stream(turn, request, choices, c, meta)
    return await s.completion.run(request, c, whole, stream, "resp_")

  async def retrieve(self, request):
    tenant = self.server.check_key(request)
    if request.query.get("stream", "false").lower() not in ("false", "0"):
      raise ApiError(400, "'stream' on GET /v1/responses/{id} is not supported: omit it.", "stream")
    rid = request.match_info["response_id"]
    rec = self.store.get(tenant, rid)
    if rec is None:
      raise unknown(rid, self.store)
    return await completions.json_reply(lambda: rec.response)

  async def delete(self, request):
    tenant = self.server.check_key(request)
    rid = request.match_info["response_id"]
    if not await asyncio.get_running_loop().run_in_executor(None, self.store.delete, tenant, rid):
      raise unknown(rid, self.store)
    return web.json_response({"id": rid, "object": "response.deleted", "deleted": True})

  # ---- the response object ----

  def _object(self, turn: Turn, meta: dict, status: str, output: list, usage, reason=None) -> dict:
    return {
      "id": meta["id"],
      "object": "response",
      "created_at": meta["created"],
      "status": status,
      "background": False,
      "completed_at": int(time.time()) if status in ("completed", "incomplete") else None,
      "error": None,
      "incomplete_details": None if reason is None else {"reason": reason},
      "instructions": turn.instructions,
      "model": meta["model"],
      "output": output,
      "previous_response_id": None if turn.previous is None else turn.previous.id,
      "reasoning": {"effort": None, "summary": None},
      "service_tier": "default",
      "store": turn.store,
      "top_logprobs": 0,
      "usage": usage,
      **turn.echo,
    }

  @staticmethod
  def _message(msg_id: str, status: str, text: str | None) -> dict:
    content = (
      [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    )
    return {"id": msg_id, "type": "message", "status": status, "role": "assistant", "content": content}

  def _usage(self, c, choices) -> dict:
    u = self.server.completion.usage(c, choices)
    return {
      "input_tokens": u["prompt_tokens"],
      "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]},
      "output_tokens": u["completion_tokens"],
      "output_tokens_details": {"reasoning_tokens": 0},
      "total_tokens": u["total_tokens"],
    }

  @staticmethod
  def _call_item(call: toolcalls.Call, item_id: str, status: str) -> dict:
    return {
      "id": item_id,
      "type": "function_call",
      "status": status,
      "call_id": call.id,
      "name": call.name,
      "arguments": call.arguments,
    }

  def _final(self, turn, choices, c, meta, items: list) -> dict:
    """The finished response object from its output items (a reply cut by max_output_tokens is
    'incomplete', and so are its items)."""
    cut = choices[0].finish == "length"
    status = "incomplete" if cut else "completed"
    for item in items:
      item["status"] = status
    return self._object(
      turn, meta, status, items, self._usage(c, choices), "max_output_tokens" if cut else None
    )

  @staticmethod
  def _assistant(items: list) -> dict:
    """The reply as the chat message a continuation renders: its text, then its calls."""
    text = "".join(p["text"] for i in items if i["type"] == "message" for p in i["content"])
    calls = [
      {"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
      for i in items
      if i["type"] == "function_call"
    ]
    return {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}

  async def _keep(self, turn: Turn, choices, c, resp: dict):
    """Store the finished response (its file written first, when persisted) unless `store` is false."""
    if not turn.store:
      return
    ch = choices[0]

    def put():  # off the event loop: a conversation's ids run to --max_prompt_tokens, and a file is written
      ids = array.array("i", c.prompt_ids)
      ids.extend(ch.out_ids[: ch.kept])
      self.store.put(
        Record(
          id=resp["id"],
          tenant=turn.tenant,
          created_at=resp["created_at"],
          ids=ids,
          messages=turn.messages + [self._assistant(resp["output"])],
          instructions=turn.instructions,
          response=resp,
        )
      )

    await asyncio.get_running_loop().run_in_executor(None, put)

  async def _whole(self, turn: Turn, choices, c, meta):
    parts = []
    async for _, piece, _, _ in self.server.completion.pieces(choices, c):
      parts.append(piece)
    text = "".join(parts)
    if chat.calls_expected(c):
      content, calls = toolcalls.parse(text)
      items = [self._message(f"msg_{uuid.uuid4().hex}", "", content)] if content else []
      items += [self._call_item(k, f"fc_{uuid.uuid4().hex}", "") for k in calls]
    else:
      items = [self._message(f"msg_{uuid.uuid4().hex}", "", text)]
    resp = self._final(turn, choices, c, meta, items)
    await self._keep(turn, choices, c, resp)
    return await completions.json_reply(lambda: resp)

  async def _stream(self, turn: Turn, request, choices, c, meta):
    """OpenAI's event sequence: created, in_progress, then per output item (a message: output_item.added,
    content_part.added, output_text.delta ..., output_text.done, content_part.done, output_item.done; a
    function call: output_item.added, function_call_arguments.delta ..., function_call_arguments.done,
    output_item.done), then completed (or incomplete); an error after the headers went out: error, then
    failed. Without tools the message item opens first; with tools an item opens when its text or call
    starts."""
    resp = web.StreamResponse(
      headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )
    await resp.prepare(request)
    out = StreamedItems(resp)
    try:
      started = self._object(turn, meta, "in_progress", [], None)
      await out.send("response.created", response=started)
      await out.send("response.in_progress", response=started)
      calls = toolcalls.CallStream() if chat.calls_expected(c) else None
      if calls is None:
        await out.open_item(self._message(f"msg_{uuid.uuid4().hex}", "in_progress", None))
      try:
        async for _, piece, reason, _ in self.server.completion.pieces(choices, c):
          events = [toolcalls.Content(piece)] if calls is None and piece else []
          if calls is not None:
            events = calls.feed(piece) + (calls.close() if reason is not None else [])
          for e in events:
            await out.on_event(e)
      except ApiError as e:  # headers are out: report in the stream
        await out.send("error", code=e.kind, message=e.message, param=e.param)
        failed = self._object(turn, meta, "failed", [], None)
        failed["error"] = {"code": "server_error", "message": e.message}
        await out.send("response.failed", response=failed)
        await resp.write_eof()
        return resp
      if not out.items:  # an empty reply is one empty message
        await out.open_item(self._message(f"msg_{uuid.uuid4().hex}", "in_progress", None))
      out.closing = "incomplete" if choices[0].finish == "length" else "completed"
      await out.close_item()
      final = self._final(turn, choices, c, meta, out.items)
      await self._keep(turn, choices, c, final)
      await out.send(f"response.{final['status']}", response=final)
      await resp.write_eof()
    except ConnectionResetError:  # the client left; CompletionRunner.run frees the slot
      pass
    return resp


def _text_part(text: str) -> dict:
  return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class StreamedItems:
  """A streamed response's events, numbered in order, and its output items as they open, grow and close (a
  message's text, a function call's arguments): what Responses._stream sends between created and
  completed."""

  def __init__(self, resp: web.StreamResponse):
    self.resp = resp
    self.seq = 0
    self.items: list = []  # output items: finished, and the open one last
    self.is_open = False
    self.closing = "completed"  # the status an item closes with (the last: the response's)

  async def send(self, kind: str, **fields):
    data = json.dumps({"type": kind, "sequence_number": self.seq, **fields})
    self.seq += 1
    await self.resp.write(f"event: {kind}\ndata: {data}\n\n".encode())

  async def open_item(self, item: dict):
    await self.close_item()
    items = self.items
    items.append(item)
    self.is_open = True
    await self.send("response.output_item.added", output_index=len(items) - 1, item=item)
    if item["type"] == "message":
      await self.send(
        "response.content_part.added",
        item_id=item["id"],
        output_index=len(items) - 1,
        content_index=0,
        part=_text_part(""),
      )

  async def close_item(self):
    if not self.is_open:
      return
    self.is_open = False
    items = self.items
    item, where = items[-1], {"item_id": items[-1]["id"], "output_index": len(items) - 1}
    item["status"] = self.closing
    if item["type"] == "message":
      text = "".join(p["text"] for p in item["content"])
      item["content"] = [_text_part(text)]
      await self.send("response.output_text.done", **where, content_index=0, text=text, logprobs=[])
      await self.send("response.content_part.done", **where, content_index=0, part=_text_part(text))
    else:
      await self.send("response.function_call_arguments.done", **where, arguments=item["arguments"])
    await self.send("response.output_item.done", output_index=len(items) - 1, item=item)

  async def on_event(self, e):
    """One event of the reply's text (toolcalls.Content, CallStart, or a call's arguments) as its items'
    events."""
    items = self.items
    if isinstance(e, toolcalls.Content):
      if not (self.is_open and items[-1]["type"] == "message"):
        await self.open_item(Responses._message(f"msg_{uuid.uuid4().hex}", "in_progress", None))
      items[-1]["content"].append(_text_part(e.text))
      await self.send(
        "response.output_text.delta",
        item_id=items[-1]["id"],
        output_index=len(items) - 1,
        content_index=0,
        delta=e.text,
        logprobs=[],
      )
    elif isinstance(e, toolcalls.CallStart):
      await self.open_item(
        Responses._call_item(e.call, f"fc_{uuid.uuid4().hex}", "in_progress") | {"arguments": ""}
      )
    else:
      items[-1]["arguments"] += e.text
      await self.send(
        "response.function_call_arguments.delta",
        item_id=items[-1]["id"],
        output_index=len(items) - 1,
        delta=e.text,
      )
