"""`python -m train`: see `python -m train --help` (and train/run_config.py for the config system).

The program's modules are imported inside the functions: the device settings (`_setup_jax`) must come before
anything could start a JAX backend.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys


def _setup_jax(tc):
  """Device simulation and multi-process initialisation, before any JAX backend starts."""
  import jax

  from laplace_jax import platform

  if tc.target and not tc.simulate_devices:
    tc = dataclasses.replace(tc, simulate_devices=platform.TRN2_DEVICES)  # LNC=2
  if tc.simulate_devices:
    platform.simulate_cpu_devices(tc.simulate_devices)
    jax.config.update("jax_platforms", "cpu")
  coordinator = tc.coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS", "")
  n_proc = int(os.environ.get("JAX_NUM_PROCESSES", tc.num_processes))
  proc_id = int(os.environ.get("JAX_PROCESS_ID", tc.process_id))
  if coordinator and n_proc > 1:
    if jax.config.jax_platforms in ("cpu",) or tc.simulate_devices:
      jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes=n_proc, process_id=proc_id)
  # the PRNG, before any key is made (--target: the target's choice)
  with platform.lowering_for(tc.target) if tc.target else contextlib.nullcontext():
    platform.use_prng(tc.prng)


def main(argv=None) -> int:
  from laplace_jax import cli

  argv = sys.argv[1:] if argv is None else list(argv)
  cli.set_verbosity("--verbose" in argv)  # before the imports below start grain, JAX and Orbax
  from train.run_config import load_config

  try:
    rc = load_config(argv)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  cli.set_verbosity(rc.train.verbose)
  _setup_jax(rc.train)
  from train.hooks import TrainingError
  from train.loop import run

  try:
    summary = run(rc)
  except (ValueError, FileNotFoundError, FileExistsError, TrainingError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  import jax

  if jax.process_index() == 0:
    print(json.dumps({k: v for k, v in summary.items() if k not in ("sample", "report")}))
  return 1 if summary.get("violations") else 0


if __name__ == "__main__":
  sys.exit(main())
