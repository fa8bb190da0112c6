"""The typed pytrees the slot functions take and return: each slot's sampling settings (`SlotSettings`), the
slot table (`SlotTable`), a prefill batch (`PrefillRows`), a scoring prefill's output (`PromptScores`) and
what a step produced (`StepOutput`, `StepsOutput`, each with its one-array packed form for the host copy).
Each field says what it holds where it is declared. The model's state in them is a
`laplace_jax.model.state.DecodeState`, its slot axis where `DecodeState.batch_axes` puts it.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from laplace_jax import sharding
from laplace_jax.array_types import Array
from laplace_jax.model.state import DecodeState
from serve.slots import sampling

N_TOP = sampling.TOP_LOGPROBS


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
  logits: Array  # f32 [P, Y] each row's logits after its last prompt token so far


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
    verify's [S, J] fields (host arrays)."""
    top = [(int(t), float(v)) for t, v in zip(self.top_ids[i], self.top_logprobs[i])]
    return float(self.logprob[i]), top


@struct.dataclass
class StepsOutput:
  """What a call that advances each slot by up to J tokens produced, S slots over J positions: a verify
  (J = drafts + 1; position j holds the token sampled after the slot's next input and its first j drafts) or
  a generate of J steps. Position j is index last_output_index + 1 + j of the slot's output, drawn exactly as
  the j-th next single generate step would draw it; the slot emits positions 0 … emitted − 1 and nothing
  after them."""

  emitted: Array  # i32 [S] tokens the slot emits (1 … J): a verify's accepted drafts + 1; a generate's
  # tokens up to the one that ends the slot, else J
  steps: StepOutput  # [S, J] fields (top ids and logprobs [S, J, N]); done: that token ends the slot

  def pack(self) -> Array:
    """One int32 [R + 1, S·J] array (one device-to-host copy): the steps flattened slot-major as
    StepOutput.pack lays them out, then a row holding each slot's `emitted` at every one of its J entries."""
    S, J = self.steps.token.shape
    flat = jax.tree.map(lambda x: x.reshape(S * J, *x.shape[2:]), self.steps)
    xp = np if isinstance(self.emitted, np.ndarray) else jnp
    return xp.concatenate([flat.pack(), xp.repeat(self.emitted.astype(xp.int32), J)[None]])

  @classmethod
  def unpack(cls, packed: np.ndarray, n_positions: int, n_top: int = N_TOP) -> StepsOutput:
    """The inverse of `pack` on the host (numpy arrays), J = n_positions."""
    flat = StepOutput.unpack(packed[:-1], n_top)
    S = packed.shape[1] // n_positions
    steps = jax.tree.map(lambda x: x.reshape(S, n_positions, *x.shape[1:]), flat)
    return cls(emitted=packed[-1].reshape(S, n_positions)[:, 0].copy(), steps=steps)

  def tokens_of(self, s: int) -> list[int]:
    """The tokens slot s emits, in order (host arrays)."""
    return self.steps.token[s, : int(self.emitted[s])].tolist()


def table_axes(state_axes) -> SlotTable:
  """Each slot-table leaf's slot axis: the model state's (`DecodeState.batch_axes`), 0 for the rest."""
  return SlotTable(
    model=state_axes,
    tokens=0,
    last_output_index=0,
    settings=jax.tree.map(lambda _: 0, SlotSettings.inert(1, 1)),
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
