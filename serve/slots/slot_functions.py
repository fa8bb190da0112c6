"""The compiled pieces of the engine: prefill a small batch chunk by chunk, insert it into slots, and
advance every slot by one sampled token. All shapes are fixed at construction; nothing here recompiles.

`SlotBackend` is the interface the engine calls, `SlotFunctions` its compiled implementation. The typed
pytrees they take and return live in serve.slots.slot_records, the bucket of rows a step runs over in
serve.slots.slot_rows, and the per-bucket lowering and compiling in serve.slots.slot_programs; their names
are also this module's (the engine's imports).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from laplace_jax import sharding
from laplace_jax.inference import speculative
from serve.slots import sampling, slot_programs
from serve.slots.slot_programs import SlotPrograms
from serve.slots.slot_records import (
  N_TOP,
  PrefillRows,
  PromptScores,
  SlotSettings,
  SlotTable,
  StepOutput,
  StepsOutput,
  host_settings,
  slot_table_shardings,
  table_axes,
)
from serve.slots.slot_rows import bucket_sizes, entry_writes, put_rows, step_rows, take_rows

__all__ = [  # the engine's, the fake's and the tests' names from before the records and rows moved out
  "N_TOP",
  "PrefillRows",
  "PromptScores",
  "SlotBackend",
  "SlotFunctions",
  "SlotPrograms",
  "SlotSettings",
  "SlotTable",
  "StepOutput",
  "StepsOutput",
  "bucket_sizes",
  "entry_writes",
  "host_settings",
  "slot_table_shardings",
  "step_rows",
  "table_axes",
]


class SlotBackend(Protocol):
  """What the engine calls to run the model over its slots (JetStream's prefill / insert / generate split):
  `SlotFunctions` compiles them; tests/helpers/fake_slots.py fakes them in numpy. Tables and batches are the typed
  pytrees of serve.slots.slot_records; every call returns new ones (the arguments may be donated). Packed outputs are
  `StepOutput.pack`'s, read on the host with `StepOutput.unpack`."""

  n_slots: int
  buckets: tuple[int, ...]  # the row counts generate and verify are compiled for (`bucket_sizes`)
  n_devices: int  # the slot axis is split over this many devices, in equal runs of slots
  prefill_batch: int
  n_stop: int  # stop ids per slot (SlotSettings.stop_ids' width)
  words: int  # G: int32 words of a row of an allowed-token bitmask (ceil of the padded vocabulary / 32)
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
    self, params, table: SlotTable, pf: PrefillRows, row_E, slot_E, settings: SlotSettings, allowed_ExG=None
  ):
    """Sample each entry's first token from prefill row row_E[i], among the tokens allowed_ExG allows (host
    int32 [E, G] bitmask, `sampling.masked`; None: all), and move that row into slot slot_E[i] (>= n_slots:
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

  def sample_rows(self, logits, table: SlotTable, rows_B, allowed_BxG=None):
    """Its second call: each row's next token among those allowed_BxG allows (host int32 [B, G]; None: all,
    a cached device array). Returns (table, packed StepOutput of the B rows)."""
    ...

  def verify(self, params, table: SlotTable, drafts_BxJ, n_drafts_B, rows_B=None, allowed_BxTxW=None):
    """Advance slots rows_B (None: every slot) by their next input and their first n_drafts_B[b] drafts
    (drafts_BxJ: J - 1 a row) in one pass, emitting what as many generate calls would, position j among the
    tokens allowed_BxTxW[b, j] allows (host int32 [B, J, G]; None: all). Returns (table, packed StepsOutput of the B rows); see SlotFunctions.verify."""
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


def _step_output(logits_SxY, tok_S, done_S, want_S, valid_vocab: int, branch_free: bool | None) -> StepOutput:
  """A step's StepOutput (its logprob fields only when some want_S >= 0; never when want_S is None)."""
  S = tok_S.shape[0]
  branch_free = sampling.branch_free_default() if branch_free is None else branch_free
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
      lambda: sampling.logprobs(logits_SxY, tok_S, valid_vocab=valid_vocab),
      zeros,
      branch_free,
    )
  )
  return StepOutput(token=tok_S, done=done_S, logprob=chosen, top_ids=ids, top_logprobs=vals)


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
    if mesh is not None and n_slots % mesh.size:
      raise ValueError(
        f"n_slots={n_slots} is not a multiple of the mesh's {mesh.size} devices: the slot "
        "table is split evenly over them. Pick a multiple (or a smaller mesh)."
      )
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
    self.words = -(-cfg.vocab_size // 32)  # G: a row of an allowed-token bitmask (the padded vocabulary's)
    self._all_ones: dict[tuple[tuple[int, ...], bool], jax.Array] = {}  # per (rows, split): all allowed
    # Abstract shapes of the slot table and a prefill batch (what serve.slots.lowering lowers from).
    self.table_shape = jax.eval_shape(self._empty_table)
    self.prefill_shape = jax.eval_shape(self._empty_prefill)
    # Measured from the real layout (not a formula): one slot's decode state, and the whole slot table.
    self.state_bytes_per_slot = _nbytes(self.state_shape)
    self.table_bytes = _nbytes(self.table_shape)
    self._jit_all()

  def _jit_all(self):
    """Place the table, batches and logits (over the mesh: the slot axis split, the rest replicated) and
    jit every program with its outputs placed so."""
    mesh = self.mesh
    # Without a mesh, the tables and batches made from nothing are placed on the default device as the
    # served params are (serve.slots.loading): a jit output is committed when an input is, and a prefill
    # chunk fed an uncommitted batch, then its own committed output, would compile twice (the second at
    # request time).
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    table_sh = pf_sh = rep = logits_sh = both = None
    if mesh is not None:
      rep = sharding.replicated(mesh)
      table_sh = slot_table_shardings(self.table_shape, mesh)
      pf_sh = jax.tree.map(lambda _: rep, self.prefill_shape)
      logits = jax.ShapeDtypeStruct((self.n_slots, self.cfg.vocab_size), jnp.float32)
      logits_sh, both = sharding.batch_shardings(logits, mesh), (table_sh, rep)
    self.table_shardings = table_sh
    self.logits_sharding = one if mesh is None else logits_sh  # where the decode call leaves its logits
    self.empty_table = _jit(self._empty_table, out=one if mesh is None else table_sh)
    self.empty_prefill = _jit(self._empty_prefill, out=one if mesh is None else pf_sh)
    self.prefill_chunk = _jit(self._prefill_chunk, donate=(1,), out=pf_sh)  # donated: the prefill batch
    self.prefill_chunk_scored = _jit(
      self._prefill_chunk_scored, donate=(1,), out=None if mesh is None else (pf_sh, rep)
    )
    # The slot table donated; one program per bucket (and per steps and greedy; per draft count): a bucket's
    # shape is its own.
    self.programs = SlotPrograms(
      insert=_jit(self._insert_entries, donate=(1,), out=both),
      decode=_jit(self._decode_next, donate=(1,), out=None if mesh is None else (table_sh, logits_sh)),
      sample=_jit(self._sample_next, donate=(1,), out=both),
      generate_steps=_jit(self._steps, donate=(1,), out=both, static=(3, 4)),
      verify=_jit(self._verify_drafts, donate=(1,), out=both),
    )
    # State cache: copy a few rows of a state out (a small [L, E, ...] array; nothing is donated, so the
    # step that follows runs on), and start a prefill batch from host states.
    self.gather = jax.jit(self._take)
    self.load_prefill = _jit(self._load_prefill, out=one if mesh is None else pf_sh)

  def precompile(
    self, params, table: SlotTable, *, decode_steps: int = 1, speculative_tokens: int = 0, workers: int = 0
  ) -> dict[int, float]:
    """See `SlotBackend.precompile` and `slot_programs.precompile`."""
    return slot_programs.precompile(
      self, params, table, decode_steps=decode_steps, speculative_tokens=speculative_tokens, workers=workers
    )

  def bucket_programs(
    self, params, table, *, decode_steps: int = 1, speculative_tokens: int = 0, rows_sharding=None
  ) -> dict[tuple[str, int], Any]:
    """{(name, bucket): jax Lowered} of every bucket's programs (`slot_programs.bucket_programs`): the engine's
    start-up compiles them (`precompile`); `python -m serve --target` checks them (serve.slots.lowering)."""
    return slot_programs.bucket_programs(
      self,
      params,
      table,
      decode_steps=decode_steps,
      speculative_tokens=speculative_tokens,
      rows_sharding=rows_sharding,
    )

  # ---- the traced functions ----

  def _init_state(self, batch: int):
    if "A" in self.cfg.mixers:
      return self.model.init_state(self.cfg, batch, max_len=self.max_context)
    return self.model.init_state(self.cfg, batch)

  def _take(self, state, rows_E):
    """Rows rows_E of a model state (the slot table's or a prefill batch's: [L, S, ...] -> [L, E, ...]),
    each leaf along its own sequence axis."""
    return jax.tree.map(lambda x, axis: jnp.take(x, rows_E, axis=axis), state, self.axes)

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
    logits_PxCxY, state = self.model.LaplaceLM(self.cfg).apply(
      {"params": params}, tokens_PxC, pf.model, mask_PxC
    )
    logits_PxCxY = logits_PxCxY.astype(jnp.float32)
    last = jnp.take_along_axis(logits_PxCxY, jnp.maximum(lengths_P - 1, 0)[:, None, None], 1)[:, 0]
    last = jnp.where((lengths_P > 0)[:, None], last, pf.logits)
    before_PxCxY = jnp.concatenate([pf.logits[:, None], logits_PxCxY[:, :-1]], 1)
    chosen, vals, ids = sampling.logprobs(
      before_PxCxY.reshape(P * C, -1), tokens_PxC.reshape(-1), valid_vocab=self.valid_vocab
    )
    return PrefillRows(model=state, logits=last), PromptScores(
      logprob=chosen.reshape(P, C),
      top_logprobs=vals.reshape(P, C, N_TOP),
      top_ids=ids.reshape(P, C, N_TOP),
    )

  def _step_output(self, logits_SxY, tok_S, done_S, want_S) -> StepOutput:
    return _step_output(logits_SxY, tok_S, done_S, want_S, self.valid_vocab, self.branch_free)

  def insert(
    self, params, table: SlotTable, pf: PrefillRows, row_E, slot_E, settings: SlotSettings, allowed_ExG=None
  ):
    """See `SlotBackend.insert` and `_insert_entries`."""
    mask = self.mask(allowed_ExG, (len(row_E),), split=False)
    return self.programs.insert(params, table, pf, row_E, slot_E, settings, mask)

  def _insert_entries(
    self, params, table: SlotTable, pf: PrefillRows, row_E, slot_E, settings: SlotSettings, allowed_ExG
  ):
    """Sample a first token for each entry from prefill row row_E[i] among the tokens allowed_ExG allows,
    and write that row into slot slot_E[i] (slot_E >= S: padding, not written). Several entries may share a
    row (n choices of one prompt). Returns (table, packed StepOutput of the E entries)."""
    del params
    zero = jnp.zeros_like(slot_E)
    logits = pf.logits[row_E]
    # A few entries per prefill: one sampler to compile (free_path=False).
    tok, done = self._draw(logits, settings, zero, allowed_ExG, free_path=False)
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
    return new, self._step_output(logits, tok, done, settings.logprobs).pack()

  def _load_prefill(self, state) -> PrefillRows:
    """A prefill batch that starts from the given (host) state rows instead of zeros."""
    return PrefillRows(
      model=jax.tree.map(jnp.asarray, state),
      logits=jnp.zeros((self.prefill_batch, self.cfg.vocab_size), jnp.float32),
    )

  def generate(self, params, table: SlotTable, steps: int = 1, greedy: bool = False, rows_B=None):
    """Advance slots rows_B (`step_rows`; None: every slot) by `steps` tokens; the table's other rows are not
    read or written. Returns (table, packed output over the B rows): one step's StepOutput, or for steps > 1 a StepsOutput
    over J = steps positions (StepsOutput.unpack(out, steps)), the tokens and draws of as many single steps.

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
      with self._on_mesh():
        return self.programs.generate_steps(params, table, rows_B, steps, greedy)
    table, logits = self.decode_rows(params, table, rows_B)
    return self.sample_rows(logits, table, rows_B)

  def decode_rows(self, params, table: SlotTable, rows_B):
    """See `SlotBackend.decode_rows`."""
    with self._on_mesh():
      return self.programs.decode(params, table, rows_B)

  def sample_rows(self, logits, table: SlotTable, rows_B, allowed_BxG=None):
    """See `SlotBackend.sample_rows`: one compiled program per bucket, masked or not."""
    return self.programs.sample(logits, table, rows_B, self.mask(allowed_BxG, (len(rows_B),)))

  def _on_mesh(self):
    """The serving mesh as the current one while a call traces (nothing without a mesh)."""
    return contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh)

  def mask(self, allowed, rows: tuple[int, ...], split: bool = True) -> jax.Array:
    """A call's mask input, int32 [*rows, G] (a row per entry or slot, [B, J] per verified position),
    placed as the call takes it (split: over the slot axis, as the bucket's logits; else replicated): the
    host's `allowed`, or for None a cached device array of all ones, so a call without constrained rows
    copies nothing to the device. Both are committed alike, so they share one compiled program."""
    want = self.mask_shape(rows, split)
    if allowed is None:
      if (rows, split) not in self._all_ones:
        self._all_ones[(rows, split)] = jax.device_put(np.full(want.shape, -1, np.int32), want.sharding)
      return self._all_ones[(rows, split)]
    if np.shape(allowed) != want.shape:
      raise ValueError(f"a mask of shape {np.shape(allowed)}: expected {want.shape} (rows, then G words).")
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

  # ---- a bucket of rows: gathered from the table by index, written back in place (serve.slots.slot_rows) ----

  def _rows(self, table: SlotTable, rows_B) -> SlotTable:
    """The bucket's rows of the table, a table of B slots."""
    return take_rows(table, table_axes(self.axes), rows_B, self.n_slots, self.n_devices)

  def _put_rows(self, tree, axes, rows_B, new):
    return put_rows(tree, axes, rows_B, new, self.n_slots, self.n_devices)

  def _write_back(self, table: SlotTable, rows_B, sub: SlotTable, model: bool = True) -> SlotTable:
    """The table with the bucket's rows replaced by sub's (settings never change in a step; model=False:
    nor did the state)."""
    return dataclasses.replace(
      table,
      model=self._put_rows(table.model, self.axes, rows_B, sub.model) if model else table.model,
      tokens=self._put_rows(table.tokens, 0, rows_B, sub.tokens),
      last_output_index=self._put_rows(table.last_output_index, 0, rows_B, sub.last_output_index),
    )

  # ---- the steps, over a bucket ----

  def _decode_next(self, params, table: SlotTable, rows_B):
    """One decode step of the bucket's slots (those whose next input ends them stand still with
    hold_ended). Returns (table, logits [B, Y])."""
    sub = self._rows(table, rows_B)
    sub, logits = self._decode_logits(params, sub, ~_input_ends(sub) if self.hold_ended else None)
    return dataclasses.replace(table, model=self._put_rows(table.model, self.axes, rows_B, sub.model)), logits

  def _decode_logits(self, params, table: SlotTable, live_S=None):
    logits, state = self.model.decode_step(params, table.model, table.tokens, cfg=self.cfg, live_B=live_S)
    return dataclasses.replace(table, model=state), logits

  def _sample_next(self, logits_BxY, table: SlotTable, rows_B, allowed_BxG):
    """Sample the bucket's next tokens from the decode call's logits, among the tokens allowed_BxG allows
    (int32 [B, G]; all ones for a free row)."""
    few = dataclasses.replace(table_axes(self.axes), model=None)  # type: ignore[arg-type]  # all but the state
    rest = dataclasses.replace(table, model=None)  # type: ignore[arg-type]
    sub = take_rows(rest, few, rows_B, self.n_slots, self.n_devices)
    sub, out = self._sample_step(logits_BxY, sub, allowed_SxG=allowed_BxG)
    return self._write_back(table, rows_B, sub, model=False), out.pack()

  def _draw(self, logits, s: SlotSettings, index, allowed, *, temperature=None, free_path: bool = True):
    """Each row's token drawn by its settings `s` at output `index` (also its position in the row's random
    stream) among the tokens `allowed` allows, and whether that token finishes the row; `temperature`
    overrides the settings' own."""
    t = s.temperature if temperature is None else temperature
    tok = self.sample(
      logits,
      t,
      s.top_k,
      s.top_p,
      s.seed,
      index,
      seed_hi_S=s.seed_hi,
      allowed_SxG=allowed,
      free_path=free_path,
    )
    return tok, _done(tok, index, s.max_tokens, s.stop_ids)

  def _sample_step(
    self, logits_SxY, table: SlotTable, greedy: bool = False, allowed_SxG=None
  ) -> tuple[SlotTable, StepOutput]:
    """Each slot's next token (among those allowed_SxG allows; None: all). A slot whose input ended it
    (finished, freed, never used) keeps its token and index, so it stays ended until an insert, and samples
    nothing: greedy, without logprobs (a freed slot's last settings would otherwise keep the sampler's
    costly paths running for nobody)."""
    s = table.settings
    ended_S = _input_ends(table)
    index = table.last_output_index + 1  # also the draw's position in the slot's random stream
    if greedy:  # the sampler's own greedy path (its rows at temperature 0), without its branches
      tok = sampling.argmax_rows(logits_SxY.astype(jnp.float32), self.valid_vocab, allowed_SxG)
      out = self._step_output(logits_SxY, tok, _done(tok, index, s.max_tokens, s.stop_ids), None)
    else:
      temperature = jnp.where(ended_S, 0.0, s.temperature)
      tok, done = self._draw(logits_SxY, s, index, allowed_SxG, temperature=temperature)
      out = self._step_output(logits_SxY, tok, done, jnp.where(ended_S, -1, s.logprobs))
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
    out = jax.tree.map(lambda x: jnp.moveaxis(x, 0, 1), outs)  # [J, B, ...] -> [B, J, ...]
    # Up to the first token that ends the slot (a min over indices: no argmax, a variadic reduce on Neuron).
    first_end = jnp.where(out.done, jnp.arange(steps)[None, :], steps).min(1)
    emitted = jnp.minimum(first_end + 1, steps)
    return self._write_back(table, rows_B, sub), StepsOutput(emitted=emitted, steps=out).pack()

  def verify(self, params, table: SlotTable, drafts_BxJ, n_drafts_B, rows_B=None, allowed_BxTxW=None):
    """Advance slots rows_B (`step_rows`; None: every slot) by 1 … J tokens in one pass: each one's next input and its
    first n_drafts_B[b] drafted tokens (drafts_BxJ[b, :n], J - 1 a row; the rest of the row is ignored, n = 0
    makes the call one generate step for that slot) go through the model together, each position samples
    the token the slot would sample there, and a draft is accepted while it equals the token sampled before
    it (and that token does not end the slot). Each slot emits its accepted drafts + 1 tokens, those that as
    many `generate` calls would have produced (the same draws; the logits equal up to fp32 rounding, the chunk
    form's against the recurrence's, so a near-tie may be chosen otherwise), and its state is committed at
    that length (laplace_jax.inference.speculative). Position j samples among the tokens allowed_BxTxW[b, j] allows
    (host int32 [B, J, G]: what the slot's grammar allows after its first j drafts; None: all), so a
    draft its grammar forbids is never accepted. Returns (table, packed StepsOutput over the B rows;
    StepsOutput.unpack(out, J)).

    Slots of models with attention layers need J free rows in their KV cache (the engine verifies
    only then): a row that would outgrow it gets NaN logits, as in decode."""
    rows_B = self.every_row if rows_B is None else rows_B
    mask = self.mask(allowed_BxTxW, (len(rows_B), np.shape(drafts_BxJ)[1] + 1))
    with self._on_mesh():
      return self.programs.verify(params, table, rows_B, drafts_BxJ, n_drafts_B, mask)

  def _verify_drafts(self, params, table: SlotTable, rows_B, drafts_SxJ, n_drafts_S, allowed_SxJxG):
    sub = self._rows(table, rows_B)  # S below: the bucket's B slots
    S, n = drafts_SxJ.shape
    J = n + 1  # the positions scored: the next input, then each draft
    real_SxJ = jnp.arange(n)[None, :] < n_drafts_S[:, None]  # (its first J - 1 columns: the drafts')
    inputs = jnp.concatenate([sub.tokens[:, None], jnp.where(real_SxJ, drafts_SxJ, 0)], axis=1)
    logits, drafted = speculative.verify(params, sub.model, inputs, cfg=self.cfg)
    flat = logits.reshape(S * J, -1).astype(jnp.float32)
    # Position j of slot s draws as the (j + 1)-th next generate step would: its index in the output is
    # also its position in the slot's random stream.
    index_SxJ = sub.last_output_index[:, None] + 1 + jnp.arange(J)[None, :]
    st = jax.tree.map(lambda x: jnp.repeat(x, J, axis=0), sub.settings)  # each slot's settings, J times
    index = index_SxJ.reshape(-1)
    allowed = allowed_SxJxG.reshape(S * J, -1)
    # A verify's positions: one sampler to compile (free_path=False; their mask is a pass over the logits).
    tok, done = self._draw(flat, st, index, allowed, free_path=False)
    tok_SxJ, done_SxJ = tok.reshape(S, J), done.reshape(S, J)
    agree = (tok_SxJ[:, :n] == drafts_SxJ) & real_SxJ & ~done_SxJ[:, :n]
    accepted = jnp.cumprod(agree.astype(jnp.int32), axis=1).sum(1)  # leading drafts that agree
    emitted = accepted + 1
    state = speculative.commit(sub.model, drafted, emitted, cfg=self.cfg)
    new = dataclasses.replace(
      sub,
      model=state,
      tokens=jnp.take_along_axis(tok_SxJ, accepted[:, None], axis=1)[:, 0],
      last_output_index=sub.last_output_index + emitted,
    )
    steps = self._step_output(flat, tok, done, st.logprobs)
    steps = jax.tree.map(lambda x: x.reshape(S, J, *x.shape[1:]), steps)
    return self._write_back(table, rows_B, new), StepsOutput(emitted=emitted, steps=steps).pack()


def _nbytes(shapes) -> int:
  return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(shapes))


def _jit(f, donate=(), out=None, static=()):
  """jax.jit with these donated and static arguments, and out_shardings unless out is None."""
  placed = {} if out is None else {"out_shardings": out}
  return jax.jit(f, donate_argnums=donate, static_argnums=static, **placed)
