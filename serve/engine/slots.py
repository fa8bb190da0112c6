"""The compiled pieces of the engine: prefill a small batch chunk by chunk, insert it into slots, and
advance every slot by one sampled token. All shapes are fixed at construction; nothing here recompiles.

The slot table (`SlotTable`), a prefill batch (`PrefillRows`) and a step's output (`StepOutput`) are typed
pytrees; each field says what it holds where it is declared. The model's state in them is a
`laplace_jax.model.state.DecodeState`, its slot axis where `DecodeState.batch_axes` puts it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import os
import time
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from laplace_jax import sharding
from laplace_jax.inference import speculative
from laplace_jax.model.state import DecodeState
from serve.engine import sampling

N_TOP = sampling.TOP_LOGPROBS
Array = Any  # a jax.Array, a numpy array or a ShapeDtypeStruct (eval_shape)


@struct.dataclass
class SlotSettings:
  """Each slot's sampling settings, arrays over E slots (or insert entries). Every value must fit its
  dtype: `Engine` checks a request's settings when it is submitted."""

  temperature: Array  # f32 [E] (0: greedy)
  top_k: Array  # i32 [E] (0: off)
  top_p: Array  # f32 [E] (1: off)
  seed: Array  # u32 [E] low word of the 64-bit seed
  seed_hi: Array  # u32 [E] its high word
  max_tokens: Array  # i32 [E] tokens the slot may generate
  logprobs: Array  # i32 [E] -1: off, else the top-n wanted
  stop_ids: Array  # i32 [E, N_STOP] ids that end the sequence (-1 pads)

  @classmethod
  def inert(cls, n: int, n_stop: int, xp=np) -> SlotSettings:
    """Settings of an empty slot or a padding entry (xp: numpy, or jax.numpy when traced)."""
    return cls(
      temperature=xp.zeros((n,), xp.float32),
      top_k=xp.zeros((n,), xp.int32),
      top_p=xp.ones((n,), xp.float32),
      seed=xp.zeros((n,), xp.uint32),
      seed_hi=xp.zeros((n,), xp.uint32),
      max_tokens=xp.ones((n,), xp.int32),
      logprobs=xp.full((n,), -1, xp.int32),
      stop_ids=xp.full((n, n_stop), -1, xp.int32),
    )


@struct.dataclass
class SlotTable:
  """Every slot's state between steps, S slots."""

  # The model's decode state, its slot axis where `DecodeState.batch_axes` puts it (layer-major leaves
  # [L_x, S, ...]); for some mixer patterns with its own position (tokens consumed: an insert writes the
  # prefilled row's, so a reused slot starts over).
  model: DecodeState
  tokens: Array  # i32 [S] the next input token (the last one sampled)
  last_output_index: Array  # i32 [S] index within the output of the last generated token (0: the first)
  settings: SlotSettings


@struct.dataclass
class PrefillRows:
  """A prefill batch of P fresh sequences, fed chunk by chunk."""

  model: DecodeState  # the rows' decode state, as the slot table's model field
  logits: Array  # f32 [P, V] each row's logits after its last prompt token so far


class PromptScores(NamedTuple):
  """The scoring prefill's output for one chunk: each token's logprob given all before it."""

  logprob: Array  # f32 [P, C] the token's
  top_logprobs: Array  # f32 [P, C, N] the N most likely tokens' there
  top_ids: Array  # i32 [P, C, N] and their ids


@struct.dataclass
class StepOutput:
  """What one insert or generate step produced per slot (or entry), E of them. The logprob fields are
  computed only when some slot asks for them (zeros otherwise)."""

  token: Array  # i32 [E] the sampled token
  done: Array  # bool [E] the slot finished with it (a stop id, or max_tokens reached)
  logprob: Array  # f32 [E] the sampled token's log-probability
  top_ids: Array  # i32 [E, N] the N most likely tokens
  top_logprobs: Array  # f32 [E, N] their log-probabilities

  @staticmethod
  def layout(n_top: int = N_TOP) -> tuple[tuple[str, int | None, type], ...]:
    """(field, its trailing size (None: an [E] field), host dtype) in packing order: the one description
    of the packed form, where each field takes as many rows as its trailing size."""
    return (
      ("token", None, np.int32),
      ("done", None, np.bool_),
      ("logprob", None, np.float32),
      ("top_ids", n_top, np.int32),
      ("top_logprobs", n_top, np.float32),
    )

  def pack(self) -> Array:
    """All fields as one int32 [R, E] array, so one device-to-host copy carries the step: traced (a jax
    array), or on the host when every field is a numpy array (a numpy array)."""
    xp = np if all(isinstance(getattr(self, name), np.ndarray) for name, _, _ in self.layout()) else jnp
    rows = []
    for name, n, _ in self.layout(self.top_ids.shape[-1]):
      x = getattr(self, name)
      if x.dtype == xp.bool_:
        x = x.astype(xp.int32)
      elif x.dtype != xp.int32:
        x = x.view(np.int32) if xp is np else jax.lax.bitcast_convert_type(x, jnp.int32)
      rows.append(x.reshape(x.shape[0], n or 1).T)
    return xp.concatenate(rows)

  @classmethod
  def unpack(cls, packed: np.ndarray, n_top: int = N_TOP) -> StepOutput:
    """The inverse of `pack` on the host: a StepOutput of numpy arrays."""
    out, at = {}, 0
    for name, n, dtype in cls.layout(n_top):
      rows = packed[at : at + (n or 1)]
      at += n or 1
      rows = rows.astype(np.bool_) if dtype is np.bool_ else rows.view(dtype)
      out[name] = rows[0] if n is None else rows.T
    if at != packed.shape[0]:
      raise ValueError(f"a packed step output has {packed.shape[0]} rows: expected {at} (N = {n_top}).")
    return cls(**out)

  def logprobs_of(self, i: int | tuple[int, int]) -> tuple[float, list[tuple[int, float]]]:
    """(the sampled token's logprob, [(id, logprob)] of the top N) of entry i, or of (slot, position) in a
    verify's [S, T] fields (host arrays)."""
    top = [(int(t), float(v)) for t, v in zip(self.top_ids[i], self.top_logprobs[i])]
    return float(self.logprob[i]), top


