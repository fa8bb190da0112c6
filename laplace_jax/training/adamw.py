"""AdamW whose bias corrections need no `power` with a runtime exponent.

optax.scale_by_adam computes 1 − βᵗ as `1 - b ** count`, which lowers to `stablehlo.power` with the step
count as exponent; Neuron documents `power` only with constant exponents. Here 1 − βᵗ = 1 − exp(t·log β),
with log β a Python constant, computed in the dtype of the leaf it divides (float64 runs equal optax's; never
narrower than float32). The state is optax's ScaleByAdamState, so checkpoints written with
optax.adamw restore unchanged; updates equal optax.adamw's to float rounding (tests/library/training/test_optimizer.py).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax


def bias_correction(decay: float, count: jax.Array, dtype=jnp.float32) -> jax.Array:
  """1 − decay**count as a `dtype` scalar, computed as 1 − exp(count·log(decay)) in `dtype` (float32 when
  `dtype` is narrower): no power op (decay a Python constant)."""
  dtype = jnp.dtype(dtype)
  wide = jnp.promote_types(dtype, jnp.float32)
  decay = float(decay)
  if decay == 0.0:  # 0**t = 0 for the t >= 1 an optimizer uses
    return jnp.ones([], dtype)
  return (1.0 - jnp.exp(jnp.asarray(count, wide) * math.log(decay))).astype(dtype)


def bias_corrections(decay: float, count: jax.Array) -> Callable[[jnp.dtype], jax.Array]:
  """dtype -> bias_correction(decay, count, dtype), made once per dtype of a tree's leaves."""
  return functools.cache(lambda dtype: bias_correction(decay, count, dtype))


def scale_by_adam(
  b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, eps_root: float = 0.0, mu_dtype=None
) -> optax.GradientTransformation:
  """optax.scale_by_adam (without Nesterov) with `bias_correction`'s form of 1 − βᵗ."""
  mu_dtype = None if mu_dtype is None else jnp.dtype(mu_dtype)

  def init_fn(params):
    mu = jax.tree.map(lambda p: jnp.zeros(p.shape, mu_dtype or p.dtype), params)
    nu = jax.tree.map(jnp.zeros_like, params)
    return optax.ScaleByAdamState(count=jnp.zeros([], jnp.int32), mu=mu, nu=nu)

  def update_fn(updates, state, params=None):
    del params
    mu = jax.tree.map(lambda g, m: (1 - b1) * g + b1 * m, updates, state.mu)
    nu = jax.tree.map(lambda g, v: (1 - b2) * (g * g) + b2 * v, updates, state.nu)
    count = optax.safe_int32_increment(state.count)
    c1, c2 = bias_corrections(b1, count), bias_corrections(b2, count)
    new = jax.tree.map(lambda m, v: (m / c1(m.dtype)) / (jnp.sqrt(v / c2(v.dtype) + eps_root) + eps), mu, nu)
    mu = jax.tree.map(lambda m, old: m.astype(mu_dtype or old.dtype), mu, state.mu)
    nu = jax.tree.map(lambda v, old: v.astype(old.dtype), nu, state.nu)
    return new, optax.ScaleByAdamState(count=count, mu=mu, nu=nu)

  return optax.GradientTransformation(init_fn, update_fn)


def adamw(
  learning_rate: optax.ScalarOrSchedule,
  b1: float = 0.9,
  b2: float = 0.999,
  eps: float = 1e-8,
  weight_decay: float = 1e-4,
  mask=None,
) -> optax.GradientTransformation:
  """optax.adamw (same arguments, same state tree) with `scale_by_adam` above."""
  return optax.chain(
    scale_by_adam(b1, b2, eps),
    optax.add_decayed_weights(weight_decay, mask),
    optax.scale_by_learning_rate(learning_rate),
  )
