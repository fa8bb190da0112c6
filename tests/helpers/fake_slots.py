"""A fake of `serve.slots.slot_functions.SlotFunctions` in numpy: the engine's scheduling, fairness, cancellation, state
cache and HTTP paths run over it without compiling a model (`Engine(..., make_slots=FakeSlots)`).

Its "model" is a hash: a sequence's state is the number of tokens it consumed and a rolling hash of them,
and the next-token distribution after a state puts `CANDIDATES` tokens derived from the hash at fixed,
decreasing logits, every other token at `FLOOR` (a mass under 1e-8: sampling draws among the candidates). Everything the engine relies on holds as with the real model:
a sequence's tokens depend on its own prompt, seed and position only (never on its slot or neighbours),
greedy decoding is deterministic, seeded sampling reproducible, and a state restored from the cache
continues exactly as a full prefill would. `reference` decodes one request the same way, without the
engine, to compare against.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from laplace_jax.model.state import DecodeState
from serve.slots.slot_functions import (
  N_TOP,
  PrefillRows,
  PromptScores,
  SlotSettings,
  SlotTable,
  StepOutput,
  StepsOutput,
  bucket_sizes,
  host_settings,
  table_axes,
)

CANDIDATES = 16
# The logits of the candidates, most likely first: a softmax over them is far from one-hot, so sampling,
# top-k and top-p all change which token comes out.
LOGITS = -0.5 * np.arange(CANDIDATES, dtype=np.float64)
FLOOR = -30.0
_M = (
  1 << 31
) - 1  # the hash's modulus (a Mersenne prime under 2**31: the hash survives the int32 of a gather)


def _mix(x):
  """splitmix64's finaliser over uint64 arrays: well-spread bits from (seed, position) counters."""
  x = np.asarray(x, np.uint64)
  with np.errstate(over="ignore"):
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def consume(h, tok):
  """The hash after feeding token(s) `tok` to a state of hash h (elementwise)."""
  return (np.asarray(h, np.int64) * 1_000_003 + np.asarray(tok, np.int64) + 1) % _M


def candidates(h, valid_vocab: int):
  """[..., CANDIDATES] token ids after states of hash h, most likely first (distinct for vocabularies of at
  least CANDIDATES tokens)."""
  h = np.asarray(h, np.int64)[..., None]
  base = _mix(h.astype(np.uint64)).astype(np.uint64) % np.uint64(valid_vocab)
  return ((base + np.arange(CANDIDATES, dtype=np.uint64) * np.uint64(7919)) % np.uint64(valid_vocab)).astype(
    np.int32
  )


