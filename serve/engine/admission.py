"""Admission, requests into slots: `Admission` keeps the requests waiting for a slot, bounds how many may wait
(in all and per tenant) and picks which waits next, tenant by tenant, when slots free up (not thread-safe by
itself: the engine calls it under its lock); `SlotMap` says which request each slot serves and which free
slot to fill next."""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable

import numpy as np

from serve.engine.request import Request, members
from serve.slots.slot_functions import step_rows


class QueueFull(Exception):
  """Every slot is busy and the waiting queue is at its bound."""


def slots_needed(r: Request) -> int:
  """The slots a request's choices decode in (max_tokens 0: scored at prefill, never decoded)."""
  return sum(m.max_tokens > 0 for m in members(r))


class Admission:
  """The waiting queue of one engine with `n_slots` slots: at most `max_queue` choices wait beyond the free
  slots, at most `per_tenant` of them one tenant's."""

  def __init__(self, n_slots: int, max_queue: int, per_tenant: int):
    self.n_slots, self.max_queue, self.per_tenant = n_slots, max_queue, per_tenant
    self.queue: collections.deque[Request] = collections.deque()  # oldest first
    self._waiting: collections.Counter[str] = collections.Counter()  # tenant -> its choices in the queue

  def __len__(self) -> int:
    return len(self.queue)

  def check_room(self, size: int, tenant: str, busy: int):
    """Raise QueueFull unless `size` more choices of `tenant` fit now, with `busy` slots taken."""
    waiting = sum(self._waiting.values())
    free = max(0, self.n_slots - busy)
    room = min(self.max_queue - waiting, self.per_tenant - self._waiting[tenant]) + free
    if size > room:
      raise QueueFull(
        f"{waiting} choices already wait for {self.n_slots} slots (queue bound "
        f"{self.max_queue}, {self.per_tenant} per tenant); this request needs room "
        f"for {size}"
      )

  def append(self, r: Request):
    """Queue r (its room checked) behind the others."""
    self.queue.append(r)
    self._waiting[r.tenant] += 1 + len(r.siblings)

  def put_first(self, reqs: Iterable[Request]):
    """Queue these ahead of every other (the engine's own cache-only requests: a conversation's next turn,
    if already queued, restores their states)."""
    for r in reqs:
      self.queue.appendleft(r)
      self._waiting[r.tenant] += 1 + len(r.siblings)

  def remove(self, r: Request) -> bool:
    """Take r out of the queue (cancelled); False if it no longer waits."""
    if r not in self.queue:
      return False
    self.queue.remove(r)
    self._dequeued(r)
    return True

  def clear(self) -> list[Request]:
    """Empty the queue; what waited."""
    waiting = list(self.queue)
    self.queue.clear()
    self._waiting.clear()
    return waiting

  def take(
    self, n_free: int, held: collections.Counter[str], most: int, blocked: Callable[[list, Request], bool]
  ) -> list[Request]:
    """Take up to `most` requests whose choices fit `n_free` free slots (`held`: tenant -> slots it holds,
    updated), stopping at one that is `blocked(taken so far, it)`. Tenant by tenant: the next one is the
    oldest request of the waiting tenant that holds the fewest slots (ties: the tenant whose oldest request
    came first), so while several tenants wait the freed slots go to those with the fewest until they hold
    as many as the others. One tenant: first come, first served."""
    take: list[Request] = []
    used = 0
    while self.queue and len(take) < most:
      i = self._fairest(held)
      r = self.queue[i]
      if used + slots_needed(r) > n_free or blocked(take, r):
        break
      del self.queue[i]
      self._dequeued(r)
      used += slots_needed(r)
      held[r.tenant] += slots_needed(r)
      take.append(r)
    return take

  def _fairest(self, held: collections.Counter[str]) -> int:
    """The queue index of the next request to admit (see `take`)."""
    tenants = sum(1 for n in self._waiting.values() if n)
    heads: dict[str, int] = {}
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


class SlotMap:
  """Which request each of `n_slots` slots serves (over `n_devices` devices, each an equal share of them), and
  which slots the prefill in progress holds for its choices; `buckets`: the row counts a step may run. The
  engine's thread only."""

  def __init__(self, n_slots: int, n_devices: int, buckets: tuple[int, ...]):
    self.n_slots, self.n_devices, self.per_device, self.buckets = (
      n_slots,
      n_devices,
      n_slots // n_devices,
      buckets,
    )
    self.req: list[Request | None] = [None] * n_slots  # live in the device table
    self.live: set[int] = set()  # the slots whose req is not None (kept as they change: a step reads it)
    self.reserved: set[int] = set()  # held by the prefill in progress

  def busy(self) -> int:
    """Slots taken: live or reserved."""
    return len(self.live) + len(self.reserved)

  def held(self) -> collections.Counter[str]:
    """Tenant -> the slots its requests decode in."""
    return collections.Counter(r.tenant for r in self.req if r is not None)

  def running(self) -> list[Request]:
    return [r for r in self.req if r is not None]

  def put(self, slot: int, r: Request):
    """r decodes in `slot` (reserved for it until now)."""
    self.reserved.discard(slot)
    self.req[slot], r.progress.slot = r, slot
    self.live.add(slot)

  def release(self, r: Request):
    """r no longer decodes (if it held a slot, the slot is free)."""
    if r.progress.slot is not None and self.req[r.progress.slot] is r:
      self.req[r.progress.slot] = None
      self.live.discard(r.progress.slot)

  def holds(self, r: Request) -> bool:
    """Whether r still runs in its slot."""
    return r.progress.finish_reason is None and r.progress.slot is not None and self.req[r.progress.slot] is r

  def clear(self):
    self.req[:] = [None] * self.n_slots
    self.live.clear()
    self.reserved.clear()

  def free(self) -> list[int]:
    """The slots free for a new request, in the order to fill them: over a mesh, those of the devices that
    run the fewest live slots first, so each device's share of a step's rows (its bucket) stays small."""
    load = collections.Counter(s // self.per_device for s in self.live)
    order = []
    for s, r in enumerate(self.req):
      if r is None and s not in self.reserved:
        d = s // self.per_device
        order.append((load[d], s))
        load[d] += 1
    return [s for _, s in sorted(order)]

  def rows(self) -> np.ndarray:
    """The slots the next generate or verify runs (serve.slots.slot_functions.step_rows): the live ones, in the smallest
    compiled bucket that holds them; none when no slot is live."""
    if not self.live:
      return np.zeros((0,), np.int32)
    return step_rows(self.live, self.n_slots, self.buckets, self.n_devices)
