"""Synthetic recall tasks, generated on the fly from a seed: multi-query associative recall and passkey.

Both give batches in the train step's format, Batch(inputs, targets: int32 [B, T], weights: f32 [B, T]),
weight 1 only where an answer is scored, so a model trains on exactly what it is graded on.

MQAR (Zoology, Arora et al. 2023): vocabulary 8,192 by default. A sequence opens with `n_pairs` key-value
pairs (keys from [1, V/2), values from [V/2, V), keys distinct), then each key is asked once more at an
even offset 2·g after the pairs, g drawn without replacement with P(g) ∝ g^(a−1) (a = power_a = 0.01:
short gaps are likely, long ones happen); the position holding the key is scored on predicting its value.
Every other position holds a random token of the whole vocabulary. Needs seq_len >= 4·n_pairs.

Zoology's MQAR ("zoology:SEQ,PAIRS", as HazyResearch/zoology's data/multiquery_ar.py builds its figure-2 data):
keys distinct from [1, V/2), values distinct from [V/2, V); the pairs first, then each key once as a query at
an even offset 2·g after them (g without replacement, P(g) ∝ g^(a−1)); every other input is 0, and only the
query positions carry a label (the value: the query's value is never an input, unlike MQAR above).

Passkey (Mohtashami & Jaggi 2023), in a small word vocabulary (PASSKEY_WORDS): filler sentences repeated
to the context length, "the pass key is d d d d d . remember it ." inserted once at a depth in [0, 1]
of the filler (or at a distance: that many filler tokens between it and the question), then "what is the
pass key ? the pass key is" and the five digits as the answer.

  mqar_batch(seed, batch, seq_len, n_pairs, vocab_size=8192) -> batch (deterministic in its arguments)
  zoology_batch(seed, batch, seq_len, n_pairs, vocab_size=8192) -> batch (Zoology's layout, vectorised)
  passkey_example(seed, context, depth=None, distance=None) -> (prompt ids, answer ids)
  passkey_batch(seed, batch, seq_len) -> batch (random depths; the answer's 5 tokens are scored)
  RecallStream(task, seq_len, global_batch, seed, ...) -> endless training iterator, resumable
  parse_task("mqar:64,4" | "zoology:64,4" | "passkey:1024") -> (kind, settings)
  accuracy(logits_or_ids, targets, weights) -> scored positions answered right / scored positions
"""

from __future__ import annotations

import time
from collections.abc import Callable

import jax
import numpy as np

from laplace_jax.data.batch import Batch

MQAR_VOCAB = 8192
MQAR_SETTINGS = ((64, 4), (128, 8), (256, 16), (512, 64))  # (sequence, pairs): the Zoology grid

_FILLER = (
  "the grass is green . the sky is blue . the sun is yellow . here we go . there and back again ."
).split()
_KEY = "the pass key is {} . remember it . {} is the pass key .".split()
_QUESTION = "what is the pass key ? the pass key is".split()
DIGITS = [str(d) for d in range(10)]
PASSKEY_WORDS = sorted(set(_FILLER + _KEY + _QUESTION) - {"{}"}) + DIGITS
PASSKEY_ID = {w: i for i, w in enumerate(PASSKEY_WORDS)}
PASSKEY_DIGITS = 5
MIN_PASSKEY_CONTEXT = len(_KEY) + 2 * (PASSKEY_DIGITS - 1) + len(_QUESTION)  # key sentence + question


def _check_mqar(seq_len: int, n_pairs: int, vocab_size: int):
  if n_pairs < 1 or seq_len < 4 * n_pairs:
    raise ValueError(
      f"MQAR setting (seq_len={seq_len}, n_pairs={n_pairs}): a sequence holds 2·n_pairs "
      f"tokens of pairs and then n_pairs queries at even offsets, so it needs seq_len >= "
      f"4·n_pairs = {4 * max(n_pairs, 1)}. Use a longer sequence or fewer pairs."
    )
  if vocab_size < 4 * n_pairs or vocab_size % 2:
    raise ValueError(
      f"MQAR vocab_size={vocab_size}: expected an even size with at least 2·n_pairs distinct "
      f"keys in its lower half (n_pairs={n_pairs}); the standard is {MQAR_VOCAB}."
    )


