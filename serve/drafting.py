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


def lookup_drafts(prompt_ids: Sequence[int], output_ids: Sequence[int], k: int) -> list[int]:
  """`LookupIndex.drafts` of a fresh index (one lookup)."""
  return LookupIndex().drafts(prompt_ids, output_ids, k)


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
  median of the last `window` the engine measured (Engine._time_call). Until each call has `min_samples`
  of them a verify is taken to cost a generate step's, so the first verifies are tried and measured in
  service (calls timed at warm-up run on cold caches, several times slower than in steady serving)."""

  def __init__(self, window: int = 9, min_samples: int = 3):
    self.min_samples = min_samples
    self.seconds: dict[str, collections.deque[float]] = {
      kind: collections.deque(maxlen=window) for kind in ("gen", "verify")
    }
    self._ratio = 1.0

  def record(self, kind: str, seconds: float) -> None:
    self.seconds[kind].append(seconds)
    gen, ver = self.seconds["gen"], self.seconds["verify"]
    if min(len(gen), len(ver)) >= self.min_samples:  # kept here: the engine asks twice a step
      self._ratio = statistics.median(ver) / statistics.median(gen)

  def ratio(self) -> float:
    """t_verify / t_generate (1 until both are measured)."""
    return self._ratio

  def pays(self, n_active: int, extra: float) -> bool:
    """Whether a verify beats a generate step for n_active slots when their drafts are expected to add
    `extra` tokens to the n_active a step gives."""
    return extra > 0 and n_active + extra >= n_active * self.ratio()
