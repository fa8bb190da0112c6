"""The engine's side of the state cache (serve.engine.state_cache): restore a prompt's longest cached prefix into
its prefill row, and copy states out of the device without stalling the step: a jitted gather of the
rows into a small [L, E, ...] array (each leaf along its own sequence axis, `DecodeState.batch_axes`),
`copy_to_host_async`, and a read once it has landed. The cache holds each row in the state's stored (flat)
form, DecodeState.to_dict's, which its files keep.

When a state is copied: at the end of every prefill (the state after exactly the prompt); when a slot's
request finished (read back) or was cancelled (a stop string), before anything can be inserted over it (the
state has then consumed the prompt and one output token per generate step dispatched since the insert);
and every `snapshot_every` chunks of a long prefill. Where a slot's state has run past the tokens its
conversation goes on from (a stop string, a stop id), the engine prefills those tokens again from the
prompt's state in a request of its own (`Request.cache_only`) whose prompt-end state is kept.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable

import jax
import numpy as np

from laplace_jax.model.state import DecodeState
from serve.engine.engine_config import EngineConfig
from serve.engine.readback import CallKind, Pending
from serve.engine.request import Request
from serve.engine.state_cache import StateCache, layout_of
from serve.slots.slot_functions import PrefillRows, SlotBackend


class StateCacheIO:
  """The engine's traffic with its state cache: restores into prefill rows, copies out of the slot table
  and prefill batches, and the copies in flight. The engine owns one when it has a cache and calls it from
  its own thread; requests are read (prompt, scope, progress) and their `cached_tokens` set."""

  def __init__(self, cache: StateCache, fns: SlotBackend, config: EngineConfig, chunk_size: int):
    """Checks that the cache holds states of the slot functions' layout (ValueError naming the fix)."""
    cache.check_layout(layout_of(fns.state_shape))
    self.cache, self.fns = cache, fns
    self.prefill_batch, self.min_tokens = config.prefill_batch, config.cache_min_tokens
    self.snapshot_every, self.chunk_size = config.snapshot_every, chunk_size
    self.copies: collections.deque = collections.deque()  # (ids, gathered rows) on their way to the host
    self._fresh_rows: DecodeState | None = None  # a fresh prefill batch's state on the host, made once

  def restore(self, reqs) -> PrefillRows | None:
    """Each request's longest cached prefix (at least one prompt token is left to prefill, for the first
    token's logits; `progress.cached_tokens` says how many); a prefill batch starting from those states,
    or None when nothing was cached."""
    if self.copies:
      self.collect(block=False)
    if any(
      scope == (r.tenant, r.cache_salt) and _is_prefix(seq, r.prompt_ids)
      for rows, _ in self.copies
      for scope, seq in rows
      for r in reqs
    ):
      # A state of this prompt's scope still on its way to the host is its prefix (an agent's next turn
      # arriving just after the last one finished): wait for it rather than prefill it again. Another
      # scope's copies never make a request wait (its time to first token would tell them apart).
      self.collect(block=True)
    found: list[dict[str, np.ndarray] | None] = []
    for r in reqs:
      if r.echo:  # every prompt token is scored
        found.append(None)
        continue
      n, state = self.cache.lookup(r.prompt_ids, len(r.prompt_ids) - 1, tenant=r.tenant, salt=r.cache_salt)
      r.progress.cached_tokens = n
      found.append(state)
    if all(f is None for f in found):
      return None
    # Rows without a cached prefix start from a fresh state, as an uncached prefill batch does.
    if self._fresh_rows is None:
      self._fresh_rows = jax.tree.map(np.asarray, self.fns.empty_prefill().model)
    assert self._fresh_rows is not None
    host = {k: a.copy() for k, a in self._fresh_rows.to_dict().items()}
    axes = self.fns.axes.to_dict()
    for i, f in enumerate(found):
      if f is not None:
        for k in host:
          host[k][_row(axes[k], i)] = f[k]
    for r in reqs:
      for sib in r.siblings:
        sib.progress.cached_tokens = r.progress.cached_tokens
    return self.fns.load_prefill(DecodeState.from_dict(host))

  def copy_out(self, table_model: DecodeState, fed_reqs):
    """Start copying the slot states of these requests to the host (their slots are still theirs: called
    before anything can be inserted over them). fed_reqs: (request, how many of its output tokens its state
    has consumed after the prompt), as the engine knows it from the calls it dispatched."""
    rows, ids = [], []
    for r, fed in fed_reqs:
      if not 0 <= fed <= len(r.progress.output_ids) or len(r.prompt_ids) + fed < self.min_tokens:
        continue
      rows.append(r.progress.slot)
      ids.append(((r.tenant, r.cache_salt), list(r.prompt_ids) + r.progress.output_ids[:fed]))
    self._gather_async(table_model, rows, ids)

  def keep(self, table_model: DecodeState, reqs, fed, keep) -> list[Request]:
    """Copy these requests' slot states into the cache. fed(r): how many output tokens r's state has
    consumed; keep(r): how many its conversation goes on from (None: fed(r)). Where the state ran past them,
    returns a cache-only request that prefills the prompt and those tokens again (the engine queues it
    first)."""
    exact, again = [], []
    for r in reqs:
      n, k = fed(r), keep(r)
      if k is None or k >= n:
        exact.append((r, n))
      elif k > 0:  # (0: the prompt's own state is kept at the end of its prefill)
        ids = list(r.prompt_ids) + r.progress.output_ids[:k]
        again.append(
          Request(prompt_ids=ids, max_tokens=0, tenant=r.tenant, cache_salt=r.cache_salt, cache_only=True)
        )
    self.copy_out(table_model, exact)
    return again

  def keep_finished(self, table_model: DecodeState, finished: list[Request], pending: Iterable[Pending]):
    """`keep` the states of requests a read-back finished, with `pending` the calls still in flight behind it.
    A finished slot's state holds its prompt and every output token but the last, and the last too once the
    call in flight has fed it (a verify does; a single step does unless the slot functions hold ended slots,
    as they do with a state cache; a call of several steps does not). A conversation goes on without a stop
    id that ended it."""
    later = [x for x in pending if x.kind is not CallKind.INSERT]
    if len(later) > 1:  # (one call at most is ever in flight behind the one read back)
      return []
    extra = int(bool(later) and later[0].runs_finished_slots_on(self.fns.hold_ended))
    fed = lambda r: len(r.progress.output_ids) - 1 + extra
    return self.keep(
      table_model,
      finished,
      fed,
      keep=lambda r: len(r.progress.output_ids) - (r.progress.finish_reason == "stop"),
    )

  def copy_prompt_ends(self, pf):
    """At the end of a prefill each row's state has consumed exactly its prompt: keep it, so that a later
    prompt re-sending this one with a reply of other ids (its text re-tokenized, or cut at a stop string)
    still skips this prompt."""
    rows, ids = [], []
    for i, r in enumerate(pf.reqs):
      if len(r.prompt_ids) >= self.min_tokens:
        rows.append(i)
        ids.append(((r.tenant, r.cache_salt), list(r.prompt_ids)))
    self._gather_async(pf.state.model, rows, ids)

  def waits_for(self, first, later) -> bool:
    """Whether request `later` should not be prefilled beside `first` (in one batch): `first` only fills
    the cache (Request.cache_only) with a state that is a prefix of `later`'s prompt, which `later`
    restores once it has landed."""
    return (
      first.cache_only
      and (first.tenant, first.cache_salt) == (later.tenant, later.cache_salt)
      and _is_prefix(list(first.prompt_ids), later.prompt_ids)
    )

  def snapshot(self, pf):
    """Mid-prompt snapshots of a long prefill every `snapshot_every` chunks, so later prompts sharing the
    prefix skip it."""
    if pf.next_chunk % self.snapshot_every:
      return
    rows, ids = [], []
    for i, r in enumerate(pf.reqs):
      done = r.progress.cached_tokens + pf.next_chunk * self.chunk_size
      if done < len(r.prompt_ids) and done >= self.min_tokens:
        rows.append(i)
        ids.append(((r.tenant, r.cache_salt), list(r.prompt_ids[:done])))
    self._gather_async(pf.state.model, rows, ids)

  def _gather_async(self, state, rows, ids):
    """ids: per row, ((tenant, cache_salt), token ids): the scope the state is cached in."""
    E = self.prefill_batch  # one compiled gather width; a short group is padded with its first row
    for g in range(0, len(rows), E):
      part = rows[g : g + E]
      idx = np.asarray(part + [part[0]] * (E - len(part)), np.int32)
      out = self.fns.gather(state, idx)
      for leaf in jax.tree.leaves(out):
        leaf.copy_to_host_async()
      self.copies.append((ids[g : g + E], out))

  def collect(self, block: bool):
    """Move the copies that have landed (all of them if block) into the cache."""
    while self.copies:
      ids, out = self.copies[0]
      if not block and not all(leaf.is_ready() for leaf in jax.tree.leaves(out)):
        return
      self.copies.popleft()
      host = {k: np.asarray(v) for k, v in out.to_dict().items()}
      axes = self.fns.axes.to_dict()
      for i, ((tenant, salt), seq) in enumerate(ids):
        row = {k: v[_row(axes[k], i)].copy() for k, v in host.items()}
        self.cache.put(seq, row, tenant=tenant, salt=salt)

  def flush(self, timeout: float = 30.0) -> bool:
    """Land every state still being copied and wait for the cache's file writes (shutdown): a finished
    conversation reaches --state_cache_dir. False if the writes did not finish within `timeout`."""
    self.collect(block=True)
    return self.cache.flush(timeout)

  def warm(self, table_model: DecodeState):
    """Compile the gathers (from the slot table and from a prefill batch) and the restore."""
    idx = np.zeros((self.prefill_batch,), np.int32)
    rows = self.fns.gather(self.fns.empty_prefill().model, idx)
    jax.block_until_ready(
      (self.fns.gather(table_model, idx), self.fns.load_prefill(jax.tree.map(np.asarray, rows)))
    )


def _is_prefix(seq, prompt) -> bool:
  return len(seq) < len(prompt) and seq[-1] == prompt[len(seq) - 1] and list(prompt[: len(seq)]) == seq


def _row(axis: int, i: int) -> tuple:
  """The index of sequence i in a leaf whose sequence axis is `axis`."""
  return (slice(None),) * axis + (i,)
