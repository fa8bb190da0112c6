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

import jax

TARGETS = ("cpu", "gpu", "neuron")
_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("laplace_jax_target", default=None)


def backend() -> str:
  """The platform choices are made for: the one set by `lowering_for`, else JAX's default backend."""
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
