"""Where the engine's drafted tokens come from, and when verifying them pays.

Drafts come from a request's prediction (OpenAI's Predicted Outputs, followed as the output proceeds) or
from prompt lookup (what followed the latest earlier occurrence of the sequence's last tokens). A verify
call runs every slot through K + 1 positions; what it costs against a generate step depends on the model,
the slot count and the machine (a step or less where a step is bound by reading the weights, several where
it is not). `VerifyCost` measures both calls as the engine runs them and verifies only when the tokens the
drafts are expected to give pay for that cost; the tokens are the same either way.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
from collections.abc import Sequence

import numpy as np

LOOKUP_WINDOW = 4096  # prompt lookup searches this many of a sequence's latest tokens


class PredictionIndex:
  """Where a prediction goes on after the first occurrence of each of its 1-, 2- and 3-grams, built once per
  request: finding the output's place in the prediction again is a few dict lookups, not a pass over the
  prediction (which may be thousands of tokens, for every slot, every step)."""

  def __init__(self, prediction: Sequence[int]):
    self.after: dict[tuple[int, ...], int] = {}
    p = tuple(prediction)
    for n in (1, 2, 3):
      for i in range(len(p) - n + 1):
        self.after.setdefault(p[i : i + n], i + n)

  def find(self, tail: Sequence[int]) -> int | None:
    """The index just past the first occurrence of the last 3 tokens of `tail` (else its last 2, else its
    last 1), or None if none occurs."""
    for n in range(min(3, len(tail)), 0, -1):
      at = self.after.get(tuple(tail[-n:]))
      if at is not None:
        return at
    return None


def follow_prediction(progress, prediction: Sequence[int], new_tokens: list[int]) -> None:
  """Move `progress.prediction_at` past the new output tokens while they are the prediction's next ones
  (counting each in `progress.accepted_prediction_tokens`); at the first that is not, look for where the
  output's last tokens (3, else 2, else 1) stand in the prediction and go on from there (None: nowhere, no
  drafts until a later token is found)."""
  for t in new_tokens:
    at = progress.prediction_at
    if at is not None and at < len(prediction) and prediction[at] == t:
      progress.prediction_at = at + 1
      progress.accepted_prediction_tokens += 1
    else:
      progress.prediction_at = None
  if progress.prediction_at is None:
    if progress.prediction_index is None:
      progress.prediction_index = PredictionIndex(prediction)
    progress.prediction_at = progress.prediction_index.find(progress.output_ids[-3:])


class LookupIndex:
  """Prompt lookup over one sequence (its prompt, then its output): where each 1-, 2- and 3-gram of it last
  ended, kept up to date as tokens arrive, so a lookup costs a few dict operations instead of a pass over
  the last LOOKUP_WINDOW tokens (the first lookup indexes the window at once, in C-level loops)."""

  def __init__(self) -> None:
    self.after: dict[tuple[int, ...], int] = {}  # n-gram -> the index just past its latest occurrence
    self.upto = 0  # n-grams ending before this index are in `after`

  def drafts(self, prompt_ids: Sequence[int], output_ids: Sequence[int], k: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the sequence's last 3 (else 2, else 1)
    tokens within its last LOOKUP_WINDOW tokens, or []."""
    T = len(prompt_ids) + len(output_ids)
    start = max(0, T - LOOKUP_WINDOW)  # the window's first index
    # Every n-gram that ends before the last token (an earlier occurrence), in order: the latest one wins.
    lo = max(start, self.upto)
    if T - 1 > lo:
      base = max(0, lo - 2)
      w = _tokens(prompt_ids, output_ids, base, T - 1)
      for n in (1, 2, 3):
        first = max(lo, base + n - 1)  # the first end index to add (its n-gram starts at or after base)
        grams = zip(*(w[first - n + 1 - base + i :] for i in range(n)))
        self.after.update(zip(grams, range(first + 1, T)))
    self.upto = max(lo, T - 1)
    for n in range(min(3, T), 0, -1):
      at = self.after.get(tuple(_tokens(prompt_ids, output_ids, T - n, T)))
      if at is not None and at - n >= start:  # the latest occurrence lies in the window
        return _tokens(prompt_ids, output_ids, at, min(at + k, T))
    return []


def _tokens(prompt_ids: Sequence[int], output_ids: Sequence[int], lo: int, hi: int) -> list[int]:
  """Tokens lo .. hi - 1 of the sequence prompt + output."""
  P = len(prompt_ids)
  if hi <= P:
    return list(prompt_ids[lo:hi])
  if lo >= P:
    return list(output_ids[lo - P : hi - P])
  return [*prompt_ids[lo:], *output_ids[: hi - P]]


# A request's record counts its recent drafts most: each output token it makes weighs what came before by
# FORGET, so a request whose drafts failed is tried again some tokens later (an output can leave its
# prediction and come back; a sequence can start quoting). PRIOR: pseudo-tries that succeeded fully, so an
# untried request's drafts count as right and are tried once where they could pay.
FORGET = 0.95
PRIOR = 0.5


