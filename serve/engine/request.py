"""What a caller hands the engine and gets back: a `Request` (prompt and settings, fixed once submitted), its
`Progress` (what the engine made of it), the `Delivery` of each step's new tokens, and the `TokenLogprob` of
each token scored; `check_request` refuses what an engine cannot run. A request's grammar is a `Constraint`
(serve/api/grammar.py's Matcher is one: the engine never imports the API tier)."""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections.abc import Sequence
from typing import NamedTuple, Protocol

import numpy as np

from serve.engine.drafting import DraftRecord, LookupIndex, PredictionIndex

_ids = itertools.count()
INT32_MAX = 2**31 - 1


class TopLogprob(NamedTuple):
  """One of the most likely tokens at a position."""

  id: int  # token id
  logprob: float  # its log-probability there


class TokenLogprob(NamedTuple):
  """A scored token: its log-probability, and the top-n tokens at its position (n: the request's logprobs)."""

  logprob: float  # the token's log-probability given the tokens before it
  top: tuple[TopLogprob, ...]  # the n most likely tokens there, most likely first


class Constraint(Protocol):
  """What the engine needs of a request's grammar (serve/api/grammar.py's Matcher is one): the allowed tokens
  at the current position, advancing by emitted tokens, rolling back rejected drafts, and its stop id."""

  @property
  def stop_id(self) -> int: ...

  def fill(self, words: np.ndarray) -> None: ...

  def advance(self, tokens) -> int: ...

  def rollback(self, n: int) -> None: ...


@dataclasses.dataclass(frozen=True, eq=False)
class Request:
  """One completion as the caller asks for it; nothing here changes once submitted. What the engine makes
  of it (tokens, finish reason, timings) is in `progress`; `on_deliver` sees each step's new tokens as they
  come. Requests compare and hash by identity."""

  prompt_ids: Sequence[int]
  max_tokens: int = 16
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  seed: int | None = None  # None: the engine draws one at submit (progress.seed)
  stop_ids: Sequence[int] = ()
  logprobs: int | None = None  # None: off; 0..5: each output token's logprob and the top-n
  echo: bool = False  # score the prompt too (prompt_logprobs); never restored from the cache
  tenant: str = ""  # who sent it (API key): its cache scope and its share of the slots
  cache_salt: str | None = None  # a further cache scope within the tenant (the request's cache_salt)
  siblings: Sequence[Request] = ()  # more choices of the same prompt (n > 1)
  # The tokens the caller expects the output to be (OpenAI's prediction): with speculative_tokens > 0 the
  # engine drafts from them and verifies the drafts in one pass; the output is the same with or without.
  prediction_ids: Sequence[int] = ()
  context: object = None  # the caller's (e.g. the HTTP handler's queue); the engine never reads it
  # The grammar this choice's output must follow (serve/api/grammar.py: fill / advance / rollback / done), one
  # per choice; None: free. Set by the server only when `applies_constraints` says the engine honours it.
  constraint: Constraint | None = None
  # The engine's own: prefill the prompt only to keep its state in the cache (max_tokens 0, not counted in
  # the engine's request counters): a conversation's state where its slot's state ran past it.
  cache_only: bool = False
  id: int = dataclasses.field(default_factory=lambda: next(_ids))
  progress: Progress = dataclasses.field(default_factory=lambda: Progress(), init=False, repr=False)


@dataclasses.dataclass(eq=False)
class Progress:
  """What the engine has done with one request: written by the engine (`cancelled` by `Engine.cancel`),
  read by the caller. `done` is set once `finish_reason` is final."""

  seed: int = 0  # the seed it samples with: the request's, or one drawn at submit
  output_ids: list[int] = dataclasses.field(default_factory=list)
  token_logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)  # one per output token
  prompt_logprobs: list[TokenLogprob | None] | None = None  # echo: one per prompt token (the first: None)
  finish_reason: str | None = None  # 'stop', 'length', 'cancelled' or 'error'
  done: threading.Event = dataclasses.field(default_factory=threading.Event)
  submitted_at: float = 0.0
  first_token_at: float | None = None
  cancelled: bool = False
  keep: int | None = None  # cancelled with output tokens to keep (Engine.cancel's keep)
  slot: int | None = None  # the slot it decodes in, while it does
  cached_tokens: int = 0  # prompt tokens restored from the state cache instead of prefilled
  prediction_at: int | None = 0  # where the output stands in prediction_ids (None: not aligned with it)
  prediction_index: PredictionIndex | None = None  # built when the output first leaves the prediction
  lookup_index: LookupIndex = dataclasses.field(default_factory=LookupIndex)  # prompt lookup's n-grams
  # prediction tokens the output matched in order (OpenAI's accepted_prediction_tokens; the rest of the
  # prediction is its rejected_prediction_tokens), whether or not they were verified as drafts
  accepted_prediction_tokens: int = 0
  drafts: DraftRecord = dataclasses.field(default_factory=DraftRecord)  # what the cost rule learns from


