"""`python -m serve`'s flags beyond the engine's: `ServerConfig`, each field described once beside it (its
flag's help), and the layout of the help (`GROUPS`): the flags of both configs, `EngineConfig`'s and these, in
the groups and the order `--help` lists them. serve/__main__.py derives its parser from the two. Imports no
JAX, so the command line's help stays quick."""

from __future__ import annotations

import dataclasses
import types
import typing

from laplace_jax import cli
from laplace_jax.model.config import PRESETS
from laplace_jax.platform import LOWERING_TARGETS, PRNG_CHOICES
from serve.api.protocol import Limits
from serve.engine.engine_config import SLOT_BUCKETS, SPECULATIVE_RULES, EngineConfig
from serve.slots.dtypes import PARAMS_DTYPES


@dataclasses.dataclass(frozen=True)
class ServerConfig:
  """The model, the request limits, the state cache, lowering and HTTP: every flag that is no `EngineConfig`
  field."""

  # ---- model ----
  preset: str | None = None
  """the model of --random_init and --target (unset: small); with --checkpoint only checked against the
  config saved with the export, which builds the model"""
  checkpoint: str | None = None
  """an export of python -m train (RUN/export/step_N): its params and the model config saved beside them"""
  random_init: bool = False
  """serve random weights (benchmarks, demos)"""
  seed: int = 0
  """init seed for --random_init"""
  prng: str = PRNG_CHOICES[0]
  """JAX's PRNG implementation (--random_init weights, seeded sampling); auto: rbg on Neuron and with
  --target neuron, threefry elsewhere. A request's seed samples different tokens under each"""
  params_dtype: str = PARAMS_DTYPES[0]
  """serve weights cast to the preset's compute dtype, or as stored"""
  model_name: str | None = None
  """name in /v1/models and responses (default: laplace-<preset>, or laplace-<export directory name> with
  --checkpoint)"""
  chat_template: str | None = None
  """Jinja chat template for /v1/chat/completions, as Hugging Face tokenizers write them (or a
  tokenizer_config.json holding one); default: plain 'User: ...' / 'Assistant:' text (serve/api/chat.py)"""

  # ---- request limits (serve.api.protocol.Limits) and the engine's bounds ----
  max_tokens: int = Limits.max_tokens
  """largest max_tokens a request may ask for"""
  max_prompt_tokens: int = Limits.max_prompt_tokens
  """longest prompt accepted"""
  max_choices: int = Limits.max_choices
  """most choices (prompts x n) one request may ask for, so that one request cannot hold every slot and the
  queue"""
  max_prediction_tokens: int = Limits.max_prediction_tokens
  """longest prediction (OpenAI's Predicted Outputs) a request may send, in tokens"""
  max_reply_entries: int = Limits.max_reply_entries
  """most token entries one reply may hold: choices x (max_tokens + echoed prompt tokens), x (3 + logprobs)
  with logprobs; a request that could exceed it gets 400 before it runs"""
  mesh_devices: int | None = None
  """devices that split the slots (default 1: no mesh; with --target, 64: a trn2.48xlarge)"""

  # ---- state cache ----
  state_cache_gb: float = 4.0
  """host memory for cached sequence states (prefix reuse, resumed conversations); 0: off"""
  state_cache_dir: str | None = None
  """keep cached states in this directory across restarts (one directory per model)"""
  max_stored_responses: int = 10_000
  """stored /v1/responses responses kept per tenant (what previous_response_id continues from); past N a
  tenant's oldest is dropped. With --state_cache_dir they are also files in its responses/ directory and
  survive restarts"""

  # ---- lowering for another platform ----
  target: str | None = None
  """lower (never compile) every program the engine compiles from abstract shapes with the choices made on
  this platform (neuron: Trainium) on simulated CPU devices, print the conformance report
  (laplace_jax.analysis.neuron_check), exit 1 on a violation"""
  hlo_dir: str | None = None
  """with --target: write each program's StableHLO to DIR/<program>.mlir"""

  # ---- http ----
  host: str = "127.0.0.1"
  """bind address (0.0.0.0 exposes the server)"""
  port: int = 8000
  """TCP port (0: any free port, logged at start)"""
  access_log: bool = True
  """one log line per request: method, path, status, tenant, prompt / output / cached tokens, time to first
  token, total time (serve/api/access_log.py; never the prompt or the key)"""
  verbose: bool = False
  """show the INFO lines of the libraries underneath (JAX's platform probe, grain, Orbax)"""
  api_key: tuple[str, ...] | None = None
  """require 'Authorization: Bearer KEY' on /v1/*, /tokenize and /metrics; repeat for several keys, each its
  own tenant (unset: $LAPLACE_API_KEY if that is set)"""
  api_keys_file: str | None = None
  """more keys, one 'tenant:key' a line; each tenant has its own state-cache scope, cache counters and share
  of the slots (serve/api/tenants.py)"""
  allowed_host: tuple[str, ...] = ()
  """a host name clients may call this server by (repeatable); requests naming another one in Host get 421
  and browser pages of other origins 403 (DNS rebinding, CSRF). Bound to a loopback address, localhost,
  127.0.0.1 and ::1 are allowed; bound to 0.0.0.0 with no --allowed_host, Host is not checked"""


