"""OpenAI-style /v1/completions request parsing: every field checked, every error a 4xx with a message."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any, TypeGuard


class ApiError(Exception):
  """An error the client caused (or 429): status, message, offending parameter."""

  def __init__(self, status: int, message: str, param: str | None = None, kind: str | None = None):
    super().__init__(message)
    self.status, self.message, self.param = status, message, param
    self.kind = kind or {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}.get(
      status, "invalid_request_error"
    )

  def body(self) -> dict:
    return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


MAX_CACHE_SALT = 256  # characters of a request's cache_salt


@dataclasses.dataclass
class Limits:
  model_name: str
  vocab_size: int  # ids the tokenizer knows (GPT-2: 50,257)
  eos_id: int | None
  max_stop_ids: int  # device-side stop ids per request, EOS included
  max_tokens: int = 4096  # cap on max_tokens per request (--max_tokens)
  max_prompt_tokens: int = 32_768  # longest prompt accepted (--max_prompt_tokens)
  max_prompts: int = 64  # prompts x n per request (the slots plus the queue)
  max_choices: int = 16  # prompts x n per request, by policy (--max_choices): one request is not the server
  max_reply_entries: int = 1 << 19  # (--max_reply_entries) see reply_entries()
  max_prediction_tokens: int = 4096  # (--max_prediction_tokens) tokens of a request's prediction


MAX_STOPS = 4  # stop strings per request (OpenAI's bound)
MAX_STOP_CHARS = 512  # characters per stop string
MAX_JSON_DEPTH = 32  # nesting of arrays and objects in a request body
INT32_MAX = 2**31 - 1


@dataclasses.dataclass
class Completion:
  max_tokens: int
  temperature: float
  top_k: int
  top_p: float
  seed: int | None
  stop: list  # stop strings, matched on the text
  stop_ids: list  # stop token ids, matched on the device (EOS unless ignore_eos)
  stream: bool
  include_usage: bool
  return_token_ids: bool
  n: int = 1  # choices per prompt
  logprobs: int | None = None
  echo: bool = False
  cache_salt: str | None = None  # a state-cache scope within the tenant (vLLM's cache_salt)
  prediction_ids: list = dataclasses.field(default_factory=list)  # the prediction's tokens (drafts)
  prompts: list = dataclasses.field(default_factory=list)  # one list of token ids per prompt
  resent_as_text: bool = False  # a client re-sends prompt and reply as text (chat), not as ids
  texts: list = dataclasses.field(
    default_factory=list
  )  # the prompts as text (echo): the string sent, or None
  # What the reply must follow (serve.api.grammar.Constraint: a JSON format or tool calls), or None: free
  constraint: Any = None

  @property
  def prompt_ids(self) -> list:
    return self.prompts[0]


def is_int(x: object) -> TypeGuard[int]:
  return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x):
  return isinstance(x, (int, float)) and not isinstance(x, bool)


def show(v, n: int = 80) -> str:
  """A short JSON rendering of a client's value for an error message (never fails)."""
  if isinstance(v, (list, dict)) and len(v) > n:
    return f"a {'list' if isinstance(v, list) else 'object'} of {len(v)} items"
  try:
    return json.dumps(v)[:n]
  except (ValueError, TypeError, RecursionError):
    return f"a {type(v).__name__}"


def get_field(obj, name, default, check, expect):
  v = obj.get(name, None)
  if v is None:
    return default
  if not check(v):
    raise ApiError(400, f"'{name}' is {show(v)}: expected {expect}.", name)
  return v


def _depth(obj) -> int:
  """How deeply arrays and objects nest in `obj` (iterative: no recursion on the client's data)."""
  deepest, stack = 0, [(obj, 1)]
  while stack:
    o, d = stack.pop()
    deepest = max(deepest, d)
    items = o.values() if isinstance(o, dict) else o
    stack.extend((c, d + 1) for c in items if isinstance(c, (list, dict)))
  return deepest if isinstance(obj, (list, dict)) else 0


