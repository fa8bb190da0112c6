"""`python -m serve --state-cache-dir`: a conversation's state survives a kill -9 of the server, the next
turn after the restart restores it, and its tokens equal those of a full prefill without the cache (the
restarted server's own, under a cache_salt no state was stored for: a scope that misses, so nothing is
restored, as with no cache; the metrics show no hit)."""

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import helpers
import numpy as np
import pytest

from laplace_jax.platform import CPU_DEVICES_ENV

ROOT = str(helpers.ROOT)


def _start(*flags):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop(CPU_DEVICES_ENV, None)
  proc = subprocess.Popen(
    [
      sys.executable,
      "-m",
      "serve",
      "--preset",
      "tiny",
      "--random-init",
      "--port",
      "0",
      "--n-slots",
      "4",
      "--slot-buckets",
      "table",  # one compiled program: the buckets are tested elsewhere
      *flags,
    ],
    cwd=ROOT,
    env=env,
    stderr=subprocess.PIPE,
    text=True,
  )
  # stderr read on a thread: a server that never prints its URL fails the test at the deadline, not hangs it
  lines: queue.Queue = queue.Queue()
  threading.Thread(target=lambda: [lines.put(x) for x in proc.stderr] + [lines.put("")], daemon=True).start()
  deadline, log = time.time() + 240, []
  while time.time() < deadline:
    try:
      line = lines.get(timeout=max(0.0, deadline - time.time()))
    except queue.Empty:
      break
    if not line:
      proc.wait()
      raise AssertionError("server exited:\n" + "".join(log))
    log.append(line)
    m = re.search(r"serving \S+ on (http://\S+)", line)
    if m:
      return proc, m.group(1)
  proc.kill()
  raise AssertionError("server did not start:\n" + "".join(log))


def _post(url, body):
  req = urllib.request.Request(
    url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
  )
  with urllib.request.urlopen(req, timeout=120) as r:
    return json.loads(r.read())


def _metric(url, name):
  with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
    text = r.read().decode()
  return float(re.search(rf"^laplace_serve_{name} (\S+)$", text, re.M).group(1))


def _turn(prompt, **kw):
  return {
    "prompt": prompt,
    "max_tokens": 6,
    "temperature": 0,
    "ignore_eos": True,
    "return_token_ids": True,
    **kw,
  }


@pytest.mark.slow
def test_a_conversation_resumes_after_kill_9(tmp_path):
  cache_dir = str(tmp_path / "states")
  first = np.random.default_rng(0).integers(0, 50_000, 200).tolist()
  proc, url = _start("--state-cache-dir", cache_dir)
  try:
    out1 = _post(url, _turn(first))["choices"][0]["token_ids"]
    deadline = time.time() + 60
    # Two states: where the prompt ends, and where the reply does.
    while _metric(url, "state_cache_files_written_total") < 2 and time.time() < deadline:
      time.sleep(0.1)
    assert _metric(url, "state_cache_files_written_total") >= 2
  finally:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
  second = first + out1 + np.random.default_rng(1).integers(0, 50_000, 40).tolist()

  proc, url = _start("--state-cache-dir", cache_dir)
  try:
    got = _post(url, _turn(second))["choices"][0]["token_ids"]
    assert _metric(url, "state_cache_hits_total") == 1
    # A finished slot's state holds every output token but its last (serve.slots.slot_functions: hold_ended).
    assert _metric(url, "prompt_tokens_cached_total") == len(first) + len(out1) - 1
    assert _metric(url, "prompt_tokens_total") == 41
    # The reference: both turns prefilled in full, each under a salt of its own (never stored, so a miss)
    assert _post(url, _turn(first, cache_salt="ref-1"))["choices"][0]["token_ids"] == out1
    assert _post(url, _turn(second, cache_salt="ref-2"))["choices"][0]["token_ids"] == got
    assert _metric(url, "state_cache_hits_total") == 1
    assert _metric(url, "prompt_tokens_cached_total") == len(first) + len(out1) - 1
    assert _metric(url, "prompt_tokens_total") == 41 + len(first) + len(second)
  finally:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
