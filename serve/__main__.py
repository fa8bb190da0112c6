"""`python -m serve`: the OpenAI-compatible completion server over the continuous-batching engine.

What loads JAX is imported inside the functions, once the flags are read: --target's device and platform
settings must come before anything could start a JAX backend, and --help answers without loading JAX.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import time

from laplace_jax import cli, platform
from laplace_jax.model.config import PRESETS, get_config
from serve.api.protocol import Limits
from serve.engine.engine_config import (
  DEFAULTS,
  PARAMS_DTYPES,
  SLOT_BUCKETS,
  SPECULATIVE_RULES,
  EngineConfig,
  slots_for,
)

_FLAGS = (
  "\n\nFlags are spelled with underscores, as in python -m train; the dashed spelling (--n-slots) is "
  "accepted too."
)


def _engine_flag(group, name: str, flag: str | None = None):
  """A flag for EngineConfig's field `name`: its default and its help."""
  group.add_argument(
    f"--{flag or name}", type=int, default=getattr(DEFAULTS, name), help=cli.field_help(EngineConfig, name)
  )


def engine_config(args) -> EngineConfig:
  """The EngineConfig of the parsed engine flags (n_slots as given: None for the model's default)."""
  return EngineConfig(
    n_slots=args.n_slots or None,
    prefill_batch=args.prefill_batch,
    prefill_chunks_per_step=args.prefill_chunks_per_step,
    max_queue=args.max_queue,
    snapshot_every=args.state_snapshot_every,
    speculative_tokens=args.speculative_tokens,
    prompt_lookup=args.prompt_lookup,
    decode_steps=args.decode_steps,
    slot_buckets=args.slot_buckets,
    speculative_rule=args.speculative_rule,
    max_context=args.max_context,
  )


def _limits_default(name: str):
  return next(f.default for f in dataclasses.fields(Limits) if f.name == name)


