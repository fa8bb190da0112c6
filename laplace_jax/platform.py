"""The platform the code makes its per-platform choices for (GLA form, decode implementation, PRNG, FSDP gather
dtype, layer stacking).

Every such choice reads `backend()` instead of `jax.default_backend()`, so that a program can be *lowered* for
a platform this machine does not have (`--target neuron`): inside `with lowering_for("neuron"):` the code takes
exactly the branches it would take on a Trainium host, and `jax.jit(...).lower(...)` records them.

A jitted function caches its trace by its arguments, not by this setting: lower a function for another target
in a fresh process (as the `--target` CLIs do) or from a function object that has not been traced yet.
"""

from __future__ import annotations

import contextlib
import contextvars
import os

# JAX is imported inside the functions: the command lines read this module's constants (their flags' choices)
# before anything loads JAX, so that --help stays quick.

TARGETS = ("cpu", "gpu", "neuron")
LOWERING_TARGETS = ("neuron",)  # what --target may name: platforms lowered for without being present
# Simulated devices of a --target neuron lowering: a trn2.48xlarge, 16 chips x 4 logical cores.
TRN2_DEVICES = 64
PRNG_IMPLS = ("threefry", "rbg", "unsafe_rbg")
PRNG_CHOICES = ("auto",) + PRNG_IMPLS
_JAX_PRNG_NAMES = {"threefry": "threefry2x32", "rbg": "rbg", "unsafe_rbg": "unsafe_rbg"}
CPU_DEVICES_ENV = "JAX_NUM_CPU_DEVICES"  # JAX's jax_num_cpu_devices option, as the environment spells it
_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("laplace_jax_target", default=None)


def simulate_cpu_devices(n: int) -> None:
  """Give JAX's CPU backend `n` devices, a simulated mesh: JAX's `jax_num_cpu_devices` option in this process,
  and its environment variable for the processes this one starts. Call it before the first use of a device:
  the CPU backend keeps the count it started with."""
  import jax

  os.environ[CPU_DEVICES_ENV] = str(n)
  jax.config.update("jax_num_cpu_devices", n)


def backend() -> str:
  """The platform choices are made for: the one set by `lowering_for`, else JAX's default backend."""
  import jax

  target = _TARGET.get()
  return target if target is not None else jax.default_backend()


@contextlib.contextmanager
def lowering_for(target: str):
  """Make every per-platform choice inside the block as on `target` ("cpu", "gpu" or "neuron")."""
  if target not in TARGETS:
    raise ValueError(f"target {target!r}: expected one of {TARGETS}.")
  token = _TARGET.set(target)
  try:
    yield target
  finally:
    _TARGET.reset(token)


def prng_impl(choice: str = "auto") -> str:
  """The PRNG implementation for `choice` ("auto", "threefry", "rbg", "unsafe_rbg"). "auto": "rbg" on Neuron
  (jax-neuronx documents Threefry as not fully supported and recommends rbg), "threefry" (JAX's default)
  elsewhere. rbg draws bits with `rng_bit_generator` but still splits and folds keys with Threefry;
  unsafe_rbg does neither (see docs/NEURON.md)."""
  if choice not in PRNG_CHOICES:
    raise ValueError(
      f"PRNG {choice!r}: expected one of {PRNG_CHOICES} (auto: rbg on Neuron, threefry elsewhere)."
    )
  if choice != "auto":
    return choice
  return "rbg" if backend() == "neuron" else "threefry"


def use_prng(choice: str = "auto") -> str:
  """Make `prng_impl(choice)` JAX's default PRNG (`jax_default_prng_impl`) and return its name. Call it once
  at program start, before any key is made: a key keeps the implementation it was made with, and the same
  seed draws different numbers under different implementations."""
  import jax

  impl = prng_impl(choice)
  jax.config.update("jax_default_prng_impl", _JAX_PRNG_NAMES[impl])
  return impl


@contextlib.contextmanager
def using_prng(choice: str = "auto"):
  """`use_prng(choice)` for the block, JAX's previous default restored after it (for callers in a process
  that runs more than one program, such as tests); yields the implementation's name."""
  import jax

  before = jax.config.values["jax_default_prng_impl"]
  try:
    yield use_prng(choice)
  finally:
    jax.config.update("jax_default_prng_impl", before)


def current_prng() -> str:
  """The name (as `prng_impl` spells it) of JAX's default PRNG implementation now."""
  import jax

  name = jax.config.values["jax_default_prng_impl"]
  return {v: k for k, v in _JAX_PRNG_NAMES.items()}.get(name, name)
