"""A training batch as a typed pytree: what the data pipeline and the recall tasks yield and what the train step
takes. Optional parts are fields that default to None, so the tree's structure (not a key's presence) says
which step is compiled."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from flax import struct

from laplace_jax.array_types import Array

if TYPE_CHECKING:  # the carry is the training tier's; a batch from the data holds none
  from laplace_jax.training.train_state import Carry


@struct.dataclass
class Batch:
  """One training batch; a row is one sequence. From the data: host numpy arrays of this process's rows; in the
  step: B global rows sharded over the mesh's batch axes."""

  inputs: Array  # int32 [B, T]: token ids
  targets: Array  # int32 [B, T]: the next token of each input
  weights: Array | None = None  # f32 [B, T]: per-token loss weights (None: every token weighs 1)
  # int32 [B, J]: only these positions are scored (targets and weights read there; the LM head runs there
  # alone). None: every position.
  positions: Array | None = None
  carry: Carry | None = None  # state passing: the rows' carried state (TrainState.carry), set by the step
  # int32 [B, T]: packed rows' document ids, each document computed as if alone (laplace_jax/ops/segments.py).
  # None: a row is one stream.
  segment_ids: Array | None = None

  if TYPE_CHECKING:

    def replace(self, **updates: Any) -> Batch: ...
