"""The HTTP front end (aiohttp): middleware, API keys and routes. OpenAI-style /v1/completions with SSE
streaming, /v1/models, /health, /metrics (serve.api.metrics); /v1/chat/completions (serve.api.chat),
/v1/responses (serve.api.responses) and /tokenize, /detokenize, /tokenizer_info (serve.api.tokenize_api). The
generating routes run over one completion path (serve.api.completions). The engine runs in its own thread; its
tokens reach each request's asyncio queue through one call_soon_threadsafe per engine step."""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import threading
import time
import urllib.parse
from typing import cast

from aiohttp import web

from serve.api import (
  access_log,
  chat,
  completions,
  constraints,
  grammar,
  metrics,
  protocol,
  responses,
  tokenize_api,
)
from serve.api.completions import ENGINE_REQUESTS, TENANT
from serve.api.protocol import ApiError
from serve.api.response_store import ResponseStore
from serve.api.tenants import Tenants, name_of_key
from serve.engine.engine import Engine

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
    self.completion = completions.CompletionRunner(engine, tokenizer, limits)

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
    self.completion.compiler.close()

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
    """Prometheus text (serve.api.metrics). With keys it needs one, and the state cache's hit counters are
    the caller's tenant's only; the rest are server-wide load figures."""
    tenant = self.check_key(request)
    text = metrics.prometheus_text(self.engine, self.tenants, tenant, self.responses, self.open_connections)
    return web.Response(
      text=text, content_type="text/plain", charset="utf-8", headers={"X-Content-Type-Options": "nosniff"}
    )

  async def completions(self, request):
    tenant = self.check_key(request)
    obj = await completions.read_json(request)
    self.completion.admit(protocol.count_choices(obj), tenant)

    # Tokenizing a long prompt takes a while (a 3.6 MB prompt: 0.26 s): off the event loop, so every open
    # stream keeps flowing meanwhile.
    def parse():
      c = protocol.parse_completion(obj, self.limits, self.tok.encode)
      fmt = constraints.json_format(obj.get("response_format"), "response_format", False, grammar.LIMITS)
      return protocol.with_constraint(c, fmt, self.limits)

    c = await asyncio.get_running_loop().run_in_executor(None, parse)
    return await self.completion.run(request, c, self._whole, self._stream, "cmpl-")

  async def _whole(self, choices, c, meta):
    parts = collections.defaultdict(list)
    async for ch, piece, _, _ in self.completion.pieces(choices, c):
      parts[ch.index].append(piece)

    def build():
      out = []
      for ch in choices:
        text = (ch.prompt_text if c.echo else "") + "".join(parts[ch.index])
        choice = {
          "index": ch.index,
          "text": text,
          "logprobs": self.completion.logprobs(ch, c, 0, True),
          "finish_reason": ch.finish,
        }
        if c.return_token_ids:
          choice["token_ids"] = ch.out_ids
        out.append(choice)
      return {**meta, "object": "text_completion", "choices": out, "usage": self.completion.usage(c, choices)}

    return await completions.json_reply(build)

  async def _stream(self, request, choices, c, meta):
    resp = web.StreamResponse(
      headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )
    await resp.prepare(request)
    send = lambda obj: resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
    try:
      try:
        async for ch, piece, reason, _ in self.completion.pieces(choices, c):
          head = ch.prompt_text if c.echo and not ch.echoed else ""
          if not (piece or head or reason):
            continue  # tokens with no text yet ride with the next event
          first, ch.sent, ch.echoed = ch.sent, len(ch.out_ids), True

          def event(ch=ch, head=head, piece=piece, reason=reason, first=first):
            choice = {
              "index": ch.index,
              "text": head + piece,
              "finish_reason": reason,
              "logprobs": self.completion.logprobs(ch, c, first, bool(head)),
            }
            if c.return_token_ids:
              choice["token_ids"] = ch.out_ids[first : ch.sent]
            return {**meta, "object": "text_completion", "choices": [choice]}

          # The echoed prompt (with its logprobs) is built off the event loop; a token's event is small.
          await send(await asyncio.get_running_loop().run_in_executor(None, event) if head else event())
      except ApiError as e:  # headers are out: report in the stream
        await send(e.body())
      if c.include_usage:
        await send(
          {**meta, "object": "text_completion", "choices": [], "usage": self.completion.usage(c, choices)}
        )
      await resp.write(b"data: [DONE]\n\n")
      await resp.write_eof()
    except ConnectionResetError:  # the client left; `completions` frees the slots
      pass
    return resp


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
