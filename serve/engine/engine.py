"""Continuous-batching decode engine over a fixed number of slots (JetStream-style).

Each `step()`: drop cancelled requests, admit queued prompts into free slots (prefill in 128-token chunks,
a few chunks per step while others decode, then insert), run one compiled generate call over all slots
(`decode_steps` tokens each while no prompt waits, else one), and hand out the tokens of the call before
(one device-to-host copy per call; the next call is already queued on the device while the host reads the
last). Requests only meet the engine through `submit`, `cancel` and the `on_deliver` callback, so it runs
the same in a test loop or a server thread.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

import jax
import numpy as np

from laplace_jax import model as laplace_model
from serve.engine.drafting import Drafter, DraftRecord, LookupIndex, PredictionIndex, follow_prediction
from serve.engine.engine_cache import StateCacheIO
from serve.engine.engine_config import DEFAULTS, SLOT_BUCKETS, slots_for
from serve.engine.slots import (
  PrefillRows,
  PromptScores,
  SlotBackend,
  SlotFunctions,
  SlotSettings,
  StepOutput,
  StepsOutput,
  host_settings,
  step_rows,
)
from serve.engine.state_cache import StateCache, layout_of

log = logging.getLogger(__name__)
_ids = itertools.count()


class QueueFull(Exception):
  """Every slot is busy and the waiting queue is at its bound."""


class EngineStopped(Exception):
  """The engine's loop is not running (it failed for good, or was stopped): nothing submitted would run."""


MAX_STEP_FAILURES = 3  # failed steps in a row (each followed by a reset) before the loop gives up
INT32_MAX = 2**31 - 1


def check_max_context(cfg, max_context):
  """Attention layers ('A') need a per-slot context bound, and only they use one (ValueError otherwise)."""
  if "A" in cfg.mixers:
    if not isinstance(max_context, int) or isinstance(max_context, bool) or max_context < 2:
      raise ValueError(
        f"mixers={cfg.mixers!r} has attention layers, whose KV cache grows with the context: pass "
        f"--max_context N (got {max_context!r}), the most tokens (prompt + output) a sequence may "
        "hold; each slot keeps a KV cache of N tokens, so memory grows with N x --n_slots."
      )
  elif max_context is not None:
    raise ValueError(
      f"--max_context={max_context} bounds attention layers' KV cache, but mixers={cfg.mixers!r} "
      "has none ('G' and 'S' layers keep a constant-size state): leave --max_context unset."
    )


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
  token_logprobs: list = dataclasses.field(default_factory=list)  # per output token: (logprob, [(id, lp)])
  prompt_logprobs: list | None = None  # echo: [None, (logprob, [(id, lp)]), ...] per prompt token
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
  tokens: list  # new token ids (empty when it ended without one)
  reason: str | None  # finish_reason, or None while it runs


@dataclasses.dataclass
class PrefillBatch:
  """The prompts being prefilled together, chunk by chunk, between decode steps."""

  reqs: list  # leader requests, one prefill row each
  slots: list  # slots reserved for their decoding choices
  n_chunks: int  # 128-token chunks the longest uncached rest needs
  state: PrefillRows | None  # the prefill rows' state (None until the batch has started)
  scored: bool  # some prompt is echoed: run the scoring prefill
  next_chunk: int = 0
  scores: list[PromptScores] = dataclasses.field(default_factory=list)  # per chunk, the scoring prefill's


class Pending(NamedTuple):
  """A dispatched insert, generate or verify whose output is not read back yet."""

  kind: str  # "insert", "gen" or "verify"
  out: jax.Array  # the call's StepOutput (width > 1: StepsOutput), packed: one host copy reads it all
  owners: tuple  # entry i's request, or None
  width: int = 1  # tokens a slot may emit: a generate's steps, a verify's K + 1
  n_drafts: np.ndarray | None = None  # verify: each slot's drafts
  step: int = -1  # generate and verify: the engine's call count at dispatch
  timed: bool = False  # and whether its time is its own (no prefill was dispatched beside it)

  def runs_finished_slots_on(self, hold_ended: bool) -> bool:
    """Whether this call feeds a slot whose next input ended it (a verify does, a single generate step
    unless the slot functions hold ended slots; a generate of several steps leaves such a slot as it is)."""
    return self.kind == "verify" or (self.kind == "gen" and self.width == 1 and not hold_ended)


