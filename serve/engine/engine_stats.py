"""The engine's counters (`EngineStats`, what /metrics and the benchmarks read by name) and its recent output
rate (`TokenRate`). Written by the engine's thread only; a reader on another thread sees each int whole."""

from __future__ import annotations

import collections
import dataclasses


@dataclasses.dataclass
class EngineStats:
  """Counts since the engine was made (zeroed after warm-up). Copy one with `dataclasses.replace` to measure
  a window."""

  requests: int = 0  # choices admitted to the queue (a request with n - 1 siblings counts n)
  finished: int = 0  # choices finished, for any reason
  rejected: int = 0  # requests refused with QueueFull
  tokens: int = 0  # output tokens delivered
  steps: int = 0  # generate and verify calls dispatched
  prefill_tokens: int = 0  # prompt tokens prefilled
  cached_prompt_tokens: int = 0  # prompt tokens restored from the state cache instead
  drafted_tokens: int = 0  # drafts verified (predictions and prompt lookup)
  accepted_tokens: int = 0  # and taken


class TokenRate:
  """Output tokens per second over a recent window, from each read-back's (time, tokens)."""

  KEEP_S = 60.0  # seconds of history kept

  def __init__(self) -> None:
    self._recent: collections.deque[tuple[float, int]] = collections.deque()  # (time, tokens)

  def add(self, now: float, tokens: int) -> None:
    self._recent.append((now, tokens))
    while self._recent[0][0] < now - self.KEEP_S:
      self._recent.popleft()

  def per_second(self, now: float, window: float = 10.0) -> float:
    while self._recent and self._recent[0][0] < now - window:
      self._recent.popleft()
    if len(self._recent) < 2:
      return 0.0
    span = max(now - self._recent[0][0], 1e-9)
    return sum(n for _, n in list(self._recent)[1:]) / span

  def clear(self) -> None:
    self._recent.clear()