@struct.dataclass
class StepsOutput:
  """What a call that advances each slot by up to T tokens produced, S slots over T positions: a verify
  (T = K + 1; position j holds the token sampled after the slot's next input and its first j drafts) or a
  generate of T steps. Position j is index last_output_index + 1 + j of the slot's output, drawn exactly as
  the j-th next single generate step would draw it; the slot emits positions 0 … emitted − 1 and nothing
  after them."""

  emitted: Array  # i32 [S] tokens the slot emits (1 … T): a verify's accepted drafts + 1; a generate's
  # tokens up to the one that ends the slot, else T
  steps: StepOutput  # [S, T] fields (top ids and logprobs [S, T, N]); done: that token ends the slot

  def pack(self) -> Array:
    """One int32 [R + 1, S·T] array (one device-to-host copy): the steps flattened slot-major as
    StepOutput.pack lays them out, then a row holding each slot's `emitted` at every one of its T entries."""
    S, T = self.steps.token.shape
    flat = jax.tree.map(lambda x: x.reshape(S * T, *x.shape[2:]), self.steps)
    xp = np if isinstance(self.emitted, np.ndarray) else jnp
    return xp.concatenate([flat.pack(), xp.repeat(self.emitted.astype(xp.int32), T)[None]])

  @classmethod
  def unpack(cls, packed: np.ndarray, n_positions: int, n_top: int = N_TOP) -> StepsOutput:
    """The inverse of `pack` on the host (numpy arrays), T = n_positions."""
    flat = StepOutput.unpack(packed[:-1], n_top)
    S = packed.shape[1] // n_positions
    steps = jax.tree.map(lambda x: x.reshape(S, n_positions, *x.shape[1:]), flat)
    return cls(emitted=packed[-1].reshape(S, n_positions)[:, 0].copy(), steps=steps)

  def tokens_of(self, s: int) -> list[int]:
    """The tokens slot s emits, in order (host arrays)."""
    return self.steps.token[s, : int(self.emitted[s])].tolist()


class SlotBackend(Protocol):
  """What the engine calls to run the model over its slots (JetStream's prefill / insert / generate split):
  `SlotFunctions` compiles them; tests/helpers/fake_slots.py fakes them in numpy. Tables and batches are the typed
  pytrees above; every call returns new ones (the arguments may be donated). Packed outputs are
  `StepOutput.pack`'s, read on the host with `StepOutput.unpack`."""

  n_slots: int
  buckets: tuple[int, ...]  # the row counts generate and verify are compiled for (`bucket_sizes`)
  n_devices: int  # the slot axis is split over this many devices, in equal runs of slots
  prefill_batch: int
  n_stop: int  # stop ids per slot (SlotSettings.stop_ids' width)
  words: int  # W: int32 words of a row of an allowed-token bitmask (ceil of the padded vocabulary / 32)
  hold_ended: bool  # a single generate step leaves a slot whose next input ends it as it is
  state_shape: Any  # one sequence's decode state (abstract): its layout is the state cache's
  axes: Any  # each state leaf's sequence axis, a DecodeState of ints
  state_bytes_per_slot: int
  table_bytes: int

  def empty_table(self) -> SlotTable: ...

  def empty_prefill(self) -> PrefillRows: ...

  def prefill_chunk(self, params, pf: PrefillRows, tokens_PxC, lengths_P) -> PrefillRows:
    """One chunk of up to C tokens per row (lengths_P of them; a row with 0 keeps its state)."""
    ...

  def prefill_chunk_scored(
    self, params, pf: PrefillRows, tokens_PxC, lengths_P
  ) -> tuple[PrefillRows, PromptScores]:
    """`prefill_chunk` that also scores every token of the chunk given all before it (echo)."""
    ...

  def insert(
    self, params, table: SlotTable, pf: PrefillRows, row_E, slot_E, settings: SlotSettings, allowed_ExW=None
  ):
    """Sample each entry's first token from prefill row row_E[i], among the tokens allowed_ExW allows (host
    int32 [E, W] bitmask, `sampling.masked`; None: all), and move that row into slot slot_E[i] (>= n_slots:
    padding). Returns (table, packed StepOutput of the entries)."""
    ...

  def generate(self, params, table: SlotTable, steps: int = 1, greedy: bool = False, rows_B=None):
    """Advance slots rows_B (`step_rows`: B of them, a bucket's count; None: every slot) by `steps` sampled
    tokens; the others are not touched. Returns (table, packed StepOutput of the B rows), for steps > 1 a packed StepsOutput
    over `steps` positions in which a slot whose next input ends it is left as it is; greedy: every slot
    in use is greedy and wants no logprobs. See SlotFunctions.generate."""
    ...

  def decode_rows(self, params, table: SlotTable, rows_B):
    """A single generate step's first call: the decode of slots rows_B. Returns (table, logits): pass both
    to `sample_rows` (generate(steps=1) is the two)."""
    ...

  def sample_rows(self, logits, table: SlotTable, rows_B, allowed_BxW=None):
    """Its second call: each row's next token among those allowed_BxW allows (host int32 [B, W]; None: all,
    a cached device array). Returns (table, packed StepOutput of the B rows)."""
    ...

  def verify(self, params, table: SlotTable, drafts_BxK, n_drafts_B, rows_B=None, allowed_BxTxW=None):
    """Advance slots rows_B (None: every slot) by their next input and their first n_drafts_B[b] drafts in one pass, emitting
    what as many generate calls would, position j among the tokens allowed_BxTxW[b, j] allows (None: all).
    Returns (table, packed StepsOutput of the B rows); see SlotFunctions.verify."""
    ...

  def gather(self, state, rows_E):
    """Rows rows_E of a model state as device arrays (copied to the host asynchronously by the caller)."""
    ...

  def precompile(
    self, params, table: SlotTable, *, decode_steps: int = 1, speculative_tokens: int = 0, workers: int = 0
  ) -> dict[int, float]:
    """Compile every bucket's generate and verify programs before their first call; each bucket's seconds."""
    ...

  def load_prefill(self, state) -> PrefillRows:
    """A prefill batch starting from the given host state rows."""
    ...