@dataclasses.dataclass
class DraftRecord:
  """One request's drafting so far, from which the cost rule estimates what its next drafts are worth.
  Counts are weighted (FORGET); `at` is the request's output length when they were last updated."""

  verifies: float = 0.0  # verify calls that fed it drafts
  accepted: float = 0.0  # drafts they took
  lookups: float = 0.0  # prompt lookups made for it
  found: float = 0.0  # that found drafts
  at: int = 0

  def _weight(self, now: int) -> float:
    return FORGET ** max(0, now - self.at)

  def _age(self, now: int) -> None:
    w = self._weight(now)
    self.verifies *= w
    self.accepted *= w
    self.lookups *= w
    self.found *= w
    self.at = now

  def add_verify(self, accepted: int, now: int) -> None:
    """A verify took `accepted` of its drafts; the output is now `now` tokens long."""
    self._age(now)
    self.verifies += 1
    self.accepted += accepted

  def add_lookup(self, found: bool, now: int) -> None:
    self._age(now)
    self.lookups += 1
    self.found += found

  def expected_extra(self, n_drafts: int, now: int, may_find_none: bool = False) -> float:
    """Tokens beyond a generate step's one that verifying n_drafts drafts is expected to add, at output length
    `now`: the drafts its recent verifies took on average (not a per-token rate: a prediction's drafts tend
    to be all right or all wrong), at most n_drafts. may_find_none: a prompt lookup not yet made, weighted
    by the share of its recent lookups that found drafts."""
    w = self._weight(now)
    extra = min(n_drafts, (self.accepted * w + PRIOR * n_drafts) / (self.verifies * w + PRIOR))
    if may_find_none:
      extra *= (self.found * w + PRIOR) / (self.lookups * w + PRIOR)
    return extra


class VerifyCost:
  """Seconds per generate step and per verify call, measured as the engine runs them, and the rule that
  decides between them: verify when the tokens it is expected to give per second beat a generate step's,
  (active slots + Σ DraftRecord.expected_extra) · t_generate >= active slots · t_verify. Each time is the
  median of the last `window` the engine measured (Drafter.time_call) for calls over the same bucket of
  rows (serve.slots.slot_functions.step_rows): the two calls' costs and their ratio change with it. Until a bucket's calls
  each have `min_samples` of them a verify is taken to cost a generate step's, so the first verifies are
  tried and measured in service (calls timed at warm-up run on cold caches, several times slower than in
  steady serving)."""

  def __init__(self, window: int = 9, min_samples: int = 3):
    self.window, self.min_samples = window, min_samples
    self.seconds: dict[tuple[str, int], collections.deque[float]] = {}  # (kind, bucket) -> recent times
    self._ratio: dict[int, float] = {}  # bucket -> t_verify / t_generate

  def record(self, kind: str, seconds: float, bucket: int = 0) -> None:
    self.seconds.setdefault((kind, bucket), collections.deque(maxlen=self.window)).append(seconds)
    gen, ver = (self.seconds.get((k, bucket), ()) for k in ("gen", "verify"))
    if min(len(gen), len(ver)) >= self.min_samples:  # kept here: the engine asks twice a step
      self._ratio[bucket] = statistics.median(ver) / statistics.median(gen)

  def ratio(self, bucket: int = 0) -> float:
    """t_verify / t_generate over `bucket` rows (1 until both are measured)."""
    return self._ratio.get(bucket, 1.0)

  def ratios(self) -> dict[int, float]:
    """{bucket: t_verify / t_generate} of the buckets measured so far."""
    return dict(self._ratio)

  def pays(self, n_active: int, extra: float, bucket: int = 0) -> bool:
    """Whether a verify beats a generate step for n_active slots (run over `bucket` rows) when their drafts
    are expected to add `extra` tokens to the n_active a step gives."""
    return extra > 0 and n_active + extra >= n_active * self.ratio(bucket)