def build_parser() -> argparse.ArgumentParser:
  p = cli.FlagParser(
    prog="python -m serve", description=__doc__ + _FLAGS, formatter_class=cli.DefaultsFormatter
  )
  w = p.add_argument_group("model")
  w.add_argument(
    "--preset",
    choices=sorted(PRESETS),
    help="the model of --random_init and --target (unset: small); with --checkpoint only checked "
    "against the config saved with the export, which builds the model",
  )
  src = w.add_mutually_exclusive_group()
  src.add_argument(
    "--checkpoint",
    help="an export of python -m train (RUN/export/step_N): its params and "
    "the model config saved beside them",
  )
  src.add_argument("--random_init", action="store_true", help="serve random weights (benchmarks, demos)")
  w.add_argument("--seed", type=int, default=0, help="init seed for --random_init")
  w.add_argument(
    "--prng",
    default=platform.PRNG_CHOICES[0],
    choices=platform.PRNG_CHOICES,
    help="JAX's PRNG implementation (--random_init weights, seeded sampling); auto: rbg on Neuron and "
    "with --target neuron, threefry elsewhere. A request's seed samples different tokens under each",
  )
  w.add_argument(
    "--params_dtype",
    default=PARAMS_DTYPES[0],
    choices=PARAMS_DTYPES,
    help="serve weights cast to the preset's compute dtype, or as stored",
  )
  w.add_argument(
    "--model_name",
    help="name in /v1/models and responses (default: laplace-<preset>, or "
    "laplace-<export directory name> with --checkpoint)",
  )
  w.add_argument(
    "--chat_template",
    metavar="FILE",
    help="Jinja chat template for /v1/chat/completions, as "
    "Hugging Face tokenizers write them (or a tokenizer_config.json holding one); default: plain "
    "'User: ...' / 'Assistant:' text (serve/api/chat.py)",
  )
  e = p.add_argument_group("engine")
  for name in (
    "n_slots",
    "prefill_batch",
    "prefill_chunks_per_step",
    "max_queue",
    "speculative_tokens",
    "decode_steps",
  ):
    _engine_flag(e, name)
  e.add_argument("--prompt_lookup", action="store_true", help=cli.field_help(EngineConfig, "prompt_lookup"))
  e.add_argument(
    "--slot_buckets",
    choices=SLOT_BUCKETS,
    default=DEFAULTS.slot_buckets,
    help=cli.field_help(EngineConfig, "slot_buckets"),
  )
  e.add_argument(
    "--speculative_rule",
    choices=SPECULATIVE_RULES,
    default=DEFAULTS.speculative_rule,
    help=cli.field_help(EngineConfig, "speculative_rule"),
  )
  for name, text in (
    ("max_tokens", "largest max_tokens a request may ask for"),
    ("max_prompt_tokens", "longest prompt accepted"),
    (
      "max_choices",
      "most choices (prompts x n) one request may ask for, so that one request cannot hold every slot and "
      "the queue",
    ),
    (
      "max_prediction_tokens",
      "longest prediction (OpenAI's Predicted Outputs) a request may send, in tokens",
    ),
    (
      "max_reply_entries",
      "most token entries one reply may hold: choices x (max_tokens + echoed prompt tokens), x (3 + logprobs) "
      "with logprobs; a request that could exceed it gets 400 before it runs",
    ),
  ):
    e.add_argument(f"--{name}", type=int, default=_limits_default(name), help=text)
  e.add_argument(
    "--max_context",
    type=int,
    metavar="N",
    help="models with attention layers (mixers with "
    "'A'; required for them, refused otherwise): the most tokens, prompt + output, a sequence may "
    "hold; each slot keeps a KV cache of N tokens. A longer prompt gets 400; a reply that reaches N "
    "ends with finish_reason 'length'. GLA ('G') and sliding-window ('S') layers need no bound",
  )
  e.add_argument(
    "--mesh_devices",
    type=int,
    help="devices that split the slots (default 1: no mesh; with --target, 64: a trn2.48xlarge)",
  )
  c = p.add_argument_group("state cache")
  c.add_argument(
    "--state_cache_gb",
    type=float,
    default=4.0,
    help="host memory for cached sequence states (prefix reuse, resumed conversations); 0: off",
  )
  c.add_argument(
    "--state_cache_dir", help="keep cached states in this directory across restarts (one directory per model)"
  )
  _engine_flag(c, "snapshot_every", "state_snapshot_every")
  c.add_argument(
    "--max_stored_responses",
    type=int,
    default=10_000,
    metavar="N",
    help="stored /v1/responses responses kept per tenant (what previous_response_id continues from); past N "
    "a tenant's oldest is dropped. With --state_cache_dir they are also files in its responses/ "
    "directory and survive restarts",
  )
  t = p.add_argument_group("lowering for another platform (no weights needed, nothing is served)")
  t.add_argument(
    "--target",
    choices=platform.LOWERING_TARGETS,
    help="lower (never compile) every program the engine compiles "
    "from abstract shapes with the choices made on this platform (neuron: Trainium) on simulated "
    "CPU devices, print the conformance report (laplace_jax.analysis.neuron_check), exit 1 on a violation",
  )
  t.add_argument("--hlo_dir", help="with --target: write each program's StableHLO to DIR/<program>.mlir")
  h = p.add_argument_group("http")
  h.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0 exposes the server)")
  h.add_argument("--port", type=int, default=8000, help="TCP port (0: any free port, logged at start)")
  h.add_argument(
    "--access_log",
    action=cli.Toggle,
    default=True,
    help="one log line per request: method, path, status, tenant, prompt / output / cached tokens, time "
    "to first token, total time (serve/api/access_log.py; never the prompt or the key)",
  )
  h.add_argument(
    "--verbose",
    action="store_true",
    help="show the INFO lines of the libraries underneath (JAX's platform probe, grain, Orbax)",
  )
  h.add_argument(
    "--api_key",
    action="append",
    metavar="KEY",
    help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize and /metrics; repeat for several "
    "keys, each its own tenant (unset: $LAPLACE_API_KEY if that is set)",
  )
  h.add_argument(
    "--api_keys_file",
    metavar="FILE",
    help="more keys, one 'tenant:key' a line; each tenant "
    "has its own state-cache scope, cache counters and share of the slots (serve/api/tenants.py)",
  )
  h.add_argument(
    "--allowed_host",
    action="append",
    default=[],
    metavar="NAME",
    help="a host name clients may call this server by (repeatable); requests naming another one "
    "in Host get 421 and browser pages of other origins 403 (DNS rebinding, CSRF). Bound to a "
    "loopback address, localhost, 127.0.0.1 and ::1 are allowed; bound to 0.0.0.0 with no "
    "--allowed_host, Host is not checked",
  )
  return p