def mqar_batch(
  seed: int, batch: int, seq_len: int, n_pairs: int, vocab_size: int = MQAR_VOCAB, power_a: float = 0.01
) -> Batch:
  """`batch` MQAR sequences of `seq_len` inputs; see the module doc. Deterministic in its arguments."""
  _check_mqar(seq_len, n_pairs, vocab_size)
  rng = np.random.default_rng([seed, seq_len, n_pairs, vocab_size])
  half = vocab_size // 2
  keys_BxJ = np.stack([rng.choice(np.arange(1, half), n_pairs, replace=False) for _ in range(batch)])
  vals_BxJ = rng.integers(half, vocab_size, (batch, n_pairs))
  examples = rng.integers(0, vocab_size, (batch, seq_len + 1))  # [B, T + 1]: random non-query tokens
  examples[:, 0 : 2 * n_pairs : 2], examples[:, 1 : 2 * n_pairs : 2] = keys_BxJ, vals_BxJ
  space = (seq_len - 2 * n_pairs) // 2  # query slots after the pairs
  p = np.arange(1, space + 1, dtype=np.float64) ** (power_a - 1)
  p /= p.sum()
  gaps_BxJ = np.stack([rng.choice(space, n_pairs, replace=False, p=p) for _ in range(batch)])
  order_BxJ = rng.permuted(np.tile(np.arange(n_pairs), (batch, 1)), axis=1)  # which key each slot asks
  q_pos_BxJ = 2 * n_pairs + 2 * gaps_BxJ
  rows = np.arange(batch)[:, None]
  examples[rows, q_pos_BxJ] = keys_BxJ[rows, order_BxJ]
  examples[rows, q_pos_BxJ + 1] = vals_BxJ[rows, order_BxJ]
  weights = np.zeros((batch, seq_len), np.float32)
  weights[rows, q_pos_BxJ] = 1.0
  return Batch(
    inputs=examples[:, :-1].astype(np.int32), targets=examples[:, 1:].astype(np.int32), weights=weights
  )


def _distinct_rows(rng, n: int, k: int, low: int, high: int) -> np.ndarray:
  """[n, k] ints from [low, high), distinct within each row: rows with a repeat are drawn again (rare when
  k² ≪ high − low, so the whole set stays one vectorised draw)."""
  out = rng.integers(low, high, (n, k))
  while True:
    s = np.sort(out, 1)
    again = (s[:, 1:] == s[:, :-1]).any(1)
    if not again.any():
      return out
    out[again] = rng.integers(low, high, (int(again.sum()), k))


def zoology_batch(
  seed: int, batch: int, seq_len: int, n_pairs: int, vocab_size: int = MQAR_VOCAB, power_a: float = 0.01
) -> Batch:
  """`batch` sequences in Zoology's MQAR layout (module doc); deterministic in its arguments. A data set of
  100,000 is one call (the gaps drawn without replacement by the Gumbel top-k trick, which samples the same
  law as drawing them one by one)."""
  _check_mqar(seq_len, n_pairs, vocab_size)
  rng = np.random.default_rng([seed, seq_len, n_pairs, vocab_size, 2])
  half = vocab_size // 2
  keys_BxJ = _distinct_rows(rng, batch, n_pairs, 1, half)
  vals_BxJ = _distinct_rows(rng, batch, n_pairs, half, vocab_size)
  space = (seq_len - 2 * n_pairs) // 2
  log_p = (power_a - 1) * np.log(np.arange(1, space + 1, dtype=np.float64))
  gumbel = -np.log(-np.log(rng.uniform(size=(batch, space))))
  gaps_BxJ = np.argsort(-(log_p + gumbel), axis=1)[:, :n_pairs]  # pair i is asked at gap gaps[:, i]
  rows = np.arange(batch)[:, None]
  x_BxT = np.zeros((batch, seq_len), np.int32)
  x_BxT[:, 0 : 2 * n_pairs : 2], x_BxT[:, 1 : 2 * n_pairs : 2] = keys_BxJ, vals_BxJ
  q_pos_BxJ = 2 * n_pairs + 2 * gaps_BxJ
  x_BxT[rows, q_pos_BxJ] = keys_BxJ
  targets = np.zeros((batch, seq_len), np.int32)
  targets[rows, q_pos_BxJ] = vals_BxJ
  weights = np.zeros((batch, seq_len), np.float32)
  weights[rows, q_pos_BxJ] = 1.0
  return Batch(inputs=x_BxT, targets=targets, weights=weights)


def _digits(rng) -> list[str]:
  return [str(d) for d in rng.integers(0, 10, PASSKEY_DIGITS)]


