"""The engine's sizes and policies with their production defaults, in one place: `serve.engine.engine.Engine` takes
one `EngineConfig` and `python -m serve` its engine flags (values and help) from it. Every check of these values
is here: `EngineConfig.__post_init__` for what needs no model, `EngineConfig.for_model` for what does. Imports no
JAX, so the command line's help stays quick."""

from __future__ import annotations

import dataclasses

from laplace_jax.model.config import get_config

SPECULATIVE_RULES = ("cost", "always")
"""EngineConfig.speculative_rule's values"""
SLOT_BUCKETS = ("doubling", "table")
"""EngineConfig.slot_buckets' values"""


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """`Engine`'s sizes and policies (each described once, below it), checked when made."""

  n_slots: int | None = None
  """concurrent sequences decoded per step (default: 1280 for laplace-3b, 64 otherwise)"""
  prefill_batch: int = 4
  """prompts prefilled together"""
  prefill_chunks_per_step: int = 4
  """128-token prefill chunks run between two decode steps"""
  max_queue: int = 1024
  """requests that may wait for a slot; more: 429"""
  max_queue_per_tenant: int | None = None
  """choices one tenant may have waiting for a slot, in [0, max_queue] (None: max_queue); more: 429"""
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
  max_context: int | None = None
  """models with attention layers (mixers with 'A'; required for them, refused otherwise): the most tokens,
  prompt + output, a sequence may hold; each slot keeps a KV cache of N tokens. A longer prompt gets 400; a
  reply that reaches N ends with finish_reason 'length'. GLA ('G') and sliding-window ('S') layers need no
  bound"""

  def __post_init__(self):
    for name in (
      "n_slots",
      "prefill_batch",
      "max_stop_ids",
      "prefill_chunks_per_step",
      "snapshot_every",
      "cache_min_tokens",
      "decode_steps",
    ):
      v = getattr(self, name)
      if not (name == "n_slots" and v is None) and (not isinstance(v, int) or v < 1):
        raise ValueError(f"{name}={v!r}: expected a positive integer.")
    if self.slot_buckets not in SLOT_BUCKETS:
      raise ValueError(f"slot_buckets={self.slot_buckets!r}: expected one of {SLOT_BUCKETS}.")
    if self.speculative_rule not in SPECULATIVE_RULES:
      raise ValueError(f"speculative_rule={self.speculative_rule!r}: expected one of {SPECULATIVE_RULES}.")
    if self.max_queue < 0:
      raise ValueError(f"max_queue={self.max_queue}: expected >= 0 (0: refuse when all slots are busy).")
    if not isinstance(self.speculative_tokens, int) or self.speculative_tokens < 0:
      raise ValueError(f"speculative_tokens={self.speculative_tokens!r}: expected an integer >= 0 (0: off).")
    per_tenant = self.max_queue_per_tenant
    if per_tenant is not None and not 0 <= per_tenant <= self.max_queue:
      raise ValueError(f"max_queue_per_tenant={per_tenant}: expected None or in [0, max_queue].")

  @property
  def queue_per_tenant(self) -> int:
    """max_queue_per_tenant, or max_queue where it is None."""
    return self.max_queue if self.max_queue_per_tenant is None else self.max_queue_per_tenant

  def for_model(self, cfg, *, state_cache: bool = False) -> EngineConfig:
    """This config for model config `cfg` (with a state cache or not), checked against it: n_slots' default
    filled in (`slots_for`), max_context against the mixers (`check_max_context`), and no state cache for
    attention layers (ValueError naming the fix)."""
    check_max_context(cfg, self.max_context)
    if state_cache and "A" in cfg.mixers:
      raise ValueError(
        f"mixers={cfg.mixers!r}: the state cache keeps constant-size states, and an attention "
        "layer's KV cache is not one; pass state_cache=None (--state_cache_gb 0)."
      )
    return self if self.n_slots is not None else dataclasses.replace(self, n_slots=slots_for(cfg))


DEFAULTS = EngineConfig()


def check_max_context(cfg, max_context):
  """Attention layers ('A') need a per-slot context bound, and only they use one (ValueError otherwise)."""
  if "A" in cfg.mixers:
    if not isinstance(max_context, int) or isinstance(max_context, bool) or max_context < 2:
      raise ValueError(
        f"mixers={cfg.mixers!r} has attention layers, whose KV cache grows with the context: pass "
        f"--max_context N (got {max_context!r}), the most tokens (prompt + output) a sequence may "
        "hold; each slot keeps a KV cache of N tokens, so memory grows with N x --n_slots."
      )
  elif max_context is not None:
    raise ValueError(
      f"--max_context={max_context} bounds attention layers' KV cache, but mixers={cfg.mixers!r} "
      "has none ('G' and 'S' layers keep a constant-size state): leave --max_context unset."
    )


def slots_for(cfg) -> int:
  """The default slot count for a model: 1280 for laplace-3b, 64 otherwise."""
  return 1280 if cfg == get_config("laplace-3b") else 64
