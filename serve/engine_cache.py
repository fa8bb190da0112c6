"""The engine's side of the state cache (serve.state_cache): restore a prompt's longest cached prefix into
its prefill row, and copy states out of the device without stalling the step: a jitted gather of the
rows into a small [L, E, ...] array (each leaf along its own sequence axis, `DecodeState.batch_axes`),
`copy_to_host_async`, and a read once it has landed. The cache holds each row in the state's stored (flat)
form, DecodeState.to_dict's, which its files keep.

When a slot's state is copied: its request finished (read back) or was cancelled (a stop string), before
anything can be inserted over it; the state has then consumed the prompt and one output token per generate
step dispatched since the insert. Long prefills leave snapshots every `snapshot_every` chunks.
"""

from __future__ import annotations

import collections
from typing import Any

import jax
import numpy as np

from laplace_jax.state import DecodeState
from serve.slots import SlotBackend


class EngineCacheMixin:
  """Methods of `serve.engine.Engine` that touch `self.cache` (None: every entry point is a no-op)."""

  _fresh_rows = None  # a fresh prefill batch's model state on the host, made at the first restore
  # Set by Engine.__init__:
  cache: Any  # serve.state_cache.StateCache, or None
  fns: SlotBackend
  _copies: collections.deque  # (ids, gathered rows) on their way to the host

  def _restore(self, reqs):
    """Each request's longest cached prefix (at least one prompt token is left to prefill, for the first
    token's logits); a prefill batch starting from those states, or None when nothing was cached."""
    if self._copies:
      self._collect_copies(block=False)
    if any(
      scope == (r.tenant, r.cache_salt) and self._is_prefix(seq, r.prompt_ids)
      for rows, _ in self._copies
      for scope, seq in rows
      for r in reqs
    ):
      # A state of this prompt's scope still on its way to the host is its prefix (an agent's next turn
      # arriving just after the last one finished): wait for it rather than prefill it again. Another
      # scope's copies never make a request wait (its time to first token would tell them apart).
      self._collect_copies(block=True)
    found = []
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
    host = {k: a.copy() for k, a in self._fresh_rows.to_dict().items()}
    axes = self.fns.axes.to_dict()
    for i, f in enumerate(found):
      if f is not None:
        for k in host:
          host[k][_row(axes[k], i)] = f[k]
    for r in reqs:
      for sib in r.siblings:
        sib.progress.cached_tokens = r.progress.cached_tokens
    self.stats["cached_prompt_tokens"] += sum(r.progress.cached_tokens for r in reqs)
    return self.fns.load_prefill(DecodeState.from_dict(host))

  @staticmethod
  def _is_prefix(seq, prompt) -> bool:
    return len(seq) < len(prompt) and seq[-1] == prompt[len(seq) - 1] and list(prompt[: len(seq)]) == seq

  def _copy_out(self, reqs):
    """Start copying the slot states of these requests to the host (their slots are still theirs: called
    before anything can be inserted over them). The state has consumed the prompt and one output token
    per generate step since the insert."""
    if self.cache is None or not reqs:
      return
    rows, ids = [], []
    for r in reqs:
      fed = self._gens - r.progress.gen_base
      if fed > len(r.progress.output_ids) or len(r.prompt_ids) + fed < self.cache_min_tokens:
        continue
      rows.append(r.progress.slot)
      ids.append(((r.tenant, r.cache_salt), list(r.prompt_ids) + r.progress.output_ids[:fed]))
    self._gather_async(self.table.model, rows, ids)

  def _snapshot(self, pf):
    """Mid-prompt snapshots of a long prefill, so later prompts sharing the prefix skip it."""
    C = self.cfg.chunk_size
    rows, ids = [], []
    for i, r in enumerate(pf.reqs):
      done = r.progress.cached_tokens + pf.next_chunk * C
      if done < len(r.prompt_ids) and done >= self.cache_min_tokens:
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
      self._copies.append((ids[g : g + E], out))

  def _collect_copies(self, block: bool):
    """Move the copies that have landed (all of them if block) into the cache."""
    while self._copies:
      ids, out = self._copies[0]
      if not block and not all(leaf.is_ready() for leaf in jax.tree.leaves(out)):
        return
      self._copies.popleft()
      host = {k: np.asarray(v) for k, v in out.to_dict().items()}
      axes = self.fns.axes.to_dict()
      for i, ((tenant, salt), seq) in enumerate(ids):
        row = {k: v[_row(axes[k], i)].copy() for k, v in host.items()}
        self.cache.put(seq, row, tenant=tenant, salt=salt)

  def flush_cache(self, timeout: float = 30.0) -> bool:
    """Land every state still being copied and wait for the cache's file writes (shutdown): a finished
    conversation reaches --state_cache_dir. False if the writes did not finish within `timeout`."""
    if self.cache is None:
      return True
    self._collect_copies(block=True)
    return self.cache.flush(timeout)

  def _warm_cache(self):
    """Compile the gathers (from the slot table and from a prefill batch) and the restore."""
    if self.cache is None:
      return
    idx = np.zeros((self.prefill_batch,), np.int32)
    rows = self.fns.gather(self.fns.empty_prefill().model, idx)
    jax.block_until_ready(
      (self.fns.gather(self.table.model, idx), self.fns.load_prefill(jax.tree.map(np.asarray, rows)))
    )


def _row(axis: int, i: int) -> tuple:
  """The index of sequence i in a leaf whose sequence axis is `axis`."""
  return (slice(None),) * axis + (i,)