def _done(tok_S, index_S, max_tokens_S, stop_ids_SxN):
  """A slot is finished when it produced a stop id or its (index + 1)-th output token reached max_tokens."""
  return (tok_S[:, None] == stop_ids_SxN).any(-1) | (index_S + 1 >= max_tokens_S)


def _input_ends(table: SlotTable):
  """bool [S]: the slot's next input (its last sampled token) ended it: finished, freed or never used."""
  s = table.settings
  return _done(table.tokens, table.last_output_index, s.max_tokens, s.stop_ids)


def table_axes(state_axes) -> SlotTable:
  """Each slot-table leaf's slot axis: the model state's (`DecodeState.batch_axes`), 0 for the rest."""
  return SlotTable(
    model=state_axes,
    tokens=0,
    last_output_index=0,
    settings=jax.tree.map(lambda _: 0, SlotSettings.inert(1, 1)),
  )


def bucket_sizes(n_slots: int, n_devices: int = 1) -> tuple[int, ...]:
  """The row counts a step is compiled for: each device's share of the rows doubles from 1 to all its slots
  (1, 2, 4, ... and n_slots / n_devices itself), times n_devices. A step runs the smallest that holds the
  live slots, so it reads and writes their states, not the whole table's."""
  per = n_slots // n_devices
  return tuple(n_devices * b for b in sorted({min(1 << i, per) for i in range(per.bit_length() + 1)}))


