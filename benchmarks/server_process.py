"""`python -m serve` as a child process, for the checks that must own their server (kill -9 it, restart it):
started from the repository root, ready once it logs the URL it serves on."""

from __future__ import annotations

import os
import queue
import re
import subprocess
import threading
import time
from collections.abc import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def start_server(
  python: str,
  flags: list[str],
  *,
  log: list[str] | None = None,
  on_line: Callable[[str], None] | None = None,
  timeout: float = 600.0,
) -> tuple[subprocess.Popen, str]:
  """Popen `python -m serve --port 0 *flags`; (process, URL) once it logs "serving ... on URL". Its stderr is
  read on a thread for as long as it runs (a full pipe would stall the server), each line appended to `log`
  and passed to `on_line`. A server that exits first, or names no URL within `timeout` seconds, is a
  SystemExit holding its log (and is killed)."""
  log = [] if log is None else log
  proc = subprocess.Popen(
    [python, "-m", "serve", "--port", "0", *flags], cwd=ROOT, stderr=subprocess.PIPE, text=True
  )
  lines: queue.Queue[str] = queue.Queue()

  def read():
    assert proc.stderr is not None
    for line in proc.stderr:
      log.append(line)
      if on_line is not None:
        on_line(line)
      lines.put(line)
    lines.put("")  # the end of its output

  threading.Thread(target=read, daemon=True).start()
  deadline = time.time() + timeout
  while True:
    try:
      line = lines.get(timeout=max(0.0, deadline - time.time()))
    except queue.Empty:
      proc.kill()
      raise SystemExit(f"the server named no URL within {timeout:.0f} s:\n" + "".join(log)) from None
    if not line:
      proc.wait()
      raise SystemExit("the server exited:\n" + "".join(log))
    m = re.search(r"serving \S+ on (http://\S+)", line)
    if m:
      return proc, m.group(1)