def parse_body(raw: bytes) -> dict:
  try:
    obj = json.loads(raw)
  except RecursionError:
    obj = None
  except (ValueError, UnicodeDecodeError) as e:
    raise ApiError(400, f"request body is not valid JSON ({e}); send a JSON object.") from None
  if obj is None or _depth(obj) > MAX_JSON_DEPTH:
    raise ApiError(
      400,
      f"request body nests arrays and objects more than {MAX_JSON_DEPTH} deep: send a flatter JSON object.",
    )
  if not isinstance(obj, dict):
    raise ApiError(400, f"request body is a JSON {type(obj).__name__}: expected a JSON object.")
  return obj


def count_choices(obj: dict) -> int:
  """The choices a request body asks for (prompts x n), read without tokenizing anything: admission
  (429 when the server is full) is decided on it first. Malformed fields count 1; parsing refuses them."""
  p, n = obj.get("prompt"), obj.get("n")
  prompts = len(p) if isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p) else 1
  return prompts * (n if is_int(n) and n > 1 else 1)


def choice_cap(limits: Limits) -> tuple[int, str]:
  """The most choices one request may ask for, and the flags that set it."""
  if limits.max_choices <= limits.max_prompts:
    return limits.max_choices, "--max_choices"
  return limits.max_prompts, "--n_slots plus --max_queue"


def reply_entries(c: Completion) -> int:
  """An upper bound on the token entries of the reply: choices x (new tokens + echoed prompt tokens), each
  entry carrying its text and, with logprobs, its token, logprob and the top-n alternatives."""
  per_token = 1 if c.logprobs is None else 3 + c.logprobs
  return sum(c.n * (c.max_tokens + (len(p) if c.echo else 0)) * per_token for p in c.prompts)


def _prompts(p, limits: Limits, encode: Callable[[str], list]) -> tuple[list, list]:
  """([ids per prompt], [text per prompt or None]) from a string, ids, or a list of either."""
  if isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
    cap, flags = choice_cap(limits)
    if len(p) > cap:
      raise ApiError(
        400,
        f"'prompt' is a list of {len(p)} prompts: at most {cap} choices per request "
        f"({flags}). Send fewer per request.",
        "prompt",
      )
    got = [prompt_ids_of(x, limits, encode) for x in p]
    return [g for g, _ in got], [t for _, t in got]
  ids, text = prompt_ids_of(p, limits, encode)
  return [ids], [text]


def prompt_ids_of(p, limits: Limits, encode: Callable[[str], list]):
  if isinstance(p, str):
    if not p:
      raise ApiError(400, "'prompt' is an empty string: expected text or token ids.", "prompt")
    ids = encode(p)
  elif isinstance(p, list) and all(is_int(t) for t in p):
    if not p:
      raise ApiError(400, "'prompt' is an empty list: expected at least one token id.", "prompt")
    bad = [t for t in p if not 0 <= t < limits.vocab_size]
    if bad:
      raise ApiError(
        400, f"'prompt' has token ids {bad[:5]} outside the vocabulary [0, {limits.vocab_size}).", "prompt"
      )
    ids = list(p)
  elif isinstance(p, list):
    raise ApiError(
      400,
      "'prompt' is a list that is neither token ids nor a list of prompts (strings or "
      "token-id lists): mixed or nested items are not accepted.",
      "prompt",
    )
  else:
    raise ApiError(
      400, f"'prompt' is a {type(p).__name__}: expected a string or a list of token ids.", "prompt"
    )
  if len(ids) > limits.max_prompt_tokens:
    raise ApiError(
      400,
      f"the prompt has {len(ids)} tokens: at most {limits.max_prompt_tokens} are allowed "
      "(--max_prompt_tokens).",
      "prompt",
    )
  return ids, p if isinstance(p, str) else None


def parse_completion(obj: dict, limits: Limits, encode: Callable[[str], list]) -> Completion:
  """Validate an OpenAI completions request against this server's limits (every field before the prompt
  is tokenized)."""
  c = parse_settings(obj, limits)
  if "prompt" not in obj:
    raise ApiError(400, "'prompt' is missing: expected a string or a list of token ids.", "prompt")
  c = with_prompts(c, *_prompts(obj["prompt"], limits, encode), limits)
  return with_prediction(c, obj, limits, encode)