def step_rows(live: Iterable[int], n_slots: int, buckets: Sequence[int], n_devices: int = 1) -> np.ndarray:
  """The slots a generate or verify call runs, int32 [B] with B the smallest bucket that holds each
  device's live slots: device d's B / n_devices rows (device-major) are its live slots, then as many of
  its other slots as the bucket has room for. Rows are distinct, so every write back is a slot's own; an
  idle row's slot holds no request (its next input ended it, or it is about to be overwritten by an
  insert), and no request's tokens depend on which rows run beside it."""
  per = n_slots // n_devices
  mine: list[list[int]] = [[] for _ in range(n_devices)]
  for s in live:
    mine[s // per].append(s)
  most = max(len(m) for m in mine)
  B = next(b for b in buckets if b // n_devices >= most)
  if B == n_slots:  # every row: the table as it is, in its own order (nothing gathered, see SlotFunctions)
    return np.arange(n_slots, dtype=np.int32)
  rows = np.empty((n_devices, B // n_devices), np.int32)
  for d, m in enumerate(mine):
    taken = set(m)
    idle = (s for s in range(d * per, (d + 1) * per) if s not in taken)
    rows[d] = sorted(m) + [next(idle) for _ in range(B // n_devices - len(m))]
  return rows.reshape(-1)


class SlotFunctions:
  """Jitted prefill / insert / generate for one model, slot count, prefill batch and mesh. Generate and
  verify run over a bucket of rows of the slot table (`step_rows`), gathered by index and written back in
  place (the table is donated): one compiled program per bucket, none sized to the whole table."""

  def __init__(
    self,
    model,
    cfg,
    *,
    n_slots: int,
    prefill_batch: int,
    n_stop: int,
    valid_vocab: int,
    mesh=None,
    branch_free: bool | None = None,
    max_context: int | None = None,
    hold_ended: bool = False,
    buckets: str = "doubling",
  ):
    self.model, self.cfg = model, cfg
    # A single generate step leaves a slot whose next input ends it as it is, as a call of several steps
    # does (model.decode_step's live_B): a finished slot's state then holds every token but its last for
    # the state cache, whatever call follows. Off, the step runs without live_B (on GPUs, the Pallas kernel).
    self.hold_ended = hold_ended
    self.max_context = max_context  # attention layers' KV cache length per slot (None: no 'A' layers)
    self.state_shape = jax.eval_shape(lambda: self._init_state(1))  # one sequence's decode state
    self.axes = self.state_shape.batch_axes()  # each leaf's sequence axis, a DecodeState of ints
    self.n_slots, self.prefill_batch, self.n_stop = n_slots, prefill_batch, n_stop
    self.n_devices = 1 if mesh is None else mesh.size
    # The row counts generate and verify are compiled for (EngineConfig.slot_buckets).
    self.buckets = bucket_sizes(n_slots, self.n_devices) if buckets == "doubling" else (n_slots,)
    self.every_row = np.arange(n_slots, dtype=np.int32)  # the largest bucket: the whole table
    # branch_free: sampling and the logprob rows without `cond` (None: decided when traced, on Neuron only)
    self.branch_free = branch_free
    self.sample = functools.partial(sampling.sample, valid_vocab=valid_vocab, branch_free=branch_free)
    self.valid_vocab = valid_vocab
    self.mesh = mesh
    self.words = -(-cfg.vocab_size // 32)  # W: a row of an allowed-token bitmask (the padded vocabulary's)
    self._all_ones: dict[
      tuple[tuple[int, ...], bool], jax.Array
    ] = {}  # per (rows, split): every token allowed
    table_shape = jax.eval_shape(self._empty_table)
    pf_shape = jax.eval_shape(self._empty_prefill)
    # Measured from the real layout (not a formula): one slot's decode state, and the whole slot table.
    self.state_bytes_per_slot = _nbytes(self.state_shape)
    self.table_bytes = _nbytes(table_shape)
    if mesh is None:
      table_sh = pf_sh = rep = None
    else:
      if n_slots % mesh.size:
        raise ValueError(
          f"n_slots={n_slots} is not a multiple of the mesh's {mesh.size} devices: the slot "
          "table is split evenly over them. Pick a multiple (or a smaller mesh)."
        )
      rep = sharding.replicated(mesh)
      table_sh = slot_table_shardings(table_shape, mesh)
      pf_sh = jax.tree.map(lambda _: rep, pf_shape)
    self.table_shardings = table_sh
    both = None if mesh is None else (table_sh, rep)
    # Without a mesh, the tables and batches made from nothing are placed on the default device as the
    # served params are (serve.engine.loading): a jit output is committed when an input is, and a prefill chunk
    # fed an uncommitted batch, then its own committed output, would compile twice (the second at request
    # time).
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    self.empty_table = _jit(self._empty_table, out=one if mesh is None else table_sh)
    self.empty_prefill = _jit(self._empty_prefill, out=one if mesh is None else pf_sh)
    self.prefill_chunk = _jit(self._prefill_chunk, donate=(1,), out=pf_sh)  # donated: the prefill batch
    self.prefill_chunk_scored = _jit(
      self._prefill_chunk_scored, donate=(1,), out=None if mesh is None else (pf_sh, rep)
    )
    self._insert = _jit(self._insert_entries, donate=(1,), out=both)  # donated: the slot table
    logits_sh = (
      None
      if mesh is None
      else sharding.batch_shardings(jax.ShapeDtypeStruct((n_slots, cfg.vocab_size), jnp.float32), mesh)
    )
    self.logits_sharding = one if mesh is None else logits_sh  # where the decode call leaves its logits
    self._decode = _jit(self._decode_next, donate=(1,), out=None if mesh is None else (table_sh, logits_sh))
    self._sample = _jit(self._sample_next, donate=(1,), out=both)
    # One program per bucket (and per steps and greedy; per draft length K): a bucket's shape is its own.
    self._generate_steps = (
      jax.jit(self._steps, static_argnums=(3, 4), donate_argnums=1)
      if mesh is None
      else jax.jit(self._steps, static_argnums=(3, 4), donate_argnums=1, out_shardings=both)
    )
    self._verify = _jit(self._verify_drafts, donate=(1,), out=both)
    # State cache: copy a few rows of a state out (a small [L, E, ...] array; nothing is donated, so the
    # step that follows runs on), and start a prefill batch from host states.
    self.gather = jax.jit(self._gather)
    self.load_prefill = _jit(self._load_prefill, out=one if mesh is None else pf_sh)

  def precompile(
    self, params, table: SlotTable, *, decode_steps: int = 1, speculative_tokens: int = 0, workers: int = 0
  ) -> dict[int, float]:
    """Compile every bucket's generate (and verify, with speculative_tokens K) programs ahead of their first
    call, `workers` at a time (0: one per CPU core): tracing is Python's, but XLA compiles outside the GIL,
    and a call finds the program its arguments' shapes and shardings compiled. Returns each bucket's compile
    seconds (its programs' sum, measured in its threads)."""
    devices = None if self.mesh is None else set(self.mesh.devices.flat)

    def placed(x):  # where the call will find x (left to jit where x is not on the serving mesh's devices)
      sh = getattr(x, "sharding", None)
      return sh if sh is None or devices is None or set(sh.device_set) == devices else None

    like = lambda tree: jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=placed(x)), tree
    )
    programs = self.bucket_programs(
      like(params), like(table), decode_steps=decode_steps, speculative_tokens=speculative_tokens
    )
    jobs = [(B, lowered) for (_, B), lowered in programs.items()]

    def compile_one(lowered) -> float:
      t = time.perf_counter()
      lowered.compile()
      return time.perf_counter() - t

    seconds = dict.fromkeys(self.buckets, 0.0)
    with concurrent.futures.ThreadPoolExecutor(workers or os.cpu_count() or 1) as pool:
      for (B, _), spent in zip(jobs, pool.map(compile_one, [lowered for _, lowered in jobs])):
        seconds[B] += spent
    return seconds

  def bucket_programs(
    self, params, table, *, decode_steps: int = 1, speculative_tokens: int = 0, rows_sharding=None
  ) -> dict[tuple[str, int], Any]:
    """{(name, bucket): jax Lowered} of every bucket's programs, from abstract params and table as the calls
    see them: decode and sample, with decode_steps > 1 the generate of several steps (greedy or not), with
    speculative_tokens K the verify. The engine's start-up compiles them (`precompile`); `python -m serve
    --target` checks them (serve.engine.lowering). rows_sharding: where the rows and drafts arrive (None: the host)."""
    out: dict[tuple[str, int], Any] = {}
    with contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh):
      for B in self.buckets:
        i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=rows_sharding)
        logits = jax.ShapeDtypeStruct((B, self.cfg.vocab_size), jnp.float32, sharding=self.logits_sharding)
        out["decode", B] = self._decode.lower(params, table, i32(B))
        out["sample", B] = self._sample.lower(logits, table, i32(B), self.mask_shape((B,)))
        if decode_steps > 1:
          for greedy, name in ((False, "generate_steps"), (True, "generate_steps_greedy")):
            out[name, B] = self._generate_steps.lower(params, table, i32(B), decode_steps, greedy)
        if speculative_tokens:
          K, mask = speculative_tokens, self.mask_shape((B, speculative_tokens + 1))
          out["verify", B] = self._verify.lower(params, table, i32(B), i32(B, K), i32(B), mask)
    return out

  # ---- the traced functions ----

  def _init_state(self, batch: int):
    if "A" in self.cfg.mixers:
      return self.model.init_state(self.cfg, batch, max_len=self.max_context)
    return self.model.init_state(self.cfg, batch)

  def _take(self, state, rows):
    """Rows `rows` of a model state, each leaf along its own sequence axis."""
    return jax.tree.map(lambda x, axis: jnp.take(x, rows, axis=axis), state, self.axes)

  def _empty_table(self) -> SlotTable:
    S = self.n_slots
    return SlotTable(
      model=self._init_state(S),
      tokens=jnp.zeros((S,), jnp.int32),
      last_output_index=jnp.zeros((S,), jnp.int32),
      settings=SlotSettings.inert(S, self.n_stop, jnp),
    )

  def _empty_prefill(self) -> PrefillRows:
    """Zero state and logits for one prefill batch (rows are fresh sequences)."""
    Pb = self.prefill_batch
    return PrefillRows(model=self._init_state(Pb), logits=jnp.zeros((Pb, self.cfg.vocab_size), jnp.float32))

  def _prefill_chunk(self, params, pf: PrefillRows, tokens_PxC, lengths_P) -> PrefillRows:
    """One 128-token chunk for the prefill batch; rows with length 0 keep state and last logits."""
    logits, state = self.model.prefill_chunk(params, pf.model, tokens_PxC, lengths_P, cfg=self.cfg)
    logits = jnp.where((lengths_P > 0)[:, None], logits.astype(jnp.float32), pf.logits)
    return PrefillRows(model=state, logits=logits)

  def _prefill_chunk_scored(self, params, pf: PrefillRows, tokens_PxC, lengths_P):
    """`_prefill_chunk` that also scores every token of the chunk (echo): the logprob of token j given
    all before it (the previous chunk's last logits predict token 0) and the top N there. Returns
    (pf, PromptScores)."""
    P, C = tokens_PxC.shape
    mask_PxC = jnp.arange(C)[None, :] < lengths_P[:, None]
    logits_PxCxV, state = self.model.LaplaceLM(self.cfg).apply(
      {"params": params}, tokens_PxC, pf.model, mask_PxC
    )
    logits_PxCxV = logits_PxCxV.astype(jnp.float32)
    last = jnp.take_along_axis(logits_PxCxV, jnp.maximum(lengths_P - 1, 0)[:, None, None], 1)[:, 0]
    last = jnp.where((lengths_P > 0)[:, None], last, pf.logits)
    before_PxCxV = jnp.concatenate([pf.logits[:, None], logits_PxCxV[:, :-1]], 1)
    chosen, vals, ids = sampling.logprobs(
      before_PxCxV.reshape(P * C, -1), tokens_PxC.reshape(-1), valid_vocab=self.valid_vocab
    )
    return PrefillRows(model=state, logits=last), PromptScores(
      logprob=chosen.reshape(P, C),
      top_logprobs=vals.reshape(P, C, N_TOP),
      top_ids=ids.reshape(P, C, N_TOP),
    )

  def _output(self, logits_SxV, tok_S, done_S, want_S) -> jax.Array:
    """The step's StepOutput, packed."""
    return self._step_output(logits_SxV, tok_S, done_S, want_S).pack()

  def _step_output(self, logits_SxV, tok_S, done_S, want_S) -> StepOutput:
    """The step's StepOutput (its logprob fields only when some want_S >= 0; never when want_S is None)."""
    S = tok_S.shape[0]
    branch_free = sampling.branch_free_default() if self.branch_free is None else self.branch_free
    zeros = lambda: (
      jnp.zeros((S,), jnp.float32),
      jnp.zeros((S, N_TOP), jnp.float32),
      jnp.zeros((S, N_TOP), jnp.int32),
    )
    chosen, vals, ids = (
      zeros()
      if want_S is None
      else sampling.when_any(
        want_S >= 0,
        lambda: sampling.logprobs(logits_SxV, tok_S, valid_vocab=self.valid_vocab),
        zeros,
        branch_free,
      )
    )
    return StepOutput(token=tok_S, done=done_S, logprob=chosen, top_ids=ids, top_logprobs=vals)

  def insert(
    self, params, table: SlotTable, pf: PrefillRows, row_E, slot_E, settings: SlotSettings, allowed_ExW=None
  ):
    """See `SlotBackend.insert` and `_insert_entries`."""
    mask = self.mask(allowed_ExW, (len(row_E),), split=False)
    return self._insert(params, table, pf, row_E, slot_E, settings, mask)

  def _insert_entries(
    self, params, table: SlotTable, pf: PrefillRows, row_E, slot_E, settings: SlotSettings, allowed_ExW
  ):
    """Sample a first token for each entry from prefill row row_E[i] among the tokens allowed_ExW allows,
    and write that row into slot slot_E[i] (slot_E >= S: padding, not written). Several entries may share a
    row (n choices of one prompt). Returns (table, packed StepOutput of the E entries)."""
    del params
    zero = jnp.zeros_like(slot_E)
    logits = pf.logits[row_E]
    tok = self.sample(
      logits,
      settings.temperature,
      settings.top_k,
      settings.top_p,
      settings.seed,
      zero,
      seed_hi_S=settings.seed_hi,
      allowed_SxW=allowed_ExW,
      free_path=False,  # a few entries per prefill: one sampler to compile
    )
    done = _done(tok, zero, settings.max_tokens, settings.stop_ids)
    src, slot_w, any_real = entry_writes(slot_E, self.n_slots)

    def put(big, small, axis):  # small: the values of the writes, already indexed by src
      if axis == 1:
        return big.at[:, slot_w].set(jnp.where(any_real, small, big[:, :1]), mode="promise_in_bounds")
      return big.at[slot_w].set(jnp.where(any_real, small, big[:1]), mode="promise_in_bounds")

    # Every leaf of the prefilled row, its pos included, replaces the slot's: nothing of the slot's last
    # sequence (its rings, KV cache, position) survives into the next.
    rows = self._take(pf.model, row_E[src])
    new = SlotTable(
      model=jax.tree.map(put, table.model, rows, self.axes),
      tokens=put(table.tokens, tok[src], 0),
      last_output_index=put(table.last_output_index, zero, 0),
      settings=jax.tree.map(lambda b, s: put(b, s[src].astype(b.dtype), 0), table.settings, settings),
    )
    return new, self._output(logits, tok, done, settings.logprobs)

  def _gather(self, state, rows_E):
    """Rows rows_E of a model state (the slot table's or a prefill batch's: [L, S, ...] -> [L, E, ...])."""
    return self._take(state, rows_E)

  def _load_prefill(self, state) -> PrefillRows:
    """A prefill batch that starts from the given (host) state rows instead of zeros."""
    return PrefillRows(
      model=jax.tree.map(jnp.asarray, state),
      logits=jnp.zeros((self.prefill_batch, self.cfg.vocab_size), jnp.float32),
    )

  def generate(self, params, table: SlotTable, steps: int = 1, greedy: bool = False, rows_B=None):
    """Advance slots rows_B (`step_rows`; None: every slot) by `steps` tokens; the table's other rows are not
    read or written. Returns (table, packed output over the B rows): one step's StepOutput, or for steps > 1 a StepsOutput
    over T = steps positions (StepsOutput.unpack(out, steps)), the tokens and draws of as many single steps.

    One step is two compiled calls, decode then sampling: compiled into one program on the CPU, the
    (untaken) sampling branches made the step 1.7-2x slower than the decode step alone at 64 `tiny` slots.
    More steps are one compiled program per (bucket, steps, greedy), a scan of both: the host reads back and
    delivers once per call. `greedy` (the caller's promise that every slot in use samples greedily and wants
    no logprobs) leaves out the sampler and the logprob rows, whose untaken branches cost ~10% of the call at
    64 `tiny` slots on the CPU. In it a slot whose next input ends it (a stop id, or its last allowed token)
    does not advance (model.decode_step's live_B: no extra pass over the state), so a finished slot's state
    holds its prompt and every output token but the last however many steps follow: what the state cache
    copies out. (On GPUs such a call takes the XLA GLA step: the Pallas kernel has no rows that stand still.)"""
    # Traced under the serving mesh: the model pins activations to the slot split, and the GPU decode
    # kernel (one device's program) knows to leave a multi-device table to XLA.
    rows_B = self.every_row if rows_B is None else rows_B
    if steps > 1:
      with contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh):
        return self._generate_steps(params, table, rows_B, steps, greedy)
    table, logits = self.decode_rows(params, table, rows_B)
    return self.sample_rows(logits, table, rows_B)

  def decode_rows(self, params, table: SlotTable, rows_B):
    """See `SlotBackend.decode_rows`."""
    with contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh):
      return self._decode(params, table, rows_B)

  def sample_rows(self, logits, table: SlotTable, rows_B, allowed_BxW=None):
    """See `SlotBackend.sample_rows`: one compiled program per bucket, masked or not."""
    return self._sample(logits, table, rows_B, self.mask(allowed_BxW, (len(rows_B),)))

  def mask(self, allowed, rows: tuple[int, ...], split: bool = True) -> jax.Array:
    """A call's mask input, int32 [*rows, W] (a row per entry or slot, [B, K + 1] per verified position),
    placed as the call takes it (split: over the slot axis, as the bucket's logits; else replicated): the
    host's `allowed`, or for None a cached device array of all ones, so a call without constrained rows
    copies nothing to the device. Both are committed alike, so they share one compiled program."""
    want = self.mask_shape(rows, split)
    if allowed is None:
      if (rows, split) not in self._all_ones:
        self._all_ones[(rows, split)] = jax.device_put(np.full(want.shape, -1, np.int32), want.sharding)
      return self._all_ones[(rows, split)]
    if np.shape(allowed) != want.shape:
      raise ValueError(f"a mask of shape {np.shape(allowed)}: expected {want.shape} (rows, then W words).")
    return jax.device_put(np.asarray(allowed, np.int32), want.sharding)

  def mask_shape(self, rows: tuple[int, ...], split: bool = True) -> jax.ShapeDtypeStruct:
    """The mask input's shape, dtype and placement (see `mask`)."""
    shape = (*rows, self.words)
    if self.mesh is None:
      where: Any = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    elif split:
      where = sharding.batch_shardings(jax.ShapeDtypeStruct(shape, jnp.int32), self.mesh)
    else:
      where = sharding.replicated(self.mesh)
    return jax.ShapeDtypeStruct(shape, jnp.int32, sharding=where)

  # ---- a bucket of rows: gathered from the table by index, written back in place ----

  def _table_axes(self) -> SlotTable:
    return table_axes(self.axes)

  def _local(self, rows_B):
    """rows_B as [D, B / D] indices into each device's own run of slots."""
    D = self.n_devices
    return rows_B.reshape(D, -1) - (jnp.arange(D, dtype=rows_B.dtype) * (self.n_slots // D))[:, None]

  def _take_rows(self, tree, axes, rows_B):
    """Rows rows_B of every leaf along its slot axis. Over a mesh each device gathers from its own slots
    (a gather batched over the devices' runs: no slot crosses a device). A bucket of every row is the table
    itself, rows_B then being 0 … S - 1 (`step_rows`): nothing is gathered or written back (a gather and its
    write back cost XLA:CPU about 6 more passes over the rows' states than the in-place step)."""
    if rows_B.shape[0] == self.n_slots:
      return tree
    D, local = self.n_devices, self._local(rows_B)

    def take(x, axis):
      if D == 1:
        return jnp.take(x, local[0], axis=axis, mode="clip")
      runs = x.reshape(*x.shape[:axis], D, -1, *x.shape[axis + 1 :])
      got = jax.vmap(lambda xd, i: jnp.take(xd, i, axis=axis, mode="clip"), (axis, 0), axis)(runs, local)
      return got.reshape(*x.shape[:axis], -1, *x.shape[axis + 1 :])

    return jax.tree.map(take, tree, axes)

  def _put_rows(self, tree, axes, rows_B, new):
    """`tree` with rows rows_B of every leaf replaced by `new`'s (distinct rows: a scatter in place)."""
    if rows_B.shape[0] == self.n_slots:  # every row, in order (_take_rows)
      return jax.tree.map(lambda x, v: v.astype(x.dtype), tree, new)
    D, local = self.n_devices, self._local(rows_B)

    def put_one(x, i, v, axis):
      at = (slice(None),) * axis + (i,)
      return x.at[at].set(v.astype(x.dtype), mode="promise_in_bounds", unique_indices=True)

    def put(x, v, axis):
      if D == 1:
        return put_one(x, local[0], v, axis)
      runs = x.reshape(*x.shape[:axis], D, -1, *x.shape[axis + 1 :])
      vs = v.reshape(*v.shape[:axis], D, -1, *v.shape[axis + 1 :])
      done = jax.vmap(lambda xd, i, vd: put_one(xd, i, vd, axis), (axis, 0, axis), axis)(runs, local, vs)
      return done.reshape(x.shape)

    return jax.tree.map(put, tree, new, axes)

  def _rows(self, table: SlotTable, rows_B) -> SlotTable:
    """The bucket's rows of the table, a table of B slots."""
    return self._take_rows(table, self._table_axes(), rows_B)

  def _write_back(self, table: SlotTable, rows_B, sub: SlotTable, model: bool = True) -> SlotTable:
    """The table with the bucket's rows replaced by sub's (settings never change in a step; model=False:
    nor did the state)."""
    ax = self._table_axes()
    return dataclasses.replace(
      table,
      model=self._put_rows(table.model, ax.model, rows_B, sub.model) if model else table.model,
      tokens=self._put_rows(table.tokens, 0, rows_B, sub.tokens),
      last_output_index=self._put_rows(table.last_output_index, 0, rows_B, sub.last_output_index),
    )

  # ---- the steps, over a bucket ----

  def _decode_next(self, params, table: SlotTable, rows_B):
    """One decode step of the bucket's slots (those whose next input ends them stand still with
    hold_ended). Returns (table, logits [B, V])."""
    sub = self._rows(table, rows_B)
    sub, logits = self._decode_logits(params, sub, ~_input_ends(sub) if self.hold_ended else None)
    ax = self._table_axes()
    return dataclasses.replace(table, model=self._put_rows(table.model, ax.model, rows_B, sub.model)), logits

  def _decode_logits(self, params, table: SlotTable, live_S=None):
    logits, state = self.model.decode_step(params, table.model, table.tokens, cfg=self.cfg, live_B=live_S)
    return dataclasses.replace(table, model=state), logits

  def _sample_next(self, logits, table: SlotTable, rows_B, allowed_BxW):
    """Sample the bucket's next tokens from the decode call's logits [B, V], among the tokens allowed_BxW
    allows (int32 [B, W]; all ones for a free row)."""
    ax = self._table_axes()
    few = dataclasses.replace(ax, model=None)  # type: ignore[arg-type]  # every field but the state
    sub = self._take_rows(dataclasses.replace(table, model=None), few, rows_B)  # type: ignore[arg-type]
    sub, out = self._sample_step(logits, sub, allowed_SxW=allowed_BxW)
    return self._write_back(table, rows_B, sub, model=False), out.pack()

  def _sample_step(
    self, logits, table: SlotTable, greedy: bool = False, allowed_SxW=None
  ) -> tuple[SlotTable, StepOutput]:
    """Each slot's next token (among those allowed_SxW allows; None: all). A slot whose input ended it
    (finished, freed, never used) keeps its token and index, so it stays ended until an insert, and samples
    nothing: greedy, without logprobs (a freed slot's last settings would otherwise keep the sampler's
    costly paths running for nobody)."""
    s = table.settings
    ended_S = _input_ends(table)
    index = table.last_output_index + 1  # also the draw's position in the slot's random stream
    if greedy:  # the sampler's own greedy path (its rows at temperature 0), without its branches
      tok = sampling.argmax_rows(logits.astype(jnp.float32), self.valid_vocab, allowed_SxW)
      out = self._step_output(logits, tok, _done(tok, index, s.max_tokens, s.stop_ids), None)
    else:
      temperature = jnp.where(ended_S, 0.0, s.temperature)
      tok = self.sample(
        logits, temperature, s.top_k, s.top_p, s.seed, index, seed_hi_S=s.seed_hi, allowed_SxW=allowed_SxW
      )
      want = jnp.where(ended_S, -1, s.logprobs)
      out = self._step_output(logits, tok, _done(tok, index, s.max_tokens, s.stop_ids), want)
    return dataclasses.replace(
      table,
      tokens=jnp.where(ended_S, table.tokens, tok),
      last_output_index=jnp.where(ended_S, table.last_output_index, index),
    ), out

  def _steps(self, params, table: SlotTable, rows_B, steps: int, greedy: bool):
    def one(table: SlotTable, _):
      moved, logits = self._decode_logits(params, table, live_S=~_input_ends(table))
      return self._sample_step(logits, moved, greedy)  # (an ended slot keeps its token and index)

    sub, outs = jax.lax.scan(one, self._rows(table, rows_B), None, length=steps)
    out = jax.tree.map(lambda x: jnp.moveaxis(x, 0, 1), outs)  # [T, B, ...] -> [B, T, ...]
    # Up to the first token that ends the slot (a min over indices: no argmax, a variadic reduce on Neuron).
    first_end = jnp.where(out.done, jnp.arange(steps)[None, :], steps).min(1)
    emitted = jnp.minimum(first_end + 1, steps)
    return self._write_back(table, rows_B, sub), StepsOutput(emitted=emitted, steps=out).pack()

  def verify(self, params, table: SlotTable, drafts_BxK, n_drafts_B, rows_B=None, allowed_BxTxW=None):
    """Advance slots rows_B (`step_rows`; None: every slot) by 1 … K + 1 tokens in one pass: each one's next input and its
    first n_drafts_B[b] drafted tokens (drafts_BxK[b, :n]; the rest of the row is ignored, n = 0 makes the
    call one generate step for that slot) go through the model together, each position samples the token
    the slot would sample there, and a draft is accepted while it equals the token sampled before it (and
    that token does not end the slot). Each slot emits its accepted drafts + 1 tokens, those that as many
    `generate` calls would have produced (the same draws; the logits equal up to fp32 rounding, the chunk
    form's against the recurrence's, so a near-tie may be chosen otherwise), and its state is committed at
    that length (laplace_jax.inference.speculative). Position j samples among the tokens allowed_BxTxW[b, j] allows
    (host int32 [B, K + 1, W]: what the slot's grammar allows after its first j drafts; None: all), so a
    draft its grammar forbids is never accepted. Returns (table, packed StepsOutput over the B rows;
    StepsOutput.unpack(out, K + 1)).

    Slots of models with attention layers need K + 1 free rows in their KV cache (the engine verifies
    only then): a row that would outgrow it gets NaN logits, as in decode."""
    rows_B = self.every_row if rows_B is None else rows_B
    mask = self.mask(allowed_BxTxW, (len(rows_B), np.shape(drafts_BxK)[1] + 1))
    with contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh):
      return self._verify(params, table, rows_B, drafts_BxK, n_drafts_B, mask)

  def _verify_drafts(self, params, table: SlotTable, rows_B, drafts_SxK, n_drafts_S, allowed_SxTxW):
    sub = self._rows(table, rows_B)  # S below: the bucket's B slots
    S, K = drafts_SxK.shape
    T = K + 1
    real_SxK = jnp.arange(K)[None, :] < n_drafts_S[:, None]
    inputs = jnp.concatenate([sub.tokens[:, None], jnp.where(real_SxK, drafts_SxK, 0)], axis=1)
    logits, drafted = speculative.verify(params, sub.model, inputs, cfg=self.cfg)
    flat = logits.reshape(S * T, -1).astype(jnp.float32)
    # Position j of slot s draws as the (j + 1)-th next generate step would: its index in the output is
    # also its position in the slot's random stream.
    index_SxT = sub.last_output_index[:, None] + 1 + jnp.arange(T)[None, :]
    st = jax.tree.map(lambda x: jnp.repeat(x, T, axis=0), sub.settings)  # each slot's settings, T times
    index = index_SxT.reshape(-1)
    allowed = allowed_SxTxW.reshape(S * T, -1)
    tok = self.sample(
      flat,
      st.temperature,
      st.top_k,
      st.top_p,
      st.seed,
      index,
      seed_hi_S=st.seed_hi,
      allowed_SxW=allowed,
      free_path=False,  # a verify's positions: one sampler to compile (their mask is a pass over the logits)
    )
    done = _done(tok, index, st.max_tokens, st.stop_ids)
    tok_SxT, done_SxT = tok.reshape(S, T), done.reshape(S, T)
    agree = (tok_SxT[:, :K] == drafts_SxK) & real_SxK & ~done_SxT[:, :K]
    accepted = jnp.cumprod(agree.astype(jnp.int32), axis=1).sum(1)  # leading drafts that agree
    emitted = accepted + 1
    state = speculative.commit(sub.model, drafted, emitted, cfg=self.cfg)
    new = dataclasses.replace(
      sub,
      model=state,
      tokens=jnp.take_along_axis(tok_SxT, accepted[:, None], axis=1)[:, 0],
      last_output_index=sub.last_output_index + emitted,
    )
    steps = self._step_output(flat, tok, done, st.logprobs)
    steps = jax.tree.map(lambda x: x.reshape(S, T, *x.shape[1:]), steps)
    return self._write_back(table, rows_B, new), StepsOutput(emitted=emitted, steps=steps).pack()


def entry_writes(slot_E, n_slots: int):
  """Insert's writes with every index in range (Neuron fails out-of-range scatters at run time; XLA drops
  them): (src_E, slot_w_E, any_real). Write i stores entry src_E[i]'s values into slot slot_w_E[i]: a real entry
  (slot_E < n_slots) its own, a padding entry repeats the first real entry's write (same slot, same values).
  With no real entry (any_real false) every write goes to slot 0 and must store slot 0's own values."""
  real = slot_E < n_slots
  src = jnp.where(real, jnp.arange(slot_E.shape[0]), jnp.argmax(real))
  any_real = real.any()
  return src, jnp.where(any_real, slot_E[src], 0), any_real


def _nbytes(shapes) -> int:
  return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(shapes))


def _jit(f, donate=(), out=None):
  return (
    jax.jit(f, donate_argnums=donate) if out is None else jax.jit(f, donate_argnums=donate, out_shardings=out)
  )


def slot_table_shardings(table_shape: SlotTable, mesh) -> SlotTable:
  """Split the slot axis over every device: the model state's axis 1, axis 0 of the per-slot arrays."""
  rest = dataclasses.replace(table_shape, model=None)  # type: ignore[arg-type]  # the per-slot fields alone
  per_slot = sharding.batch_shardings(rest, mesh)
  return dataclasses.replace(per_slot, model=sharding.decode_state_shardings(table_shape.model, mesh))


def host_settings(rows: list[SlotSettings], prefill_batch: int, n_stop: int) -> SlotSettings:
  """Per-row sampling arrays for one insert, padded to the prefill batch (padding rows are inert). Each row
  holds one entry's settings as Python scalars (stop_ids: a list of at most n_stop ids)."""
  out = SlotSettings.inert(prefill_batch, n_stop)
  for i, r in enumerate(rows):
    for f in dataclasses.fields(SlotSettings):
      value, column = getattr(r, f.name), getattr(out, f.name)
      if f.name == "stop_ids":
        column[i, : len(value)] = value
      else:
        column[i] = value
  return out