class Drafter:
  """The engine's speculative half, for K drafts per slot: which requests may draft, each slot's drafts for the
  next step (from its prediction, or with `prompt_lookup` from its own tokens), whether verifying them pays
  (`rule`: 'cost' or 'always'; `cost` is measured from the engine's read-backs, `time_call`), and what each
  verify taught the request's record. The engine owns one and hands it its slots' requests."""

  def __init__(self, k: int, *, prompt_lookup: bool, rule: str, max_context: int | None):
    self.k, self.prompt_lookup, self.rule, self.max_context = k, prompt_lookup, rule, max_context
    self.cost = VerifyCost()  # what a verify and a generate step cost here, measured as they run
    self._last_read: tuple[int, float] | None = None  # the last generate or verify read back: (step, when)

  def worth_reading_back(self, slot_req: Sequence, n_active: int, bucket: int = 0) -> bool:
    """Whether some request may draft and its drafts could pay: only then are the steps in flight read back
    to build drafts. A prediction that the output has left (prediction_at None) drafts nothing, so generate
    steps go on, pipelined, until a token read back finds its place in the prediction again; so do they
    while even K drafts for every slot that may draft (before its lookup is made) would not pay."""
    may, n_may = [], []  # the requests that may draft, and at most how many tokens
    for r in slot_req:
      if r is None or r.progress.finish_reason is not None:
        continue
      at = r.progress.prediction_at
      if r.prediction_ids and at is not None and at < len(r.prediction_ids):
        may.append(r)
        n_may.append(min(self.k, len(r.prediction_ids) - at))
      elif not r.prediction_ids and self.prompt_lookup:
        may.append(r)
        n_may.append(self.k)
    return bool(may) and self.pays(may, n_may, n_active, bucket, upfront=True)

  def drafts(
    self, slot_req: Sequence, n_active: int, bucket: int = 0
  ) -> tuple[np.ndarray, np.ndarray] | None:
    """(drafts [S, K], n_drafts [S]) for the next step from the outputs read back so far, or None: a plain
    generate step (no slot drafts, or the drafts would not pay). With attention layers every slot's KV cache
    must have room for K + 1 more tokens."""
    K = self.k
    drafts, n = np.zeros((len(slot_req), K), np.int32), np.zeros((len(slot_req),), np.int32)
    for s, r in enumerate(slot_req):
      if r is None or r.progress.finish_reason is not None:
        continue
      p = r.progress
      if self.max_context is not None and len(r.prompt_ids) + len(p.output_ids) + K + 1 > self.max_context:
        return None
      if r.prediction_ids:
        d = [] if p.prediction_at is None else list(r.prediction_ids[p.prediction_at : p.prediction_at + K])
      else:
        d = p.lookup_index.drafts(r.prompt_ids, p.output_ids, K)
        p.drafts.add_lookup(bool(d), len(p.output_ids))
      drafts[s, : len(d)], n[s] = d, len(d)
    drafting = [r for r, k in zip(slot_req, n) if k]
    if not drafting or not self.pays(drafting, n[n > 0].tolist(), n_active, bucket):
      return None
    return drafts, n

  def pays(
    self, reqs: Sequence, n_drafts: Sequence[int], n_active: int, bucket: int = 0, upfront: bool = False
  ) -> bool:
    """Whether verifying n_drafts[i] drafts of each reqs[i] beats a generate step over n_active slots (in a
    call over `bucket` rows); upfront: before the lookups are made, K drafts each where they find any."""
    if self.rule == "always":
      return True
    extra = sum(
      r.progress.drafts.expected_extra(
        n, len(r.progress.output_ids), may_find_none=upfront and not r.prediction_ids
      )
      for r, n in zip(reqs, n_drafts)
    )
    return self.cost.pays(n_active, extra, bucket)

  def time_call(self, kind: str, step: int, timed: bool, now: float, steps: int = 1, bucket: int = 0) -> None:
    """A generate or verify call's cost as the engine runs it (one call in flight, host work beside it): the
    time from the previous call's read-back to this one's (`now`, call number `step`), when the two calls
    follow each other and no prefill ran beside this one (`timed`); a generate of several `steps`, per step;
    `bucket`: the rows it ran."""
    if timed and self._last_read is not None and self._last_read[0] == step - 1:
      self.cost.record(kind, (now - self._last_read[1]) / steps, bucket)
    self._last_read = (step, now)

  def forget_timing(self) -> None:
    """The engine reset after a failed step: that step's time is no call's cost."""
    self._last_read = None

  @staticmethod
  def learn(progress, drafted: int, emitted: int) -> None:
    """A verify fed a request `drafted` drafts and it emitted `emitted` tokens (emitted - 1 drafts taken)."""
    if drafted:
      progress.drafts.add_verify(emitted - 1, len(progress.output_ids) + emitted)


def draft_masks(reqs: Sequence, drafts_BxJ: np.ndarray, n_B: np.ndarray, words: int) -> np.ndarray | None:
  """A verify's masks of allowed tokens, int32 [B, J, G] (drafts_BxJ: [B, J - 1], each row's drafts; G: 32-bit
  words of a bitmask), for rows whose requests are `reqs`; None: no row is constrained. Position j of a constrained row
  allows what its grammar allows after its first j drafts (its matcher advanced through them, then rolled
  back). Its drafts are cut (n_B, in place) before the first its grammar forbids, which could never be
  accepted."""
  if not any(r is not None and r.constraint is not None for r in reqs):
    return None
  allowed_BxJxG = np.full((len(reqs), drafts_BxJ.shape[1] + 1, words), -1, np.int32)
  for i, r in enumerate(reqs):
    if r is None or r.constraint is None:
      continue
    m, n = r.constraint, 0
    m.fill(allowed_BxJxG[i, 0])
    while n < n_B[i] and m.advance([int(drafts_BxJ[i, n])]) == 1:
      n += 1
      m.fill(allowed_BxJxG[i, n])
    m.rollback(n)
    n_B[i] = n
  return allowed_BxJxG