def with_constraint(c: Completion, constraint, limits: Limits) -> Completion:
  """`c` constrained (None: free). A constrained reply ends by its grammar's end token (EOS), so that is one
  of its stop ids even under ignore_eos."""
  c.constraint = constraint
  if constraint is not None and limits.eos_id is not None and limits.eos_id not in c.stop_ids:
    if len(c.stop_ids) >= limits.max_stop_ids:
      raise ApiError(
        400,
        f"a constrained reply ends with the end-of-text token, and 'stop_token_ids' already holds "
        f"{len(c.stop_ids)} (at most {limits.max_stop_ids} with it): send one fewer.",
        "stop_token_ids",
      )
    c.stop_ids = [*c.stop_ids, limits.eos_id]
  return c


def with_prediction(c: Completion, obj: dict, limits: Limits, encode: Callable[[str], list]) -> Completion:
  """`c` with the tokens of the request's `prediction` (OpenAI's Predicted Outputs: {"type": "content",
  "content": a string or a list of {"type": "text", "text": ...} parts}), the output the caller expects:
  the engine drafts from it; it never changes the output."""
  pred = obj.get("prediction")
  if pred is None:
    return c
  want = '{"type": "content", "content": a string or a list of {"type": "text", "text": string} parts}'
  content = pred.get("content") if isinstance(pred, dict) else None
  if isinstance(content, list) and all(
    isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
  ):
    content = "".join(p["text"] for p in content)
  if not isinstance(pred, dict) or pred.get("type") != "content" or not isinstance(content, str):
    raise ApiError(400, f"'prediction' is {show(pred, 60)}: expected {want}.", "prediction")
  ids = encode(content)
  if len(ids) > limits.max_prediction_tokens:
    raise ApiError(
      400,
      f"'prediction' is {len(ids)} tokens: at most {limits.max_prediction_tokens} "
      "(--max_prediction_tokens). Send the part of the expected output that comes first.",
      "prediction",
    )
  c.prediction_ids = ids
  return c


def with_prompts(c: Completion, prompts: list, texts: list, limits: Limits) -> Completion:
  """`c` with its prompts, checked against the per-request caps on choices and reply size."""
  c.prompts, c.texts = prompts, texts
  cap, flags = choice_cap(limits)
  if len(prompts) * c.n > cap:
    raise ApiError(
      400,
      f"{len(prompts)} prompts x n={c.n} = {len(prompts) * c.n} choices: at most {cap} per "
      f"request ({flags}).",
      "n",
    )
  entries = reply_entries(c)
  if entries > limits.max_reply_entries:
    raise ApiError(
      400,
      f"this reply could hold {entries} token entries ({len(prompts) * c.n} choices x "
      f"(max_tokens {c.max_tokens}{' + the echoed prompt' if c.echo else ''})"
      f"{'' if c.logprobs is None else f' x {3 + c.logprobs} with logprobs {c.logprobs}'}): at most "
      f"{limits.max_reply_entries} per request (--max_reply_entries). Ask for fewer choices, tokens "
      "or logprobs, or split the request.",
      "max_tokens",
    )
  return c


# Fields accepted only at the values that mean "off": anything else would be silently ignored otherwise.
_OFF: dict[str, object] = {
  "suffix": None,
  "presence_penalty": 0,
  "frequency_penalty": 0,
  "logit_bias": {},
  "min_p": 0,
  "repetition_penalty": 1,
}


