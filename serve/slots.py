"""The compiled pieces of the engine: prefill a small batch chunk by chunk, insert it into slots, and
advance every slot by one sampled token. All shapes are fixed at construction; nothing here recompiles.

Slot table (one pytree; the slot axis S of each model-state leaf where `DecodeState.batch_axes` puts it):
  model: the model's DecodeState (laplace_jax/state.py), layer-major tables [L_x, S, ...] and its own pos [S]
  (tokens consumed; an insert writes the prefilled row's, so a reused slot starts over);
  tokens [S] (next input);  pos [S] (index of the last
  generated token);  temperature, top_p f32 [S];  top_k, max_tokens i32 [S];  seed, seed_hi u32 [S] (a 64-bit
  seed's two words);  logprobs i32 [S] (-1: off, else top-n wanted);  stop_ids i32 [S, N_STOP] (-1 pads).

Each step's output is one int32 array [3 + 2·N, S] (N = TOP_LOGPROBS), so one host copy carries it all:
rows token, finished, chosen-token logprob (f32 bits), N top ids, N top logprobs (f32 bits). The logprob
rows are computed only when some slot asks for them (zeros otherwise).
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np

from laplace_jax import sharding
from serve import sampling

SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "seed", "seed_hi", "max_tokens", "logprobs", "stop_ids")
SAMPLING_DTYPES = {
  "temperature": np.float32,
  "top_k": np.int32,
  "top_p": np.float32,
  "seed": np.uint32,
  "seed_hi": np.uint32,
  "max_tokens": np.int32,
  "logprobs": np.int32,
  "stop_ids": np.int32,
}
N_TOP = sampling.TOP_LOGPROBS


def unpack_logprobs(out, i):
  """(chosen logprob, [(id, logprob)] top N) of column i of a step's output array (host numpy)."""
  f = lambda rows: rows.view(np.float32)
  top = f(out[3 + N_TOP : 3 + 2 * N_TOP, i])
  return float(f(out[2:3, i])[0]), [(int(t), float(v)) for t, v in zip(out[3 : 3 + N_TOP, i], top)]


def _done(tok_S, pos_S, max_tokens_S, stop_ids_SxN):
  """A slot is finished when it produced a stop id or its (pos + 1)-th token reached max_tokens."""
  return (tok_S[:, None] == stop_ids_SxN).any(-1) | (pos_S + 1 >= max_tokens_S)