def parse_args(argv=None):
  p = build_parser()
  args = p.parse_args(argv)
  for name, lo, hi in (
    ("max_tokens", 1, 1 << 30),
    ("max_prompt_tokens", 1, 1 << 30),
    ("max_choices", 1, 1 << 20),
    ("max_reply_entries", 1, 1 << 40),
    ("max_prediction_tokens", 0, 1 << 20),
    ("max_queue", 0, 1 << 20),
    ("max_stored_responses", 1, 1 << 30),
    ("speculative_tokens", 0, 64),
    ("decode_steps", 1, 64),
  ):
    v = getattr(args, name)
    if not lo <= v <= hi:
      p.error(f"--{name}={v}: expected an integer in [{lo}, {hi}]")
  if args.state_cache_gb < 0:
    p.error(f"--state_cache_gb={args.state_cache_gb}: expected >= 0 (0 disables the state cache)")
  if args.state_cache_dir and args.state_cache_gb == 0:
    p.error("--state_cache_dir needs a state cache: pass --state_cache_gb > 0")
  if args.hlo_dir and not args.target:
    p.error("--hlo_dir needs --target neuron (it is where the lowered programs go)")
  if args.mesh_devices is None:
    args.mesh_devices = platform.TRN2_DEVICES if args.target else 1
  if not args.checkpoint and not args.random_init and not args.target:
    p.error("no weights: pass --checkpoint RUN/export/step_N (an export of python -m train) or --random_init")
  if (args.random_init or args.target) and args.preset is None:
    args.preset = "small"
  if args.api_key is None and os.environ.get("LAPLACE_API_KEY"):
    args.api_key = [os.environ["LAPLACE_API_KEY"]]
  return args


def tenant_keys(args):
  """serve.api.tenants.Tenants from --api-key and --api-keys-file (ValueError naming the problem)."""
  from serve.api.tenants import Tenants, name_of_key, read_keys_file

  keys = [(name_of_key(k), k) for k in args.api_key or []]
  if args.api_keys_file:
    keys += read_keys_file(args.api_keys_file)
  return Tenants(keys)


def lower_target(args) -> int:
  """--target: lower and check the engine's programs on simulated CPU devices; 1 on any violation."""
  import jax

  from laplace_jax.analysis import neuron_check
  from laplace_jax.data import tokenizer

  jax.config.update("jax_platforms", "cpu")
  platform.simulate_cpu_devices(args.mesh_devices)

  with platform.lowering_for(args.target):
    platform.use_prng(args.prng)  # the target's PRNG, before any key is made
  from serve.engine import lowering
  from serve.engine.engine import check_max_context

  cfg = get_config(args.preset)
  check_max_context(cfg, args.max_context)
  n_slots = args.n_slots or slots_for(cfg)
  from serve.engine import loading

  mesh = loading.make_serving_mesh(args.mesh_devices)
  t = time.perf_counter()
  texts = lowering.lower_for_target(
    cfg,
    target=args.target,
    n_slots=n_slots,
    prefill_batch=args.prefill_batch,
    n_stop=DEFAULTS.max_stop_ids,
    valid_vocab=tokenizer.VOCAB_SIZE,
    mesh=mesh,
    params_dtype=args.params_dtype,
    max_context=args.max_context,
    speculative_tokens=args.speculative_tokens,
    decode_steps=args.decode_steps,
  )
  lower_s = time.perf_counter() - t
  reports, text = neuron_check.check_programs(texts, args.hlo_dir)
  print(
    f"{len(texts)} programs of {args.preset} ({n_slots} slots, {args.mesh_devices} devices) lowered for "
    f"{args.target} in {lower_s:.1f} s (not compiled)\n{text}"
  )
  return 1 if any(r.violations for r in reports.values()) else 0


def model_config(args):
  """The config the server will build: the one saved with --checkpoint, else --preset's."""
  if args.checkpoint:
    from laplace_jax.training import checkpoint

    return checkpoint.export_config(args.checkpoint, preset=args.preset)
  return get_config(args.preset)


