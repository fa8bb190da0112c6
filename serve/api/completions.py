"""The completion path every generating route shares (/v1/completions, /v1/chat/completions, /v1/responses):
admission, a completion's choices submitted to the engine, their text as the engine delivers it (stop strings,
the tokens a reply keeps, the state a re-sent reply restores), OpenAI's logprobs and usage. The routes format
what it yields; the Server routes requests to them."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from aiohttp import web

from serve.api import grammar, protocol
from serve.api.protocol import ApiError
from serve.api.text import TextStream
from serve.engine.engine import Engine, EngineStopped, QueueFull, Request
from serve.engine.request import TokenLogprob

TENANT = web.RequestKey("tenant", str)  # set by Server.check_key
ENGINE_REQUESTS = web.RequestKey("engine_requests", list)  # set by CompletionRunner.run: what it submitted
RETOKENIZED_TAIL = 8  # prompt tokens tokenized again with a reply's text (CompletionRunner.keep_resent)


def engine_down() -> ApiError:
  """The refusal of every request while the engine's loop is not running (the reason is in the server log)."""
  return ApiError(503, "the engine is not running; see the server log. Retry later.", kind="server_error")


async def json_reply(build) -> web.Response:
  """A JSON response from `build()`, built and encoded off the event loop (with echo and logprobs, a reply
  can run to megabytes; protocol.reply_entries bounds it)."""
  body = await asyncio.get_running_loop().run_in_executor(None, lambda: json.dumps(build()).encode())
  return web.Response(body=body, content_type="application/json")


async def read_json(request) -> dict:
  """The request's JSON object (parsed off the event loop: a body may hold 4 MiB)."""
  raw = await request.read()
  return await asyncio.get_running_loop().run_in_executor(None, protocol.parse_body, raw)


