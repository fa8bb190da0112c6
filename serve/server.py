"""The HTTP front end (aiohttp): OpenAI-style /v1/completions with SSE streaming, /v1/models, /health,
/metrics. The engine runs in its own thread; its tokens reach each request's asyncio queue through one
call_soon_threadsafe per engine step."""
from __future__ import annotations

import asyncio
import collections
import hmac
import json
import threading
import time
import uuid

from aiohttp import web

from serve import protocol
from serve.engine import Engine, QueueFull, Request
from serve.protocol import ApiError
from serve.text import TextStream


class Server:
  """Routes and request handling over one running `Engine`."""

  def __init__(self, engine: Engine, tokenizer, limits: protocol.Limits, *, api_key: str | None = None):
    self.engine, self.tok, self.limits, self.api_key = engine, tokenizer, limits, api_key
    self.loop: asyncio.AbstractEventLoop | None = None
    self.started = time.time()
    self.responses = collections.Counter()  # HTTP status -> count
    self.runner: web.AppRunner | None = None

  def app(self) -> web.Application:
    app = web.Application(middlewares=[self._errors], client_max_size=4 << 20)
    app.router.add_post("/v1/completions", self.completions)
    app.router.add_get("/v1/models", self.models)
    app.router.add_get("/health", self.health)
    app.router.add_get("/metrics", self.metrics)
    return app

  async def start(self, host: str = "127.0.0.1", port: int = 8000) -> int:
    """Start the engine thread and listen; returns the bound port (pass 0 for any free one)."""
    self.loop = asyncio.get_running_loop()
    self.engine.on_deliver = self._deliver
    self.engine.start()
    # handler_cancellation: a client that goes away cancels its handler, whose `finally` frees the slot.
    self.runner = web.AppRunner(self.app(), handler_cancellation=True, access_log=None)
    await self.runner.setup()
    site = web.TCPSite(self.runner, host, port, backlog=4096)
    await site.start()
    return site._server.sockets[0].getsockname()[1]

  async def stop(self):
    if self.runner is not None:
      await self.runner.cleanup()
    self.engine.stop()

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
      resp = web.json_response(e.body(), status=e.status,
                               headers={"Retry-After": "1"} if e.status == 429 else None)
    except web.HTTPException as e:  # unknown route, wrong method, body too large
      if e.status < 400:
        raise
      resp = web.json_response(ApiError(e.status, f"{e.reason}: {request.method} {request.path}").body(),
                               status=e.status)
    self.responses[resp.status] += 1
    return resp

  def _check_key(self, request):
    if self.api_key is None:
      return
    got = request.headers.get("Authorization", "")
    if not hmac.compare_digest(got.encode(), f"Bearer {self.api_key}".encode()):
      raise ApiError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'.")

  # ---- routes ----

  async def health(self, request):
    if self.engine.error is not None:
      return web.json_response({"status": "error", "error": repr(self.engine.error)}, status=503)
    return web.json_response({"status": "ok"})

  async def models(self, request):
    self._check_key(request)
    return web.json_response({"object": "list", "data": [{
        "id": self.limits.model_name, "object": "model", "created": int(self.started),
        "owned_by": "laplace-jax", "max_tokens": self.limits.max_tokens,
        "max_prompt_tokens": self.limits.max_prompt_tokens}]})

  async def metrics(self, request):
    e, s = self.engine, self.engine.stats
    rows = [
        ("tokens_per_second", "gauge", "Output tokens per second over the last 10 s.",
         [("", round(e.tokens_per_second(), 3))]),
        ("active_slots", "gauge", "Slots decoding a request.", [("", e.active_slots)]),
        ("slots", "gauge", "Slots in the engine.", [("", e.n_slots)]),
        ("open_connections", "gauge", "Open HTTP connections.", [("", self.open_connections)]),
        ("queue_depth", "gauge", "Requests waiting for a slot.", [("", e.queue_depth)]),
        ("generated_tokens_total", "counter", "Output tokens produced.", [("", s["tokens"])]),
        ("prompt_tokens_total", "counter", "Prompt tokens prefilled.", [("", s["prefill_tokens"])]),
        ("decode_steps_total", "counter", "Compiled generate steps run.", [("", s["steps"])]),
        ("engine_requests_total", "counter", "Requests admitted to the engine queue.", [("", s["requests"])]),
        ("engine_finished_total", "counter", "Requests finished (any reason).", [("", s["finished"])]),
        ("engine_rejected_total", "counter", "Requests refused with 429 (queue full).", [("", s["rejected"])]),
        ("prompt_tokens_cached_total", "counter", "Prompt tokens restored from the state cache, not prefilled.",
         [("", s["cached_prompt_tokens"])]),
        *self._cache_rows(),
        ("http_responses_total", "counter", "HTTP responses by status code.",
         [(f'{{code="{c}"}}', n) for c, n in sorted(self.responses.items())]),
    ]
    lines = []
    for name, kind, doc, samples in rows:
      lines += [f"# HELP laplace_serve_{name} {doc}", f"# TYPE laplace_serve_{name} {kind}"]
      lines += [f"laplace_serve_{name}{labels} {value}" for labels, value in samples]
    return web.Response(text="\n".join(lines) + "\n", content_type="text/plain", charset="utf-8",
                        headers={"X-Content-Type-Options": "nosniff"})

  def _cache_rows(self):
    c = self.engine.cache
    if c is None:
      return []
    return [("state_cache_hits_total", "counter", "Requests that restored a cached state.", [("", c.stats["hits"])]),
            ("state_cache_misses_total", "counter", "Requests with no cached prefix.", [("", c.stats["misses"])]),
            ("state_cache_evictions_total", "counter", "States evicted for the byte budget.",
             [("", c.stats["evictions"])]),
            ("state_cache_bytes", "gauge", "Bytes of cached states held.", [("", c.bytes)]),
            ("state_cache_entries", "gauge", "Cached states held.", [("", len(c))]),
            ("state_cache_files_written_total", "counter", "State files written to --state-cache-dir.",
             [("", c.stats["files_written"])])]

  async def completions(self, request):
    self._check_key(request)
    raw = await request.read()
    # Parsing and tokenizing a long prompt takes a while (a 3.6 MB prompt: 0.26 s): off the event loop,
    # so every open stream keeps flowing meanwhile.
    c = await asyncio.get_running_loop().run_in_executor(
        None, lambda: protocol.parse_completion(protocol.parse_body(raw), self.limits, self.tok.encode))
    req = Request(prompt_ids=c.prompt_ids, max_tokens=c.max_tokens, temperature=c.temperature,
                  top_k=c.top_k, top_p=c.top_p, seed=c.seed, stop_ids=c.stop_ids, context=asyncio.Queue())
    try:
      self.engine.submit(req)
    except QueueFull as e:
      raise ApiError(429, f"server busy: {e}. Retry later.") from None
    except ValueError as e:
      raise ApiError(400, str(e)) from None
    meta = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": self.limits.model_name}
    try:
      if c.stream:
        return await self._stream(request, req, c, meta)
      return await self._whole(req, c, meta)
    finally:
      if req.finish_reason is None:
        self.engine.cancel(req)

  async def _pieces(self, req: Request, c: protocol.Completion, out_ids: list):
    """Yield (text, finish_reason or None) as the engine delivers; fills out_ids with the tokens used."""
    text = TextStream(self.tok.token_bytes, c.stop)
    while True:
      tokens, reason = await req.context.get()
      while not req.context.empty() and reason is None:  # catch up on steps that queued meanwhile
        more, reason = req.context.get_nowait()
        tokens = tokens + more
      if reason in ("error", "cancelled"):
        raise ApiError(500 if reason == "error" else 503, f"generation ended early ({reason}); see the "
                       "server log.", kind="server_error")
      # Token by token: a merged delivery may run past the token that completes a stop string, and
      # nothing after that token is returned or counted.
      piece = ""
      for i, t in enumerate(tokens):
        out_ids.append(t)
        if reason == "stop" and i == len(tokens) - 1 and t in c.stop_ids:
          break  # a stop token is counted but is not part of the text
        piece += text.feed([t])
        if text.stopped:
          break
      if text.stopped:
        self.engine.cancel(req)
        yield piece, "stop"
        return
      if reason is not None:
        yield piece + text.close(), reason
        return
      if piece:
        yield piece, None

  def _usage(self, c, out_ids):
    return {"prompt_tokens": len(c.prompt_ids), "completion_tokens": len(out_ids),
            "total_tokens": len(c.prompt_ids) + len(out_ids)}

  async def _whole(self, req, c, meta):
    out_ids, parts, finish = [], [], None
    async for piece, reason in self._pieces(req, c, out_ids):
      parts.append(piece)
      finish = reason
    choice = {"index": 0, "text": "".join(parts), "logprobs": None, "finish_reason": finish}
    if c.return_token_ids:
      choice["token_ids"] = out_ids
    return web.json_response({**meta, "object": "text_completion", "choices": [choice],
                              "usage": self._usage(c, out_ids)})

  async def _stream(self, request, req, c, meta):
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       "X-Accel-Buffering": "no"})
    await resp.prepare(request)
    send = lambda obj: resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
    out_ids, sent = [], 0
    try:
      try:
        async for piece, reason in self._pieces(req, c, out_ids):
          choice = {"index": 0, "text": piece, "logprobs": None, "finish_reason": reason}
          if c.return_token_ids:
            choice["token_ids"], sent = out_ids[sent:], len(out_ids)
          await send({**meta, "object": "text_completion", "choices": [choice]})
      except ApiError as e:  # headers are out: report in the stream
        await send(e.body())
      if c.include_usage:
        await send({**meta, "object": "text_completion", "choices": [], "usage": self._usage(c, out_ids)})
      await resp.write(b"data: [DONE]\n\n")
      await resp.write_eof()
    except ConnectionResetError:  # the client left; `completions` frees the slot
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
    self.port = asyncio.run_coroutine_threadsafe(self.server.start(self.host, self.port), self.loop).result(60)
    return self.port

  def __exit__(self, *exc):
    asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(60)
    self.loop.call_soon_threadsafe(self.loop.stop)
    self.thread.join(10)
    self.loop.close()
