"""Incremental detokenisation for streaming: whole UTF-8 characters only, and stop strings cut exactly
(text that could still grow into a stop string is held back until it can't)."""
from __future__ import annotations

import codecs
from typing import Callable, Sequence


class TextStream:
  """Feed token ids as they come; get back the text that is safe to send and whether a stop hit."""

  def __init__(self, token_bytes: Callable[[Sequence[int]], bytes], stops: Sequence[str] = ()):
    self._bytes = token_bytes
    self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
    self._stops = [s for s in stops if s]
    self._hold = max((len(s) for s in self._stops), default=1) - 1
    self.text = ""
    self.sent = 0
    self.stopped = False

  def feed(self, ids: Sequence[int]) -> str:
    """New sendable text after these tokens ('' once a stop string was found)."""
    if self.stopped:
      return ""
    self.text += self._utf8.decode(self._bytes(ids))
    return self._emit(final=False)

  def close(self) -> str:
    """Flush what was held back (at the end of generation)."""
    if self.stopped:
      return ""
    self.text += self._utf8.decode(b"", final=True)
    return self._emit(final=True)

  def _emit(self, final: bool) -> str:
    start = max(0, self.sent - self._hold)
    hits = [i for i in (self.text.find(s, start) for s in self._stops) if i >= 0]
    if hits:
      end = min(hits)
      self.stopped = True
    elif final:
      end = len(self.text)
    else:
      end = len(self.text) - self._partial_stop()
    out = self.text[self.sent:max(end, self.sent)]
    self.sent = max(end, self.sent)
    if self.stopped:
      self.text = self.text[:end]
    return out

  def _partial_stop(self) -> int:
    """Length of the longest tail of the text that begins some stop string."""
    for n in range(min(self._hold, len(self.text)), 0, -1):
      tail = self.text[-n:]
      if any(s.startswith(tail) for s in self._stops):
        return n
    return 0
