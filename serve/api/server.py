"""The HTTP front end (aiohttp): OpenAI-style /v1/completions with SSE streaming, /v1/models, /health,
/metrics; /v1/chat/completions (serve.api.chat), /v1/responses (serve.api.responses) and /tokenize, /detokenize,
/tokenizer_info (serve.api.tokenize_api) run over its completion path. The engine runs in its own thread; its
tokens reach each request's asyncio queue through one call_soon_threadsafe per engine step."""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import threading
import time
import urllib.parse
import uuid
from collections.abc import Mapping
from typing import cast

from aiohttp import web

from serve.api import access_log, chat, constraints, grammar, protocol, responses, tokenize_api
from serve.api.protocol import ApiError
from serve.api.response_store import ResponseStore
from serve.api.tenants import Tenants, name_of_key
from serve.api.text import TextStream
from serve.engine.engine import Engine, EngineStopped, QueueFull, Request
from serve.engine.request import TokenLogprob

TENANT = web.RequestKey("tenant", str)  # set by Server.check_key
ENGINE_REQUESTS = web.RequestKey("engine_requests", list)  # set by Server.run_completion: what it submitted
RETOKENIZED_TAIL = 8  # prompt tokens tokenized again with a reply's text (Server._keep_resent)
log = logging.getLogger(__name__)
LOOPBACK = frozenset({"localhost", "127.0.0.1", "::1"})
WILDCARD = frozenset({"", "0.0.0.0", "::"})


def allowed_hosts(bind: str, extra) -> set | None:
  """Host names a request's Host (and a browser's Origin) may name: the bind address, its localhost aliases
  when it is a loopback one, and `extra` (--allowed_host). None: not checked (bound to every address with
  no --allowed_host: the server cannot know its public names)."""
  names = {h.strip("[]").lower() for h in extra}
  bind = (bind or "").strip("[]").lower()
  if bind in WILDCARD:
    return names or None
  if bind in LOOPBACK or bind.startswith("127."):
    names |= LOOPBACK
  return names | {bind}


def _engine_down() -> ApiError:
  """The refusal of every request while the engine's loop is not running (the reason is in the server log)."""
  return ApiError(503, "the engine is not running; see the server log. Retry later.", kind="server_error")


def _hostname(value: str, scheme: bool = False) -> str | None:
  """'Example.com:8000', '[::1]:8000' (or with scheme, 'http://example.com') -> 'example.com', '::1'."""
  try:
    return urllib.parse.urlsplit(value if scheme else "//" + value).hostname
  except ValueError:
    return None


