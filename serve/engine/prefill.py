"""Prefill: the prompts admitted together (`PrefillBatch`), prefilled chunk by chunk between decode steps from
their longest cached prefix, and what the insert calls that move their rows into slots take
(`insert_inputs`)."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

from serve.engine.engine_cache import StateCacheIO
from serve.engine.request import Request, members
from serve.slots.slot_functions import PrefillRows, PromptScores, SlotBackend, SlotSettings, host_settings


@dataclasses.dataclass
class PrefillBatch:
  """The prompts being prefilled together, chunk by chunk between decode steps, and the slots their decoding
  choices will take."""

  reqs: list[Request]  # leader requests, one prefill row each
  slots: list[int]  # slots reserved for their decoding choices
  scored: bool  # some prompt is echoed: run the scoring prefill
  n_chunks: int = 0  # chunks the longest uncached rest needs (set by `begin`)
  state: PrefillRows | None = None  # the prefill rows' state (None until `begin`)
  next_chunk: int = 0
  scores: list[PromptScores] = dataclasses.field(default_factory=list)  # per chunk, the scoring prefill's

  def begin(self, fns: SlotBackend, state_io: StateCacheIO | None, chunk_size: int):
    """Start from each prompt's longest cached prefix (with a state cache), else from empty rows."""
    state = None if state_io is None else state_io.restore(self.reqs)
    self.n_chunks = max(-(-(len(r.prompt_ids) - r.progress.cached_tokens) // chunk_size) for r in self.reqs)
    self.state = fns.empty_prefill() if state is None else state

  def run_chunk(self, fns: SlotBackend, params, P: int, C: int) -> int:
    """Prefill the next chunk of C tokens of each of the P rows; how many prompt tokens it took."""
    assert self.state is not None, "begin() first"
    tokens_PxC, lengths_P = np.zeros((P, C), np.int32), np.zeros((P,), np.int32)
    for i, r in enumerate(self.reqs):
      at = r.progress.cached_tokens + self.next_chunk * C
      piece = r.prompt_ids[at : at + C]
      tokens_PxC[i, : len(piece)] = piece
      lengths_P[i] = len(piece)
    if self.scored:
      self.state, scores = fns.prefill_chunk_scored(params, self.state, tokens_PxC, lengths_P)
      self.scores.append(scores)
    else:
      self.state = fns.prefill_chunk(params, self.state, tokens_PxC, lengths_P)
    self.next_chunk += 1
    return int(lengths_P.sum())

  def entries(self) -> list[tuple[int, int | None, Request]]:
    """(prefill row, slot or None, choice) per choice: n > 1 choices share their prompt's row; a choice with
    max_tokens 0 (echo scoring) takes no slot."""
    free = iter(self.slots)
    return [
      (i, next(free) if m.max_tokens > 0 else None, m) for i, r in enumerate(self.reqs) for m in members(r)
    ]


def slot_settings(m: Request, max_tokens: int) -> SlotSettings:
  """A choice's sampling settings as the slot table holds them, generating at most `max_tokens`."""
  return SlotSettings(
    temperature=m.temperature,
    top_k=m.top_k,
    top_p=m.top_p,
    seed=m.progress.seed & 0xFFFFFFFF,
    seed_hi=m.progress.seed >> 32,
    max_tokens=max_tokens,
    stop_ids=list(m.stop_ids),
    logprobs=-1 if m.logprobs is None else m.logprobs,
  )


def token_budget(m: Request, max_context: int | None) -> int:
  """The most tokens `m` may generate: its max_tokens, and with attention layers no more than the KV cache
  has room for (prompt + output <= max_context; reaching it finishes the request with 'length')."""
  return m.max_tokens if max_context is None else min(m.max_tokens, max_context - len(m.prompt_ids))


class InsertInputs(NamedTuple):
  """One insert call's host inputs for E entries (a prefill row into a slot each)."""

  row_E: np.ndarray  # int32: the prefill row of each entry
  slot_E: np.ndarray  # int32: its slot (>= n_slots: none, the entry is dropped)
  settings: SlotSettings  # its sampling settings
  allowed_ExG: np.ndarray | None  # int32 [E, G]: its first token's mask of allowed tokens (None: all allowed)


def insert_inputs(part: list, E: int, n_slots: int, n_stop: int, words: int, budget) -> InsertInputs:
  """The inputs of an insert of `part` (up to E of PrefillBatch.entries: (row, slot or None, choice)), each
  choice generating at most budget(choice) tokens; a constrained choice's first token takes its matcher's first
  mask (`words`: G, 32-bit words per mask)."""
  settings = host_settings([slot_settings(m, budget(m)) for _, _, m in part], E, n_stop)
  allowed_ExG = None
  if any(m.constraint is not None and slot is not None for _, slot, m in part):
    allowed_ExG = np.full((E, words), -1, np.int32)
    for j, (_, slot, m) in enumerate(part):
      if m.constraint is not None and slot is not None:
        m.constraint.fill(allowed_ExG[j])
  row_E, slot_E = np.zeros((E,), np.int32), np.full((E,), n_slots, np.int32)
  for j, (row, slot, _) in enumerate(part):
    row_E[j] = row
    if slot is not None:
      slot_E[j] = slot
  return InsertInputs(row_E, slot_E, settings, allowed_ExG)
