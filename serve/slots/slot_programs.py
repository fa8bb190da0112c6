"""The slot functions' jitted programs by name (`SlotPrograms`), and their per-bucket forms: lowered from
abstract arguments (`bucket_programs`, what `python -m serve --target` checks) and compiled ahead of the first
call (`precompile`, the engine's start-up).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import time
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp

if TYPE_CHECKING:
  from serve.slots.slot_functions import SlotFunctions


class SlotPrograms(NamedTuple):
  """The jitted programs behind `SlotFunctions`' calls, which take device arrays: an allowed-token mask
  already placed by `SlotFunctions.mask` (int32, G words a row), rows_B a bucket's slots (`step_rows`). Each
  donates the slot table and returns (table, a packed output)."""

  insert: Any  # (params, table, pf, row_E, slot_E, settings, allowed_ExG): packed StepOutput of the E entries
  decode: Any  # (params, table, rows_B): logits_BxY instead of a packed output
  sample: Any  # (logits_BxY, table, rows_B, allowed_BxG): packed StepOutput of the B rows
  generate_steps: Any  # (params, table, rows_B, steps, greedy), the last two static: packed StepsOutput
  verify: Any  # (params, table, rows_B, drafts_BxJ, n_drafts_B, allowed_BxJxG): packed StepsOutput


def bucket_programs(
  fns: SlotFunctions, params, table, *, decode_steps: int = 1, speculative_tokens: int = 0, rows_sharding=None
) -> dict[tuple[str, int], Any]:
  """{(name, bucket): jax Lowered} of every bucket's programs, from abstract params and table as the calls
  see them: decode and sample, with decode_steps > 1 the generate of several steps (greedy or not), with
  speculative_tokens drafts the verify. rows_sharding: where the rows and drafts arrive (None: the host)."""
  out: dict[tuple[str, int], Any] = {}
  run = fns.programs
  with contextlib.nullcontext() if fns.mesh is None else jax.set_mesh(fns.mesh):
    for B in fns.buckets:
      i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=rows_sharding)
      logits_BxY = jax.ShapeDtypeStruct((B, fns.cfg.vocab_size), jnp.float32, sharding=fns.logits_sharding)
      out["decode", B] = run.decode.lower(params, table, i32(B))
      out["sample", B] = run.sample.lower(logits_BxY, table, i32(B), fns.mask_shape((B,)))
      if decode_steps > 1:
        for greedy, name in ((False, "generate_steps"), (True, "generate_steps_greedy")):
          out[name, B] = run.generate_steps.lower(params, table, i32(B), decode_steps, greedy)
      if speculative_tokens:
        n, J = speculative_tokens, speculative_tokens + 1  # drafts, and the positions scored
        out["verify", B] = run.verify.lower(params, table, i32(B), i32(B, n), i32(B), fns.mask_shape((B, J)))
  return out


def precompile(
  fns: SlotFunctions, params, table, *, decode_steps: int = 1, speculative_tokens: int = 0, workers: int = 0
) -> dict[int, float]:
  """Compile every bucket's generate (and verify, with speculative_tokens drafts) programs ahead of their
  first call, `workers` at a time (0: one per CPU core): tracing is Python's, but XLA compiles outside the
  GIL, and a call finds the program its arguments' shapes and shardings compiled. Returns each bucket's
  compile seconds (its programs' sum, measured in its threads)."""
  devices = None if fns.mesh is None else set(fns.mesh.devices.flat)

  def placed(x):  # where the call will find x (left to jit where x is not on the serving mesh's devices)
    sh = getattr(x, "sharding", None)
    return sh if sh is None or devices is None or set(sh.device_set) == devices else None

  like = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=placed(x)), tree)
  programs = bucket_programs(
    fns, like(params), like(table), decode_steps=decode_steps, speculative_tokens=speculative_tokens
  )
  jobs = [(B, lowered) for (_, B), lowered in programs.items()]

  def compile_one(lowered) -> float:
    t = time.perf_counter()
    lowered.compile()
    return time.perf_counter() - t

  seconds = dict.fromkeys(fns.buckets, 0.0)
  with concurrent.futures.ThreadPoolExecutor(workers or os.cpu_count() or 1) as pool:
    for (B, _), spent in zip(jobs, pool.map(compile_one, [lowered for _, lowered in jobs])):
      seconds[B] += spent
  return seconds
