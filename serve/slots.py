"""The compiled pieces of the engine: prefill a small batch chunk by chunk, insert it into slots, and
advance every slot by one sampled token. All shapes are fixed at construction; nothing here recompiles.

Slot table (one pytree, leading slot axis S after the model state's layer axis):
  model: the model's decode state [L, S, ...];  tokens [S] (next input);  pos [S] (index of the last
  generated token);  temperature, top_p f32 [S];  top_k, max_tokens i32 [S];  seed u32 [S];
  stop_ids i32 [S, N_STOP] (-1 pads).
"""
from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np

from laplace_jax import sharding
from serve import sampling

SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "seed", "max_tokens", "stop_ids")
SAMPLING_DTYPES = {"temperature": np.float32, "top_k": np.int32, "top_p": np.float32, "seed": np.uint32,
                   "max_tokens": np.int32, "stop_ids": np.int32}


def _done(tok_S, pos_S, max_tokens_S, stop_ids_SxN):
  """A slot is finished when it produced a stop id or its (pos + 1)-th token reached max_tokens."""
  return (tok_S[:, None] == stop_ids_SxN).any(-1) | (pos_S + 1 >= max_tokens_S)


class SlotFunctions:
  """Jitted prefill / insert / generate for one model, slot count, prefill batch and mesh."""

  def __init__(self, model, cfg, *, n_slots: int, prefill_batch: int, n_stop: int, valid_vocab: int,
               mesh=None):
    self.model, self.cfg = model, cfg
    self.n_slots, self.prefill_batch, self.n_stop = n_slots, prefill_batch, n_stop
    self.sample = functools.partial(sampling.sample, valid_vocab=valid_vocab)
    self.mesh = mesh
    table_shape = jax.eval_shape(self._empty_table)
    pf_shape = jax.eval_shape(self._empty_prefill)
    if mesh is None:
      table_sh = pf_sh = rep = None
    else:
      if n_slots % mesh.size:
        raise ValueError(f"n_slots={n_slots} is not a multiple of the mesh's {mesh.size} devices: the slot "
                         "table is split evenly over them. Pick a multiple (or a smaller mesh).")
      rep = sharding.replicated(mesh)
      table_sh = slot_table_shardings(table_shape, mesh)
      pf_sh = jax.tree.map(lambda _: rep, pf_shape)
    self.table_shardings = table_sh
    both = None if mesh is None else (table_sh, rep)
    self.empty_table = _jit(self._empty_table, out=table_sh)
    self.empty_prefill = _jit(self._empty_prefill, out=pf_sh)
    self.prefill_chunk = _jit(self._prefill_chunk, donate=(1,), out=pf_sh)  # donated: the prefill batch
    self.insert = _jit(self._insert, donate=(1,), out=both)                 # donated: the slot table
    logits_sh = None if mesh is None else sharding.batch_shardings(
        jax.ShapeDtypeStruct((n_slots, cfg.vocab_size), jnp.float32), mesh)
    self._decode = _jit(self._decode_logits, donate=(1,), out=None if mesh is None else (table_sh, logits_sh))
    self._sample = _jit(self._sample_next, donate=(1,), out=both)

  # ---- the traced functions ----

  def _empty_table(self):
    S = self.n_slots
    z = lambda dt, *shape: jnp.zeros((S, *shape), dt)
    return {"model": self.model.init_state(self.cfg, S), "tokens": z(jnp.int32), "pos": z(jnp.int32),
            "temperature": z(jnp.float32), "top_k": z(jnp.int32), "top_p": jnp.ones((S,), jnp.float32),
            "seed": z(jnp.uint32), "max_tokens": jnp.ones((S,), jnp.int32),
            "stop_ids": jnp.full((S, self.n_stop), -1, jnp.int32)}

  def _empty_prefill(self):
    """Zero state and logits for one prefill batch (rows are fresh sequences)."""
    Pb = self.prefill_batch
    return {"model": self.model.init_state(self.cfg, Pb),
            "logits": jnp.zeros((Pb, self.cfg.vocab_size), jnp.float32)}

  def _prefill_chunk(self, params, pf, tokens_PxC, lengths_P):
    """One 128-token chunk for the prefill batch; rows with length 0 keep state and last logits."""
    logits, state = self.model.prefill_chunk(params, pf["model"], tokens_PxC, lengths_P, cfg=self.cfg)
    logits = jnp.where((lengths_P > 0)[:, None], logits.astype(jnp.float32), pf["logits"])
    return {"model": state, "logits": logits}

  def _insert(self, params, table, pf, slot_P, settings):
    """Sample each row's first token and write row i into slot slot_P[i] (slot_P >= S: padding, dropped).
    Returns (table, out [2, P] int32: first tokens and finished flags)."""
    del params
    zero = jnp.zeros_like(slot_P)
    tok = self.sample(pf["logits"], settings["temperature"], settings["top_k"], settings["top_p"],
                      settings["seed"], zero)
    done = _done(tok, zero, settings["max_tokens"], settings["stop_ids"])
    put = lambda big, small, axis: (big.at[:, slot_P].set(small, mode="drop") if axis == 1
                                    else big.at[slot_P].set(small, mode="drop"))
    new = {"model": jax.tree.map(lambda b, s: put(b, s, 1), table["model"], pf["model"]),
           "tokens": put(table["tokens"], tok, 0), "pos": put(table["pos"], zero, 0)}
    for name in SAMPLING_FIELDS:
      new[name] = put(table[name], settings[name].astype(table[name].dtype), 0)
    return new, jnp.stack([tok, done.astype(jnp.int32)])

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
    tok = self.sample(logits, table["temperature"], table["top_k"], table["top_p"], table["seed"], pos)
    done = _done(tok, pos, table["max_tokens"], table["stop_ids"])
    return dict(table, tokens=tok, pos=pos), jnp.stack([tok, done.astype(jnp.int32)])


def _jit(f, donate=(), out=None):
  return jax.jit(f, donate_argnums=donate) if out is None else jax.jit(f, donate_argnums=donate,
                                                                       out_shardings=out)


def slot_table_shardings(table_shape, mesh):
  """Split the slot axis over every device: the model state's axis 1, axis 0 of the per-slot arrays."""
  rest = {k: v for k, v in table_shape.items() if k != "model"}
  return {"model": sharding.decode_state_shardings(table_shape["model"], mesh),
          **sharding.batch_shardings(rest, mesh)}


def host_settings(rows: list[dict], prefill_batch: int, n_stop: int) -> dict:
  """Per-row sampling arrays for one insert, padded to the prefill batch (padding rows are inert)."""
  out = {n: np.zeros((prefill_batch,), SAMPLING_DTYPES[n]) for n in SAMPLING_FIELDS if n != "stop_ids"}
  out["top_p"][:] = 1.0
  out["max_tokens"][:] = 1
  out["stop_ids"] = np.full((prefill_batch, n_stop), -1, np.int32)
  for i, r in enumerate(rows):
    for n in SAMPLING_FIELDS:
      if n == "stop_ids":
        out[n][i, :len(r[n])] = r[n]
      else:
        out[n][i] = r[n]
  return out
