"""What a grammar library costs the host per constrained token, with our GPT-2 vocabulary (50,257 ids, bitmask
rows padded to the model's vocabulary): the time to compile a schema, and the time to fill one position's
allowed-token bitmask and to advance by the emitted token, for `json_object`, for a strict `json_schema`
bounded by enums, integer ranges, maxLength and maxItems, and for tools under `auto` (free text, then calls);
then what the mask costs the sampler (docs/BENCHMARKS.md, "Grammar masks").

Each grammar is walked two ways: along the GPT-2 tokens of valid replies (what a model that follows the
schema emits), and by random walks that pick a uniformly random allowed token at each position (cut at 256
tokens). The library is timed where it is installed: llguidance (through serve/api/grammar.py, as the server
runs it) and outlines-core; xgrammar is reported as not importable without torch.

    python -m benchmarks grammar_masks [--walks 20] [--repeat 3] [--sampler_calls 30]
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np

from laplace_jax.data.tokenizer import EOS_ID, VOCAB_SIZE, get_tokenizer
from laplace_jax.model.config import get_config
from serve.api import grammar, toolcalls

STRICT = {
  "type": "object",
  "properties": {
    "name": {"type": "string", "maxLength": 24},
    "kind": {"enum": ["person", "place", "thing", "idea"]},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
    "score": {"type": "number"},
    "active": {"type": "boolean"},
    "address": {
      "type": "object",
      "properties": {
        "city": {"type": "string", "maxLength": 32},
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
      },
      "required": ["city", "zip"],
      "additionalProperties": False,
    },
  },
  "required": ["name", "kind", "age", "tags", "score", "active", "address"],
  "additionalProperties": False,
}

# serve/api/grammar.py's: json.dumps's separators, no other whitespace (a random model cannot pad forever)
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

DOCS = {
  "json_object": [
    {"a": 1, "b": [1, 2, {"c": "three"}], "d": None},
    {"user": {"name": "Ada Lovelace", "langs": ["en", "fr"], "id": 1815}, "ok": True},
    {"numbers": [3.14, -2, 1e10, 0], "text": 'a longer string with spaces, commas, and "quotes"'},
  ],
  "strict json_schema": [
    {
      "name": "Ada",
      "kind": "person",
      "age": 36,
      "tags": ["math", "poet"],
      "score": 9.5,
      "active": False,
      "address": {"city": "London", "zip": "12345"},
    },
    {
      "name": "Rome",
      "kind": "place",
      "age": 150,
      "tags": [],
      "score": -1,
      "active": True,
      "address": {"city": "Rome", "zip": "00100"},
    },
  ],
}
TOOLS = (
  grammar.Tool("lookup", STRICT, strict=True),
  grammar.Tool("add", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}),
)
GRAMMARS = {
  "json_object": grammar.Constraint("json_object"),
  "strict json_schema": grammar.Constraint("json_schema", schema=STRICT, strict=True),
  "tools, auto": grammar.Constraint("tools", tools=TOOLS, choice="auto"),
}
PROSE = (
  " In the beginning God created the heaven and the earth. And the earth was without form, and void; and"
  " darkness was upon the face of the deep. I will look that up for you."
)
TEXTS = {
  "json_object": [json.dumps(d) for d in DOCS["json_object"]],
  "strict json_schema": [json.dumps(d) for d in DOCS["strict json_schema"]],
  "tools, auto": [
    PROSE,
    PROSE
    + " "
    + toolcalls.calls_text([("lookup", json.dumps(DOCS["strict json_schema"][0])), ("add", '{"a": 1}')]),
  ],
}


class LLGuidance:
  """llguidance through serve/api/grammar.py, as the server runs it."""

  name = "llguidance"

  def __init__(self, enc, words: int):
    import llguidance

    from serve.api import grammar

    self.grammar, self.words = grammar, words
    t = time.perf_counter()
    grammar.tokenizer()
    self.tokenizer_s = time.perf_counter() - t
    self.version = llguidance.get_version() if hasattr(llguidance, "get_version") else "?"

  def compile(self, c):
    return self.grammar.Grammar(c).matcher()

  def fill(self, m, row):
    m.fill(row)

  def advance(self, m, t) -> bool:
    return m.advance([t]) == 1

  def done(self, m) -> bool:
    return m.done


class OutlinesCore:
  name = "outlines-core"

  def __init__(self, enc, words: int):
    import outlines_core

    self.oc, self.words = outlines_core, words
    t = time.perf_counter()
    vocab: dict = {}
    for i in range(VOCAB_SIZE - 1):
      vocab.setdefault(enc.decode_single_token_bytes(i), []).append(i)
    self.vocab = outlines_core.Vocabulary(EOS_ID, vocab)
    self.tokenizer_s = time.perf_counter() - t
    from importlib.metadata import version

    self.version = version("outlines-core")

  def compile(self, c):
    if c.kind == "tools":
      raise NotImplementedError("outlines-core has no lazy triggers for tools under auto")
    schema = {"type": "object"} if c.schema is None else c.schema
    regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema), r"[ ]?")
    return self.oc.Guide(self.oc.Index(regex, self.vocab))

  def fill(self, g, row):
    g.write_mask_into(row.ctypes.data, row.size, 4)

  def advance(self, g, t) -> bool:
    g.advance(t, return_tokens=False)
    return True

  def done(self, g) -> bool:
    return g.is_finished()


def allowed(row) -> np.ndarray:
  return np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))


def walk(lib, m0_factory, tokens, rng, times, limit=256):
  """Fill and advance along `tokens` (or random allowed ones when None); appends per-position seconds."""
  m = m0_factory()
  row = np.zeros(lib.words, np.int32)
  for i in range(limit if tokens is None else len(tokens)):
    t0 = time.perf_counter()
    lib.fill(m, row)
    t1 = time.perf_counter()
    ok = allowed(row)
    if tokens is None:
      ok = ok[ok != EOS_ID] if len(ok) > 1 else ok
      t = int(rng.choice(ok))
    else:
      t = tokens[i]
      assert t in set(ok.tolist()), f"{lib.name}: token {i} ({t}) of a valid document is masked out"
    t2 = time.perf_counter()
    lib.advance(m, t)
    times.append((t1 - t0) + (time.perf_counter() - t2))
    if t == EOS_ID or lib.done(m):
      break


def grammar_rows(args, enc, words):
  try:
    import xgrammar  # noqa: F401

    print("xgrammar: importable (not timed here)")
  except ImportError as e:
    print(f"xgrammar: not importable ({e}); it depends on torch")
  libs = []
  for cls in (LLGuidance, OutlinesCore):
    try:
      libs.append(cls(enc, words))
    except ImportError as e:
      print(f"{cls.name}: not installed ({e})")
  rng = np.random.default_rng(0)
  print(
    "| library | grammar | compile + first mask, ms (median) | mask + advance, µs: median | p99 | max | positions |"
  )
  print("|---|---|---:|---:|---:|---:|---:|")
  for lib in libs:
    for gname, c in GRAMMARS.items():
      compile_s = []
      row = np.zeros(words, np.int32)
      try:
        for _ in range(args.repeat):  # the compile and the first mask (llguidance builds its lexer lazily)
          t = time.perf_counter()
          lib.fill(lib.compile(c), row)
          compile_s.append(time.perf_counter() - t)
      except NotImplementedError as e:
        print(f"| {lib.name} | {gname} | {e} | | | | |")
        continue
      if lib.name == "llguidance":
        fresh = grammar.Grammar(c).matcher
      else:
        g = lib.compile(c)
        fresh = lambda g=g: (g.reset(), g)[1]
      times: list[float] = []
      for text in TEXTS[gname]:
        walk(lib, fresh, enc.encode(text), rng, times)
      for _ in range(args.walks):
        walk(lib, fresh, None, rng, times)
      us = np.array(times) * 1e6
      print(
        f"| {lib.name} {lib.version} | {gname} | {np.median(compile_s) * 1e3:.1f} | {np.median(us):.0f} | "
        f"{np.percentile(us, 99):.0f} | {us.max():.0f} | {len(us)} |"
      )
    print(f"| {lib.name} | its tokenizer from our vocabulary | {lib.tokenizer_s * 1e3:.0f} | | | | |")


def sampler_rows(args, words):
  """serve.slots.sampling.sample over 64 rows of tiny's vocabulary, the logits made by a matmul as the LM head
  makes them (logits that are a jitted call's argument cost the masked select a pass of its own): without
  a mask, with an all-ones mask (a free slot's), with 1 row in 8 masked; calls interleaved, medians."""
  import jax
  import jax.numpy as jnp

  from serve.slots import sampling

  S, V, D = 64, get_config("tiny").vocab_size, 16
  rng = np.random.default_rng(0)
  h = jnp.asarray(rng.normal(0, 1, (S, D)).astype(np.float32))
  emb = jnp.asarray(rng.normal(0, 1, (D, V)).astype(np.float32))
  ones = np.full((S, words), -1, np.int32)
  some = ones.copy()
  some[::8] = rng.integers(-(2**31), 2**31, (S // 8, words), dtype=np.int64).astype(np.int32)

  @jax.jit
  def fn(h, emb, t, top_p, allowed):
    zero = jnp.zeros(S, jnp.int32)
    seeds = jnp.arange(S, dtype=jnp.uint32)
    return sampling.sample(h @ emb, t, zero, top_p, seeds, zero, valid_vocab=VOCAB_SIZE, allowed_SxG=allowed)

  print(
    "| sampler, 64 rows (+ a [64, 16] x [16, V] matmul) | no mask, ms | all-ones mask, ms | 8 rows masked, ms |"
  )
  print("|---|---:|---:|---:|")
  for name, t, top_p in (("greedy", 0.0, 1.0), ("temperature 1", 1.0, 1.0), ("top-p 0.95", 1.0, 0.95)):
    settings = (jnp.full(S, t, jnp.float32), jnp.full(S, top_p, jnp.float32))
    masks = {"none": None, "ones": jnp.asarray(ones), "some": jnp.asarray(some)}
    got: dict = {k: [] for k in masks}
    for m in masks.values():  # compile
      fn(h, emb, *settings, m).block_until_ready()
    for _ in range(args.sampler_calls):
      for k, m in masks.items():
        t0 = time.perf_counter()
        fn(h, emb, *settings, m).block_until_ready()
        got[k].append(time.perf_counter() - t0)
    med = {k: np.median(v) * 1e3 for k, v in got.items()}
    print(f"| {name} | {med['none']:.2f} | {med['ones']:.2f} | {med['some']:.2f} |")


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--walks", type=int, default=20, help="random walks per grammar")
  ap.add_argument("--repeat", type=int, default=3, help="compiles timed per schema (the median is reported)")
  ap.add_argument("--sampler_calls", type=int, default=30, help="timed sampler calls per variant")
  args = ap.parse_args()
  enc = get_tokenizer()
  words = -(-get_config("tiny").vocab_size // 32)
  print(f"machine: {platform.processor() or platform.machine()}, python {platform.python_version()}")
  grammar_rows(args, enc, words)
  sampler_rows(args, words)


if __name__ == "__main__":
  main()
