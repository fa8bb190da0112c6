"""The model: its config and presets, the layer pieces (mixers), the decode state, the decoder
(model/decoder.py) and the parameter and FLOP counts. Above the kernels (laplace_jax/ops); below inference and
training.

`from laplace_jax import model` gives the decoder's public functions (init_params, forward, init_state,
decode_step, prefill, ...), as it did when the model was one module, imported on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the names below, for type checkers; at run time they load with the decoder on first use
  from laplace_jax.model.decoder import (
    Block,
    Group,
    LaplaceLM,
    check_capacity,
    check_state,
    check_tokens,
    decode_step,
    forward,
    forward_carry,
    init_carry,
    init_params,
    init_state,
    layer_param_shapes,
    layer_param_specs,
    model_param_shapes,
    model_param_specs,
    prefill,
    prefill_chunk,
    table_row,
  )

__all__ = [
  "Block",
  "Group",
  "LaplaceLM",
  "check_capacity",
  "check_state",
  "check_tokens",
  "decode_step",
  "forward",
  "forward_carry",
  "init_carry",
  "init_params",
  "init_state",
  "layer_param_shapes",
  "layer_param_specs",
  "model_param_shapes",
  "model_param_specs",
  "prefill",
  "prefill_chunk",
  "table_row",
]


def __getattr__(name: str):
  """The decoder's functions, imported on first use: `laplace_jax.model.config` (and the presets) import
  without Flax, so a program's flags and --help load no JAX."""
  if name in __all__:
    return getattr(importlib.import_module("laplace_jax.model.decoder"), name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