def max_passkey_distance(context: int) -> int:
  """The most filler tokens a prompt of `context` tokens can hold between the key sentence and the question."""
  return context - MIN_PASSKEY_CONTEXT


def passkey_example(
  seed: int, context: int, depth: float | None = None, distance: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
  """(prompt ids, answer ids [5]): a prompt of exactly `context` tokens with the key sentence at `depth`
  (0: the start of the filler, 1: just before the question) or `distance` filler tokens before the
  question (one of the two)."""
  key = _KEY[:]
  if context < MIN_PASSKEY_CONTEXT:
    raise ValueError(
      f"passkey context={context}: the key sentence and the question alone take "
      f"{MIN_PASSKEY_CONTEXT} tokens; use a context of at least that."
    )
  if (depth is None) == (distance is None):
    raise ValueError(
      "passkey_example: give exactly one of depth (a fraction of the filler) or distance (tokens)."
    )
  if depth is not None and not 0.0 <= depth <= 1.0:
    raise ValueError(f"passkey depth={depth}: expected a fraction in [0, 1] of the filler.")
  if distance is not None and not 0 <= distance <= max_passkey_distance(context):
    raise ValueError(
      f"passkey distance={distance}: a {context}-token prompt holds 0 to "
      f"{max_passkey_distance(context)} filler tokens after the key; use a longer context."
    )
  if depth is not None:
    place = int(round(depth * 1000))
  else:
    assert distance is not None  # exactly one of depth and distance (checked above)
    place = 10**6 + distance
  rng = np.random.default_rng([seed, context, place])
  digits = _digits(rng)
  i = key.index("{}")
  key[i : i + 1] = digits
  j = key.index("{}")
  key[j : j + 1] = digits
  n_fill = context - len(key) - len(_QUESTION)
  fill = [_FILLER[t % len(_FILLER)] for t in range(n_fill)]
  if depth is not None:
    at = int(round(depth * n_fill))
  else:
    assert distance is not None
    at = n_fill - distance
  words = fill[:at] + key + fill[at:] + _QUESTION
  return (
    np.array([PASSKEY_ID[w] for w in words], np.int32),
    np.array([PASSKEY_ID[d] for d in digits], np.int32),
  )


def passkey_batch(seed: int, batch: int, seq_len: int) -> Batch:
  """Training sequences of seq_len inputs: a prompt (random length and depth) then its 5-digit answer,
  left-padded with filler; only the answer tokens are scored."""
  rng = np.random.default_rng([seed, seq_len, 7])
  min_ctx = MIN_PASSKEY_CONTEXT
  examples = np.zeros((batch, seq_len + 1), np.int32)  # [B, T + 1]: inputs, then the last target
  weights = np.zeros((batch, seq_len), np.float32)
  for b in range(batch):
    ctx = int(rng.integers(min_ctx, seq_len + 1 - PASSKEY_DIGITS + 1))
    prompt, answer = passkey_example(int(rng.integers(2**31)), ctx, float(rng.uniform()))
    seq = np.concatenate([prompt, answer])
    pad = seq_len + 1 - len(seq)
    examples[b] = np.concatenate([[PASSKEY_ID[_FILLER[t % len(_FILLER)]] for t in range(pad)], seq])
    weights[b, pad + len(prompt) - 1 : pad + len(seq) - 1] = 1.0  # positions whose next token is a digit
  return Batch(inputs=examples[:, :-1], targets=examples[:, 1:], weights=weights)


def parse_task(spec: str) -> tuple[str, tuple[int, ...]]:
  """'mqar:SEQ,PAIRS[,VOCAB]', 'zoology:SEQ,PAIRS[,VOCAB]' or 'passkey:SEQ' -> (kind, (seq, pairs[, vocab]))
  / ("passkey", (seq,))."""
  kind, _, rest = str(spec).partition(":")
  try:
    nums = tuple(int(v) for v in rest.split(",")) if rest else ()
  except ValueError:
    nums = None
  if kind in ("mqar", "zoology") and nums and len(nums) in (2, 3):
    _check_mqar(nums[0], nums[1], nums[2] if len(nums) == 3 else MQAR_VOCAB)
    return kind, nums
  if kind == "passkey" and nums and len(nums) == 1 and nums[0] >= MIN_PASSKEY_CONTEXT + PASSKEY_DIGITS:
    return kind, nums
  raise ValueError(
    f"recall task {spec!r}: expected 'mqar:SEQ,PAIRS[,VOCAB]' (e.g. mqar:64,4; vocabulary "
    f"{MQAR_VOCAB} unless given), 'zoology:SEQ,PAIRS[,VOCAB]' (Zoology's layout) or 'passkey:SEQ' "
    f"(e.g. passkey:1024, at least {MIN_PASSKEY_CONTEXT + PASSKEY_DIGITS} tokens)."
  )


def task_batch(spec: str, seed: int, batch: int) -> Batch:
  kind, nums = parse_task(spec)
  makers: dict[str, Callable[..., Batch]] = {
    "mqar": mqar_batch,
    "zoology": zoology_batch,
    "passkey": passkey_batch,
  }
  return makers[kind](seed, batch, *nums)


def task_vocab(spec: str) -> int:
  """Token ids a model needs for the task."""
  kind, nums = parse_task(spec)
  if kind in ("mqar", "zoology"):
    return nums[2] if len(nums) == 3 else MQAR_VOCAB
  return len(PASSKEY_WORDS)


class RecallStream:
  """Endless training batches of a task: batch i is task_batch(spec, seed·10⁶ + i); this process's rows.
  get_state/set_state hold the batch counter, so a resumed run sees the batches an uninterrupted one would."""

  def __init__(
    self,
    spec: str,
    *,
    seq_len: int,
    global_batch: int,
    seed: int = 0,
    process_index: int = 0,
    process_count: int = 1,
  ):
    kind, nums = parse_task(spec)
    if nums[0] != seq_len:
      raise ValueError(
        f"recall task {spec!r} has sequences of {nums[0]} tokens but seq_len={seq_len}; "
        f"set --seq_len {nums[0]}."
      )
    if global_batch % process_count:
      raise ValueError(f"global_batch={global_batch} does not split over {process_count} processes.")
    self.spec, self.seed, self.i = spec, seed, 0
    b = global_batch // process_count
    self.global_batch, self.rows = global_batch, slice(process_index * b, (process_index + 1) * b)
    self.last_wait_s = 0.0

  def __iter__(self):
    return self

  def __next__(self) -> Batch:
    t0 = time.perf_counter()
    batch = task_batch(self.spec, self.seed * 1_000_000 + self.i, self.global_batch)
    self.i += 1
    self.last_wait_s = time.perf_counter() - t0
    return jax.tree.map(lambda v: v[self.rows], batch)

  def get_state(self) -> dict:
    return {"task": self.spec, "seed": self.seed, "batches": self.i}

  def set_state(self, state: dict) -> None:
    if state.get("task") != self.spec or state.get("seed") != self.seed:
      raise ValueError(
        f"data state {state} was saved for another recall stream (task {self.spec!r}, seed "
        f"{self.seed}); resume with the same --data_source and --seed."
      )
    self.i = int(state["batches"])

  def close(self) -> None:
    pass


def eval_batches(spec: str, *, global_batch: int, n_batches: int, seed: int = 10**9) -> list[Batch]:
  """A fixed held-out set (seeds disjoint from RecallStream's for seed < 1000)."""
  return [task_batch(spec, seed + i, global_batch) for i in range(n_batches)]


def scored_positions(weights_BxT) -> np.ndarray:
  """[B, J] indices of the scored positions of each row (every row of a recall batch scores J of them)."""
  w = np.asarray(weights_BxT) > 0
  k = w.sum(1)
  if k.min() != k.max() or k.min() == 0:
    raise ValueError(
      f"rows score {sorted(set(k.tolist()))} positions: expected the same number (> 0) in "
      "every row, as recall batches have."
    )
  return np.nonzero(w)[1].reshape(w.shape[0], int(k[0])).astype(np.int32)


def accuracy(pred, targets, weights) -> float:
  """Share of scored positions (weights > 0) whose prediction equals the target; `pred` is ids [B, T] or
  logits [B, T, Y] (argmax taken)."""
  pred, targets, weights = np.asarray(pred), np.asarray(targets), np.asarray(weights)
  if pred.ndim == targets.ndim + 1:
    pred = pred.argmax(-1)
  if pred.shape != targets.shape or weights.shape != targets.shape:
    raise ValueError(
      f"pred {pred.shape}, targets {targets.shape}, weights {weights.shape}: expected the "
      "same [B, T] (logits [B, T, Y])."
    )
  scored = weights > 0
  if not scored.any():
    raise ValueError("no scored positions (all weights are 0): nothing to measure.")
  return float((pred[scored] == targets[scored]).mean())
