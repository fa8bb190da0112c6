"""Where the engine's drafted tokens come from, and when verifying them pays.

Drafts come from a request's prediction (OpenAI's Predicted Outputs, followed as the output proceeds) or
from prompt lookup (what followed the latest earlier occurrence of the sequence's last tokens). A verify
call runs every slot through K + 1 positions, so it costs more than a generate step; how much more depends
on the model, the slot count and the machine (near one step where a step is memory-bound, several where it
is not). `VerifyCost` measures both calls as the engine runs them and verifies only when the tokens the
drafts are expected to give pay for that cost; the tokens are the same either way.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

import numpy as np

LOOKUP_WINDOW = 4096  # prompt lookup searches this many of a sequence's latest tokens


def follow_prediction(progress, prediction: Sequence[int], new_tokens: list[int]) -> None:
  """Move `progress.prediction_at` past the new output tokens while they are the prediction's next ones; at
  the first that is not, look for where the output's last tokens (3, else 2, else 1) stand in the prediction
  and go on from there (None: nowhere, no drafts until a later token is found)."""
  for t in new_tokens:
    at = progress.prediction_at
    progress.prediction_at = (
      at + 1 if at is not None and at < len(prediction) and prediction[at] == t else None
    )
  if progress.prediction_at is None:
    tail = np.asarray(progress.output_ids[-3:])
    progress.prediction_at = _after_ngram(np.asarray(prediction), tail, latest=False)


def lookup_drafts(prompt_ids: Sequence[int], output_ids: list[int], k: int) -> list[int]:
  """Prompt lookup: up to k tokens that followed the latest earlier occurrence of the sequence's last 3
  (else 2, else 1) tokens within its last LOOKUP_WINDOW tokens (prompt and output), or []."""
  seq = np.asarray([*prompt_ids[-LOOKUP_WINDOW:], *output_ids][-LOOKUP_WINDOW:], np.int64)
  at = _after_ngram(seq[:-1], seq[-3:], latest=True)  # an earlier occurrence: it ends before the last token
  return [] if at is None else seq[at : at + k].tolist()


def _after_ngram(seq: np.ndarray, tail: np.ndarray, *, latest: bool) -> int | None:
  """Where `seq` goes on after an occurrence of the last 3 tokens of `tail` (else its last 2, else its last
  1): the index just past the first occurrence, or the latest with `latest`; None if none occurs."""
  for n in range(min(3, len(tail)), 0, -1):
    L = len(seq) - n + 1  # where an occurrence may start
    if L <= 0:
      continue
    hit = np.ones(L, bool)
    for j, t in enumerate(tail[-n:]):
      hit &= seq[j : j + L] == t
    found = np.flatnonzero(hit)
    if len(found):
      return int(found[-1 if latest else 0]) + n
  return None


def chance(tried: int, succeeded: int) -> float:
  """The estimated chance that the next try succeeds, from a record of tries (Laplace's rule, (succeeded + 1)
  / (tried + 2)). Untried counts as certain (1.0): a request's drafts are tried once where they could pay,
  and its own record decides after."""
  if tried == 0:
    return 1.0
  return (succeeded + 1) / (tried + 2)


def expected_emitted(n_drafts: int, alpha: float) -> float:
  """Tokens a slot expects from one verify of n_drafts drafts, each accepted with chance alpha while the ones
  before it were: 1 + alpha + ... + alpha^n_drafts (a slot without drafts emits its one token)."""
  if alpha >= 1.0:
    return n_drafts + 1.0
  return (1.0 - alpha ** (n_drafts + 1)) / (1.0 - alpha)


@dataclasses.dataclass
class DraftRecord:
  """One request's drafting so far, from which the cost rule estimates what its next drafts are worth."""

  drafted: int = 0  # drafts verified (from its prediction or prompt lookup)
  accepted: int = 0  # and taken
  lookups: int = 0  # prompt lookups tried
  found: int = 0  # that found drafts

  def expected_extra(self, n_drafts: int, may_find_none: bool = False) -> float:
    """Tokens beyond a generate step's one that verifying n_drafts drafts is expected to add; may_find_none:
    the drafts are a prompt lookup not yet made, weighted by the chance that it finds any."""
    extra = expected_emitted(n_drafts, chance(self.drafted, self.accepted)) - 1.0
    return extra * chance(self.lookups, self.found) if may_find_none else extra


class VerifyCost:
  """Seconds per generate step and per verify call, measured as the engine runs them, and the rule that
  decides between them: verify when the tokens it is expected to emit per second beat a generate step's,
  Σ_slots expected_emitted · t_generate >= active slots · t_verify. Each time is the median of the last
  `window` the engine measured (Engine._time_call). Until each call has `min_samples` of them a verify is
  taken to cost a generate step's, so the first verifies are tried and measured (timing them when the
  engine warms up measured cold caches, several times the steady cost)."""

  def __init__(self, window: int = 9, min_samples: int = 3):
    self.min_samples = min_samples
    self.seconds: dict[str, collections.deque[float]] = {
      kind: collections.deque(maxlen=window) for kind in ("gen", "verify")
    }

  def record(self, kind: str, seconds: float) -> None:
    self.seconds[kind].append(seconds)

  def ratio(self) -> float:
    """t_verify / t_generate (1 until both are measured)."""
    gen, ver = self.seconds["gen"], self.seconds["verify"]
    if min(len(gen), len(ver)) < self.min_samples:
      return 1.0
    return float(np.median(ver)) / float(np.median(gen))

  def pays(self, n_active: int, extra: float) -> bool:
    """Whether a verify beats a generate step for n_active slots when their drafts are expected to add
    `extra` tokens to the n_active a step gives."""
    return extra > 0 and n_active + extra >= n_active * self.ratio()
