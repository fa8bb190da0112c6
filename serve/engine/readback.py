"""Read-back: what the engine makes of a dispatched call's one host copy. `read_call` turns a `Pending` insert,
generate or verify into each request's `Delivery` (its new tokens, whether a stop id or its token budget ended
it) and appends their logprobs; `score_prompts` turns a scoring prefill's chunks into the echoed prompts'
logprobs. The engine finishes the requests, counts and delivers."""

from __future__ import annotations

import enum
import logging
from typing import NamedTuple

import jax
import numpy as np

from serve.engine.drafting import Drafter, follow_prediction
from serve.engine.request import Delivery, Request, TokenLogprob, TopLogprob, members
from serve.slots.slot_functions import StepOutput, StepsOutput

log = logging.getLogger(__name__)


class CallKind(enum.Enum):
  """What a dispatched call was (its value: the name `serve.engine.drafting.VerifyCost` times it under)."""

  INSERT = "insert"  # prefilled rows written into slots, each choice's first token sampled
  GENERATE = "gen"  # every running slot advanced by one token, or by several (a call of decode_steps)
  VERIFY = "verify"  # every running slot advanced through its drafts, the accepted ones emitted


class Pending(NamedTuple):
  """A dispatched insert, generate or verify whose output is not read back yet."""

  kind: CallKind
  out: jax.Array  # the call's StepOutput (width > 1: StepsOutput), packed: one host copy reads it all
  owners: tuple  # entry i's request, or None
  width: int = 1  # tokens a slot may emit: a generate's steps, a verify's drafts + 1
  n_drafts: np.ndarray | None = None  # verify: each slot's drafts
  step: int = -1  # generate and verify: the engine's call count at dispatch
  timed: bool = False  # and whether its time is its own (no prefill was dispatched beside it)

  def runs_finished_slots_on(self, hold_ended: bool) -> bool:
    """Whether this call feeds a slot whose next input ended it (a verify does, a single generate step
    unless the slot functions hold ended slots; a generate of several steps leaves such a slot as it is)."""
    return self.kind is CallKind.VERIFY or (
      self.kind is CallKind.GENERATE and self.width == 1 and not hold_ended
    )


class CallRead(NamedTuple):
  """What one call gave its requests."""

  deliveries: list[Delivery]  # one per request still running in it; reason set: the call ended it
  tokens: int  # output tokens delivered
  drafted: int  # drafts it verified
  accepted: int  # and of those, the ones taken


def scored(logprob, top_ids, top_logprobs) -> TokenLogprob:
  """A TokenLogprob from one position's host arrays: the token's logprob, the top-n ids and theirs."""
  return TokenLogprob(
    float(logprob), tuple(TopLogprob(int(t), float(v)) for t, v in zip(top_ids, top_logprobs))
  )


def read_call(item: Pending, packed: np.ndarray, now: float, advanced: bool = False) -> CallRead:
  """Each running request's new tokens from a call's host copy `packed` (read at `now`): output ids,
  logprobs, first-token time, place in its prediction, draft record, its grammar advanced (unless
  `advanced`: already done), and a finish reason where its last token ended it ('stop': a stop id,
  'length': its budget)."""
  multi = StepsOutput.unpack(packed, item.width) if item.width > 1 else None
  steps = StepOutput.unpack(packed) if multi is None else multi.steps  # multi: [S, width] fields
  deliveries, n_tokens, drafted, accepted = [], 0, 0, 0
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
        p.token_logprobs.append(scored(steps.logprob[i], steps.top_ids[i], steps.top_logprobs[i]))
    else:
      n = emitted[i]
      toks, done = tokens[i][:n], dones[i][n - 1]
      if item.kind is CallKind.VERIFY:
        # It fed slot i's state n tokens at once (as n - 1 more steps would have) and took n - 1 drafts.
        assert item.n_drafts is not None
        drafted += int(item.n_drafts[i])
        accepted += n - 1
        Drafter.learn(p, int(item.n_drafts[i]), n)
      if r.logprobs is not None:
        p.token_logprobs.extend(
          scored(steps.logprob[i, j], steps.top_ids[i, j], steps.top_logprobs[i, j]) for j in range(n)
        )
    p.output_ids.extend(toks)
    if r.constraint is not None and not advanced:
      advance_grammar(r, toks)
    if p.first_token_at is None:
      p.first_token_at = now
    if r.prediction_ids:
      follow_prediction(p, r.prediction_ids, toks)
    n_tokens += len(toks)
    reason = None if not done else "stop" if toks[-1] in r.stop_ids else "length"
    deliveries.append(Delivery(r, toks, reason))
  return CallRead(deliveries, n_tokens, drafted, accepted)


def advance_grammars(item: Pending, packed: np.ndarray):
  """Advance the matcher of each constrained request in a call by the tokens it emitted there (before its
  read-back: the next step's masks need them)."""
  emitted: list | None = None  # each entry's tokens
  for i, r in enumerate(item.owners):
    if r is not None and r.constraint is not None and r.progress.finish_reason is None:
      if emitted is None:
        if item.width == 1:
          emitted = [[t] for t in StepOutput.unpack(packed).token.tolist()]
        else:
          multi = StepsOutput.unpack(packed, item.width)
          emitted = [multi.tokens_of(s) for s in range(len(item.owners))]
      advance_grammar(r, emitted[i])


def advance_grammar(r: Request, toks: list[int]):
  """Advance r's matcher by the tokens it emitted (each sampled under its mask; a grammar that has ended
  takes no more, not even the stop id it allowed)."""
  assert r.constraint is not None
  taken = r.constraint.advance(toks)
  if any(t != r.constraint.stop_id for t in toks[taken:]):
    log.warning("request %d: its grammar refused tokens %s it was masked for", r.id, toks[taken:])


def score_prompts(reqs: list[Request], chunk_scores: list, chunk_size: int):
  """Echo: each echoed prompt token's logprob given the tokens before it, and the top-n there, from the scoring
  prefill's PromptScores per chunk (row i: reqs[i]), set on every choice of the prompt."""
  C = chunk_size
  chunks = [jax.tree.map(np.asarray, sc) for sc in chunk_scores]
  for i, r in enumerate(reqs):
    if not r.echo:
      continue
    out: list[TokenLogprob | None] = [None]
    for p in range(1, len(r.prompt_ids)):
      sc, j = chunks[p // C], p % C
      out.append(scored(sc.logprob[i, j], sc.top_ids[i, j], sc.top_logprobs[i, j]))
    for m in members(r):
      m.progress.prompt_logprobs = out