class CompletionRunner:
  """One engine's completion path: `run` submits a completion and hands its choices to a route's format,
  which reads them through `pieces` (and `usage`, `logprobs`)."""

  def __init__(self, engine: Engine, tokenizer, limits: protocol.Limits):
    self.engine, self.tok, self.limits = engine, tokenizer, limits
    self.compiler = grammar.Compiler()

  def admit(self, choices: int, tenant: str):
    """Refuse at once (503, 429) what the engine could not take now, before any prompt is tokenized.
    A count over the per-request cap is left to the parser's 400."""
    if not self.engine.serving:
      raise engine_down()
    if choices <= protocol.choice_cap(self.limits)[0]:
      try:
        self.engine.check_room(choices, tenant)
      except QueueFull as e:
        raise ApiError(429, f"server busy: {e}. Retry later.") from None

  async def run(self, request, c: protocol.Completion, whole, stream, id_prefix: str):
    """Submit `c`'s choices to the engine and answer with `await whole(choices, c, meta)` or
    `await stream(request, choices, c, meta)` (the completion and chat formats share everything else)."""
    events: asyncio.Queue = asyncio.Queue()
    choices, leaders = [], []
    tenant = request.get(TENANT, "")
    compiled = None
    if c.constraint is not None:
      param = "tools" if c.constraint.kind == "tools" else "response_format"
      # THE PHASE-2 HOOK: the engine sets `applies_constraints = True` once its compiled calls take each
      # slot's mask (Request.constraint); until then a constrained reply could not keep its promise.
      if not getattr(self.engine, "applies_constraints", False):
        raise ApiError(
          501,
          f"'{param}': constrained decoding (JSON formats, tool calls) is not served by this engine yet; "
          'send the request without it (or with tool_choice "none").',
          param,
        )
      compiled = await self.compiler.compile(c.constraint, (tenant, c.cache_salt), param)

    def engine_request(ch: Choice, ids, j: int, siblings=()) -> Request:
      # Choice j follows seed + j: a prompt sent in a list, or with n, gets what it gets alone.
      return Request(
        prompt_ids=ids,
        max_tokens=c.max_tokens,
        temperature=c.temperature,
        top_k=c.top_k,
        top_p=c.top_p,
        seed=None if c.seed is None else (c.seed + j) % 2**64,
        stop_ids=c.stop_ids,
        logprobs=c.logprobs,
        echo=c.echo,
        siblings=siblings,
        context=ch,
        tenant=tenant,
        cache_salt=c.cache_salt,
        prediction_ids=c.prediction_ids,
        constraint=None if compiled is None else compiled.matcher(),
      )

    for p, ids in enumerate(c.prompts):
      members = [Choice(p * c.n + j, p, events) for j in range(c.n)]
      for j, ch in enumerate(members[1:], 1):
        ch.req = engine_request(ch, ids, j)
      members[0].req = engine_request(members[0], ids, 0, siblings=[ch.req for ch in members[1:]])
      for ch in members:
        ch.text = TextStream(self.tok.token_bytes, c.stop)
      choices += members
      leaders.append(members[0].req)
    if not self.engine.serving:
      raise engine_down()
    try:
      self.engine.submit_all(leaders)
      request[ENGINE_REQUESTS] = leaders
    except QueueFull as e:
      raise ApiError(429, f"server busy: {e}. Retry later.") from None
    except EngineStopped:
      raise engine_down() from None
    except ValueError as e:
      raise ApiError(400, str(e)) from None
    meta = {
      "id": f"{id_prefix}{uuid.uuid4().hex}",
      "created": int(time.time()),
      "model": self.limits.model_name,
    }
    try:
      if c.stream:
        return await stream(request, choices, c, meta)
      return await whole(choices, c, meta)
    finally:
      for ch in choices:
        if ch.req is not None and ch.req.progress.finish_reason is None:
          self.engine.cancel(ch.req)

  async def pieces(self, choices: list, c: protocol.Completion):
    """Yield (choice, text, finish_reason or None, first new token index) as the engine delivers."""
    live = set(choices)
    events = choices[0].events
    for ch in choices:
      if c.echo:
        ch.prompt_text = (
          c.texts[ch.prompt]
          if c.texts[ch.prompt] is not None
          else self.tok.token_bytes(c.prompts[ch.prompt]).decode("utf-8", "replace")
        )
    while live:
      batch = [await events.get()]
      while not events.empty():  # catch up on steps that queued meanwhile
        batch.append(events.get_nowait())
      for ch, tokens, reason in batch:
        if ch not in live:
          continue
        if reason in ("error", "cancelled"):
          raise ApiError(
            500 if reason == "error" else 503,
            f"generation ended early ({reason}); see the server log.",
            kind="server_error",
          )
        first = len(ch.out_ids)
        piece = ""
        # Token by token: a merged delivery may run past the token that completes a stop string, and
        # nothing after that token is returned or counted.
        for i, t in enumerate(tokens):
          ch.out_ids.append(t)
          if reason == "stop" and i == len(tokens) - 1 and t in c.stop_ids:
            break  # a stop token is counted but is not part of the text
          piece += ch.text.feed([t])
          if ch.text.stopped:
            break
        if ch.text.stopped:
          ch.kept = self.tokens_before(ch.out_ids, ch.text.sent_bytes)
          self.engine.cancel(ch.req, keep=ch.kept)
          reason = "stop"
        elif reason == "stop" and ch.out_ids and ch.out_ids[-1] in c.stop_ids:
          ch.kept = len(ch.out_ids) - 1
        elif reason is not None:
          ch.kept = len(ch.out_ids)
        if reason is not None and not ch.text.stopped:
          piece += ch.text.close()
        if reason is not None:
          live.discard(ch)
          ch.finish = reason
          if c.resent_as_text or c.texts[ch.prompt] is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.keep_resent, ch)
        yield ch, piece, reason, first

  def keep_resent(self, ch: Choice):
    """Ask the engine to keep the state of the ids a client that re-sends this prompt and reply as text
    will send (they differ from the ids consumed where the reply's text tokenizes otherwise, or the prompt
    ended in whitespace that the reply's text joins), so its next turn restores them. The tail of the prompt
    and the reply are tokenized again (tokens further back keep their ids); the last token is left out, as
    what the client appends may join it."""
    assert ch.req is not None and ch.text is not None
    prompt = list(ch.req.prompt_ids)
    k = min(RETOKENIZED_TAIL, len(prompt))
    # the reply's text as sent: up to a stop string, a part of the token that holds one included
    reply = self.tok.token_bytes(ch.out_ids[: ch.kept + 1])[: ch.text.sent_bytes]
    tail = (self.tok.token_bytes(prompt[len(prompt) - k :]) + reply).decode("utf-8", "replace")
    ids = (prompt[: len(prompt) - k] + self.tok.encode(tail))[:-1]
    if len(ids) > len(prompt) and ids != (prompt + ch.out_ids)[: len(ids)]:
      self.engine.keep_state(ids, ch.req.tenant, ch.req.cache_salt)

  def tokens_before(self, ids: list, n_bytes: int) -> int:
    """How many of `ids` lie wholly inside the first n_bytes of their text: the tokens a reply cut by a
    stop string keeps (a client re-sends the text before the stop string)."""
    total = 0
    for j, t in enumerate(ids):
      total += len(self.tok.token_bytes([t]))
      if total > n_bytes:
        return j
    return len(ids)

  def logprobs(self, ch, c, first: int, with_prompt: bool):
    """OpenAI's logprobs object for output tokens [first:] (and the echoed prompt's tokens before them)."""
    if c.logprobs is None:
      return None
    ids: list[int] = []
    pairs: list[TokenLogprob | None] = []  # per token (None: the first prompt token)
    if with_prompt and c.echo:
      ids += list(ch.req.prompt_ids)
      pairs += ch.req.progress.prompt_logprobs or [None] * len(ch.req.prompt_ids)
    ids += ch.out_ids[first:]
    pairs += ch.req.progress.token_logprobs[first : len(ch.out_ids)]
    word = lambda t: self.tok.token_bytes([t]).decode("utf-8", "replace")
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t, pair in zip(ids, pairs):
      w = word(t)
      out["tokens"].append(w)
      out["text_offset"].append(ch.offset)
      ch.offset += len(w)
      out["token_logprobs"].append(None if pair is None else pair.logprob)
      out["top_logprobs"].append(
        None if pair is None else {word(t.id): t.logprob for t in pair.top[: c.logprobs]}
      )
    return out

  def usage(self, c, choices):
    """OpenAI's usage: each prompt counted once (its choices share one prefill), and of those tokens the
    ones restored from the state cache (prompt_tokens_details.cached_tokens)."""
    prompt = sum(len(p) for p in c.prompts)
    done = sum(len(ch.out_ids) for ch in choices)
    cached = sum(
      ch.req.progress.cached_tokens for ch in choices if ch.index % c.n == 0
    )  # the first choice of each prompt
    usage = {
      "prompt_tokens": prompt,
      "completion_tokens": done,
      "total_tokens": prompt + done,
      "prompt_tokens_details": {"cached_tokens": cached},
    }
    if c.prediction_ids:  # the prediction's tokens that each choice's output matched, and the rest
      accepted = sum(ch.req.progress.accepted_prediction_tokens for ch in choices)
      usage["completion_tokens_details"] = {
        "accepted_prediction_tokens": accepted,
        "rejected_prediction_tokens": len(choices) * len(c.prediction_ids) - accepted,
      }
    return usage


class Choice:
  """One choice of a completion: its engine request, text stream and tokens so far. It is also the
  request's `context`: the engine's deliveries land in the completion's one event queue, tagged."""

  def __init__(self, index: int, prompt: int, events: asyncio.Queue):
    self.index, self.prompt, self.events = index, prompt, events
    self.req: Request | None = None
    self.text: TextStream | None = None
    self.out_ids: list = []
    self.finish: str | None = None
    self.prompt_text = ""
    self.offset = 0  # text_offset of the next token
    self.echoed = False  # streaming: the prompt was sent
    self.sent = 0  # streaming: output tokens sent so far
    # Once finished: how many output tokens the reply's text holds (a stop id and the tokens of a stop
    # string and past it are not its), the ids a conversation continues from after the prompt.
    self.kept = 0

  def put_nowait(self, item):
    self.events.put_nowait((self, *item))