class Server:
  """Routes and request handling over one running `Engine`."""

  def __init__(
    self,
    engine: Engine,
    tokenizer,
    limits: protocol.Limits,
    *,
    api_key: str | None = None,
    tenants: Tenants | None = None,
    chat_template: chat.ChatTemplate | None = None,
    allowed_hosts: tuple = (),
    response_store: ResponseStore | None = None,
  ):
    """tenants: the API keys (serve.api.tenants); api_key: one key, its own tenant. Neither: no keys.
    allowed_hosts: more names for Host and Origin (see allowed_hosts()). response_store: the stored
    responses of /v1/responses (default: in memory, serve.api.response_store's default budget)."""
    if tenants is None:
      tenants = Tenants([] if api_key is None else [(name_of_key(api_key), api_key)])
    self.engine, self.tok, self.limits, self.tenants = engine, tokenizer, limits, tenants
    self.extra_hosts = tuple(allowed_hosts)
    self.allowed: set | None = None  # set at start() from the bind address
    self.chat_template = chat_template or chat.ChatTemplate(None, tokenizer)
    self.response_store = ResponseStore() if response_store is None else response_store
    self.loop: asyncio.AbstractEventLoop | None = None
    self.started = time.time()
    self.responses: collections.Counter[int] = collections.Counter()  # HTTP status -> count
    self.runner: web.AppRunner | None = None
    self.compiler = grammar.Compiler()

  def app(self) -> web.Application:
    app = web.Application(middlewares=[self._errors, self._edge], client_max_size=4 << 20)
    app.router.add_post("/v1/completions", self.completions)
    chat.Chat(self, self.chat_template).register(app)
    responses.Responses(self, self.chat_template, self.response_store).register(app)
    tokenize_api.TokenizerRoutes(self, self.chat_template).register(app)
    app.router.add_get("/v1/models", self.models)
    app.router.add_get("/v1/models/{model_id}", self.model_info)
    app.router.add_get("/health", self.health)
    app.router.add_get("/metrics", self.metrics)
    access_log.install(app, TENANT, ENGINE_REQUESTS)
    return app

  async def start(self, host: str, port: int) -> int:
    """Start the engine thread and listen; returns the bound port (pass 0 for any free one)."""
    self.loop = asyncio.get_running_loop()
    self.allowed = allowed_hosts(host, self.extra_hosts)
    self.engine.on_deliver = self._deliver
    self.engine.start()
    # handler_cancellation: a client that goes away cancels its handler, whose `finally` frees the slot.
    self.runner = web.AppRunner(self.app(), handler_cancellation=True, access_log=None)
    await self.runner.setup()
    site = web.TCPSite(self.runner, host, port, backlog=4096)
    await site.start()
    return cast(asyncio.Server, site._server).sockets[0].getsockname()[1]

  async def stop(self):
    if self.runner is not None:
      await self.runner.cleanup()
    self.engine.stop()
    self.compiler.close()

  @property
  def open_connections(self) -> int:
    server = None if self.runner is None else self.runner.server
    return 0 if server is None else len(server.connections)

  # ---- engine thread -> event loop ----

  def _deliver(self, deliveries):
    self.loop.call_soon_threadsafe(self._fan_out, deliveries)

  @staticmethod
  def _fan_out(deliveries):
    for req, tokens, reason in deliveries:
      if req.context is not None:
        req.context.put_nowait((tokens, reason))

  # ---- plumbing ----

  @web.middleware
  async def _errors(self, request, handler):
    try:
      resp = await handler(request)
    except ApiError as e:
      resp = web.json_response(
        e.body(), status=e.status, headers={"Retry-After": "1"} if e.status == 429 else None
      )
    except web.HTTPException as e:  # unknown route, wrong method, body too large
      if e.status < 400:
        raise
      resp = web.json_response(
        ApiError(e.status, f"{e.reason}: {request.method} {request.path}").body(), status=e.status
      )
    except Exception:  # a bug: the client gets an error object, never internals
      log.exception("%s %s failed", request.method, request.path)
      resp = web.json_response(
        ApiError(500, "internal server error; see the server log.", kind="server_error").body(), status=500
      )
    self.responses[resp.status] += 1
    return resp

  @web.middleware
  async def _edge(self, request, handler):
    """What a browser page could send: a Host or Origin that is not this server (DNS rebinding, a page
    posting to a local server) is refused, and POST bodies must say they are JSON (a page cannot send
    that cross-origin without a CORS preflight, which this server never grants)."""
    host = request.headers.get("Host")
    if host is not None and self.allowed is not None and _hostname(host) not in self.allowed:
      raise ApiError(
        421,
        f"Host {protocol.show(host, 60)} is not a name of this server: call it by "
        f"{sorted(self.allowed)[0]!r} or start it with --allowed_host NAME.",
      )
    origin = request.headers.get("Origin")
    if origin is not None:
      ok = self.allowed if self.allowed is not None else {_hostname(host or "")}
      if _hostname(origin, scheme=True) not in ok - {None}:
        raise ApiError(
          403,
          f"Origin {protocol.show(origin, 60)} is not this server: browser pages of other "
          "sites may not call it (--allowed_host NAME names more of its own hosts).",
        )
    if request.method == "POST" and request.content_type != "application/json":
      raise ApiError(
        415,
        f"Content-Type is {protocol.show(request.headers.get('Content-Type', ''), 60)}: send "
        "JSON with 'Content-Type: application/json' (curl: -H 'Content-Type: application/json').",
      )
    return await handler(request)

  def check_key(self, request) -> str:
    """The request's tenant ('' without keys; also kept as request["tenant"]); 401 for a missing or wrong key."""
    tenant = self.tenants.authenticate(request.headers.get("Authorization"))
    if tenant is None:
      raise ApiError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'.")
    request[TENANT] = tenant
    return tenant

  # ---- routes ----

  async def health(self, request):
    if not self.engine.serving:  # why is in the server log, not here
      return web.json_response({"status": "unhealthy", "reason": "the engine is not running"}, status=503)
    return web.json_response({"status": "ok"})

  def _model_card(self):
    return {
      "id": self.limits.model_name,
      "object": "model",
      "created": int(self.started),
      "owned_by": "laplace-jax",
      "max_tokens": self.limits.max_tokens,
      "max_prompt_tokens": self.limits.max_prompt_tokens,
    }

  async def models(self, request):
    self.check_key(request)
    return web.json_response({"object": "list", "data": [self._model_card()]})

  async def model_info(self, request):
    self.check_key(request)
    name = request.match_info["model_id"]
    if name != self.limits.model_name:
      raise ApiError(
        404,
        f"model {json.dumps(name)[:80]} is not served here: this server serves "
        f"'{self.limits.model_name}' (GET /v1/models).",
        "model",
      )
    return web.json_response(self._model_card())

  async def metrics(self, request):
    """Prometheus text. With keys it needs one, and the state cache's hit counters are the caller's
    tenant's only (labelled tenant="..."); the rest are server-wide load figures."""
    tenant = self.check_key(request)
    e, s = self.engine, self.engine.stats
    rows = [
      (
        "tokens_per_second",
        "gauge",
        "Output tokens per second over the last 10 s.",
        [("", round(e.tokens_per_second(), 3))],
      ),
      ("active_slots", "gauge", "Slots decoding a request.", [("", e.active_slots)]),
      ("slots", "gauge", "Slots in the engine.", [("", e.n_slots)]),
      (
        "state_bytes_per_slot",
        "gauge",
        "Bytes of one slot's decode state (GLA states, conv windows, "
        "sliding-window rings, KV cache of --max_context tokens), measured from its layout.",
        [("", e.fns.state_bytes_per_slot)],
      ),
      (
        "slot_table_bytes",
        "gauge",
        "Bytes of the whole slot table: every slot's state and sampling settings.",
        [("", e.fns.table_bytes)],
      ),
      ("open_connections", "gauge", "Open HTTP connections.", [("", self.open_connections)]),
      ("queue_depth", "gauge", "Requests waiting for a slot.", [("", e.queue_depth)]),
      ("generated_tokens_total", "counter", "Output tokens produced.", [("", s.tokens)]),
      ("prompt_tokens_total", "counter", "Prompt tokens prefilled.", [("", s.prefill_tokens)]),
      ("decode_steps_total", "counter", "Compiled generate and verify calls run.", [("", s.steps)]),
      ("drafted_tokens_total", "counter", "Drafted tokens verified.", [("", s.drafted_tokens)]),
      (
        "accepted_draft_tokens_total",
        "counter",
        "Drafted tokens the output took.",
        [("", s.accepted_tokens)],
      ),
      (
        "verify_cost_ratio",
        "gauge",
        "A verify step's time over a generate step's over the same bucket of rows, as the engine measured "
        "them (1 until measured).",
        [(f'{{bucket="{b}"}}', round(e.drafter.cost.ratio(b), 3)) for b in e.fns.buckets],
      ),
      ("engine_requests_total", "counter", "Requests admitted to the engine queue.", [("", s.requests)]),
      ("engine_finished_total", "counter", "Requests finished (any reason).", [("", s.finished)]),
      ("engine_rejected_total", "counter", "Requests refused with 429 (queue full).", [("", s.rejected)]),
      *self._cache_rows(tenant),
      (
        "http_responses_total",
        "counter",
        "HTTP responses by status code.",
        [(f'{{code="{c}"}}', n) for c, n in sorted(self.responses.items())],
      ),
    ]
    lines = []
    for name, kind, doc, samples in rows:
      lines += [f"# HELP laplace_serve_{name} {doc}", f"# TYPE laplace_serve_{name} {kind}"]
      lines += [f"laplace_serve_{name}{labels} {value}" for labels, value in samples]
    return web.Response(
      text="\n".join(lines) + "\n",
      content_type="text/plain",
      charset="utf-8",
      headers={"X-Content-Type-Options": "nosniff"},
    )

  def _cache_rows(self, tenant: str):
    c = self.engine.cache
    if c is None:
      return [
        ("prompt_tokens_cached_total", "counter", "Prompt tokens restored from the state cache.", [("", 0)])
      ]
    counts: Mapping[str, int]
    if self.tenants.enabled:  # the caller's own counters: another tenant's hits are not its business
      label, counts = f'{{tenant="{tenant}"}}', c.tenant_stats.get(tenant, {})
    else:
      label, counts = "", c.stats
    return [
      (
        "prompt_tokens_cached_total",
        "counter",
        "Prompt tokens restored from the state cache, not prefilled.",
        [(label, counts.get("tokens_reused", 0))],
      ),
      (
        "state_cache_hits_total",
        "counter",
        "Requests that restored a cached state.",
        [(label, counts.get("hits", 0))],
      ),
      (
        "state_cache_misses_total",
        "counter",
        "Requests with no cached prefix.",
        [(label, counts.get("misses", 0))],
      ),
      (
        "state_cache_evictions_total",
        "counter",
        "States evicted for the byte budget.",
        [("", c.stats["evictions"])],
      ),
      (
        "state_cache_superseded_total",
        "counter",
        "States dropped because a conversation stored newer ones (the bound on states per conversation).",
        [("", c.stats["superseded"])],
      ),
      ("state_cache_bytes", "gauge", "Bytes of cached states held.", [("", c.bytes)]),
      ("state_cache_entries", "gauge", "Cached states held.", [("", len(c))]),
      (
        "state_cache_files_written_total",
        "counter",
        "State files written to --state_cache_dir.",
        [("", c.stats["files_written"])],
      ),
    ]

  async def completions(self, request):
    tenant = self.check_key(request)
    obj = await self.read_json(request)
    self.admit(protocol.count_choices(obj), tenant)

    # Tokenizing a long prompt takes a while (a 3.6 MB prompt: 0.26 s): off the event loop, so every open
    # stream keeps flowing meanwhile.
    def parse():
      c = protocol.parse_completion(obj, self.limits, self.tok.encode)
      fmt = constraints.json_format(obj.get("response_format"), "response_format", False, grammar.LIMITS)
      return protocol.with_constraint(c, fmt, self.limits)

    c = await asyncio.get_running_loop().run_in_executor(None, parse)
    return await self.run_completion(request, c, self._whole, self._stream, "cmpl-")

  @staticmethod
  async def json_reply(build) -> web.Response:
    """A JSON response from `build()`, built and encoded off the event loop (with echo and logprobs, a reply
    can run to megabytes; protocol.reply_entries bounds it)."""
    body = await asyncio.get_running_loop().run_in_executor(None, lambda: json.dumps(build()).encode())
    return web.Response(body=body, content_type="application/json")

  async def read_json(self, request) -> dict:
    """The request's JSON object (parsed off the event loop: a body may hold 4 MiB)."""
    raw = await request.read()
    return await asyncio.get_running_loop().run_in_executor(None, protocol.parse_body, raw)

  def admit(self, choices: int, tenant: str):
    """Refuse at once (503, 429) what the engine could not take now, before any prompt is tokenized.
    A count over the per-request cap is left to the parser's 400."""
    if not self.engine.serving:
      raise _engine_down()
    if choices <= protocol.choice_cap(self.limits)[0]:
      try:
        self.engine.check_room(choices, tenant)
      except QueueFull as e:
        raise ApiError(429, f"server busy: {e}. Retry later.") from None

  async def run_completion(self, request, c: protocol.Completion, whole, stream, id_prefix: str):
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

    def engine_request(ch: _Choice, ids, j: int, siblings=()) -> Request:
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
      members = [_Choice(p * c.n + j, p, events) for j in range(c.n)]
      for j, ch in enumerate(members[1:], 1):
        ch.req = engine_request(ch, ids, j)
      members[0].req = engine_request(members[0], ids, 0, siblings=[ch.req for ch in members[1:]])
      for ch in members:
        ch.text = TextStream(self.tok.token_bytes, c.stop)
      choices += members
      leaders.append(members[0].req)
    if not self.engine.serving:
      raise _engine_down()
    try:
      self.engine.submit_all(leaders)
      request[ENGINE_REQUESTS] = leaders
    except QueueFull as e:
      raise ApiError(429, f"server busy: {e}. Retry later.") from None
    except EngineStopped:
      raise _engine_down() from None
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
          ch.kept = self._tokens_before(ch.out_ids, ch.text.sent_bytes)
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
            await asyncio.get_running_loop().run_in_executor(None, self._keep_resent, ch)
        yield ch, piece, reason, first

  def _keep_resent(self, ch: _Choice):
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

  def _tokens_before(self, ids: list, n_bytes: int) -> int:
    """How many of `ids` lie wholly inside the first n_bytes of their text: the tokens a reply cut by a
    stop string keeps (a client re-sends the text before the stop string)."""
    total = 0
    for j, t in enumerate(ids):
      total += len(self.tok.token_bytes([t]))
      if total > n_bytes:
        return j
    return len(ids)

  def _logprobs(self, ch, c, first: int, with_prompt: bool):
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

  async def _whole(self, choices, c, meta):
    parts = collections.defaultdict(list)
    async for ch, piece, _, _ in self.pieces(choices, c):
      parts[ch.index].append(piece)

    def build():
      out = []
      for ch in choices:
        text = (ch.prompt_text if c.echo else "") + "".join(parts[ch.index])
        choice = {
          "index": ch.index,
          "text": text,
          "logprobs": self._logprobs(ch, c, 0, True),
          "finish_reason": ch.finish,
        }
        if c.return_token_ids:
          choice["token_ids"] = ch.out_ids
        out.append(choice)
      return {**meta, "object": "text_completion", "choices": out, "usage": self.usage(c, choices)}

    return await self.json_reply(build)

  async def _stream(self, request, choices, c, meta):
    resp = web.StreamResponse(
      headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )
    await resp.prepare(request)
    send = lambda obj: resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
    try:
      try:
        async for ch, piece, reason, _ in self.pieces(choices, c):
          head = ch.prompt_text if c.echo and not ch.echoed else ""
          if not (piece or head or reason):
            continue  # tokens with no text yet ride with the next event
          first, ch.sent, ch.echoed = ch.sent, len(ch.out_ids), True

          def event(ch=ch, head=head, piece=piece, reason=reason, first=first):
            choice = {
              "index": ch.index,
              "text": head + piece,
              "finish_reason": reason,
              "logprobs": self._logprobs(ch, c, first, bool(head)),
            }
            if c.return_token_ids:
              choice["token_ids"] = ch.out_ids[first : ch.sent]
            return {**meta, "object": "text_completion", "choices": [choice]}

          # The echoed prompt (with its logprobs) is built off the event loop; a token's event is small.
          await send(await asyncio.get_running_loop().run_in_executor(None, event) if head else event())
      except ApiError as e:  # headers are out: report in the stream
        await send(e.body())
      if c.include_usage:
        await send({**meta, "object": "text_completion", "choices": [], "usage": self.usage(c, choices)})
      await resp.write(b"data: [DONE]\n\n")
      await resp.write_eof()
    except ConnectionResetError:  # the client left; `completions` frees the slots
      pass
    return resp


class _Choice:
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


class InThread:
  """Run a Server on its own event-loop thread (tests, notebooks): `with InThread(server) as port: ...`."""

  def __init__(self, server: Server, host: str = "127.0.0.1", port: int = 0):
    self.server, self.host, self.port = server, host, port
    self.loop = asyncio.new_event_loop()
    self.thread = threading.Thread(target=self.loop.run_forever, name="serve-http", daemon=True)

  def __enter__(self) -> int:
    self.thread.start()
    self.port = asyncio.run_coroutine_threadsafe(self.server.start(self.host, self.port), self.loop).result(
      60
    )
    return self.port

  def __exit__(self, *exc):
    asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(60)
    self.loop.call_soon_threadsafe(self.loop.stop)
    self.thread.join(10)
    self.loop.close()
