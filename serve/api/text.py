"""Incremental detokenisation for streaming: whole UTF-8 characters only, and stop strings cut exactly
(text that could still grow into a stop string is held back until it can't).

Stop strings are matched by one Knuth–Morris–Pratt automaton each, fed character by character: amortised
O(1) work per character and stop string, whatever their length, and only the held-back tail (at most the
longest stop string's length) is kept. Generation stops at the first character that completes some stop
string (the longest one completed there), and the text is cut where that stop string begins.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence


class _Stop:
  """A KMP automaton for one stop string: `state` is the length of the longest prefix of it that ends the
  text seen so far."""

  def __init__(self, s: str):
    self.s, self.state = s, 0
    self.fail = [0] * len(s)  # fail[i]: the longest proper prefix of s[:i + 1] that is also its suffix
    k = 0
    for i in range(1, len(s)):
      while k and s[i] != s[k]:
        k = self.fail[k - 1]
      if s[i] == s[k]:
        k += 1
      self.fail[i] = k

  def step(self, ch: str) -> bool:
    """Advance by one character; True when the stop string was just completed."""
    s, k = self.s, self.state
    while k and s[k] != ch:
      k = self.fail[k - 1]
    if s[k] == ch:
      k += 1
    if k == len(s):
      self.state = self.fail[k - 1]
      return True
    self.state = k
    return False


class TextStream:
  """Feed token ids as they come; get back the text that is safe to send and whether a stop hit."""

  def __init__(self, token_bytes: Callable[[Sequence[int]], bytes], stops: Sequence[str] = ()):
    self._bytes = token_bytes
    self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
    self._stops = [_Stop(s) for s in dict.fromkeys(stops) if s]
    self._firsts = {s.s[0] for s in self._stops}
    self.held = ""  # decoded text not sent yet: the tail that could still begin a stop string
    self.sent_bytes = 0  # UTF-8 bytes of the text returned so far (all of it once closed or stopped)
    self.stopped = False

  def feed(self, ids: Sequence[int]) -> str:
    """New sendable text after these tokens ('' once a stop string was found)."""
    if self.stopped:
      return ""
    return self._scan(self._utf8.decode(self._bytes(ids)), final=False)

  def close(self) -> str:
    """Flush what was held back (at the end of generation)."""
    if self.stopped:
      return ""
    return self._scan(self._utf8.decode(b"", final=True), final=True)

  def _scan(self, new: str, final: bool) -> str:
    out = self._cut(new, final)
    self.sent_bytes += len(out.encode("utf-8", "surrogatepass"))
    return out

  def _cut(self, new: str, final: bool) -> str:
    text = self.held + new
    if not self._stops:
      self.held = ""
      return text
    base = len(self.held)
    # Idle automata stay idle over characters that begin no stop string: skip such text whole.
    if base or not self._firsts.isdisjoint(new):
      for i, ch in enumerate(new):
        done = [m for m in self._stops if m.step(ch)]
        if done:
          self.stopped, self.held = True, ""
          return text[: base + i + 1 - max(len(m.s) for m in done)]
    keep = 0 if final else max(m.state for m in self._stops)
    self.held = text[len(text) - keep :]
    return text[: len(text) - keep]
