"""Continuous-batching decode engine over a fixed number of slots (JetStream-style).

Each `step()`: drop cancelled requests, admit queued prompts into free slots (prefill in 128-token chunks,
a few chunks per step while others decode, then insert), run one compiled generate call over all slots
(`decode_steps` tokens each while no prompt waits, else one), and hand out the tokens of the call before
(one device-to-host copy per call; the next call is already queued on the device while the host reads the
last). Requests only meet the engine through `submit`, `cancel` and the `on_deliver` callback, so it runs
the same in a test loop or a server thread. Its pieces: `admission` (the queue, tenant fairness and the
slot map), `prefill` (prompts into rows), `readback` (a call's host copy into deliveries), `engine_stats`
(its counters), `drafting` (speculative drafts) and `engine_cache` (its traffic with the state cache).
"""

from __future__ import annotations

import collections
import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from laplace_jax import model as laplace_model
from serve.engine.admission import Admission, QueueFull, SlotMap, slots_needed
from serve.engine.drafting import Drafter, draft_masks
from serve.engine.engine_cache import StateCacheIO
from serve.engine.engine_config import DEFAULTS, EngineConfig, check_max_context
from serve.engine.engine_stats import EngineStats, TokenRate
from serve.engine.prefill import PrefillBatch, insert_inputs, token_budget
from serve.engine.readback import CallKind, Pending, advance_grammars, read_call, score_prompts
from serve.engine.request import Constraint, Delivery, Progress, Request, check_request, members
from serve.engine.state_cache import StateCache
from serve.slots.slot_functions import SlotBackend, SlotFunctions

# What callers import from here: the engine and the types it takes and gives.
__all__ = [
  "Constraint",
  "Delivery",
  "Engine",
  "EngineStopped",
  "Progress",
  "QueueFull",
  "Request",
  "check_max_context",
]

log = logging.getLogger(__name__)


class EngineStopped(Exception):
  """The engine's loop is not running (it failed for good, or was stopped): nothing submitted would run."""


MAX_STEP_FAILURES = 3  # failed steps in a row (each followed by a reset) before the loop gives up


class StepLoop:
  """Runs `step` (True: busy) in a background thread until stopped, sleeping while idle until `wake` is set.
  A failed step fails the requests it touched and starts over (`reset`); failing again and again, the loop
  gives up (`give_up` fails every request; `error` says why): the engine then refuses new requests
  (EngineStopped) and the server reports itself unhealthy."""

  def __init__(self, step: Callable[[], bool], reset: Callable[[], None], give_up: Callable[[], None]):
    self.step, self.reset, self.give_up = step, reset, give_up
    self.wake = threading.Event()  # set by callers with new work
    self.error: BaseException | None = None
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None

  @property
  def running(self) -> bool:
    """The thread runs and has not given up."""
    return self.error is None and self._thread is not None and self._thread.is_alive()

  def start(self):
    self._stop.clear()
    self.error = None
    self._thread = threading.Thread(target=self._run, name="serve-engine", daemon=True)
    self._thread.start()

  def stop(self, timeout: float) -> bool:
    """Stop the thread; whether it ended in time without having given up."""
    self._stop.set()
    self.wake.set()
    if self._thread is None:
      return False
    self._thread.join(timeout)
    alive, self._thread = self._thread.is_alive(), None
    return not alive and self.error is None

  def _run(self):
    failures = 0
    while not self._stop.is_set():
      self.wake.clear()
      try:
        busy = self.step()
        failures = 0
      except Exception as e:
        failures += 1
        log.exception("engine step failed (%d in a row)", failures)
        try:
          if failures >= MAX_STEP_FAILURES:
            raise
          self.reset()
        except Exception:
          self.error = e
          self.give_up()
          return
        self.wake.wait(0.05 * failures)
        continue
      if not busy:
        self.wake.wait(0.5)