def _size(n: int) -> str:
  return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def build(args):
  """Config, params, tokenizer, engine and server from the parsed flags (the engine is warmed up)."""
  from serve.api import protocol
  from serve.api.chat import ChatTemplate
  from serve.api.response_store import SUBDIR, ResponseStore
  from serve.api.server import Server
  from serve.engine import loading
  from serve.engine.engine import Engine, check_max_context

  tenants = tenant_keys(args)  # a bad keys file fails before the weights load
  logging.info("PRNG: %s", platform.use_prng(args.prng))  # before any key is made
  mesh = loading.make_serving_mesh(args.mesh_devices)
  tok = loading.gpt2_tokenizer()
  template = ChatTemplate.from_file(args.chat_template, tok)  # a bad file fails before the weights load
  check_max_context(model_config(args), args.max_context)  # before the weights load
  params, cfg = loading.load_model(
    checkpoint=args.checkpoint, preset=args.preset, seed=args.seed, mesh=mesh, dtype=args.params_dtype
  )
  n_slots = args.n_slots or slots_for(cfg)
  name = args.model_name or (
    f"laplace-{args.preset}"
    if args.random_init
    else f"laplace-{os.path.basename(os.path.normpath(args.checkpoint))}"
  )
  cache = None
  if args.state_cache_gb > 0 and "A" in cfg.mixers:
    logging.info(
      "state cache off: mixers=%r has attention layers, whose state (a KV cache of --max_context "
      "tokens) is not the constant-size state the cache keeps",
      cfg.mixers,
    )
  elif args.state_cache_gb > 0:
    from serve.engine.state_cache import StateCache, layout_for, model_identity

    t = time.perf_counter()
    ident = model_identity(cfg, params)
    logging.info("model fingerprint %s (every parameter byte) in %.1f s", ident, time.perf_counter() - t)
    cache = StateCache(ident, int(args.state_cache_gb * 1e9), args.state_cache_dir, layout=layout_for(cfg))
  # Several tenants: each may fill only its share of the queue, so one tenant's burst leaves room to wait.
  share = -(-args.max_queue // max(1, len(tenants.names)))
  config = dataclasses.replace(engine_config(args), n_slots=n_slots, max_queue_per_tenant=share)
  engine = Engine(params, cfg, config, valid_vocab=tok.vocab_size, mesh=mesh, state_cache=cache)
  t = time.perf_counter()
  engine.warmup()
  logging.info("engine ready: %s, %d slots, compiled in %.1f s", name, n_slots, time.perf_counter() - t)
  logging.info(
    "state: mixers=%r%s, %s per slot, slot table %s",
    cfg.mixers,
    "" if args.max_context is None else f", --max_context={args.max_context}",
    _size(engine.fns.state_bytes_per_slot),
    _size(engine.fns.table_bytes),
  )
  limits = protocol.Limits(
    model_name=name,
    vocab_size=tok.vocab_size,
    eos_id=tok.eos_id,
    max_tokens=args.max_tokens,
    max_prompt_tokens=args.max_prompt_tokens,
    max_stop_ids=engine.fns.n_stop,
    max_prompts=n_slots + share,
    max_choices=args.max_choices,
    max_reply_entries=args.max_reply_entries,
    max_prediction_tokens=args.max_prediction_tokens,
  )
  # In the state cache's directory, which opens only its own *.state files: one directory per model.
  store_dir = os.path.join(cache.dir, SUBDIR) if cache is not None and cache.dir else None
  if args.state_cache_dir and store_dir is None:
    logging.info("stored responses are kept in memory only: the state cache, and so its directory, is off")
  return Server(
    engine,
    tok,
    limits,
    tenants=tenants,
    chat_template=template,
    allowed_hosts=args.allowed_host,
    response_store=ResponseStore(args.max_stored_responses, store_dir),
  )


async def serve_forever(server, host, port):
  bound = await server.start(host, port)
  logging.info("serving %s on http://%s:%d", server.limits.model_name, host, bound)
  stop = asyncio.Event()
  loop = asyncio.get_running_loop()
  for sig in (signal.SIGINT, signal.SIGTERM):
    loop.add_signal_handler(sig, stop.set)
  await stop.wait()
  logging.info("shutting down")
  await server.stop()


def main(argv=None):
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
  args = parse_args(argv)
  cli.set_verbosity(args.verbose)
  logging.getLogger("serve.access").disabled = not args.access_log
  if args.target:
    try:
      raise SystemExit(lower_target(args))
    except ValueError as e:
      raise SystemExit(f"python -m serve: error: {e}") from None
  try:
    server = build(args)
  except (ValueError, FileNotFoundError) as e:  # a bad flag found while building (a foreign
    # --state-cache-dir, a mesh too big, a --checkpoint that is no export or not --preset's model)
    raise SystemExit(f"python -m serve: error: {e}") from None
  asyncio.run(serve_forever(server, args.host, args.port))


if __name__ == "__main__":
  main()
