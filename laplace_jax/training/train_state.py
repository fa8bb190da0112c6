"""The train state as a typed pytree (and the training batch, defined with the data in laplace_jax/data/batch.py);
optional parts are fields that default to None, so the tree's structure (not a key's presence) says which
step is compiled."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from flax import struct

from laplace_jax.array_types import Array
from laplace_jax.data.batch import Batch as Batch  # the step's input, defined with the data that yields it
from laplace_jax.model.state import DecodeState


@struct.dataclass
class Carry:
  """State passing's carried state: each row's recurrent state after its last token, batch-major (the row
  axis first, so every leaf shards with the batch's rows). Attention layers carry nothing (each training
  segment starts their context afresh), so it holds the GLA matrices, the conv windows and the position."""

  pos: Array  # int32 [B]: tokens the row's state has consumed (where the conv rings' next slot is)
  conv: Array  # f32 [B, L, conv_size, D]: every layer's short-conv ring
  gla: Array | None = None  # f32 [B, L_G, H, d_k, d_v]: the GLA layers' matrices (None: no GLA layer)
  # int32 [B]: the segment id of the row's last input (packed documents: a next input with another id begins
  # a new document, laplace_jax/ops/segments.py). None: the run has no segment ids.
  segment: Array | None = None

  if TYPE_CHECKING:

    def replace(self, **updates: Any) -> Carry: ...

  @classmethod
  def from_state(cls, state: DecodeState, segment: Array | None = None) -> Carry:
    """The model's carry (model.init_carry / forward_carry's DecodeState) with each leaf's row axis first,
    and the rows' last segment ids (packed documents only)."""
    if state.kv is not None or state.ring is not None:
      raise ValueError("a training carry holds no attention state: pass model.init_carry's DecodeState.")
    first = jax.tree.map(lambda x, a: jnp.moveaxis(x, a, 0), state, state.batch_axes())
    return cls(pos=first.pos, conv=first.conv, gla=first.gla, segment=segment)

  def to_state(self) -> DecodeState:
    """The inverse of from_state: the model's DecodeState layout."""
    state = DecodeState(pos=self.pos, conv=self.conv, gla=self.gla)
    return jax.tree.map(lambda x, a: jnp.moveaxis(x, 0, a), state, state.batch_axes())

  def to_dict(self) -> dict[str, Array]:
    """The checkpoint's form, DecodeState.to_dict's keys: {"pos", "conv"[, "gla"][, "segment"]} (carry.pos,
    ... on disk)."""
    d = DecodeState(pos=self.pos, conv=self.conv, gla=self.gla).to_dict()
    return d if self.segment is None else {**d, "segment": self.segment}

  @classmethod
  def from_dict(cls, d: dict[str, Array]) -> Carry:
    """The inverse of to_dict (DecodeState.from_dict's checks, and no attention tables)."""
    state = DecodeState.from_dict({k: v for k, v in d.items() if k != "segment"})
    if state.kv is not None or state.ring is not None:
      raise ValueError(f"a stored carry has keys {sorted(d)}: expected pos, conv, gla and segment only.")
    return cls(pos=state.pos, conv=state.conv, gla=state.gla, segment=d.get("segment"))


@struct.dataclass
class TrainState:
  """What the compiled step carries from one step to the next (donated, and saved in every checkpoint)."""

  params: Any  # model.init_params' tree: param_dtype, shapes from counts.param_shapes; FSDP-sharded
  opt_state: Any  # the optimizer's state (its moments shaped and sharded like params)
  step: Array  # int32 []: updates applied (a skipped step does not count)
  rng: Array  # uint32 [2] (threefry; [4] under rbg): key data of the run's seed
  bad_steps: Array  # int32 []: consecutive non-finite steps (0 after a good one)
  carry: Carry | None = None  # state passing only (train_step.init_carry), sharded with the batch's rows

  if TYPE_CHECKING:  # made by flax.struct.dataclass; declared here for type checkers

    def replace(self, **updates: Any) -> TrainState: ...

  def to_tree(self) -> dict:
    """The checkpoint's tree: {"params", "opt_state", "step", "rng", "bad_steps"[, "carry"]}, as saved
    before the state was typed (no "carry" key without state passing)."""
    tree = {
      "params": self.params,
      "opt_state": self.opt_state,
      "step": self.step,
      "rng": self.rng,
      "bad_steps": self.bad_steps,
    }
    if self.carry is not None:
      tree["carry"] = self.carry.to_dict()
    return tree

  @classmethod
  def from_tree(cls, tree: dict) -> TrainState:
    """The inverse of to_tree (a restored checkpoint's train_state)."""
    carry = tree.get("carry")
    return cls(**{**tree, "carry": None if carry is None else Carry.from_dict(carry)})