class Engine:
  """Slots, queue and loop around the compiled prefill / insert / generate of `serve.slots.slot_functions`: the engine
  schedules, and meets the model only through the `SlotBackend` interface `make_slots` builds (by default
  `SlotFunctions`; tests pass a fake that needs no compile)."""

  # A request's constraint (Request.constraint) masks every token it samples: the server's hook
  # (serve.api.completions.CompletionRunner.run) serves constrained requests only from an engine that says so.
  applies_constraints = True

  def __init__(
    self,
    params,
    cfg,
    config: EngineConfig = DEFAULTS,
    *,
    model=None,
    mesh=None,
    valid_vocab: int | None = None,
    on_deliver: Callable[[list[Delivery]], None] | None = None,
    state_cache: StateCache | None = None,
    make_slots: Callable[..., SlotBackend] = SlotFunctions,
  ):
    """`config`: sizes and policies (checked against `cfg` here, its n_slots default filled in).
    `make_slots(model, cfg, n_slots=, prefill_batch=, n_stop=, valid_vocab=, mesh=, max_context=,
    hold_ended=, buckets=)` builds the slot functions (hold_ended: with a state cache)."""
    self.config = config = config.for_model(cfg, state_cache=state_cache is not None)
    self.cfg, self.params = cfg, params
    self.valid_vocab = cfg.vocab_size if valid_vocab is None else valid_vocab
    # Drafts and when to verify them (with speculative_tokens > 0).
    c = config
    self.drafter = Drafter(
      c.speculative_tokens, prompt_lookup=c.prompt_lookup, rule=c.speculative_rule, max_context=c.max_context
    )
    self.fns: SlotBackend = make_slots(
      laplace_model if model is None else model,
      cfg,
      n_slots=self.n_slots,
      prefill_batch=config.prefill_batch,
      n_stop=config.max_stop_ids,
      valid_vocab=self.valid_vocab,
      mesh=mesh,
      max_context=config.max_context,
      hold_ended=state_cache is not None,
      buckets=config.slot_buckets,
    )
    self.on_deliver = on_deliver or (lambda deliveries: None)
    self.table = self.fns.empty_table()
    self.slot_map = SlotMap(self.n_slots, self.fns.n_devices, self.fns.buckets)
    self.admission = Admission(self.n_slots, config.max_queue, config.queue_per_tenant)
    self.prefill: PrefillBatch | None = None  # the prefill batch in progress
    self.pending: collections.deque[Pending] = collections.deque()  # dispatched, not yet read back
    self._lock = threading.Lock()  # the queue and the cancels, between callers and the engine's thread
    self._cancels: list[Request] = []
    self.loop = StepLoop(lambda: self.step(), self._reset, self._fail_all)  # (step looked up per call)
    self.stats = EngineStats()
    self.rate = TokenRate()
    # The engine's traffic with its state cache (serve.engine.state_cache.StateCache), None without one.
    self.state_io = (
      None if state_cache is None else StateCacheIO(state_cache, self.fns, config, cfg.chunk_size)
    )
    self._gens = 0  # generate and verify calls dispatched
    self.warmup_seconds: dict[str, float] = {}  # warmup's compile and first run, per bucket and the rest

  @property
  def n_slots(self) -> int:
    """Slots in the table (config.n_slots, filled in for the model)."""
    assert self.config.n_slots is not None
    return self.config.n_slots

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
      check_request(r, self.valid_vocab, self.n_slots, self.fns.n_stop, self.config.max_context)
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
        for m in members(r):
          m.progress.seed = secrets.randbits(32) if m.seed is None else m.seed
          m.progress.submitted_at = now
        self.admission.append(r)
      self.stats.requests += size
    self.loop.wake.set()

  def check_room(self, size: int, tenant: str = ""):
    """Raise QueueFull unless `size` more choices of `tenant` fit now (admission before a request's prompt
    is even tokenized; submit_all decides for good)."""
    with self._lock:
      self._check_room(size, 1, tenant)

  def _check_room(self, size: int, n_requests: int, tenant: str):
    try:
      self.admission.check_room(size, tenant, busy=self.slot_map.busy())
    except QueueFull:
      self.stats.rejected += n_requests
      raise

  @property
  def serving(self) -> bool:
    """The loop thread runs and has not given up."""
    return self.loop.running

  @property
  def error(self) -> BaseException | None:
    """Why the loop gave up (None: it has not)."""
    return self.loop.error

  def cancel(self, req: Request, keep: int | None = None):
    """Stop a request (client gone, or a stop string matched); its slot is freed on the engine's next step.
    keep: how many output tokens the conversation goes on from (a stop string cuts the text before it):
    with a state cache, the state after the prompt and exactly those tokens is kept."""
    with self._lock:
      req.progress.cancelled = True
      req.progress.keep = keep
      self._cancels.append(req)
    self.loop.wake.set()

  def keep_state(self, ids: Sequence[int], tenant: str = "", cache_salt: str | None = None):
    """Keep the state after exactly `ids` in the state cache (nothing without one): a request of the
    engine's own prefills them from their longest cached prefix, ahead of the queue (the ids a client will
    send next, e.g. a reply's text tokenized again). Any thread."""
    if self.state_io is None or not ids:
      return
    self._queue_cache_only(
      [Request(prompt_ids=list(ids), max_tokens=0, tenant=tenant, cache_salt=cache_salt, cache_only=True)]
    )
    self.loop.wake.set()

  # ---- status ----

  @property
  def active_slots(self) -> int:
    return len(self.slot_map.live)

  @property
  def queue_depth(self) -> int:
    return len(self.admission)

  def tokens_per_second(self, window: float = 10.0) -> float:
    return self.rate.per_second(time.perf_counter(), window)

  def idle(self) -> bool:
    return not (len(self.admission) or self.prefill or self.pending or self.active_slots or self._cancels)

  # ---- the engine's side (one thread) ----

  def step(self) -> bool:
    """One round: cancels, admission and prefill, one generate (or verify) call, read back. False when idle."""
    self._apply_cancels()
    prefilled = self.stats.prefill_tokens
    self._advance_prefill()
    timed = self.stats.prefill_tokens == prefilled  # no prefill shares this step's time on the device
    dispatched = False
    # While a live slot is constrained, no call of several steps (a token's mask depends on the tokens
    # before it, read back from the call before).
    constrained = any(r.constraint is not None for r in self.slot_map.running())
    J = self.config.speculative_tokens + 1  # positions a verify scores per row
    rows, drafts = self._drafts() if J > 1 and self.active_slots else (self.slot_map.rows(), None)
    if len(rows):
      owners = tuple(self.slot_map.req[s] for s in rows)  # the call's row i runs slot rows[i]
      if drafts is None:
        # Several tokens a call only while no prompt waits for a slot: admission goes on between calls.
        steps = (
          1 if len(self.admission) or self.prefill is not None or constrained else self.config.decode_steps
        )
        greedy = steps > 1 and all(r is None or (r.temperature == 0 and r.logprobs is None) for r in owners)
        if constrained:
          self.table, out = self._masked_step(rows)
        else:
          self.table, out = self.fns.generate(self.params, self.table, steps, greedy, rows_B=rows)
        self.pending.append(Pending(CallKind.GENERATE, out, owners, steps, step=self._gens, timed=timed))
      else:
        drafts_BxJ, n_B = drafts  # (drafting read the calls before back: the matchers are up to date)
        allowed_BxJxG = draft_masks(owners, drafts_BxJ, n_B, self.fns.words)  # (may cut n_B: before Pending)
        self.table, out = self.fns.verify(self.params, self.table, drafts_BxJ, n_B, rows, allowed_BxJxG)
        self.pending.append(Pending(CallKind.VERIFY, out, owners, J, n_B, step=self._gens, timed=timed))
      self.stats.steps += 1
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
      advance_grammars(item, packed)
    allowed_BxG = np.full((len(rows), self.fns.words), -1, np.int32)
    for i, s in enumerate(rows):
      r = self.slot_map.req[s]
      if r is not None and r.constraint is not None:
        r.constraint.fill(allowed_BxG[i])
    self.table, out = self.fns.sample_rows(logits, self.table, rows, allowed_BxG)
    for item, packed in read:
      self._read_back(item, packed, advanced=True)
    return self.table, out

  def read_back_all(self):
    """Read back every call in flight: the host then holds every token dispatched so far (the engine's
    thread only; benchmarks use it to end a timed window with nothing left running)."""
    while self.pending:
      self._read_back(self.pending.popleft())

  def _apply_cancels(self):
    with self._lock:
      cancels, self._cancels = self._cancels, []
      for r in cancels:
        self.admission.remove(r)
    # A stop string ends a request by cancelling it: its context is still worth keeping. What the calls in
    # flight fed its slot is known once they are read back; then its state holds every token but the last.
    live = [r for r in cancels if self.slot_map.holds(r)]
    if self.state_io is not None and live:
      self.read_back_all()
      live = [r for r in live if r.progress.finish_reason is None]
      self._keep_states(live, fed=lambda r: len(r.progress.output_ids) - 1, keep=lambda r: r.progress.keep)
    self._end(cancels, "cancelled")

  def _keep_states(self, reqs, fed: Callable[[Request], int], keep: Callable[[Request], int | None]):
    """Copy these slots' states into the cache (`StateCacheIO.keep`), queueing first the requests that
    prefill again what a state ran past."""
    assert self.state_io is not None
    self._queue_cache_only(self.state_io.keep(self.table.model, reqs, fed, keep))

  def _queue_cache_only(self, reqs: list[Request]):
    with self._lock:
      self.admission.put_first(reqs)

  def _finish(self, r: Request, reason: str):
    r.progress.finish_reason = reason
    self.slot_map.release(r)
    self.stats.finished += not r.cache_only
    r.progress.done.set()

  def _end(self, reqs: list[Request], reason: str):
    """Finish these requests (those still running) with `reason`, and tell their callers."""
    out = []
    for r in reqs:
      if r.progress.finish_reason is None:
        self._finish(r, reason)
        out.append(Delivery(r, [], reason))
    if out:
      self.on_deliver(out)

  def _advance_prefill(self):
    """Prefill chunks within this step's budget. A failure here (a request's settings, a cached state)
    fails the prompts being prefilled and nothing else: the slot table is untouched until the insert."""
    try:
      self._prefill_chunks()
    except Exception:
      log.exception("prefill failed: its requests fail, the engine goes on")
      pf, self.prefill = self.prefill, None
      if pf is not None:
        self.slot_map.reserved.difference_update(pf.slots)
        self._end([m for r in pf.reqs for m in members(r)], "error")

  def _prefill_chunks(self):
    budget = self.config.prefill_chunks_per_step if self.active_slots else 1 << 30
    while budget > 0 and (self.prefill is not None or self._start_prefill()):
      pf = self.prefill
      assert pf is not None
      self.stats.prefill_tokens += pf.run_chunk(
        self.fns, self.params, self.config.prefill_batch, self.cfg.chunk_size
      )
      budget -= 1
      if self.state_io is not None:
        self.state_io.snapshot(pf)
      if pf.next_chunk == pf.n_chunks:
        self._insert(pf)

  def _start_prefill(self) -> bool:
    """Take up to prefill_batch queued requests that have free slots (`Admission.take`: tenant by tenant);
    False if none."""
    free, io = self.slot_map.free(), self.state_io
    # A request whose prefix's state is being made in this batch waits for the next, which restores it.
    blocked = lambda take, r: io is not None and any(io.waits_for(t, r) for t in take)
    with self._lock:
      take = self.admission.take(len(free), self.slot_map.held(), self.config.prefill_batch, blocked)
    if not take:
      return False
    slots = free[: sum(slots_needed(r) for r in take)]
    # The batch is in place before anything can fail, so a failure fails exactly these requests.
    self.prefill = pf = PrefillBatch(reqs=take, slots=slots, scored=any(r.echo for r in take))
    self.slot_map.reserved.update(slots)
    pf.begin(self.fns, io, self.cfg.chunk_size)
    self.stats.cached_prompt_tokens += sum(r.progress.cached_tokens for r in take)
    return True

  def _insert(self, pf: PrefillBatch):
    """Write each prefilled row into the slots of its choices (n > 1: one row, several slots), sampling
    each choice's first token; choices with max_tokens 0 (echo scoring) finish here without a slot."""
    if pf.scored:
      score_prompts(pf.reqs, pf.scores, self.cfg.chunk_size)
    if self.state_io is not None:
      self.state_io.copy_prompt_ends(pf)
    entries, E, unslotted = pf.entries(), self.config.prefill_batch, []
    for g in range(0, len(entries), E):
      part = entries[g : g + E]
      budget = lambda m: token_budget(m, self.config.max_context)
      x = insert_inputs(part, E, self.n_slots, self.fns.n_stop, self.fns.words, budget)
      owners: list[Request | None] = []
      for _, slot, m in part:
        if slot is not None and m.progress.finish_reason is None:
          self.slot_map.put(slot, m)
          owners.append(m)
        else:  # no slot (max_tokens 0), or cancelled during prefill: its slot stays free
          self.slot_map.reserved.discard(-1 if slot is None else slot)
          owners.append(None)
          unslotted.append(m)
      assert pf.state is not None
      self.table, out = self.fns.insert(self.params, self.table, pf.state, *x)
      self.pending.append(Pending(CallKind.INSERT, out, tuple(owners)))
    self.prefill = None
    self._end(unslotted, "length")

  def _read_back(self, item: Pending, packed: np.ndarray | None = None, advanced: bool = False):
    """Deliver a call's tokens (packed: its host copy, else made here; advanced: its constrained requests'
    matchers have taken them already)."""
    if packed is None:
      packed = np.asarray(item.out)  # the one device-to-host copy of this call
    now = time.perf_counter()
    if self.config.speculative_tokens and item.kind is not CallKind.INSERT:
      per_call = item.width if item.kind is CallKind.GENERATE else 1
      self.drafter.time_call(item.kind.value, item.step, item.timed, now, per_call, bucket=len(item.owners))
    got = read_call(item, packed, now, advanced)
    ended = [(d.request, d.reason) for d in got.deliveries if d.reason is not None]
    for r, reason in ended:
      self._finish(r, reason)
    if ended and self.state_io is not None:
      self._queue_cache_only(
        self.state_io.keep_finished(self.table.model, [r for r, _ in ended], self.pending)
      )
    self.stats.tokens += got.tokens
    self.stats.drafted_tokens += got.drafted
    self.stats.accepted_tokens += got.accepted
    self.rate.add(now, got.tokens)
    if got.deliveries:
      self.on_deliver(got.deliveries)

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
    self.loop.start()

  def stop(self, timeout: float = 30.0):
    """Stop the loop, then land the states still being copied and write them to the cache directory."""
    if self.loop.stop(timeout) and self.state_io and not self.state_io.flush(timeout):
      log.warning("state cache: some files were still being written at shutdown")

  def _in_flight(self) -> list:
    """Every request past the queue: in a slot, being prefilled, or waiting to be read back."""
    live = self.slot_map.running()
    live += [m for r in (self.prefill.reqs if self.prefill else []) for m in members(r)]
    live += [r for p in self.pending for r in p.owners if r is not None]
    return list(dict.fromkeys(live))

  def _reset(self):
    """After a failed step: fail what was in flight and start from an empty slot table (queued requests
    stay queued)."""
    live = self._in_flight()
    self.slot_map.clear()
    self.prefill = None
    self.pending.clear()
    self.drafter.forget_timing()
    if self.state_io is not None:
      self.state_io.copies.clear()
    self._end(live, "error")
    self.table = self.fns.empty_table()

  def _fail_all(self):
    with self._lock:
      waiting = self.admission.clear()
    self._end(self._in_flight() + [m for r in waiting for m in members(r)], "error")

  def _drafts(self) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray] | None]:
    """(rows, drafts): the slots the next call runs and, for a verify, (drafts [B, J - 1], n_drafts [B]) of
    those rows, or None: a plain generate step (serve.engine.drafting.Drafter). Drafts follow the output so
    far, so the steps in flight are read back first (which may finish slots), unless no drafts could pay."""
    rows = self.slot_map.rows()
    if not self.drafter.worth_reading_back(self.slot_map.req, self.active_slots, len(rows)):
      return rows, None
    self.read_back_all()
    rows = self.slot_map.rows()
    drafts = self.drafter.drafts(self.slot_map.req, self.active_slots, len(rows)) if len(rows) else None
    return rows, None if drafts is None else (drafts[0][rows], drafts[1][rows])

  def warmup(self):
    """Compile every function (each bucket's generate and verify) by running them once: nothing is compiled
    at request time, and nothing of the warm-up is cached. `warmup_seconds`: per bucket, and the rest."""
    state_io, self.state_io = self.state_io, None  # (nothing of the warm-up is cached)
    try:
      t = time.perf_counter()
      self.generate([Request(prompt_ids=[0], max_tokens=2, temperature=1.0, top_k=1, top_p=0.5, seed=0)])
      self.warmup_seconds = {"prefill and insert": time.perf_counter() - t}
      self.table, seconds = warm_buckets(
        self.fns, self.params, self.table, self.config.decode_steps, self.config.speculative_tokens
      )
      self.warmup_seconds |= seconds
      t = time.perf_counter()
      self.generate([Request(prompt_ids=[0], max_tokens=1, echo=True, logprobs=0)])  # the scored prefill
      self.warmup_seconds["scored prefill"] = time.perf_counter() - t
    finally:
      self.state_io = state_io
    if self.state_io is not None:
      self.state_io.warm(self.table.model)
    self.stats = EngineStats()
    self.rate.clear()


