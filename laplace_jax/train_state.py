"""The train state and the training batch as typed pytrees; optional parts are fields that default to None,
so the tree's structure (not a key's presence) says which step is compiled."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from flax import struct

# A leaf: a jax.Array, a host numpy array (a batch before it is put on the mesh) or a jax.ShapeDtypeStruct
# (the abstract state and batch the step is compiled for).
Array = Any


@struct.dataclass
class TrainState:
  """What the compiled step carries from one step to the next (donated, and saved in every checkpoint)."""

  params: Any  # model.init_params' tree: param_dtype, shapes from counts.param_shapes; FSDP-sharded
  opt_state: Any  # the optimizer's state (its moments shaped and sharded like params)
  step: Array  # int32 []: updates applied (a skipped step does not count)
  rng: Array  # uint32 [2] (threefry; [4] under rbg): key data of the run's seed
  bad_steps: Array  # int32 []: consecutive non-finite steps (0 after a good one)
  # State passing only: each row's recurrent state after its last token (train_step.init_carry), batch-major
  # and sharded with the batch's rows: {"gla": f32 [B, L_gla, H, K, V], "conv": f32 [B, L, conv, D],
  # "pos": int32 [B]}. Treated as an opaque pytree here.
  carry: Any = None

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
      tree["carry"] = self.carry
    return tree

  @classmethod
  def from_tree(cls, tree: dict) -> TrainState:
    """The inverse of to_tree (a restored checkpoint's train_state)."""
    return cls(**tree)


@struct.dataclass
class Batch:
  """One global training batch; a row is one sequence, B rows sharded over the mesh's batch axes."""

  inputs: Array  # int32 [B, T]: token ids
  targets: Array  # int32 [B, T]: the next token of each input
  weights: Array | None = None  # f32 [B, T]: per-token loss weights (None: every token weighs 1)
  # int32 [B, K]: only these positions are scored (targets and weights read there; the LM head runs there
  # alone). None: every position.
  positions: Array | None = None
  carry: Any = None  # state passing: the rows' carried state (TrainState.carry), set by the step

  if TYPE_CHECKING:

    def replace(self, **updates: Any) -> Batch: ...