def parse_settings(obj: dict, limits: Limits) -> Completion:
  """Every field of a completions request but the prompt, checked (the prompt comes with with_prompts)."""
  model = obj.get("model")
  if model is not None and model != limits.model_name:
    raise ApiError(
      404,
      f"model {show(model)} is not served here: this server serves '{limits.model_name}' (GET /v1/models).",
      "model",
    )
  echo = get_field(obj, "echo", False, lambda v: isinstance(v, bool), "true or false")
  max_tokens = get_field(
    obj,
    "max_tokens",
    16,
    lambda v: is_int(v) and 0 <= v <= limits.max_tokens,
    f"an integer in [0, {limits.max_tokens}] (0: score the prompt, with echo)",
  )
  logprobs = get_field(
    obj,
    "logprobs",
    None,
    lambda v: is_int(v) and 0 <= v <= 5,
    "an integer in [0, 5] (the top-n logprobs per token; 5 is the most)",
  )
  cap, flags = choice_cap(limits)
  n = get_field(obj, "n", 1, lambda v: is_int(v) and 1 <= v <= cap, f"an integer in [1, {cap}] ({flags})")
  temperature, top_p, top_k, seed = _sampling(obj, limits)
  stop, stop_ids = _stops(obj, limits)
  stream = get_field(obj, "stream", False, lambda v: isinstance(v, bool), "true or false")
  opts = get_field(obj, "stream_options", {}, lambda v: isinstance(v, dict), "an object")
  include_usage = get_field(opts, "include_usage", False, lambda v: isinstance(v, bool), "true or false")
  return_ids = get_field(obj, "return_token_ids", False, lambda v: isinstance(v, bool), "true or false")
  cache_salt = get_field(
    obj,
    "cache_salt",
    None,
    lambda v: isinstance(v, str) and 0 < len(v) <= MAX_CACHE_SALT,
    f"a non-empty string of at most {MAX_CACHE_SALT} characters",
  )
  _refuse_unserved(obj, n)
  return Completion(
    n=n,
    logprobs=logprobs,
    echo=echo,
    max_tokens=max_tokens,
    temperature=temperature,
    top_k=top_k,
    top_p=top_p,
    seed=seed,
    stop=stop,
    stop_ids=stop_ids,
    stream=stream,
    include_usage=include_usage,
    return_token_ids=return_ids,
    cache_salt=cache_salt,
  )


def _sampling(obj: dict, limits: Limits) -> tuple[float, float, int, int | None]:
  """(temperature, top_p, top_k, seed) checked: top_k 0 where it is off (0, -1, or the vocabulary or more),
  the seed taken mod 2**64 (None: unseeded)."""
  temperature = float(
    get_field(obj, "temperature", 1.0, lambda v: _is_num(v) and 0 <= v <= 2, "a number in [0, 2]")
  )
  top_p = float(get_field(obj, "top_p", 1.0, lambda v: _is_num(v) and 0 < v <= 1, "a number in (0, 1]"))
  top_k = get_field(
    obj,
    "top_k",
    0,
    lambda v: is_int(v) and -1 <= v <= INT32_MAX,
    f"an integer in [-1, {INT32_MAX}] (0 or -1: off; the vocabulary size or more: off)",
  )
  seed = get_field(
    obj, "seed", None, lambda v: is_int(v) and -(2**63) <= v < 2**64, "an integer in [-2**63, 2**64)"
  )
  seed = None if seed is None else seed % 2**64
  return temperature, top_p, 0 if top_k >= limits.vocab_size else max(top_k, 0), seed


def _stops(obj: dict, limits: Limits) -> tuple[list, list]:
  """(stop strings, stop token ids) checked; the ids end with EOS unless ignore_eos (or no EOS)."""
  stop = get_field(
    obj,
    "stop",
    [],
    lambda v: _stop_ok(v) or (isinstance(v, list) and len(v) <= MAX_STOPS and all(_stop_ok(s) for s in v)),
    f"a non-empty string of at most {MAX_STOP_CHARS} characters or a list of at most {MAX_STOPS}",
  )
  stop = [stop] if isinstance(stop, str) else list(stop)
  ignore_eos = get_field(obj, "ignore_eos", False, lambda v: isinstance(v, bool), "true or false")
  room = limits.max_stop_ids - (0 if ignore_eos or limits.eos_id is None else 1)
  stop_ids = get_field(
    obj,
    "stop_token_ids",
    [],
    lambda v: (
      isinstance(v, list) and len(v) <= room and all(is_int(t) and 0 <= t < limits.vocab_size for t in v)
    ),
    f"a list of at most {room} token ids in [0, {limits.vocab_size})",
  )
  if not ignore_eos and limits.eos_id is not None and limits.eos_id not in stop_ids:
    stop_ids = [*stop_ids, limits.eos_id]
  return stop, list(stop_ids)


def _refuse_unserved(obj: dict, n: int):
  """400 for a field that would change the output in a way not served (best_of other than n)."""
  for name, off in (*_OFF.items(), ("best_of", n)):
    v = obj.get(name)
    if v is not None and not (v == {} if isinstance(off, dict) else _is_num(v) and v == off):
      raise ApiError(
        400, f"'{name}'={show(v)} is not supported by this server: omit it or send {json.dumps(off)}.", name
      )


def _stop_ok(s) -> bool:
  return isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS
