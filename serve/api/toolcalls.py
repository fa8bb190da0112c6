"""The one format in which the model writes tool calls, and its parsers (whole replies and streamed deltas).

A call is written as Hermes / Qwen chat templates write it, the arguments as JSON with json.dumps's
separators (serve/api/grammar.py constrains decoding to exactly this):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

several in a row for parallel calls, one newline apart, after any free text (`tool_choice` "auto"). The
default chat template (serve/api/chat.py) renders an assistant message that carries `tool_calls` as its content
followed by its calls in this format, so a re-sent history is the text the model produced.

`CallStream` turns the reply's text, piece by piece, into content and OpenAI-style call events: content
streams as it comes (a piece that could start a call is held until it is known not to), a call starts once
its name is complete, then its arguments stream as they come.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
_HEAD_CHARS = 4096  # a head longer than this is not one (then it is content)


def call_text(name: str, arguments: str) -> str:
  """One call as the model writes it (`arguments`: the JSON text of the arguments)."""
  return f'{OPEN}\n{{"name": {json.dumps(name)}, "arguments": {arguments}}}\n{CLOSE}'


def calls_text(calls: list) -> str:
  """Several calls ([(name, arguments)]) as the model writes them."""
  return "\n".join(call_text(n, a) for n, a in calls)


def new_call_id() -> str:
  return f"call_{uuid.uuid4().hex[:24]}"


@dataclasses.dataclass
class Call:
  id: str
  name: str
  arguments: str = ""


@dataclasses.dataclass
class Content:
  text: str


@dataclasses.dataclass
class CallStart:
  index: int
  call: Call


@dataclasses.dataclass
class CallArguments:
  index: int
  text: str


def _partial_suffix(s: str, tag: str) -> int:
  """The length of the longest suffix of s that is a proper prefix of tag."""
  for n in range(min(len(s), len(tag) - 1), 0, -1):
    if tag.startswith(s[-n:]):
      return n
  return 0


class CallStream:
  """Feed the reply's text with `feed`, then `close`; each returns the events the text completed."""

  def __init__(self) -> None:
    self.calls: list[Call] = []
    self.content = ""
    self._buf = ""
    self._state = "text"  # text, head, args, tail
    self._depth = 0  # inside the arguments: open brackets; -1 before the value starts
    self._in_string = self._escape = False
    self._after_call = False
    self._blank = ""  # leading whitespace content, held (see _emit_content)

  def feed(self, text: str) -> list:
    self._buf += text
    out: list = []
    while self._buf:
      before = (self._state, len(self._buf))
      getattr(self, f"_{self._state}")(out)
      if (self._state, len(self._buf)) == before:
        break  # waits for more text
    return out

  def close(self) -> list:
    """The end of the reply: text held back is content (a call cut short keeps what it got)."""
    out: list = []
    if self._state in ("text", "head") and self._buf:
      self._emit_content(out, (OPEN if self._state == "head" else "") + self._buf)
    if self._blank and not self.calls:
      self.content, self._blank = self._blank, ""
      out.append(Content(self.content))
    self._buf = ""
    return out

  def _emit_content(self, out, text):
    """Content; whitespace before anything else waits: before a call it is dropped (the default template's
    space after "Assistant:"), before text it goes out with it."""
    if not text:
      return
    if not self.content and not text.strip():
      self._blank += text
      return
    text, self._blank = self._blank + text, ""
    self.content += text
    out.append(Content(text))

  def _text(self, out):
    if self._after_call:  # the newlines between calls are not content
      self._buf = self._buf.lstrip()
      if not self._buf:
        return
      self._after_call = False
    i = self._buf.find(OPEN)
    if i >= 0:
      self._emit_content(out, self._buf[:i])
      self._buf, self._state = self._buf[i + len(OPEN) :], "head"
      return
    keep = _partial_suffix(self._buf, OPEN)
    self._emit_content(out, self._buf[: len(self._buf) - keep])
    self._buf = self._buf[len(self._buf) - keep :]

  def _head(self, out):
    m = _HEAD.match(self._buf)
    if m and m.end() < len(self._buf):  # the head and the first character of the arguments are here
      try:
        name = json.loads(f'"{m.group(1)}"')
      except ValueError:
        name = m.group(1)
      call = Call(new_call_id(), name)
      self.calls.append(call)
      out.append(CallStart(len(self.calls) - 1, call))
      self._buf, self._state = self._buf[m.end() :], "args"
      self._depth, self._in_string, self._escape = -1, False, False
    elif len(self._buf) > _HEAD_CHARS or CLOSE in self._buf:  # not a call after all: text
      self._emit_content(out, OPEN)
      self._state = "text"

  def _args(self, out):
    """Arguments text up to where its JSON value ends (bracket depth outside strings)."""
    end = None
    for i, ch in enumerate(self._buf):
      if self._in_string:
        if self._escape:
          self._escape = False
        elif ch == "\\":
          self._escape = True
        elif ch == '"':
          self._in_string = False
          if self._depth == -1:  # a bare string value
            end = i + 1
            break
      elif ch == '"':
        self._in_string = True
      elif ch in "{[":
        self._depth = max(self._depth, 0) + 1
      elif ch in "}]":
        if self._depth <= 0:  # the call's own closing brace: a scalar value ended before it
          end = i
          break
        self._depth -= 1
        if self._depth == 0:
          end = i + 1
          break
      elif self._depth == -1 and ch in ", \n":
        end = i
        break
    taken = self._buf if end is None else self._buf[:end]
    if taken:
      self.calls[-1].arguments += taken
      out.append(CallArguments(len(self.calls) - 1, taken))
    self._buf = "" if end is None else self._buf[end:]
    if end is not None:
      self._state = "tail"

  def _tail(self, out):
    i = self._buf.find(CLOSE)
    if i >= 0:
      self._buf, self._state, self._after_call = self._buf[i + len(CLOSE) :], "text", True


def parse(text: str) -> tuple[str, list[Call]]:
  """A whole reply's content (the text outside calls) and calls."""
  s = CallStream()
  s.feed(text)
  s.close()
  return s.content, s.calls