class Engine:
  """Slots, queue and loop around the compiled prefill / insert / generate of `serve.engine.slots`: the engine
  schedules, and meets the model only through the `SlotBackend` interface `make_slots` builds (by default
  `SlotFunctions`; tests pass a fake that needs no compile)."""

  # A request's constraint (Request.constraint) masks every token it samples: the server's hook
  # (Server.run_completion) serves constrained requests only from an engine that says so.
  applies_constraints = True

  def __init__(
    self,
    params,
    cfg,
    *,
    model=None,
    n_slots: int | None = DEFAULTS.n_slots,
    prefill_batch: int = DEFAULTS.prefill_batch,
    max_queue: int = DEFAULTS.max_queue,
    max_queue_per_tenant: int | None = None,
    max_stop_ids: int = DEFAULTS.max_stop_ids,
    valid_vocab: int | None = None,
    prefill_chunks_per_step: int = DEFAULTS.prefill_chunks_per_step,
    mesh=None,
    on_deliver: Callable[[list[Delivery]], None] | None = None,
    state_cache=None,
    snapshot_every: int = DEFAULTS.snapshot_every,
    cache_min_tokens: int = DEFAULTS.cache_min_tokens,
    speculative_tokens: int = DEFAULTS.speculative_tokens,
    prompt_lookup: bool = DEFAULTS.prompt_lookup,
    speculative_rule: str = DEFAULTS.speculative_rule,
    decode_steps: int = DEFAULTS.decode_steps,
    slot_buckets: str = DEFAULTS.slot_buckets,
    max_context: int | None = None,
    make_slots: Callable[..., SlotBackend] = SlotFunctions,
  ):
    """Keyword arguments named as `serve.engine.engine_config.EngineConfig`'s fields are described there.
    `make_slots(model, cfg, n_slots=, prefill_batch=, n_stop=, valid_vocab=, mesh=, max_context=,
    hold_ended=)` builds the slot functions (hold_ended: with a state cache)."""
    if model is None:
      model = laplace_model
    if n_slots is None:
      n_slots = slots_for(cfg)
    check_max_context(cfg, max_context)
    if state_cache is not None and "A" in cfg.mixers:
      raise ValueError(
        f"mixers={cfg.mixers!r}: the state cache keeps constant-size states, and an attention "
        "layer's KV cache is not one; pass state_cache=None (--state_cache_gb 0)."
      )
    for name, v in (
      ("n_slots", n_slots),
      ("prefill_batch", prefill_batch),
      ("max_stop_ids", max_stop_ids),
      ("prefill_chunks_per_step", prefill_chunks_per_step),
      ("snapshot_every", snapshot_every),
      ("cache_min_tokens", cache_min_tokens),
      ("decode_steps", decode_steps),
    ):
      if not isinstance(v, int) or v < 1:
        raise ValueError(f"{name}={v!r}: expected a positive integer.")
    if slot_buckets not in SLOT_BUCKETS:
      raise ValueError(f"slot_buckets={slot_buckets!r}: expected one of {SLOT_BUCKETS}.")
    if max_queue < 0:
      raise ValueError(f"max_queue={max_queue}: expected >= 0 (0: refuse when all slots are busy).")
    if not isinstance(speculative_tokens, int) or speculative_tokens < 0:
      raise ValueError(f"speculative_tokens={speculative_tokens!r}: expected an integer >= 0 (0: off).")
    self.speculative_tokens = speculative_tokens
    self.decode_steps = decode_steps
    if max_queue_per_tenant is not None and not 0 <= max_queue_per_tenant <= max_queue:
      raise ValueError(f"max_queue_per_tenant={max_queue_per_tenant}: expected None or in [0, max_queue].")
    self.cfg, self.params = cfg, params
    self.valid_vocab = cfg.vocab_size if valid_vocab is None else valid_vocab
    self.n_slots, self.prefill_batch, self.max_queue = n_slots, prefill_batch, max_queue
    self.max_queue_per_tenant = max_queue if max_queue_per_tenant is None else max_queue_per_tenant
    self.chunks_per_step = prefill_chunks_per_step
    self.max_context = max_context  # tokens (prompt + output) a slot's KV cache holds; None: no 'A' layers
    # Drafts and when to verify them (used with speculative_tokens > 0).
    self.drafter = Drafter(
      speculative_tokens, prompt_lookup=bool(prompt_lookup), rule=speculative_rule, max_context=max_context
    )
    self.fns: SlotBackend = make_slots(
      model,
      cfg,
      n_slots=n_slots,
      prefill_batch=prefill_batch,
      n_stop=max_stop_ids,
      valid_vocab=self.valid_vocab,
      mesh=mesh,
      max_context=max_context,
      hold_ended=state_cache is not None,
      buckets=slot_buckets,
    )
    self.on_deliver = on_deliver or (lambda deliveries: None)
    self.table = self.fns.empty_table()
    self.slot_req: list[Request | None] = [None] * n_slots  # live in the device table
    self._live: set[int] = (
      set()
    )  # the slots whose slot_req is not None (kept as they change: a step reads it)
    self.reserved: set[int] = set()  # held by the prefill in progress
    self.queue: collections.deque[Request] = collections.deque()
    self._waiting: collections.Counter[str] = collections.Counter()  # tenant -> choices in self.queue
    self.prefill: PrefillBatch | None = None  # the prefill batch in progress
    self.pending: collections.deque = collections.deque()  # dispatched, not yet read back
    self._lock = threading.Lock()
    self._wake = threading.Event()
    self._cancels: list[Request] = []
    self._thread: threading.Thread | None = None
    self._stop = threading.Event()
    self.error: BaseException | None = None
    self.stats = {
      "requests": 0,
      "finished": 0,
      "rejected": 0,
      "tokens": 0,
      "steps": 0,
      "prefill_tokens": 0,
      "cached_prompt_tokens": 0,
      "drafted_tokens": 0,  # drafts verified (predictions and prompt lookup)
      "accepted_tokens": 0,  # and taken
    }
    self._rate: collections.deque[tuple[float, int]] = collections.deque()  # (time, tokens) of recent steps
    # The engine's traffic with its state cache (serve.engine.state_cache.StateCache), None without one.
    self.state_io: StateCacheIO | None = None
    if state_cache is not None:
      state_cache.check_layout(layout_of(self.fns.state_shape))
      self.state_io = StateCacheIO(
        state_cache,
        self.fns,
        prefill_batch=self.prefill_batch,
        min_tokens=cache_min_tokens,
        snapshot_every=snapshot_every,
        chunk_size=self.cfg.chunk_size,
      )
    self._gens = 0  # generate and verify calls dispatched
    self.warmup_seconds: dict[str, float] = {}  # warmup's compile and first run, per bucket and the rest

  @property
  def cache(self) -> StateCache | None:
    """The state cache (None: none)."""
    return None if self.state_io is None else self.state_io.cache

  # ---- the caller's side (any thread) ----

  def submit(self, req: Request) -> Request:
    """Queue a request (with its siblings); raises ValueError on bad settings, QueueFull past the bound."""
    self.submit_all([req])
    return req

  def submit_all(self, reqs: Sequence[Request]):
    """Queue several requests (a list of prompts) all or none: ValueError / QueueFull leave none queued.
    The queue bound counts choices: a request with n - 1 siblings counts n. All share one tenant; a tenant
    may have at most max_queue_per_tenant choices waiting beyond the free slots."""
    for r in reqs:
      self._validate(r)
    if len({r.tenant for r in reqs}) > 1:
      raise ValueError("requests submitted together must share one tenant.")
    size = sum(1 + len(r.siblings) for r in reqs)
    tenant = reqs[0].tenant if reqs else ""
    with self._lock:
      if self.error is not None:
        raise EngineStopped("the engine stopped after repeated failures")
      self._check_room(size, len(reqs), tenant)
      now = time.perf_counter()
      for r in reqs:
        for m in self._members(r):
          m.progress.seed = secrets.randbits(32) if m.seed is None else m.seed
          m.progress.submitted_at = now
        self.queue.append(r)
        self._waiting[tenant] += 1 + len(r.siblings)
      self.stats["requests"] += size
    self._wake.set()

  def check_room(self, size: int, tenant: str = ""):
    """Raise QueueFull unless `size` more choices of `tenant` fit now (admission before a request's prompt
    is even tokenized; submit_all decides for good)."""
    with self._lock:
      self._check_room(size, 1, tenant)

  def _check_room(self, size: int, n_requests: int, tenant: str):
    busy = sum(r is not None for r in self.slot_req) + len(self.reserved)
    waiting = sum(self._waiting.values())
    free = max(0, self.n_slots - busy)
    room = min(self.max_queue - waiting, self.max_queue_per_tenant - self._waiting[tenant]) + free
    if size > room:
      self.stats["rejected"] += n_requests
      raise QueueFull(
        f"{waiting} choices already wait for {self.n_slots} slots (queue bound "
        f"{self.max_queue}, {self.max_queue_per_tenant} per tenant); this request needs room "
        f"for {size}"
      )

  @property
  def serving(self) -> bool:
    """The loop thread runs and has not given up."""
    return self.error is None and self._thread is not None and self._thread.is_alive()

  @staticmethod
  def _members(r: Request) -> list:
    return [r, *r.siblings]

  def cancel(self, req: Request, keep: int | None = None):
    """Stop a request (client gone, or a stop string matched); its slot is freed on the engine's next step.
    keep: how many output tokens the conversation goes on from (a stop string cuts the text before it):
    with a state cache, the state after the prompt and exactly those tokens is kept."""
    with self._lock:
      req.progress.cancelled = True
      req.progress.keep = keep
      self._cancels.append(req)
    self._wake.set()

  def _validate(self, req: Request):
    n = len(req.prompt_ids)
    if n == 0:
      raise ValueError("prompt is empty: expected at least one token.")
    ids = np.asarray(req.prompt_ids)
    if not np.issubdtype(ids.dtype, np.integer) or ids.ndim != 1:
      raise ValueError(
        f"prompt_ids must be a flat list of integer token ids, got dtype {ids.dtype} with shape {ids.shape}."
      )
    if ids.min() < 0 or ids.max() >= self.valid_vocab:
      raise ValueError(
        f"prompt token ids span [{ids.min()}, {ids.max()}]: expected ids in [0, {self.valid_vocab})."
      )
    if not isinstance(req.max_tokens, int) or not 0 <= req.max_tokens <= INT32_MAX:
      raise ValueError(
        f"max_tokens={req.max_tokens!r}: expected an integer in [0, 2**31) (0: score the prompt only)."
      )
    if self.max_context is not None and n + (req.max_tokens > 0) > self.max_context:
      raise ValueError(
        f"the prompt has {n} tokens: this server's attention layers hold --max_context="
        f"{self.max_context} tokens per sequence (prompt + output), so a prompt may have at most "
        f"{self.max_context - 1} to leave room for one new token. Shorten the prompt, or restart "
        "the server with a larger --max_context."
      )
    if req.logprobs is not None and not 0 <= req.logprobs <= 5:
      raise ValueError(f"logprobs={req.logprobs!r}: expected None or an integer in [0, 5].")
    if 1 + len(req.siblings) > self.n_slots:
      raise ValueError(
        f"{1 + len(req.siblings)} choices of one prompt: at most the {self.n_slots} slots "
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
      self._validate(sib)
    # Every setting must fit the slot table's dtypes (serve.engine.slots.SlotSettings): a value that does not
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
    if len(req.stop_ids) > self.fns.n_stop or not all(
      isinstance(t, (int, np.integer)) and 0 <= t < self.valid_vocab for t in req.stop_ids
    ):
      raise ValueError(
        f"stop ids {list(req.stop_ids)[:10]}: at most {self.fns.n_stop} per request, each in "
        f"[0, {self.valid_vocab})."
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

  # ---- status ----

  @property
  def active_slots(self) -> int:
    return len(self._live)

  @property
  def queue_depth(self) -> int:
    return len(self.queue)

  def tokens_per_second(self, window: float = 10.0) -> float:
    now = time.perf_counter()
    while self._rate and self._rate[0][0] < now - window:
      self._rate.popleft()
    if len(self._rate) < 2:
      return 0.0
    span = max(now - self._rate[0][0], 1e-9)
    return sum(n for _, n in list(self._rate)[1:]) / span

  def idle(self) -> bool:
    return not (self.queue or self.prefill or self.pending or self.active_slots or self._cancels)

  # ---- the engine's side (one thread) ----

  def step(self) -> bool:
    """One round: cancels, admission and prefill, one generate (or verify) call, read back. False when idle."""
    self._apply_cancels()
    prefilled = self.stats["prefill_tokens"]
    self._advance_prefill()
    timed = self.stats["prefill_tokens"] == prefilled  # no prefill shares this step's time on the device
    dispatched = False
    # While a live slot is constrained, no call of several steps (a token's mask depends on the tokens
    # before it, read back from the call before).
    constrained = any(r is not None and r.constraint is not None for r in self.slot_req)
    rows, drafts = self._drafts() if self.speculative_tokens and self.active_slots else (self._rows(), None)
    if len(rows):
      owners = tuple(self.slot_req[s] for s in rows)  # the call's row i runs slot rows[i]
      if drafts is None:
        # Several tokens a call only while no prompt waits for a slot: admission goes on between calls.
        steps = 1 if self.queue or self.prefill is not None or constrained else self.decode_steps
        greedy = steps > 1 and all(r is None or (r.temperature == 0 and r.logprobs is None) for r in owners)
        if constrained:
          self.table, out = self._masked_step(rows)
        else:
          self.table, out = self.fns.generate(self.params, self.table, steps, greedy, rows_B=rows)
        self.pending.append(Pending("gen", out, owners, steps, step=self._gens, timed=timed))
      else:
        K = self.speculative_tokens
        allowed = self._draft_masks(rows, *drafts)  # (may cut drafts: before the Pending records them)
        self.table, out = self.fns.verify(
          self.params, self.table, *drafts, rows_B=rows, allowed_BxTxW=allowed
        )
        self.pending.append(Pending("verify", out, owners, K + 1, drafts[1], step=self._gens, timed=timed))
      self.stats["steps"] += 1
      self._gens += 1
      dispatched = True
    if self.state_io is not None and self.state_io.copies:
      self.state_io.collect(block=False)
    # Keep one generate step in flight while reading the previous one back.
    while self.pending and (len(self.pending) > 1 or not dispatched):
      self._read_back(self.pending.popleft())
    return not self.idle()

  def _masked_step(self, rows: np.ndarray):
    """One generate step whose sampling is masked: its decode is dispatched first, and while the device runs
    it the host copies the calls before back, advances each constrained slot's matcher by the tokens it
    emitted and fills its row of the mask; then the sampling call, and while it runs the host delivers
    the calls before. Free rows allow every token."""
    self.table, logits = self.fns.decode_rows(self.params, self.table, rows)
    read = [(item, np.asarray(item.out)) for item in self.pending]  # each call's one host copy
    self.pending.clear()
    for item, packed in read:
      self._advance_grammars(item, packed)
    allowed_BxW = np.full((len(rows), self.fns.words), -1, np.int32)
    for i, s in enumerate(rows):
      r = self.slot_req[s]
      if r is not None and r.constraint is not None:
        r.constraint.fill(allowed_BxW[i])
    self.table, out = self.fns.sample_rows(logits, self.table, rows, allowed_BxW)
    for item, packed in read:
      self._read_back(item, packed, advanced=True)
    return self.table, out

  def _advance_grammars(self, item: Pending, packed: np.ndarray):
    """Advance the matcher of each constrained request in a call by the tokens it emitted there."""
    emitted: list | None = None  # each entry's tokens
    for i, r in enumerate(item.owners):
      if r is not None and r.constraint is not None and r.progress.finish_reason is None:
        if emitted is None:
          if item.width == 1:
            emitted = [[t] for t in StepOutput.unpack(packed).token.tolist()]
          else:
            multi = StepsOutput.unpack(packed, item.width)
            emitted = [multi.tokens_of(s) for s in range(len(item.owners))]
        self._advance_grammar(r, emitted[i])

  def _draft_masks(self, rows: np.ndarray, drafts_BxK: np.ndarray, n_B: np.ndarray) -> np.ndarray | None:
    """A verify's masks, int32 [B, K + 1, W] (None: no row is constrained): position j of a constrained
    slot allows what its grammar allows after its first j drafts (its matcher advanced through them, then
    rolled back). Its drafts are cut (n_B, in place) before the first its grammar forbids, which could
    never be accepted. The calls before are read back (drafting did)."""
    reqs = [self.slot_req[s] for s in rows]
    if not any(r is not None and r.constraint is not None for r in reqs):
      return None
    allowed = np.full((len(rows), drafts_BxK.shape[1] + 1, self.fns.words), -1, np.int32)
    for i, r in enumerate(reqs):
      if r is None or r.constraint is None:
        continue
      m, n = r.constraint, 0
      m.fill(allowed[i, 0])
      while n < n_B[i] and m.advance([int(drafts_BxK[i, n])]) == 1:
        n += 1
        m.fill(allowed[i, n])
      m.rollback(n)
      n_B[i] = n
    return allowed

  def read_back_all(self):
    """Read back every call in flight: the host then holds every token dispatched so far (the engine's
    thread only; benchmarks use it to end a timed window with nothing left running)."""
    while self.pending:
      self._read_back(self.pending.popleft())

  def _apply_cancels(self):
    with self._lock:
      cancels, self._cancels = self._cancels, []
      for r in cancels:
        if r in self.queue:
          self.queue.remove(r)
          self._dequeued(r)
    out = []
    live = [
      r
      for r in cancels
      if r.progress.finish_reason is None
      and r.progress.slot is not None
      and self.slot_req[r.progress.slot] is r
    ]
    # A stop string ends a request by cancelling it: its context is still worth keeping. What the calls in
    # flight fed its slot is known once they are read back; then its state holds every token but the last.
    if self.state_io is not None and live:
      self.read_back_all()
      live = [r for r in live if r.progress.finish_reason is None]
      self._keep_states(live, fed=lambda r: len(r.progress.output_ids) - 1, keep=lambda r: r.progress.keep)
    for r in cancels:
      if r.progress.finish_reason is None:
        self._finish(r, "cancelled")
        out.append(Delivery(r, [], "cancelled"))
    if out:
      self.on_deliver(out)

  def _keep_states(self, reqs, fed: Callable[[Request], int], keep: Callable[[Request], int | None]):
    """Copy these slots' states into the cache. fed(r): how many output tokens r's state has consumed;
    keep(r): how many its conversation goes on from (None: fed(r)). Where the state ran past them, the
    prompt and those tokens are prefilled again in a cache-only request."""
    exact, again = [], []
    for r in reqs:
      n, k = fed(r), keep(r)
      if k is None or k >= n:
        exact.append((r, n))
      elif k > 0:  # (0: the prompt's own state is kept at the end of its prefill)
        again.append(
          Request(
            prompt_ids=list(r.prompt_ids) + r.progress.output_ids[:k],
            max_tokens=0,
            tenant=r.tenant,
            cache_salt=r.cache_salt,
            cache_only=True,
          )
        )
    assert self.state_io is not None
    self.state_io.copy_out(self.table.model, exact)
    self._queue_cache_only(again)

  def keep_state(self, ids: Sequence[int], tenant: str = "", cache_salt: str | None = None):
    """Keep the state after exactly `ids` in the state cache (nothing without one): a request of the
    engine's own prefills them from their longest cached prefix, ahead of the queue (the ids a client will
    send next, e.g. a reply's text tokenized again). Any thread."""
    if self.state_io is None or not ids:
      return
    self._queue_cache_only(
      [Request(prompt_ids=list(ids), max_tokens=0, tenant=tenant, cache_salt=cache_salt, cache_only=True)]
    )
    self._wake.set()

  def _queue_cache_only(self, reqs: list[Request]):
    """First in the queue: a conversation's next turn, if already queued, restores their states."""
    with self._lock:
      for r in reqs:
        self.queue.appendleft(r)
        self._waiting[r.tenant] += 1

  def _finish(self, r: Request, reason: str):
    r.progress.finish_reason = reason
    if r.progress.slot is not None and self.slot_req[r.progress.slot] is r:
      self.slot_req[r.progress.slot] = None
      self._live.discard(r.progress.slot)
    if not r.cache_only:
      self.stats["finished"] += 1
    r.progress.done.set()

  def _advance_prefill(self):
    """Prefill chunks within this step's budget. A failure here (a request's settings, a cached state)
    fails the prompts being prefilled and nothing else: the slot table is untouched until the insert."""
    try:
      self._prefill_chunks()
    except Exception:
      log.exception("prefill failed: its requests fail, the engine goes on")
      pf, self.prefill = self.prefill, None
      if pf is not None:
        self.reserved.difference_update(pf.slots)
        self._fail([m for r in pf.reqs for m in self._members(r)])

  def _prefill_chunks(self):
    budget = self.chunks_per_step if self.active_slots else 1 << 30
    while budget > 0:
      if self.prefill is None and not self._start_prefill():
        return
      pf = self.prefill
      C = self.cfg.chunk_size
      c = pf.next_chunk
      tokens = np.zeros((self.prefill_batch, C), np.int32)
      lengths = np.zeros((self.prefill_batch,), np.int32)
      for i, r in enumerate(pf.reqs):
        at = r.progress.cached_tokens + c * C
        piece = r.prompt_ids[at : at + C]
        tokens[i, : len(piece)] = piece
        lengths[i] = len(piece)
      if pf.scored:
        pf.state, scores = self.fns.prefill_chunk_scored(self.params, pf.state, tokens, lengths)
        pf.scores.append(scores)
      else:
        pf.state = self.fns.prefill_chunk(self.params, pf.state, tokens, lengths)
      self.stats["prefill_tokens"] += int(lengths.sum())
      pf.next_chunk += 1
      budget -= 1
      if self.state_io is not None:
        self.state_io.snapshot(pf)
      if pf.next_chunk == pf.n_chunks:
        self._insert(pf)

  def _start_prefill(self) -> bool:
    """Take up to prefill_batch queued requests that have free slots; False if none. Tenant by tenant: the
    next one is the oldest request of the waiting tenant that holds the fewest slots (ties: the tenant
    whose oldest request came first), so while several tenants wait the freed slots go to those with the
    fewest until they hold as many as the others. One tenant: first come, first served."""
    free = self._free_slots()
    need = lambda r: sum(m.max_tokens > 0 for m in self._members(r))  # max_tokens 0: scored, never decoded
    held = collections.Counter(r.tenant for r in self.slot_req if r is not None)
    with self._lock:
      take: list[Request] = []
      used = 0
      while self.queue and len(take) < self.prefill_batch:
        i = self._fairest(held)
        r = self.queue[i]
        if used + need(r) > len(free):
          break
        if self.state_io is not None and any(self.state_io.waits_for(t, r) for t in take):
          break  # its prefix's state is being made in this batch: the next batch restores it
        del self.queue[i]
        self._dequeued(r)
        used += need(r)
        held[r.tenant] += need(r)
        take.append(r)
    if not take:
      return False
    slots = free[:used]
    # The batch is in place before anything can fail, so a failure fails exactly these requests.
    self.prefill = pf = PrefillBatch(
      reqs=take, slots=slots, n_chunks=0, state=None, scored=any(r.echo for r in take)
    )
    self.reserved.update(slots)
    C = self.cfg.chunk_size
    state = None
    if self.state_io is not None:
      state = self.state_io.restore(take)
      self.stats["cached_prompt_tokens"] += sum(r.progress.cached_tokens for r in take)
    pf.n_chunks = max(-(-(len(r.prompt_ids) - r.progress.cached_tokens) // C) for r in take)
    pf.state = self.fns.empty_prefill() if state is None else state
    return True

  def _free_slots(self) -> list[int]:
    """The slots free for a new request, in the order to fill them: over a mesh, those of the devices that
    run the fewest live slots first, so each device's share of a step's rows (its bucket) stays small."""
    per = self.n_slots // self.fns.n_devices
    load = collections.Counter(s // per for s, r in enumerate(self.slot_req) if r is not None)
    order = []
    for s, r in enumerate(self.slot_req):
      if r is None and s not in self.reserved:
        d = s // per
        order.append((load[d], s))
        load[d] += 1
    return [s for _, s in sorted(order)]

  def _fairest(self, held) -> int:
    """The queue index of the next request to admit (see _start_prefill); call under the lock."""
    tenants = sum(1 for n in self._waiting.values() if n)
    heads = {}
    for i, r in enumerate(self.queue):
      if r.tenant not in heads:
        heads[r.tenant] = i
        if len(heads) == tenants:
          break
    return min(heads.values(), key=lambda i: (held[self.queue[i].tenant], i))

  def _dequeued(self, r: Request):
    self._waiting[r.tenant] -= 1 + len(r.siblings)
    if not self._waiting[r.tenant]:
      del self._waiting[r.tenant]

  def _insert(self, pf):
    """Write each prefilled row into the slots of its choices (n > 1: one row, several slots), sampling
    each choice's first token; choices with max_tokens 0 (echo scoring) finish here without a slot."""
    if pf.scored:
      self._score_prompts(pf)
    if self.state_io is not None:
      self.state_io.copy_prompt_ends(pf)
    entries, free, done = [], iter(pf.slots), []  # (row, slot or None, request)
    for i, r in enumerate(pf.reqs):
      for m in self._members(r):
        entries.append((i, next(free) if m.max_tokens > 0 else None, m))
    E = self.prefill_batch
    for g in range(0, len(entries), E):
      part = entries[g : g + E]
      rows = [
        SlotSettings(
          temperature=m.temperature,
          top_k=m.top_k,
          top_p=m.top_p,
          seed=m.progress.seed & 0xFFFFFFFF,
          seed_hi=m.progress.seed >> 32,
          max_tokens=self._token_budget(m),
          stop_ids=list(m.stop_ids),
          logprobs=-1 if m.logprobs is None else m.logprobs,
        )
        for _, _, m in part
      ]
      settings = host_settings(rows, E, self.fns.n_stop)
      allowed_ExW = None  # each entry's first token: its matcher's first mask
      if any(m.constraint is not None and slot is not None for _, slot, m in part):
        allowed_ExW = np.full((E, self.fns.words), -1, np.int32)
        for j, (_, slot, m) in enumerate(part):
          if m.constraint is not None and slot is not None:
            m.constraint.fill(allowed_ExW[j])
      row_idx = np.zeros((E,), np.int32)
      slot_idx = np.full((E,), self.n_slots, np.int32)  # >= n_slots: dropped
      owners = []
      for j, (row, slot, m) in enumerate(part):
        row_idx[j] = row
        if slot is not None:
          slot_idx[j] = slot
          self.reserved.discard(slot)
        if (
          slot is not None and m.progress.finish_reason is None
        ):  # cancelled during prefill: leave the slot free
          self.slot_req[slot], m.progress.slot = m, slot
          self._live.add(slot)
          owners.append(m)
        else:
          owners.append(None)
          if m.progress.finish_reason is None:
            self._finish(m, "length")
            done.append(Delivery(m, [], "length"))
      self.table, out = self.fns.insert(
        self.params, self.table, pf.state, row_idx, slot_idx, settings, allowed_ExW
      )
      self.pending.append(Pending("insert", out, tuple(owners)))
    self.prefill = None
    if done:
      self.on_deliver(done)

  def _token_budget(self, m: Request) -> int:
    """The most tokens `m` may generate: its max_tokens, and with attention layers no more than the KV cache
    has room for (prompt + output <= max_context; reaching it finishes the request with 'length')."""
    if self.max_context is None:
      return m.max_tokens
    return min(m.max_tokens, self.max_context - len(m.prompt_ids))

  def _score_prompts(self, pf):
    """Echo: each prompt token's logprob given the tokens before it, and the top-n there."""
    C = self.cfg.chunk_size
    chunks = [jax.tree.map(np.asarray, sc) for sc in pf.scores]  # PromptScores per chunk
    for i, r in enumerate(pf.reqs):
      if not r.echo:
        continue
      out = [None]
      for p in range(1, len(r.prompt_ids)):
        sc, j = chunks[p // C], p % C
        top = [(int(t), float(v)) for t, v in zip(sc.top_ids[i, j], sc.top_logprobs[i, j])]
        out.append((float(sc.logprob[i, j]), top))
      for m in self._members(r):
        m.progress.prompt_logprobs = out

  def _read_back(self, item: Pending, packed: np.ndarray | None = None, advanced: bool = False):
    """Deliver a call's tokens (packed: its host copy, else made here; advanced: its constrained requests'
    matchers have taken them already)."""
    if packed is None:
      packed = np.asarray(item.out)  # the one device-to-host copy of this call
    now = time.perf_counter()
    if self.speculative_tokens and item.kind != "insert":
      per_call = item.width if item.kind == "gen" else 1
      self.drafter.time_call(item.kind, item.step, item.timed, now, per_call, bucket=len(item.owners))
    multi = StepsOutput.unpack(packed, item.width) if item.width > 1 else None
    steps = StepOutput.unpack(packed) if multi is None else multi.steps  # multi: [S, width] fields
    deliveries, n_tokens, finished = [], 0, []
    # Python ints and bools at once (indexing numpy per slot costs more): [S], or [S][width] with emitted [S]
    tokens, dones = steps.token.tolist(), steps.done.tolist()
    emitted = None if multi is None else multi.emitted.tolist()
    for i, r in enumerate(item.owners):
      if r is None or r.progress.finish_reason is not None:
        continue
      p = r.progress
      if emitted is None:  # the single step's path
        toks, done = [tokens[i]], dones[i]
        if r.logprobs is not None:
          p.token_logprobs.append(steps.logprobs_of(i))
      else:
        n = emitted[i]
        toks, done = tokens[i][:n], dones[i][n - 1]
        if item.kind == "verify":
          self._count_drafts(p, item, i, n)
        if r.logprobs is not None:
          p.token_logprobs.extend(steps.logprobs_of((i, j)) for j in range(n))
      p.output_ids.extend(toks)
      if r.constraint is not None and not advanced:
        self._advance_grammar(r, toks)
      if p.first_token_at is None:
        p.first_token_at = now
      if r.prediction_ids:
        follow_prediction(p, r.prediction_ids, toks)
      n_tokens += len(toks)
      if done:
        reason = "stop" if toks[-1] in r.stop_ids else "length"
        finished.append(r)
        self._finish(r, reason)
        deliveries.append(Delivery(r, toks, reason))
      else:
        deliveries.append(Delivery(r, toks, None))
    if finished and self.state_io is not None:
      # A finished slot's state holds its prompt and every output token but the last, and the last too once
      # the call in flight has fed it (a verify does; a single step does unless the slot functions hold ended
      # slots, as they do with a state cache; a call of several steps does not). A conversation goes on
      # without a stop id that ended it.
      later = [x for x in self.pending if x.kind != "insert"]
      if len(later) <= 1:  # (one call at most is ever in flight behind the one read back)
        extra = int(bool(later) and later[0].runs_finished_slots_on(self.fns.hold_ended))
        self._keep_states(
          finished,
          fed=lambda r: len(r.progress.output_ids) - 1 + extra,
          keep=lambda r: len(r.progress.output_ids) - (r.progress.finish_reason == "stop"),
        )
    self.stats["tokens"] += n_tokens
    self._rate.append((now, n_tokens))
    while self._rate[0][0] < now - 60:
      self._rate.popleft()
    if deliveries:
      self.on_deliver(deliveries)

  @staticmethod
  def _advance_grammar(r: Request, toks: list[int]):
    """Advance r's matcher by the tokens it emitted (each sampled under its mask; a grammar that has ended
    takes no more, not even the stop id it allowed)."""
    assert r.constraint is not None
    taken = r.constraint.advance(toks)
    if any(t != r.constraint.stop_id for t in toks[taken:]):
      log.warning("request %d: its grammar refused tokens %s it was masked for", r.id, toks[taken:])

  def _count_drafts(self, p: Progress, item: Pending, i: int, n: int):
    """A verify call fed slot i's state n tokens at once (as n - 1 more steps would have) and took n - 1 of
    its drafts: the engine's draft counters and the request's record."""
    assert item.n_drafts is not None
    drafted = int(item.n_drafts[i])
    self.stats["drafted_tokens"] += drafted
    self.stats["accepted_tokens"] += n - 1
    self.drafter.learn(p, drafted, n)

  # ---- running ----

  def run_until_idle(self, max_steps: int = 1_000_000):
    """Step until nothing is queued, prefilling, decoding or unread (tests and benchmarks)."""
    for _ in range(max_steps):
      if not self.step():
        return
    raise RuntimeError(f"engine still busy after {max_steps} steps")

  def generate(self, requests: Sequence[Request]) -> list[list[int]]:
    """Submit all, run to completion, return each request's output ids."""
    for r in requests:
      self.submit(r)
    self.run_until_idle()
    return [r.progress.output_ids for r in requests]

  def start(self):
    """Run the loop in a background thread until `stop()` (again after it gave up: a fresh start)."""
    self._stop.clear()
    self.error = None
    self._thread = threading.Thread(target=self._loop, name="serve-engine", daemon=True)
    self._thread.start()

  def stop(self, timeout: float = 30.0):
    """Stop the loop, then land the states still being copied and write them to the cache directory."""
    self._stop.set()
    self._wake.set()
    if self._thread is not None:
      self._thread.join(timeout)
      alive, self._thread = self._thread.is_alive(), None
      if not alive and self.error is None and self.state_io and not self.state_io.flush(timeout):
        log.warning("state cache: some files were still being written at shutdown")

  def _loop(self):
    failures = 0
    while not self._stop.is_set():
      self._wake.clear()
      try:
        busy = self.step()
        failures = 0
      except Exception as e:
        # A failed step fails the requests it touched (every slot, the prefill batch) and starts over from
        # an empty slot table; queued requests wait on. Failing again and again, the loop gives up: new
        # requests are then refused (EngineStopped) and the server reports itself unhealthy.
        failures += 1
        log.exception("engine step failed (%d in a row)", failures)
        try:
          if failures >= MAX_STEP_FAILURES:
            raise
          self._reset()
        except Exception:
          self.error = e
          self._fail_all()
          return
        self._wake.wait(0.05 * failures)
        continue
      if not busy:
        self._wake.wait(0.5)

  def _fail(self, reqs):
    """Finish these requests with 'error' and tell their callers."""
    out = []
    for r in reqs:
      if r.progress.finish_reason is None:
        self._finish(r, "error")
        out.append(Delivery(r, [], "error"))
    if out:
      self.on_deliver(out)

  def _in_flight(self) -> list:
    """Every request past the queue: in a slot, being prefilled, or waiting to be read back."""
    live = [r for r in self.slot_req if r is not None]
    live += [m for r in (self.prefill.reqs if self.prefill else []) for m in self._members(r)]
    live += [r for p in self.pending for r in p.owners if r is not None]
    return list(dict.fromkeys(live))

  def _reset(self):
    """After a failed step: fail what was in flight and start from an empty slot table (queued requests
    stay queued)."""
    live = self._in_flight()
    self.slot_req = [None] * self.n_slots
    self._live.clear()
    self.reserved.clear()
    self.prefill = None
    self.pending.clear()
    self.drafter.forget_timing()
    if self.state_io is not None:
      self.state_io.copies.clear()
    self._fail(live)
    self.table = self.fns.empty_table()

  def _fail_all(self):
    with self._lock:
      waiting = list(self.queue)
      self.queue.clear()
      self._waiting.clear()
    self._fail(self._in_flight() + [m for r in waiting for m in self._members(r)])

  def _rows(self) -> np.ndarray:
    """The slots the next generate or verify runs (serve.engine.slots.step_rows): the live ones, in the smallest
    compiled bucket that holds them; none when no slot is live."""
    if not self._live:
      return np.zeros((0,), np.int32)
    return step_rows(self._live, self.n_slots, self.fns.buckets, self.fns.n_devices)

  def _drafts(self) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray] | None]:
    """(rows, drafts): the slots the next call runs and, for a verify, (drafts [B, K], n_drafts [B]) of those
    rows, or None: a plain generate step (serve.engine.drafting.Drafter). Drafts follow the output so far, so the
    steps in flight are read back first (which may finish slots), unless no drafts could pay."""
    rows = self._rows()
    if not self.drafter.worth_reading_back(self.slot_req, self.active_slots, len(rows)):
      return rows, None
    self.read_back_all()
    rows = self._rows()
    drafts = self.drafter.drafts(self.slot_req, self.active_slots, len(rows)) if len(rows) else None
    return rows, None if drafts is None else (drafts[0][rows], drafts[1][rows])

  def warmup(self):
    """Compile every function (each bucket's generate and verify) by running them once: nothing is compiled
    at request time, and nothing of the warm-up is cached. `warmup_seconds`: per bucket, and the rest."""
    state_io, self.state_io = self.state_io, None
    try:
      self._warm_calls()
    finally:
      self.state_io = state_io
    if self.state_io is not None:
      self.state_io.warm(self.table.model)
    self.stats = dict.fromkeys(self.stats, 0)
    self._rate.clear()

  def _warm_calls(self):
    t = time.perf_counter()
    self.generate([Request(prompt_ids=[0], max_tokens=2, temperature=1.0, top_k=1, top_p=0.5, seed=0)])
    self.warmup_seconds = {"prefill and insert": time.perf_counter() - t}
    # Every bucket's programs compiled side by side (one per core), then each run once over idle slots.
    t = time.perf_counter()
    per_bucket = self.fns.precompile(
      self.params, self.table, decode_steps=self.decode_steps, speculative_tokens=self.speculative_tokens
    )
    self.warmup_seconds |= {f"compile bucket {B}": s for B, s in per_bucket.items()}
    self.warmup_seconds["buckets compiled (wall)"] = time.perf_counter() - t
    t = time.perf_counter()
    D = self.fns.n_devices
    per = self.n_slots // D
    for B in self.fns.buckets:  # each over slots that hold no request
      rows = (np.arange(D)[:, None] * per + np.arange(B // D)[None, :]).reshape(-1).astype(np.int32)
      calls = [(1, False)] + (
        [(self.decode_steps, g) for g in (False, True)] if self.decode_steps > 1 else []
      )
      for steps, greedy in calls:
        self.table, out = self.fns.generate(self.params, self.table, steps, greedy, rows_B=rows)
        np.asarray(out)
      if self.speculative_tokens:
        K = self.speculative_tokens
        drafts, n = np.zeros((B, K), np.int32), np.zeros((B,), np.int32)
        self.table, out = self.fns.verify(self.params, self.table, drafts, n, rows_B=rows)
        np.asarray(out)
    self.warmup_seconds["buckets run once"] = time.perf_counter() - t
    t = time.perf_counter()
    self.generate([Request(prompt_ids=[0], max_tokens=1, echo=True, logprobs=0)])  # the scored prefill
    self.warmup_seconds["scored prefill"] = time.perf_counter() - t
