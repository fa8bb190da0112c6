"""The server's access log (serve/api/access_log.py): one line per request with its status, tenant, token counts
and times; never the prompt or the key. Over the fake engine: nothing compiles."""

import logging
import re

import pytest
from helpers import serve_fixtures as sf
from helpers.serve_fixtures import call

from serve.api.tenants import Tenants

KEY = "sk-access-log-secret"
PROMPT = "a confidential prompt about zebras"


@pytest.fixture(scope="module")
def served():
  tok = sf.gpt2_tokenizer()
  engine = sf.fake_engine(n_slots=4, prefill_batch=2, max_queue=4)
  lim = sf.limits(tok, engine, max_tokens=16, max_prompt_tokens=1000)
  with sf.serving(engine, tok, lim, tenants=Tenants([("alice", KEY)])) as (url, _):
    yield url, len(tok.encode(PROMPT))


def _lines(caplog):
  return [r.getMessage() for r in caplog.records if r.name == "serve.access"]


def test_one_line_per_request_without_the_prompt_or_the_key(served, caplog):
  url, n_prompt = served
  auth = {"Authorization": f"Bearer {KEY}"}
  with caplog.at_level(logging.INFO, logger="serve.access"):
    body = {"model": "laplace-tiny", "prompt": PROMPT, "max_tokens": 5, "n": 2, "ignore_eos": True}
    assert call(url, body=body, headers=auth)[0] == 200
    assert call(url, body={**body, "stream": True, "n": 1}, headers=auth)[0] == 200
    assert call(url, method="GET", path="/health", headers={})[0] == 200
    assert call(url, body=body, headers={"Authorization": "Bearer wrong"})[0] == 401
  lines = _lines(caplog)
  assert len(lines) == 4, lines
  whole, stream, health, denied = lines
  assert re.fullmatch(
    rf"POST /v1/completions 200 tenant=alice prompt_tokens={n_prompt} output_tokens=10 cached_tokens=0 "
    r"ttft_ms=[\d.]+ total_ms=[\d.]+",
    whole,
  )
  assert f"prompt_tokens={n_prompt} output_tokens=5 " in stream and "ttft_ms=-" not in stream
  assert (
    health.startswith("GET /health 200 tenant=- prompt_tokens=0 output_tokens=0") and "ttft_ms=-" in health
  )
  assert denied.startswith("POST /v1/completions 401 tenant=- ")
  for line in lines:
    assert KEY not in line and "zebras" not in line and "wrong" not in line


def test_third_party_info_lines_are_quiet_unless_verbose():
  from laplace_jax import cli

  try:
    cli.set_verbosity(False)
    assert not logging.getLogger("orbax").isEnabledFor(logging.INFO)
    assert not logging.getLogger("jax._src.xla_bridge").isEnabledFor(logging.INFO)  # the TPU probe
    assert not logging.getLogger("absl").isEnabledFor(logging.WARNING)  # grain's profiler notice
    cli.set_verbosity(True)
    assert logging.getLogger("orbax").isEnabledFor(logging.INFO)
  finally:
    for name in cli.THIRD_PARTY_LOGGERS:
      logging.getLogger(name).setLevel(logging.NOTSET)