def uniforms(seed, seed_hi, index):
  """One U[0, 1) draw per (seed, seed_hi, index), as the real sampler's depends on those only."""
  key = _mix(np.asarray(seed, np.uint64) ^ (np.asarray(seed_hi, np.uint64) << np.uint64(32)))
  with np.errstate(over="ignore"):
    bits = _mix(key + np.asarray(index, np.uint64) * np.uint64(0x9E3779B97F4A7C15))
  return (bits >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def allowed_bits(allowed_SxG, n: int) -> np.ndarray:
  """bool [S, n]: the tokens < n each row of an int32 bitmask allows (serve.slots.sampling.masked's layout)."""
  return np.unpackbits(np.ascontiguousarray(allowed_SxG, np.int32).view(np.uint8), -1, bitorder="little")[
    :, :n
  ].astype(bool)


def sample(h, settings: SlotSettings, index, valid_vocab: int, allowed_SxG=None):
  """Each row's token after a state of hash h[i] under its settings, its index-th draw, among the tokens
  allowed_SxG allows (None: all), as the real sampler renormalises over them: the allowed candidates
  (top-k counts those); a row that allows none of its candidates gets its lowest allowed id."""
  cand = candidates(h, valid_vocab)
  ok = np.ones(cand.shape, bool)
  if allowed_SxG is not None:
    bits = allowed_bits(allowed_SxG, valid_vocab)
    ok = np.take_along_axis(bits, cand, 1)
  t = np.asarray(settings.temperature, np.float64)[:, None]
  greedy = t[:, 0] == 0
  w = np.where(ok, np.exp(LOGITS[None] / np.where(greedy[:, None], 1.0, t)), 0.0)
  k = np.asarray(settings.top_k)[:, None]
  w = np.where((k == 0) | (np.cumsum(ok, 1) <= k), w, 0.0)
  some = ok.any(1)
  p = w / np.where(some, w.sum(1), 1.0)[:, None]
  before = np.cumsum(p, 1) - p  # mass of the more likely candidates: top-p keeps those with less than top_p
  w = np.where(before < np.asarray(settings.top_p, np.float64)[:, None], w, 0.0)
  cdf = np.cumsum(w, 1) / np.where(some, w.sum(1), 1.0)[:, None]
  u = uniforms(settings.seed, settings.seed_hi, index)
  pick = np.minimum((cdf <= u[:, None]).sum(1), CANDIDATES - 1)
  pick = np.where(greedy, ok.argmax(1), pick)
  tok = cand[np.arange(len(pick)), pick]
  if not some.all():
    tok = np.where(some, tok, bits.argmax(1)).astype(np.int32)
  return tok


def logprobs(h, tok, valid_vocab: int):
  """(logprob of tok, top-N logprobs, top-N ids) after states of hash h, as `serve.slots.sampling.logprobs`."""
  cand = candidates(h, valid_vocab)
  lse = np.log(np.exp(LOGITS).sum() + (valid_vocab - CANDIDATES) * np.exp(FLOOR))
  lp = LOGITS - lse
  hit = cand == np.asarray(tok)[:, None]
  chosen = np.where(hit.any(1), (lp[None] * hit).sum(1), FLOOR - lse)
  top = np.broadcast_to(lp[:N_TOP], (len(cand), N_TOP))
  return chosen.astype(np.float32), top.astype(np.float32), cand[:, :N_TOP]


def reference(prompt, max_tokens: int, valid_vocab: int, *, temperature=0.0, top_k=0, top_p=1.0, seed=0):
  """The tokens one request gets from the fake, decoded alone (no stop ids)."""
  h = np.zeros((1,), np.int64)
  for t in prompt:
    h = consume(h, t)
  row = SlotSettings(
    temperature=temperature,
    top_k=top_k,
    top_p=top_p,
    seed=seed & 0xFFFFFFFF,
    seed_hi=seed >> 32,
    max_tokens=max_tokens,
    stop_ids=[],
    logprobs=-1,
  )
  s = host_settings([row], 1, 1)  # as the engine builds an insert's settings
  out = []
  for i in range(max_tokens):
    tok = sample(h, s, np.int64([i]), valid_vocab)
    out.append(int(tok[0]))
    h = consume(h, tok)
  return out


def _ends(tok, index, settings: SlotSettings):
  """Whether output token tok, the index-th, ends its slot (a stop id, or max_tokens reached)."""
  return (tok[:, None] == settings.stop_ids).any(-1) | (index + 1 >= settings.max_tokens)


def _keep(ended_S, new, old, axis: int):
  """old where the slot ended, else new (ended_S along `axis`)."""
  shape = [1] * new.ndim
  shape[axis] = len(ended_S)
  return np.where(ended_S.reshape(shape), old, new)


class FakeSlots:
  """`serve.slots.slot_functions.SlotFunctions`' interface (the engine's prefill / insert / generate, the state cache's
  gather and load) over hash states in numpy; constructed with SlotFunctions' arguments."""

  def __init__(
    self,
    model,
    cfg,
    *,
    n_slots,
    prefill_batch,
    n_stop,
    valid_vocab,
    mesh=None,
    max_context=None,
    hold_ended=False,
    buckets="doubling",
    step_s=0.0,
  ):
    del model, mesh, max_context
    self.hold_ended = hold_ended
    self.step_s = step_s  # seconds each generate step sleeps, as a model's step takes time
    self.cfg, self.n_slots, self.prefill_batch, self.n_stop = cfg, n_slots, prefill_batch, n_stop
    self.words = -(-cfg.vocab_size // 32)
    self.steps_run: list[int] = []  # each generate call's steps (a masked step's decode counts as one)
    self.masked_rows = 0  # rows sampled under a mask that is not all ones (inserts and steps)
    self.n_devices, self.buckets = 1, bucket_sizes(n_slots) if buckets == "doubling" else (n_slots,)
    self.rows_run: list[int] = []  # each generate call's row count (its bucket)
    self.valid_vocab = valid_vocab
    self.state_shape = jax.eval_shape(lambda: self._state(1))
    self.axes = self.state_shape.batch_axes()
    nbytes = lambda tree: sum(x.nbytes for x in jax.tree.leaves(tree))
    self.state_bytes_per_slot = nbytes(self._state(1))
    self.table_bytes = nbytes(self.empty_table())
    self.calls = {"prefill": 0, "insert": 0, "generate": 0}

  @staticmethod
  def _state(batch):
    # The hash lives in `conv` ([1, B, 1, 1]) so that the state has DecodeState's structure and batch axes.
    return DecodeState(pos=np.zeros((batch,), np.int32), conv=np.zeros((1, batch, 1, 1), np.int64))

  def empty_table(self) -> SlotTable:
    S = self.n_slots
    return SlotTable(
      model=self._state(S),
      tokens=np.zeros((S,), np.int32),
      last_output_index=np.zeros((S,), np.int32),
      settings=SlotSettings.inert(S, self.n_stop),
    )

  def empty_prefill(self) -> PrefillRows:
    return PrefillRows(model=self._state(self.prefill_batch), logits=None)

  def load_prefill(self, state) -> PrefillRows:
    return PrefillRows(model=jax.tree.map(np.array, state), logits=None)

  def gather(self, state, rows_E):
    # A device array, as the real gather's: the engine copies it to the host asynchronously.
    return jax.tree.map(lambda x, axis: jax.numpy.asarray(np.take(x, rows_E, axis=axis)), state, self.axes)

  def prefill_chunk(self, params, pf: PrefillRows, tokens_PxC, lengths_P) -> PrefillRows:
    return self.prefill_chunk_scored(params, pf, tokens_PxC, lengths_P)[0]

  def prefill_chunk_scored(self, params, pf: PrefillRows, tokens_PxC, lengths_P):
    del params
    self.calls["prefill"] += 1
    tokens, lengths = np.asarray(tokens_PxC), np.asarray(lengths_P)
    P, C = tokens.shape
    h = pf.model.conv[0, :, 0, 0].copy()
    scores = [logprobs(h, tokens[:, 0], self.valid_vocab)]  # token j scored after the state before it
    for j in range(C):
      live = j < lengths
      h = np.where(live, consume(h, tokens[:, j]), h)
      if j + 1 < C:
        scores.append(logprobs(h, tokens[:, j + 1], self.valid_vocab))
    state = DecodeState(pos=pf.model.pos + lengths.astype(np.int32), conv=h.reshape(1, P, 1, 1))
    chosen, top, ids = (np.stack(x, 1) for x in zip(*scores))
    return PrefillRows(model=state, logits=None), PromptScores(logprob=chosen, top_logprobs=top, top_ids=ids)

  def _output(self, h, tok, index, settings: SlotSettings) -> StepOutput:
    done = _ends(tok, index, settings)
    chosen, top, ids = logprobs(h, tok, self.valid_vocab)
    return StepOutput(token=tok, done=done, logprob=chosen, top_ids=ids, top_logprobs=top)

  def _count_masked(self, allowed):
    if allowed is not None:
      assert np.shape(allowed)[1] == self.words, np.shape(allowed)
      self.masked_rows += int((np.asarray(allowed) != -1).any(1).sum())

  def insert(
    self, params, table: SlotTable, pf: PrefillRows, row_E, slot_E, settings: SlotSettings, allowed_ExG=None
  ):
    del params
    self.calls["insert"] += 1
    self._count_masked(allowed_ExG)
    row_E, slot_E = np.asarray(row_E), np.asarray(slot_E)
    h = pf.model.conv[0, row_E, 0, 0]
    zero = np.zeros_like(slot_E)
    tok = sample(h, settings, zero, self.valid_vocab, allowed_ExG)
    table = jax.tree.map(np.array, table)  # a new table: the caller's is "donated"
    for e in np.flatnonzero(slot_E < self.n_slots):
      s, r = slot_E[e], row_E[e]
      table.model.pos[s], table.model.conv[0, s, 0, 0] = pf.model.pos[r], h[e]
      table.tokens[s], table.last_output_index[s] = tok[e], 0
      for f in dataclasses.fields(SlotSettings):
        getattr(table.settings, f.name)[s] = getattr(settings, f.name)[e]
    return table, self._output(h, tok, zero, settings).pack()

  def generate(self, params, table: SlotTable, steps: int = 1, greedy: bool = False, rows_B=None):
    """As SlotFunctions.generate: rows rows_B of the table (None: all) advance, the others are untouched."""
    if steps == 1:
      table, logits = self.decode_rows(params, table, rows_B)
      return self.sample_rows(logits, table, rows_B)
    rows = self._run(rows_B, steps)
    table = jax.tree.map(np.array, table)  # a new table: the caller's is "donated"
    sub, out = self._generate(self._take(table, rows), steps, greedy)
    self._put(table, rows, sub)
    return table, out

  def _run(self, rows_B, steps: int) -> np.ndarray:
    """A generate call over rows_B (None: every slot) starts: counted, and as slow as a model's."""
    self.calls["generate"] += 1
    rows = np.arange(self.n_slots) if rows_B is None else np.asarray(rows_B)
    assert len(rows) in self.buckets and len(set(rows.tolist())) == len(rows), rows
    self.rows_run.append(len(rows))
    self.steps_run.append(steps)
    if self.step_s:
      time.sleep(self.step_s * steps)
    return rows

  def _take(self, table: SlotTable, rows) -> SlotTable:
    return jax.tree.map(lambda x, a: np.take(x, rows, axis=a), table, self._axes())

  def _put(self, table: SlotTable, rows, sub: SlotTable):
    for x, v, a in zip(jax.tree.leaves(table), jax.tree.leaves(sub), jax.tree.leaves(self._axes())):
      np.moveaxis(x, a, 0)[rows] = np.moveaxis(v, a, 0)

  def decode_rows(self, params, table: SlotTable, rows_B):
    """As SlotFunctions': the rows' states consume their next inputs (a slot whose input ended it stands
    still with hold_ended); the "logits" are the rows' hashes after them."""
    del params
    rows = self._run(rows_B, 1)
    table = jax.tree.map(np.array, table)
    sub = self._take(table, rows)
    h = consume(sub.model.conv[0, :, 0, 0], sub.tokens)
    model = DecodeState(pos=sub.model.pos + 1, conv=h.reshape(1, -1, 1, 1))
    if self.hold_ended:
      ended = _ends(sub.tokens, sub.last_output_index, sub.settings)
      model = jax.tree.map(lambda new, old, axis: _keep(ended, new, old, axis), model, sub.model, self.axes)
    self._put(table, rows, dataclasses.replace(sub, model=model))
    return table, h

  def sample_rows(self, logits, table: SlotTable, rows_B, allowed_BxG=None):
    """As SlotFunctions': each row's next token after hash logits[i], among those allowed_BxG allows."""
    self._count_masked(allowed_BxG)
    rows = np.arange(self.n_slots) if rows_B is None else np.asarray(rows_B)
    table = jax.tree.map(np.array, table)
    sub = self._take(table, rows)
    index = sub.last_output_index + 1
    tok = sample(logits, sub.settings, index, self.valid_vocab, allowed_BxG)
    self._put(table, rows, dataclasses.replace(sub, tokens=tok, last_output_index=index))
    return table, self._output(logits, tok, index, sub.settings).pack()

  def verify(self, params, table: SlotTable, drafts_BxJ, n_drafts_B, rows_B=None, allowed_BxTxW=None):
    """As SlotFunctions.verify: each row runs its next input and its drafts while each position's token
    (sampled as the next single step would, under allowed_BxTxW[:, j]) equals the draft there and does not
    end it; its state is left after the tokens it emits."""
    del params
    self.calls["verify"] = self.calls.get("verify", 0) + 1
    rows = np.arange(self.n_slots) if rows_B is None else np.asarray(rows_B)
    self._count_masked(None if allowed_BxTxW is None else np.asarray(allowed_BxTxW).reshape(-1, self.words))
    drafts, n_drafts = np.asarray(drafts_BxJ), np.asarray(n_drafts_B)
    table = jax.tree.map(np.array, table)
    sub = self._take(table, rows)
    S, J, outs = drafts.shape[0], drafts.shape[1] + 1, []  # J positions: the next input, then the drafts
    live, emitted = np.ones(S, bool), np.zeros(S, np.int32)
    for j in range(J):
      step, out = self._step(
        sub, allowed_SxG=None if allowed_BxTxW is None else np.asarray(allowed_BxTxW)[:, j]
      )
      sub = jax.tree.map(lambda new, old, axis: _keep(~live, new, old, axis), step, sub, self._axes())
      outs.append(out)
      emitted += live
      live = live & (j < n_drafts) & (out.token == drafts[:, min(j, J - 2)]) & ~out.done
    self._put(table, rows, sub)
    steps = jax.tree.map(lambda *x: np.stack(x, 1), *outs)
    return table, StepsOutput(emitted=emitted, steps=steps).pack()

  def precompile(self, params, table, *, decode_steps=1, speculative_tokens=0, workers=0):
    del params, table, decode_steps, speculative_tokens, workers
    return dict.fromkeys(self.buckets, 0.0)  # nothing to compile

  def _axes(self) -> SlotTable:
    return table_axes(self.axes)

  def _generate(self, table: SlotTable, steps: int, greedy: bool):
    outs = []
    for _ in range(steps):  # as SlotFunctions: a slot whose next input ends it is left as it is
      s = table.settings
      ended = _ends(table.tokens, table.last_output_index, s)  # its next input ends it
      moved, out = self._step(table, greedy)
      table = SlotTable(
        model=jax.tree.map(
          lambda new, old, axis: _keep(ended, new, old, axis), moved.model, table.model, self.axes
        ),
        tokens=_keep(ended, moved.tokens, table.tokens, 0),
        last_output_index=_keep(ended, moved.last_output_index, table.last_output_index, 0),
        settings=s,
      )
      outs.append(out)
    out = jax.tree.map(lambda *x: np.stack(x, 1), *outs)
    first_end = np.where(out.done, np.arange(steps)[None], steps).min(1)
    return table, StepsOutput(emitted=np.minimum(first_end + 1, steps), steps=out).pack()

  def _step(self, table: SlotTable, greedy: bool = False, allowed_SxG=None) -> tuple[SlotTable, StepOutput]:
    h = consume(table.model.conv[0, :, 0, 0], table.tokens)
    index = table.last_output_index + 1
    s = table.settings
    if greedy:  # as SlotFunctions: argmax for every slot (a sampled request would get other tokens)
      s = dataclasses.replace(s, temperature=np.zeros_like(s.temperature))
    tok = sample(h, s, index, self.valid_vocab, allowed_SxG)
    new = SlotTable(
      model=DecodeState(pos=table.model.pos + 1, conv=h.reshape(1, -1, 1, 1)),
      tokens=tok,
      last_output_index=index,
      settings=table.settings,
    )
    return new, self._output(h, tok, index, table.settings)
