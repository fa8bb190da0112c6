"""`python -m serve --target neuron`: every program the engine compiles, lowered (never compiled) from abstract
shapes with the choices made on the target, and checked by laplace_jax.analysis.neuron_check.

The programs are the jitted functions of `serve.slots.slot_functions.SlotFunctions` (`SlotPrograms`) as the engine calls them: the slot table
and prefill batch made at start, a prefill chunk (plain and scored for echo/logprobs), insert (first token
sampled, rows written into slots), the generate step's two calls (decode, then sampling with the logprob rows;
insert and sampling take each row's allowed-token bitmask),
the generate of several steps and the verify where the engine runs them (each once per bucket of rows), and the state cache's gathers (from
the slot table and from a prefill batch) and restore. No weights or states are materialised: laplace-3b with
1,280 slots on 64 simulated devices lowers on a laptop-class CPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from laplace_jax import model, platform, sharding
from serve.slots import loading
from serve.slots.dtypes import PARAMS_DTYPES
from serve.slots.slot_functions import SlotFunctions, host_settings


def _sds(tree, shardings=None):
  """ShapeDtypeStructs of a shape tree, with these shardings (a tree, one sharding, or None)."""
  if shardings is None or isinstance(shardings, jax.sharding.Sharding):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=shardings), tree)
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)


def abstract_params(cfg, mesh, dtype: str = PARAMS_DTYPES[0]):
  """The served params' shapes (as `loading.load_params` places them: replicated, in the compute dtype)."""
  shapes = jax.eval_shape(lambda: loading.cast_params(model.init_params(cfg, jax.random.key(0)), cfg, dtype))
  return _sds(shapes, None if mesh is None else sharding.replicated(mesh))


def lower_engine(fns: SlotFunctions, params, speculative_tokens: int = 0, decode_steps: int = 1) -> dict:
  """{program name: jax Lowered} for every function the engine compiles, from abstract arguments (verify:
  with speculative_tokens K > 0, for K drafts per slot; the generate of several steps with decode_steps > 1)."""
  P, C = fns.prefill_batch, fns.cfg.chunk_size
  mesh = fns.mesh
  rep = None if mesh is None else sharding.replicated(mesh)
  table = _sds(fns.table_shape, fns.table_shardings)
  pf = _sds(fns.prefill_shape, rep)
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=rep)
  settings = _sds(jax.tree.map(np.asarray, host_settings([], P, fns.n_stop)), rep)
  rows = jax.eval_shape(fns.gather, pf.model, i32(P))
  programs = fns.bucket_programs(
    params, table, decode_steps=decode_steps, speculative_tokens=speculative_tokens, rows_sharding=rep
  )
  optional = {f"{name}_b{B}": lowered for (name, B), lowered in programs.items()}  # B rows
  return optional | {
    "empty_table": fns.empty_table.lower(),
    "empty_prefill": fns.empty_prefill.lower(),
    "prefill_chunk": fns.prefill_chunk.lower(params, pf, i32(P, C), i32(P)),
    "prefill_chunk_scored": fns.prefill_chunk_scored.lower(params, pf, i32(P, C), i32(P)),
    "insert": fns.programs.insert.lower(
      params, table, pf, i32(P), i32(P), settings, fns.mask_shape((P,), split=False)
    ),
    "gather_slots": fns.gather.lower(table.model, i32(P)),
    "gather_prefill": fns.gather.lower(pf.model, i32(P)),
    "load_prefill": fns.load_prefill.lower(_sds(rows)),
  }


def lower_for_target(
  cfg,
  *,
  target: str,
  n_slots: int,
  prefill_batch: int,
  n_stop: int,
  valid_vocab: int,
  mesh=None,
  params_dtype: str = PARAMS_DTYPES[0],
  max_context: int | None = None,
  speculative_tokens: int = 0,
  decode_steps: int = 1,
) -> dict:
  """{program name: StableHLO text} of the engine's programs with every choice made as on `target`."""
  with platform.lowering_for(target):
    fns = SlotFunctions(
      model,
      cfg,
      n_slots=n_slots,
      prefill_batch=prefill_batch,
      n_stop=n_stop,
      valid_vocab=valid_vocab,
      mesh=mesh,
      max_context=max_context,
      hold_ended=True,  # as served with a state cache (the default): the step with live_B
    )
    lowered = lower_engine(fns, abstract_params(cfg, mesh, params_dtype), speculative_tokens, decode_steps)
  return {name: low.as_text() for name, low in lowered.items()}
