"""GET /metrics' Prometheus text: the engine's load and counters, the state cache's (per tenant with keys)
and the HTTP responses by status, built from the objects that keep them."""

from __future__ import annotations

from collections.abc import Mapping

from serve.api.tenants import Tenants
from serve.engine.engine import Engine
from serve.engine.state_cache import CacheStats, TenantStats


def prometheus_text(
  engine: Engine, tenants: Tenants, tenant: str, responses: Mapping[int, int], open_connections: int
) -> str:
  """Every metric as Prometheus text. With keys the state cache's hit counters are `tenant`'s only (labelled
  tenant="..."); the rest are server-wide load figures. responses: HTTP status -> count."""
  e, s = engine, engine.stats
  rows = [
    (
      "tokens_per_second",
      "gauge",
      "Output tokens per second over the last 10 s.",
      [("", round(e.tokens_per_second(), 3))],
    ),
    ("active_slots", "gauge", "Slots decoding a request.", [("", e.active_slots)]),
    ("slots", "gauge", "Slots in the engine.", [("", e.n_slots)]),
    (
      "state_bytes_per_slot",
      "gauge",
      "Bytes of one slot's decode state (GLA states, conv windows, "
      "sliding-window rings, KV cache of --max_context tokens), measured from its layout.",
      [("", e.fns.state_bytes_per_slot)],
    ),
    (
      "slot_table_bytes",
      "gauge",
      "Bytes of the whole slot table: every slot's state and sampling settings.",
      [("", e.fns.table_bytes)],
    ),
    ("open_connections", "gauge", "Open HTTP connections.", [("", open_connections)]),
    ("queue_depth", "gauge", "Requests waiting for a slot.", [("", e.queue_depth)]),
    ("generated_tokens_total", "counter", "Output tokens produced.", [("", s.tokens)]),
    ("prompt_tokens_total", "counter", "Prompt tokens prefilled.", [("", s.prefill_tokens)]),
    ("decode_steps_total", "counter", "Compiled generate and verify calls run.", [("", s.steps)]),
    ("drafted_tokens_total", "counter", "Drafted tokens verified.", [("", s.drafted_tokens)]),
    (
      "accepted_draft_tokens_total",
      "counter",
      "Drafted tokens the output took.",
      [("", s.accepted_tokens)],
    ),
    (
      "verify_cost_ratio",
      "gauge",
      "A verify step's time over a generate step's over the same bucket of rows, as the engine measured "
      "them (1 until measured).",
      [(f'{{bucket="{b}"}}', round(e.drafter.cost.ratio(b), 3)) for b in e.fns.buckets],
    ),
    ("engine_requests_total", "counter", "Requests admitted to the engine queue.", [("", s.requests)]),
    ("engine_finished_total", "counter", "Requests finished (any reason).", [("", s.finished)]),
    ("engine_rejected_total", "counter", "Requests refused with 429 (queue full).", [("", s.rejected)]),
    *cache_rows(engine, tenants, tenant),
    (
      "http_responses_total",
      "counter",
      "HTTP responses by status code.",
      [(f'{{code="{c}"}}', n) for c, n in sorted(responses.items())],
    ),
  ]
  lines = []
  for name, kind, doc, samples in rows:
    lines += [f"# HELP laplace_serve_{name} {doc}", f"# TYPE laplace_serve_{name} {kind}"]
    lines += [f"laplace_serve_{name}{labels} {value}" for labels, value in samples]
  return "\n".join(lines) + "\n"


def cache_rows(engine: Engine, tenants: Tenants, tenant: str):
  """The state cache's rows: (name, kind, help, [(labels, value)]), zeros without a cache."""
  c = engine.cache
  if c is None:
    return [
      ("prompt_tokens_cached_total", "counter", "Prompt tokens restored from the state cache.", [("", 0)])
    ]
  counts: CacheStats | TenantStats
  if tenants.enabled:  # the caller's own counters: another tenant's hits are not its business
    label, counts = f'{{tenant="{tenant}"}}', c.tenant_stats.get(tenant, TenantStats())
  else:
    label, counts = "", c.stats
  return [
    (
      "prompt_tokens_cached_total",
      "counter",
      "Prompt tokens restored from the state cache, not prefilled.",
      [(label, counts.tokens_reused)],
    ),
    (
      "state_cache_hits_total",
      "counter",
      "Requests that restored a cached state.",
      [(label, counts.hits)],
    ),
    (
      "state_cache_misses_total",
      "counter",
      "Requests with no cached prefix.",
      [(label, counts.misses)],
    ),
    (
      "state_cache_evictions_total",
      "counter",
      "States evicted for the byte budget.",
      [("", c.stats.evictions)],
    ),
    (
      "state_cache_superseded_total",
      "counter",
      "States dropped because a conversation stored newer ones (the bound on states per conversation).",
      [("", c.stats.superseded)],
    ),
    ("state_cache_bytes", "gauge", "Bytes of cached states held.", [("", c.bytes)]),
    ("state_cache_entries", "gauge", "Cached states held.", [("", len(c))]),
    (
      "state_cache_files_written_total",
      "counter",
      "State files written to --state_cache_dir.",
      [("", c.stats.files_written)],
    ),
  ]