# The help's groups in order, each flag named as its field of ServerConfig or EngineConfig (ENGINE_FLAGS).
GROUPS = (
  (
    "model",
    ("preset", "checkpoint", "random_init", "seed", "prng", "params_dtype", "model_name", "chat_template"),
  ),
  (
    "engine",
    (
      "n_slots",
      "prefill_batch",
      "prefill_chunks_per_step",
      "max_queue",
      "speculative_tokens",
      "decode_steps",
      "prompt_lookup",
      "slot_buckets",
      "speculative_rule",
      "max_tokens",
      "max_prompt_tokens",
      "max_choices",
      "max_prediction_tokens",
      "max_reply_entries",
      "max_context",
      "mesh_devices",
    ),
  ),
  ("state cache", ("state_cache_gb", "state_cache_dir", "state_snapshot_every", "max_stored_responses")),
  ("lowering for another platform (no weights needed, nothing is served)", ("target", "hlo_dir")),
  ("http", ("host", "port", "access_log", "verbose", "api_key", "api_keys_file", "allowed_host")),
)
# Flag -> EngineConfig field, for the engine's flags (EngineConfig's other fields keep their defaults).
ENGINE_FLAGS = {
  **{f: f for _, flags in GROUPS for f in flags if f in {x.name for x in dataclasses.fields(EngineConfig)}},
  "state_snapshot_every": "snapshot_every",
}
CHOICES = {
  "preset": sorted(PRESETS),
  "prng": PRNG_CHOICES,
  "params_dtype": PARAMS_DTYPES,
  "slot_buckets": SLOT_BUCKETS,
  "speculative_rule": SPECULATIVE_RULES,
  "target": LOWERING_TARGETS,
}
METAVARS = {
  "chat_template": "FILE",
  "max_context": "N",
  "max_stored_responses": "N",
  "api_key": "KEY",
  "api_keys_file": "FILE",
  "allowed_host": "NAME",
}
EXCLUSIVE = ("checkpoint", "random_init")  # where the weights come from: one of them (or --target)


def flag_options(flag: str) -> dict:
  """add_argument's keywords for `--flag`, from its field: the type, default and help (the field's
  docstring); a bool is a switch (a Toggle when on by default), a tuple a repeatable flag."""
  cls, name = (EngineConfig, ENGINE_FLAGS[flag]) if flag in ENGINE_FLAGS else (ServerConfig, flag)
  default = next(f.default for f in dataclasses.fields(cls) if f.name == name)
  kind = typing.get_type_hints(cls)[name]
  if isinstance(kind, types.UnionType):  # X | None -> X
    kind = next(a for a in typing.get_args(kind) if a is not type(None))
  out: dict = {"help": cli.field_help(cls, name), "default": default}
  if kind is bool:
    out["action"] = cli.Toggle if default else "store_true"
  elif typing.get_origin(kind) is tuple:  # one value per use of the flag
    out.update(action="append", default=None if default is None else [])
  elif kind in (int, float):
    out["type"] = kind
  if flag in CHOICES:
    out["choices"] = CHOICES[flag]
  if flag in METAVARS:
    out["metavar"] = METAVARS[flag]
  return out


def configs(args) -> tuple[EngineConfig, ServerConfig]:
  """The parsed flags (python -m serve's namespace) as the two configs."""
  flags = vars(args)
  engine = EngineConfig(**{field: flags[flag] for flag, field in ENGINE_FLAGS.items()})
  values: dict[str, typing.Any] = {}
  for f in dataclasses.fields(ServerConfig):
    v = flags[f.name]
    values[f.name] = tuple(v) if isinstance(v, list) else v  # a repeated flag's list, frozen
  return engine, ServerConfig(**values)
