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
from laplace_jax.model.config import get_config
from serve.api import server_config
from serve.engine.engine_config import DEFAULTS, slots_for

_FLAGS = (
  "\n\nFlags are spelled with underscores, as in python -m train; the dashed spelling (--n-slots) is "
  "accepted too."
)


def build_parser() -> argparse.ArgumentParser:
  """A flag for each field of serve.api.server_config.GROUPS (ServerConfig's and EngineConfig's), in its group;
  the help is the field's docstring."""
  p = cli.FlagParser(
    prog="python -m serve", description=__doc__ + _FLAGS, formatter_class=cli.DefaultsFormatter
  )
  for title, flags in server_config.GROUPS:
    group = p.add_argument_group(title)
    exclusive = None
    for flag in flags:
      where = group
      if flag in server_config.EXCLUSIVE:
        exclusive = exclusive or group.add_mutually_exclusive_group()
        where = exclusive
      where.add_argument(f"--{flag}", **server_config.flag_options(flag))
  return p


def parse_args(argv=None):
  """The flags, checked, as one namespace (serve.api.server_config.configs splits it into the two configs)."""
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
  """serve.api.tenants.Tenants from --api-key and --api-keys-file (ValueError naming the problem); `args`:
  the parsed flags or a ServerConfig."""
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
  from serve.engine.engine import check_max_context
  from serve.slots import lowering

  cfg = get_config(args.preset)
  check_max_context(cfg, args.max_context)
  n_slots = args.n_slots or slots_for(cfg)
  from serve.slots import loading

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


def state_cache(sc: server_config.ServerConfig, cfg, params):
  """The state cache --state_cache_gb asks for (None: off, or a model with attention layers)."""
  if sc.state_cache_gb > 0 and "A" in cfg.mixers:
    logging.info(
      "state cache off: mixers=%r has attention layers, whose state (a KV cache of --max_context "
      "tokens) is not the constant-size state the cache keeps",
      cfg.mixers,
    )
  elif sc.state_cache_gb > 0:
    from serve.engine.state_cache import StateCache, layout_for, model_identity

    t = time.perf_counter()
    ident = model_identity(cfg, params)
    logging.info("model fingerprint %s (every parameter byte) in %.1f s", ident, time.perf_counter() - t)
    return StateCache(ident, int(sc.state_cache_gb * 1e9), sc.state_cache_dir, layout=layout_for(cfg))
  return None


def build(args):
  """Config, params, tokenizer, engine and server from the parsed flags (the engine is warmed up)."""
  from serve.api import protocol
  from serve.api.chat import ChatTemplate
  from serve.api.response_store import SUBDIR, ResponseStore
  from serve.api.server import Server
  from serve.engine.engine import Engine, check_max_context
  from serve.slots import loading

  engine_config, sc = server_config.configs(args)
  tenants = tenant_keys(sc)  # a bad keys file fails before the weights load
  logging.info("PRNG: %s", platform.use_prng(sc.prng))  # before any key is made
  mesh = loading.make_serving_mesh(sc.mesh_devices)
  tok = loading.gpt2_tokenizer()
  template = ChatTemplate.from_file(sc.chat_template, tok)  # a bad file fails before the weights load
  check_max_context(model_config(sc), engine_config.max_context)  # before the weights load
  params, cfg = loading.load_model(
    checkpoint=sc.checkpoint, preset=sc.preset, seed=sc.seed, mesh=mesh, dtype=sc.params_dtype
  )
  name = sc.model_name or (
    f"laplace-{sc.preset}"
    if sc.random_init
    else f"laplace-{os.path.basename(os.path.normpath(sc.checkpoint))}"
  )
  cache = state_cache(sc, cfg, params)
  # Several tenants: each may fill only its share of the queue, so one tenant's burst leaves room to wait.
  share = -(-engine_config.max_queue // max(1, len(tenants.names)))
  engine_config = dataclasses.replace(engine_config, max_queue_per_tenant=share)
  engine = Engine(params, cfg, engine_config, valid_vocab=tok.vocab_size, mesh=mesh, state_cache=cache)
  n_slots = engine.n_slots  # the flag's, or the model's default (EngineConfig.for_model)
  t = time.perf_counter()
  engine.warmup()
  logging.info("engine ready: %s, %d slots, compiled in %.1f s", name, n_slots, time.perf_counter() - t)
  logging.info(
    "state: mixers=%r%s, %s per slot, slot table %s",
    cfg.mixers,
    "" if engine_config.max_context is None else f", --max_context={engine_config.max_context}",
    _size(engine.fns.state_bytes_per_slot),
    _size(engine.fns.table_bytes),
  )
  limits = protocol.Limits(
    model_name=name,
    vocab_size=tok.vocab_size,
    eos_id=tok.eos_id,
    max_tokens=sc.max_tokens,
    max_prompt_tokens=sc.max_prompt_tokens,
    max_stop_ids=engine.fns.n_stop,
    max_prompts=n_slots + share,
    max_choices=sc.max_choices,
    max_reply_entries=sc.max_reply_entries,
    max_prediction_tokens=sc.max_prediction_tokens,
  )
  # In the state cache's directory, which opens only its own *.state files: one directory per model.
  store_dir = os.path.join(cache.dir, SUBDIR) if cache is not None and cache.dir else None
  if sc.state_cache_dir and store_dir is None:
    logging.info("stored responses are kept in memory only: the state cache, and so its directory, is off")
  return Server(
    engine,
    tok,
    limits,
    tenants=tenants,
    chat_template=template,
    allowed_hosts=sc.allowed_host,
    response_store=ResponseStore(sc.max_stored_responses, store_dir),
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
  # A no-op where the root logger already has a handler: a library that installs one on import (absl's,
  # through orbax) would leave the root at WARNING and hide the "serving ... on URL" line clients wait for,
  # so nothing imported above may load JAX or Orbax (tests/library/test_cli.py checks it).
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