def warm_buckets(
  fns: SlotBackend, params, table, decode_steps: int, K: int
) -> tuple[object, dict[str, float]]:
  """Every bucket's generate (and with K drafts, verify) programs compiled side by side (one per core), then
  each run once over slots that hold no request. (The table after them, seconds per bucket and the rest.)"""
  t = time.perf_counter()
  per_bucket = fns.precompile(params, table, decode_steps=decode_steps, speculative_tokens=K)
  seconds = {f"compile bucket {B}": s for B, s in per_bucket.items()}
  seconds["buckets compiled (wall)"] = time.perf_counter() - t
  t = time.perf_counter()
  D = fns.n_devices
  per = fns.n_slots // D
  for B in fns.buckets:
    rows = (np.arange(D)[:, None] * per + np.arange(B // D)[None, :]).reshape(-1).astype(np.int32)
    calls = [(1, False)] + ([(decode_steps, g) for g in (False, True)] if decode_steps > 1 else [])
    for steps, greedy in calls:
      table, out = fns.generate(params, table, steps, greedy, rows_B=rows)
      np.asarray(out)
    if K:
      drafts_BxJ, n_B = np.zeros((B, K), np.int32), np.zeros((B,), np.int32)
      table, out = fns.verify(params, table, drafts_BxJ, n_B, rows)
      np.asarray(out)
  seconds["buckets run once"] = time.perf_counter() - t
  return table, seconds
