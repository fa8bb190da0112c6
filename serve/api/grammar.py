"""Grammar-constrained decoding, the host side: a request's constraint (a JSON format or its tools) compiled by
llguidance into a grammar, and a per-choice `Matcher` that writes each position's allowed-token bitmask.

Why llguidance: measured with our GPT-2 vocabulary (benchmarks/grammar_masks.py, docs/BENCHMARKS.md "Grammar
masks"), a mask and an advance take microseconds at the median and under half a millisecond at p99, a schema
compiles in about a millisecond (its lexer is built lazily, per mask), it serves any JSON value (not a
depth-bounded regex, as outlines-core does, whose `json_object` takes seconds to compile) and lazy triggers
for tools under `auto`; it installs alone (xgrammar imports torch).

The protocol, as the engine calls it (one engine thread per Matcher; never two threads at once):

    m = request.constraint            # a Matcher, or None for a free request
    m.fill(words_W)                   # int32 [W], W = ceil(vocab_size / 32): bit t % 32 of word t // 32 set
                                      # = token t allowed now; ids >= 50257 (the padded rows) never are
    n = m.advance(tokens)             # the tokens the slot emitted, in order; returns how many the grammar
                                      # took (all of them when each was sampled under its own fill)
    m.rollback(k)                     # undo the last k advanced tokens (a verify's rejected drafts)
    m.done                            # the grammar has ended: the reply ends here, finish_reason "stop";
                                      # fill() then allows only m.stop_id
    m.error                           # None, or why the library stopped matching (its limits): fill() then
                                      # allows only m.stop_id

Several tokens per call (`--decode_steps M`) need a mask per step, which depends on the tokens sampled before
it inside the call, so a constrained slot takes single steps (or the engine masks step i from the host after
step i - 1 is read). A verify builds its K + 1 rows by advancing through the drafts (fill, advance one draft,
fill, ...), then rolls back the drafts and advances by the tokens accepted; a draft its row forbids is never
accepted because the sampled token is always allowed. When `done`, the engine may end the slot at once or
let it sample `stop_id` (the only allowed token; the server puts it in the request's stop ids).

Compiled grammars are cached per (tenant, cache_salt, canonical constraint), LRU-bounded, never across
tenants; compiles run in a thread pool under a time limit, never on the event loop or in an engine step.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import functools
import json
import threading
from typing import Any, cast

import numpy as np

from laplace_jax.data.tokenizer import EOS_ID, VOCAB_SIZE
from serve.api import toolcalls
from serve.api.protocol import ApiError

# The JSON the model writes: json.dumps's separators and no other whitespace, so a random model cannot pad
# with whitespace forever and a re-sent reply renders into the text it produced.
JSON_OPTIONS: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CALL_OPEN, CALL_CLOSE = toolcalls.OPEN + "\n", "\n" + toolcalls.CLOSE  # the format around a call
WORDS = -(-VOCAB_SIZE // 32)  # the words of a row that llguidance writes (our vocabulary's tokens)


@dataclasses.dataclass(frozen=True)
class GrammarLimits:
  """Bounds on what a request may ask to compile; each refusal is a 400 naming it."""

  max_schema_bytes: int = 65_536  # one request's schemas together, as canonical JSON
  max_schema_depth: int = 24  # nesting of objects and arrays inside a schema
  max_tools: int = 128  # tools per request (OpenAI's bound)
  compile_seconds: float = 5.0  # a grammar's compile and first mask
  cache_entries: int = 512  # compiled grammars kept (all tenants together)


LIMITS = GrammarLimits()  # the server's


@dataclasses.dataclass(frozen=True)
class Tool:
  """A function tool: its name, and the JSON schema of its arguments."""

  name: str
  parameters: dict
  strict: bool = False
  description: str | None = None


@dataclasses.dataclass(frozen=True)
class Constraint:
  """What a request constrains its output to. kind "json_object": any JSON object; "json_schema": `schema`
  (strict: every keyword must be enforced, else 400; otherwise keywords the library does not do are
  ignored); "tools": `tools` called per `choice` ("auto": free text, or text then calls, the text free until
  a call starts; "required": calls only; a tool's name: calls of it only), several calls when `parallel`."""

  kind: str
  schema: dict | None = None
  strict: bool = False
  tools: tuple[Tool, ...] = ()
  choice: str = "auto"
  parallel: bool = True
  lead: str = ""  # text before the first call when one must be made (the default template's space)

  def key(self) -> str:
    """The canonical form the cache is keyed by."""
    return json.dumps(dataclasses.asdict(self), sort_keys=True, separators=(",", ":"))


def _schema_with_options(schema: dict, strict: bool) -> dict:
  return {**schema, "x-guidance": {**JSON_OPTIONS, "lenient": not strict}}


def _lark_str(s: str) -> str:
  return json.dumps(s)


def grammar_text(c: Constraint) -> str:
  """The llguidance grammar of a constraint (blocking, cheap: the work is in compile)."""
  import llguidance

  if c.kind == "json_object":
    return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
  if c.kind == "json_schema":
    assert c.schema is not None
    return llguidance.LLMatcher.grammar_from_json_schema(
      c.schema, defaults=cast(Any, {**JSON_OPTIONS, "lenient": not c.strict})
    )
  tools = [t for t in c.tools if c.choice in ("auto", "required") or t.name == c.choice]
  rules = []
  for i, t in enumerate(tools):
    head = _lark_str('{"name": ' + json.dumps(t.name) + ', "arguments": ')
    rules.append(f"fn_{i}: {head} %json {json.dumps(_schema_with_options(t.parameters, t.strict))} " + '"}"')
  body = f"call: ({' | '.join(f'fn_{i}' for i in range(len(tools)))}) {_lark_str(CALL_CLOSE)}"
  more = f"({_lark_str(chr(10) + CALL_OPEN)} call)*" if c.parallel else ""
  if c.choice == "auto":  # free text, or text up to the first CALL_OPEN (lazy: it ends there) and calls
    start = ["start: TEXT | pre calls", "TEXT: /(.|\\n)*/", f"pre[lazy]: TEXT {_lark_str(CALL_OPEN)}"]
  else:
    start = [f"start: {_lark_str(c.lead + CALL_OPEN)} calls"]
  return "\n".join(["%llguidance {}", *start, f"calls: call {more}", body, *rules])


@functools.lru_cache(maxsize=1)
def tokenizer():
  """llguidance's view of the GPT-2 vocabulary (built once, ~0.15 s)."""
  from llguidance.tiktoken import lltokenizer_from_encoding

  from laplace_jax.data.tokenizer import get_tokenizer

  return lltokenizer_from_encoding(get_tokenizer(), n_vocab=VOCAB_SIZE, eos_token=EOS_ID)


def _parser_limits():
  import llguidance

  # verbose_errors off: an error names the problem, not the parser's state
  return llguidance.LLParserLimits(verbose_errors=False)


class Grammar:
  """A compiled constraint: an llguidance matcher at its start, copied for each choice (never advanced)."""

  def __init__(self, constraint: Constraint):
    import llguidance

    self.constraint = constraint
    try:
      text = grammar_text(constraint)
    except ValueError as e:
      raise GrammarError(str(e)) from None
    self._start = llguidance.LLMatcher(tokenizer(), text, log_level=0, limits=_parser_limits())
    if not self._start.is_error():  # the first mask builds the lexer: part of the compile, timed with it
      row = np.zeros(WORDS, np.int32)
      self._start.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
    if self._start.is_error():
      raise GrammarError(self._start.get_error())

  def matcher(self) -> Matcher:
    return Matcher(self._start.deep_copy())


class GrammarError(Exception):
  """The library refused a constraint (its message says why)."""


class Matcher:
  """One choice's position in its grammar (see the module docstring for the protocol)."""

  stop_id = EOS_ID

  def __init__(self, m):
    self._m = m
    self._stop = np.zeros(WORDS, np.int32)
    self._stop[EOS_ID // 32] = np.int32(np.uint32(1 << (EOS_ID % 32)).view(np.int32))

  def fill(self, words: np.ndarray) -> None:
    """Write this position's allowed tokens into `words` (int32 [W], W >= ceil(50257 / 32), contiguous)."""
    if words.dtype != np.int32 or words.ndim != 1 or words.size < WORDS or not words.flags["C_CONTIGUOUS"]:
      raise ValueError(
        f"fill needs a contiguous int32 row of at least {WORDS} words, got {words.dtype} {words.shape}"
      )
    words[WORDS:] = 0
    if self._m.is_error() or self._m.is_stopped():
      words[:WORDS] = self._stop
      return
    self._m.unsafe_compute_mask_ptr(words.ctypes.data, WORDS * 4)
    if self._m.is_error():
      words[:WORDS] = self._stop

  def advance(self, tokens) -> int:
    """Consume the emitted tokens; the count the grammar took (the rest were not allowed: a bug upstream)."""
    return self._m.try_consume_tokens([int(t) for t in tokens])

  def rollback(self, n: int) -> None:
    if n and not self._m.rollback(n):
      raise ValueError(f"cannot roll back {n} tokens: {self._m.get_error()}")

  @property
  def done(self) -> bool:
    return self._m.is_stopped() and not self._m.is_error()

  @property
  def error(self) -> str | None:
    return self._m.get_error() if self._m.is_error() else None


def depth(obj) -> int:
  """How deeply arrays and objects nest in `obj` (iterative)."""
  deepest, stack = 0, [(obj, 1)]
  while stack:
    o, d = stack.pop()
    if isinstance(o, (list, dict)):
      deepest = max(deepest, d)
      stack.extend((c, d + 1) for c in (o.values() if isinstance(o, dict) else o))
  return deepest


def check_size(c: Constraint, limits: GrammarLimits, param: str) -> None:
  """400s for a constraint over the limits on schema bytes, nesting and tools (run before any compile)."""
  if len(c.tools) > limits.max_tools:
    raise ApiError(
      400, f"{len(c.tools)} tools: at most {limits.max_tools} per request (the limit on tools).", param
    )
  schemas: list[Any] = [c.schema] if c.schema is not None else [t.parameters for t in c.tools]
  size = len(c.key().encode())
  if size > limits.max_schema_bytes:
    raise ApiError(
      400,
      f"the schemas of this request are {size} bytes as JSON: at most {limits.max_schema_bytes} (the limit "
      "on schema bytes). Send a smaller schema or fewer tools.",
      param,
    )
  deepest = max((depth(s) for s in schemas), default=0)
  if deepest > limits.max_schema_depth:
    raise ApiError(
      400,
      f"a schema nests objects and arrays {deepest} deep: at most {limits.max_schema_depth} (the limit on "
      "schema nesting depth). Flatten it.",
      param,
    )


@dataclasses.dataclass
class CompilerStats:
  """The Compiler's counters since it started (mutable: each compile adds to them)."""

  hits: int = 0  # compiles answered from the cache
  misses: int = 0  # grammars compiled
  timeouts: int = 0  # compiles that ran past limits.compile_seconds (answered 400, cached when they finish)
  rejected: int = 0  # schemas the grammar library refused


class Compiler:
  """Compiles constraints off the event loop under a time limit, cached per tenant scope (LRU)."""

  def __init__(self, limits: GrammarLimits | None = None, workers: int = 2):
    self.limits = limits or GrammarLimits()
    self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="grammar")
    self._cache: collections.OrderedDict[tuple, Grammar] = collections.OrderedDict()
    self._lock = threading.Lock()
    self.stats = CompilerStats()

  def cached(self, scope: tuple, c: Constraint) -> Grammar | None:
    with self._lock:
      g = self._cache.get((scope, c.key()))
      if g is not None:
        self._cache.move_to_end((scope, c.key()))
      return g

  def _put(self, scope: tuple, c: Constraint, g: Grammar):
    with self._lock:
      self._cache[(scope, c.key())] = g
      while len(self._cache) > self.limits.cache_entries:
        self._cache.popitem(last=False)

  def compile_now(self, c: Constraint, scope: tuple = ("",), param: str | None = None) -> Grammar:
    """Blocking compile (cached); a library refusal is a 400 with its reason."""
    g = self.cached(scope, c)
    if g is not None:
      self.stats.hits += 1
      return g
    self.stats.misses += 1
    try:
      g = Grammar(c)
    except GrammarError as e:
      self.stats.rejected += 1
      raise ApiError(400, f"the grammar library refused this schema: {str(e)[:500]}", param) from None
    self._put(scope, c, g)
    return g

  async def compile(self, c: Constraint, scope: tuple, param: str | None = None) -> Grammar:
    """`compile_now` in the pool, awaited at most limits.compile_seconds (then a 400 naming the limit; the
    compile finishes in the background and is cached)."""
    g = self.cached(scope, c)
    if g is not None:
      self.stats.hits += 1
      return g
    fut = asyncio.wrap_future(self._pool.submit(self.compile_now, c, scope, param))
    try:
      return await asyncio.wait_for(asyncio.shield(fut), self.limits.compile_seconds)
    except asyncio.TimeoutError:
      self.stats.timeouts += 1
      fut.add_done_callback(lambda f: f.exception())  # retrieved: no "never retrieved" warning
      raise ApiError(
        400,
        f"compiling this request's grammar took more than {self.limits.compile_seconds:g} s (the limit on "
        "grammar compile time): send a smaller or simpler schema.",
        param,
      ) from None

  def close(self):
    self._pool.shutdown(wait=False, cancel_futures=True)