class Delivery(NamedTuple):
  """What `on_deliver` receives per request and step."""

  request: Request
  tokens: list[int]  # new token ids (empty when it ended without one)
  reason: str | None  # finish_reason, or None while it runs


def members(r: Request) -> list[Request]:
  """A request and its siblings: every choice of its prompt."""
  return [r, *r.siblings]


def check_request(req: Request, valid_vocab: int, n_slots: int, n_stop: int, max_context: int | None):
  """Refuse a request (ValueError naming the setting, the value and what is expected) whose prompt or settings
  this engine cannot run: token ids past `valid_vocab`, more choices than `n_slots`, more than `n_stop` stop
  ids, a prompt that leaves no room for a token within `max_context`, settings the slot table cannot hold."""
  n = len(req.prompt_ids)
  if n == 0:
    raise ValueError("prompt is empty: expected at least one token.")
  ids = np.asarray(req.prompt_ids)
  if not np.issubdtype(ids.dtype, np.integer) or ids.ndim != 1:
    raise ValueError(
      f"prompt_ids must be a flat list of integer token ids, got dtype {ids.dtype} with shape {ids.shape}."
    )
  if ids.min() < 0 or ids.max() >= valid_vocab:
    raise ValueError(f"prompt token ids span [{ids.min()}, {ids.max()}]: expected ids in [0, {valid_vocab}).")
  if not isinstance(req.max_tokens, int) or not 0 <= req.max_tokens <= INT32_MAX:
    raise ValueError(
      f"max_tokens={req.max_tokens!r}: expected an integer in [0, 2**31) (0: score the prompt only)."
    )
  if max_context is not None and n + (req.max_tokens > 0) > max_context:
    raise ValueError(
      f"the prompt has {n} tokens: this server's attention layers hold --max_context="
      f"{max_context} tokens per sequence (prompt + output), so a prompt may have at most "
      f"{max_context - 1} to leave room for one new token. Shorten the prompt, or restart "
      "the server with a larger --max_context."
    )
  if req.logprobs is not None and not 0 <= req.logprobs <= 5:
    raise ValueError(f"logprobs={req.logprobs!r}: expected None or an integer in [0, 5].")
  if 1 + len(req.siblings) > n_slots:
    raise ValueError(
      f"{1 + len(req.siblings)} choices of one prompt: at most the {n_slots} slots "
      "(--n_slots) can decode at once."
    )
  for sib in req.siblings:
    if (
      list(sib.prompt_ids) != list(req.prompt_ids)
      or sib.siblings
      or sib.echo != req.echo
      or (sib.tenant, sib.cache_salt) != (req.tenant, req.cache_salt)
    ):
      raise ValueError(
        "siblings must share the prompt, echo setting, tenant and cache salt, and have no "
        "siblings themselves."
      )
    check_request(sib, valid_vocab, n_slots, n_stop, max_context)
  # Every setting must fit the slot table's dtypes (serve.slots.slot_functions.SlotSettings): a value that does not
  # would fail inside the engine's step.
  if not (
    0 <= req.temperature < float("inf")
    and 0 < req.top_p <= 1
    and isinstance(req.top_k, int)
    and 0 <= req.top_k <= INT32_MAX
  ):
    raise ValueError(
      f"temperature={req.temperature}, top_p={req.top_p}, top_k={req.top_k}: expected a finite "
      "temperature >= 0, 0 < top_p <= 1, an integer top_k in [0, 2**31) (0 = off)."
    )
  if len(req.stop_ids) > n_stop or not all(
    isinstance(t, (int, np.integer)) and 0 <= t < valid_vocab for t in req.stop_ids
  ):
    raise ValueError(
      f"stop ids {list(req.stop_ids)[:10]}: at most {n_stop} per request, each in [0, {valid_vocab})."
    )
  if req.constraint is not None and req.constraint.stop_id not in req.stop_ids:
    raise ValueError(
      f"a constrained request must have its grammar's stop id {req.constraint.stop_id} among its stop "
      f"ids (got {list(req.stop_ids)[:10]}): a reply its grammar ended samples it and ends there."
    )
  if req.seed is not None and not 0 <= req.seed < 2**64:
    raise ValueError(f"seed={req.seed}: expected an integer in [0, 2**64).")
  if not isinstance(req.tenant, str) or not (req.cache_salt is None or isinstance(req.cache_salt, str)):
    raise ValueError(
      f"tenant={req.tenant!r}, cache_salt={req.cache_salt!r}: expected a string and None or a string."
    )
