"""The server's access log: one line per HTTP request on the `serve.access` logger, e.g.

  POST /v1/completions 200 tenant=alice prompt_tokens=12 output_tokens=16 cached_tokens=0 ttft_ms=35.2
  total_ms=120.3

(one line). Times run from the request's arrival: ttft_ms to the first output token of any of its
sequences, total_ms to the response's end (after the last streamed chunk). Token counts are those of the
engine requests the handler submitted (each prompt counted once, the output of every choice); a request
that decodes nothing (/health, /v1/models, an error) logs zeros and ttft_ms=-. The prompt, the output and
the API key are never logged; the tenant is the key's name (serve.api.tenants), '-' without keys.

`install(app, tenant_key, requests_key)` adds the middleware (outermost, so it sees the status of every
answer, errors included); the server keeps the caller's tenant and the engine requests a handler submitted
under those keys of the aiohttp request.
"""

from __future__ import annotations

import logging
import time

from aiohttp import web

log = logging.getLogger("serve.access")


def install(app: web.Application, tenant_key, requests_key) -> None:
  """Log one line per request of `app` (tenant_key, requests_key: see the module docstring)."""

  @web.middleware
  async def access_log(request: web.Request, handler):
    t0 = time.perf_counter()  # the engine's clock (Progress.first_token_at)
    status = 500
    try:
      resp = await handler(request)
      status = resp.status
      return resp
    except web.HTTPException as e:
      status = e.status
      raise
    finally:
      if log.isEnabledFor(logging.INFO):
        submitted = request.get(requests_key, [])
        log.info(line(request, status, submitted, t0, time.perf_counter(), request.get(tenant_key, "")))

  app.middlewares.insert(0, access_log)


def line(request, status: int, submitted: list, t0: float, t1: float, tenant: str) -> str:
  """The log line of one HTTP request (module docstring); `submitted` holds its engine requests."""
  reqs = [r for lead in submitted for r in (lead, *getattr(lead, "siblings", ()))]
  prompt = sum(len(lead.prompt_ids) for lead in submitted)  # siblings share their leader's prompt
  output = sum(len(r.progress.output_ids) for r in reqs)
  cached = sum(lead.progress.cached_tokens for lead in submitted)
  firsts = [r.progress.first_token_at for r in reqs if r.progress.first_token_at is not None]
  ttft = f"{1e3 * (min(firsts) - t0):.1f}" if firsts else "-"
  return (
    f"{request.method} {request.path} {status} tenant={tenant or '-'} prompt_tokens={prompt} "
    f"output_tokens={output} cached_tokens={cached} ttft_ms={ttft} total_ms={1e3 * (t1 - t0):.1f}"
  )
