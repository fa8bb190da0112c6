"""The engine's sizes and policies with their production defaults, in one place: `serve.engine.engine.Engine` takes
its defaults from here and `python -m serve` its engine flags (values and help). Imports no JAX, so the
command line's help stays quick."""

from __future__ import annotations

import dataclasses

from laplace_jax.model.config import get_config


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """`Engine`'s keyword arguments of these names (each described once, below it)."""

  n_slots: int | None = None
  """concurrent sequences decoded per step (default: 1280 for laplace-3b, 64 otherwise)"""
  prefill_batch: int = 4
  """prompts prefilled together"""
  prefill_chunks_per_step: int = 4
  """128-token prefill chunks run between two decode steps"""
  max_queue: int = 1024
  """requests that may wait for a slot; more: 429"""
  max_stop_ids: int = 8
  """device-side stop ids per request (EOS included)"""
  snapshot_every: int = 8
  """long prompts leave a cached state every this many 128-token chunks"""
  cache_min_tokens: int = 1
  """the shortest sequence whose state is cached (1: every prompt and reply, so short conversations resume
  too)"""
  speculative_tokens: int = 0
  """drafted tokens verified per slot in one step, for requests with a prediction (0: off; one compiled
  verify per value)"""
  prompt_lookup: bool = False
  """with speculative_tokens: a request without a prediction drafts from its own prompt and output, the
  tokens that followed the latest earlier occurrence of its last 3 (else 2, else 1) tokens"""
  decode_steps: int = 1
  """tokens each slot generates per compiled call while no prompt waits for a slot: the host reads back and
  delivers once per call (more than 1 pays where the host's work per call bounds the engine, short steps on
  a CPU; one compiled generate per value)"""
  slot_buckets: str = "doubling"
  """the row counts generate and verify are compiled for: 'doubling' (each device's share 1, 2, 4, ... up to
  all its slots; a step runs the smallest that holds its live slots), or 'table' (one program over the whole
  slot table: the fastest start-up, every step pays for every slot)"""
  speculative_rule: str = "cost"
  """when a step verifies drafts: 'cost', when the tokens they are expected to give pay for a verify's
  measured cost over a generate step's (serve.engine.drafting.VerifyCost); 'always', whenever a slot has one"""


DEFAULTS = EngineConfig()

SPECULATIVE_RULES = ("cost", "always")
SLOT_BUCKETS = ("doubling", "table")
"""EngineConfig.slot_buckets' values"""
"""EngineConfig.speculative_rule's values"""

PARAMS_DTYPES = ("compute", "param")
"""how the served weights are held (`serve.engine.loading.cast_params`): the preset's compute dtype, or as stored"""


def slots_for(cfg) -> int:
  """The default slot count for a model: 1280 for laplace-3b, 64 otherwise."""
  return 1280 if cfg == get_config("laplace-3b") else 64