class SlotFunctions:
  """Jitted prefill / insert / generate for one model, slot count, prefill batch and mesh."""

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
  ):
    self.model, self.cfg = model, cfg
    self.max_context = max_context  # attention layers' KV cache length per slot (None: no 'A' layers)
    self.state_shape = jax.eval_shape(lambda: self._init_state(1))  # one sequence's decode state
    self.axes = self.state_shape.batch_axes()  # each leaf's sequence axis, a DecodeState of ints
    self.n_slots, self.prefill_batch, self.n_stop = n_slots, prefill_batch, n_stop
    # branch_free: sampling and the logprob rows without `cond` (None: decided when traced, on Neuron only)
    self.branch_free = branch_free
    self.sample = functools.partial(sampling.sample, valid_vocab=valid_vocab, branch_free=branch_free)
    self.valid_vocab = valid_vocab
    self.mesh = mesh
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
    self.empty_table = _jit(self._empty_table, out=table_sh)
    self.empty_prefill = _jit(self._empty_prefill, out=pf_sh)
    self.prefill_chunk = _jit(self._prefill_chunk, donate=(1,), out=pf_sh)  # donated: the prefill batch
    self.prefill_chunk_scored = _jit(
      self._prefill_chunk_scored, donate=(1,), out=None if mesh is None else (pf_sh, rep)
    )
    self.insert = _jit(self._insert, donate=(1,), out=both)  # donated: the slot table
    logits_sh = (
      None
      if mesh is None
      else sharding.batch_shardings(jax.ShapeDtypeStruct((n_slots, cfg.vocab_size), jnp.float32), mesh)
    )
    self._decode = _jit(self._decode_logits, donate=(1,), out=None if mesh is None else (table_sh, logits_sh))
    self._sample = _jit(self._sample_next, donate=(1,), out=both)
    # State cache: copy a few rows of a state out (a small [L, E, ...] array; nothing is donated, so the
    # step that follows runs on), and start a prefill batch from host states.
    self.gather = jax.jit(self._gather)
    self.load_prefill = _jit(self._load_prefill, out=pf_sh)

  # ---- the traced functions ----

  def _init_state(self, batch: int):
    if "A" in self.cfg.mixers:
      return self.model.init_state(self.cfg, batch, max_len=self.max_context)
    return self.model.init_state(self.cfg, batch)

  def _take(self, state, rows):
    """Rows `rows` of a model state, each leaf along its own sequence axis."""
    return jax.tree.map(lambda x, axis: jnp.take(x, rows, axis=axis), state, self.axes)

  def _empty_table(self):
    S = self.n_slots
    z = lambda dt, *shape: jnp.zeros((S, *shape), dt)
    return {
      "model": self._init_state(S),
      "tokens": z(jnp.int32),
      "pos": z(jnp.int32),
      "temperature": z(jnp.float32),
      "top_k": z(jnp.int32),
      "top_p": jnp.ones((S,), jnp.float32),
      "seed": z(jnp.uint32),
      "seed_hi": z(jnp.uint32),
      "max_tokens": jnp.ones((S,), jnp.int32),
      "logprobs": jnp.full((S,), -1, jnp.int32),
      "stop_ids": jnp.full((S, self.n_stop), -1, jnp.int32),
    }

  def _empty_prefill(self):
    """Zero state and logits for one prefill batch (rows are fresh sequences)."""
    Pb = self.prefill_batch
    return {"model": self._init_state(Pb), "logits": jnp.zeros((Pb, self.cfg.vocab_size), jnp.float32)}

  def _prefill_chunk(self, params, pf, tokens_PxC, lengths_P):
    """One 128-token chunk for the prefill batch; rows with length 0 keep state and last logits."""
    logits, state = self.model.prefill_chunk(params, pf["model"], tokens_PxC, lengths_P, cfg=self.cfg)
    logits = jnp.where((lengths_P > 0)[:, None], logits.astype(jnp.float32), pf["logits"])
    return {"model": state, "logits": logits}

  def _prefill_chunk_scored(self, params, pf, tokens_PxC, lengths_P):
    """`_prefill_chunk` that also scores every token of the chunk (echo): the logprob of token j given
    all before it (the previous chunk's last logits predict token 0) and the top N there. Returns
    (pf, (chosen [P, C], top logprobs [P, C, N], top ids [P, C, N]))."""
    P, C = tokens_PxC.shape
    mask_PxC = jnp.arange(C)[None, :] < lengths_P[:, None]
    logits_PxCxV, state = self.model.LaplaceLM(self.cfg).apply(
      {"params": params}, tokens_PxC, pf["model"], mask_PxC
    )
    logits_PxCxV = logits_PxCxV.astype(jnp.float32)
    last = jnp.take_along_axis(logits_PxCxV, jnp.maximum(lengths_P - 1, 0)[:, None, None], 1)[:, 0]
    last = jnp.where((lengths_P > 0)[:, None], last, pf["logits"])
    before_PxCxV = jnp.concatenate([pf["logits"][:, None], logits_PxCxV[:, :-1]], 1)
    chosen, vals, ids = sampling.logprobs(
      before_PxCxV.reshape(P * C, -1), tokens_PxC.reshape(-1), valid_vocab=self.valid_vocab
    )
    return {"model": state, "logits": last}, (
      chosen.reshape(P, C),
      vals.reshape(P, C, N_TOP),
      ids.reshape(P, C, N_TOP),
    )

  def _pack(self, logits_SxV, tok_S, done_S, want_S):
    """One int32 output array (see the module docstring)."""
    S = tok_S.shape[0]
    branch_free = sampling.branch_free_default() if self.branch_free is None else self.branch_free
    chosen, vals, ids = sampling.when_any(
      want_S >= 0,
      lambda: sampling.logprobs(logits_SxV, tok_S, valid_vocab=self.valid_vocab),
      lambda: (
        jnp.zeros((S,), jnp.float32),
        jnp.zeros((S, N_TOP), jnp.float32),
        jnp.zeros((S, N_TOP), jnp.int32),
      ),
      branch_free,
    )
    bits = lambda x: jax.lax.bitcast_convert_type(x, jnp.int32)
    return jnp.concatenate(
      [tok_S[None], done_S.astype(jnp.int32)[None], bits(chosen)[None], ids.T, bits(vals).T]
    )

  def _insert(self, params, table, pf, row_E, slot_E, settings):
    """Sample a first token for each entry from prefill row row_E[i] and write that row into slot
    slot_E[i] (slot_E >= S: padding, not written). Several entries may share a row (n choices of one prompt).
    Returns (table, out [3 + 2N, E] int32)."""
    del params
    zero = jnp.zeros_like(slot_E)
    logits = pf["logits"][row_E]
    tok = self.sample(
      logits,
      settings["temperature"],
      settings["top_k"],
      settings["top_p"],
      settings["seed"],
      zero,
      seed_hi_S=settings["seed_hi"],
    )
    done = _done(tok, zero, settings["max_tokens"], settings["stop_ids"])
    src, slot_w, any_real = entry_writes(slot_E, self.n_slots)

    def put(big, small, axis):  # small: the values of the writes, already indexed by src
      if axis == 1:
        return big.at[:, slot_w].set(jnp.where(any_real, small, big[:, :1]), mode="promise_in_bounds")
      return big.at[slot_w].set(jnp.where(any_real, small, big[:1]), mode="promise_in_bounds")

    # Every leaf of the prefilled row, its pos included, replaces the slot's: nothing of the slot's last
    # sequence (its rings, KV cache, position) survives into the next.
    rows = self._take(pf["model"], row_E[src])
    new = {
      "model": jax.tree.map(put, table["model"], rows, self.axes),
      "tokens": put(table["tokens"], tok[src], 0),
      "pos": put(table["pos"], zero, 0),
    }
    for name in SAMPLING_FIELDS:
      new[name] = put(table[name], settings[name][src].astype(table[name].dtype), 0)
    return new, self._pack(logits, tok, done, settings["logprobs"])

  def _gather(self, state, rows_E):
    """Rows rows_E of a model state (the slot table's or a prefill batch's: [L, S, ...] -> [L, E, ...])."""
    return self._take(state, rows_E)

  def _load_prefill(self, state):
    """A prefill batch that starts from the given (host) state rows instead of zeros."""
    return {
      "model": jax.tree.map(jnp.asarray, state),
      "logits": jnp.zeros((self.prefill_batch, self.cfg.vocab_size), jnp.float32),
    }

  def generate(self, params, table):
    """Advance every slot by one token. Returns (table, out [2, S] int32: tokens and finished flags).

    Two compiled calls, decode then sampling: compiled into one program on the CPU, the (untaken)
    sampling branches made the step 1.7-2x slower than the decode step alone at 64 `tiny` slots."""
    # Traced under the serving mesh: the model pins activations to the slot split, and the GPU decode
    # kernel (one device's program) knows to leave a multi-device table to XLA.
    with contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh):
      table, logits = self._decode(params, table)
    return self._sample(logits, table)

  def _decode_logits(self, params, table):
    logits, state = self.model.decode_step(params, table["model"], table["tokens"], cfg=self.cfg)
    return dict(table, model=state), logits

  def _sample_next(self, logits, table):
    pos = table["pos"] + 1
    tok = self.sample(
      logits,
      table["temperature"],
      table["top_k"],
      table["top_p"],
      table["seed"],
      pos,
      seed_hi_S=table["seed_hi"],
    )
    done = _done(tok, pos, table["max_tokens"], table["stop_ids"])
    return dict(table, tokens=tok, pos=pos), self._pack(logits, tok, done, table["logprobs"])


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


def slot_table_shardings(table_shape, mesh):
  """Split the slot axis over every device: the model state's axis 1, axis 0 of the per-slot arrays."""
  rest = {k: v for k, v in table_shape.items() if k != "model"}
  return {
    "model": sharding.decode_state_shardings(table_shape["model"], mesh),
    **sharding.batch_shardings(rest, mesh),
  }


def host_settings(rows: list[dict], prefill_batch: int, n_stop: int) -> dict:
  """Per-row sampling arrays for one insert, padded to the prefill batch (padding rows are inert)."""
  out = {n: np.zeros((prefill_batch,), SAMPLING_DTYPES[n]) for n in SAMPLING_FIELDS if n != "stop_ids"}
  out["top_p"][:] = 1.0
  out["max_tokens"][:] = 1
  out["logprobs"][:] = -1
  out["stop_ids"] = np.full((prefill_batch, n_stop), -1, np.int32)
  for i, r in enumerate(rows):
    for n in SAMPLING_FIELDS:
      if n == "stop_ids":
        out[n][i, : len(r[n])] = r[n]
      else:
        out[n][i] = r[n]
  return out
