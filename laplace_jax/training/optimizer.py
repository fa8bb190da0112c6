"""The training optimizer: Muon on the 2-D hidden matrices, AdamW on the rest, one schedule shape, clipping,
and token-weighted gradient accumulation.

Defaults are the laplace-3b run: 524,288 tokens per step, 3,815 warm-up steps, 100B tokens (190,735
steps), linear warm-up to the peak (peak·(t+1)/warm-up) then cosine decay to 10% of it. Muon (reference
shape scaling) peaks at 0.02 with no weight decay, as in the public Muon recipes; AdamW peaks at 3e-4
with β = (0.9, 0.95), eps 1e-8 and decoupled weight decay 0.1 on the embedding and LM head only (norm
scales, conv, aug_balance are not decayed). Gradients are clipped to a global norm of 1.0 before either
optimizer sees them. AdamW is laplace_jax.training.adamw's (optax's, with bias corrections free of runtime `power`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from laplace_jax.sharding import is_muon_leaf, path_names
from laplace_jax.training.adamw import adamw
from laplace_jax.training.muon import DISTRIBUTIONS, SCALE_MODES, muon

ADAMW_DECAYED = ("embed", "lm_head")  # AdamW leaves that get weight decay


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  total_steps: int = 190_735
  """length of the LR schedule (190,735 = 100B tokens / 524,288 tokens per step; defaults to --steps below
  laplace-3b; fixed when a run starts and kept when it is resumed or extended)"""
  warmup_steps: int = 3_815
  """linear warm-up steps"""
  end_lr_fraction: float = 0.1
  """cosine decays to this fraction of each peak"""
  clip_norm: float | None = 1.0
  """global gradient-norm clip (0, or None in code: no clipping; TOML and flags have no null)"""
  muon_lr: float = 0.02
  """Muon peak learning rate (2-D hidden matrices)"""
  muon_beta: float = 0.95
  """Muon Nesterov momentum"""
  muon_nesterov: bool = True
  """Nesterov momentum (true/false)"""
  muon_ns_steps: int = 5
  """Newton-Schulz iterations"""
  muon_weight_decay: float = 0.0
  """Muon decoupled weight decay"""
  muon_scale_mode: str = "reference"
  """reference (sqrt(max(1, out/in))) | adamw_rms (0.2*sqrt(max(in, out)); then use an AdamW-sized
  muon_lr)"""
  muon_distribution: str = "all_to_all"
  """with a mesh: all_to_all (two sharded all_to_alls) | gather (every matrix on every device; only to
  compare traffic)"""
  muon_ns_dtype: str = "float32"
  """Newton-Schulz iterations in float32 | bfloat16 (the reference Muon's; faster on GPUs)"""
  adamw_lr: float = 3e-4
  """AdamW peak learning rate (embedding, head, norms, conv, aug_balance)"""
  adamw_b1: float = 0.9
  """AdamW beta1"""
  adamw_b2: float = 0.95
  """AdamW beta2"""
  adamw_eps: float = 1e-8
  """AdamW epsilon"""
  adamw_weight_decay: float = 0.1
  """AdamW decoupled weight decay (embedding and head only)"""

  def __post_init__(self):
    def bad(field, expect, fix=""):
      raise ValueError(f"OptimizerConfig.{field}={getattr(self, field)!r}: expected {expect}. {fix}".rstrip())

    def is_int(v):
      return isinstance(v, int) and not isinstance(v, bool)

    if not is_int(self.total_steps) or self.total_steps < 1:
      bad("total_steps", "a positive integer")
    if not is_int(self.warmup_steps) or not 0 <= self.warmup_steps <= self.total_steps:
      bad("warmup_steps", f"an integer in [0, total_steps={self.total_steps}]")
    if not 0 <= self.end_lr_fraction <= 1:
      bad("end_lr_fraction", "a fraction of the peak in [0, 1]")
    if self.clip_norm is not None and not (math.isfinite(self.clip_norm) and self.clip_norm >= 0):
      bad("clip_norm", "a positive finite norm, or 0 (or None) to disable clipping")
    for f in ("muon_lr", "adamw_lr", "muon_weight_decay", "adamw_weight_decay"):
      v = getattr(self, f)
      if not (math.isfinite(v) and v >= 0):
        bad(f, "a finite value >= 0", "Learning rates and weight decays cannot be negative.")
    for f in ("muon_beta", "adamw_b1", "adamw_b2"):
      if not 0 <= getattr(self, f) < 1:
        bad(f, "a decay rate in [0, 1)")
    if not (math.isfinite(self.adamw_eps) and self.adamw_eps > 0):
      bad("adamw_eps", "a small positive value such as 1e-8")
    if not is_int(self.muon_ns_steps) or self.muon_ns_steps < 1:
      bad("muon_ns_steps", "an integer >= 1")
    if self.muon_scale_mode not in SCALE_MODES:
      bad("muon_scale_mode", f"one of {SCALE_MODES}")
    if self.muon_distribution not in DISTRIBUTIONS:
      bad("muon_distribution", f"one of {DISTRIBUTIONS}")
    if self.muon_ns_dtype not in ("float32", "bfloat16"):
      bad("muon_ns_dtype", "'float32' or 'bfloat16'")

  def replace(self, **changes) -> OptimizerConfig:
    return dataclasses.replace(self, **changes)


def lr_schedule(peak: float, ocfg: OptimizerConfig) -> optax.Schedule:
  """Step t (from 0): peak·(t+1)/warmup while t < warmup, then cosine from peak to end_lr_fraction·peak
  at total_steps (and flat after)."""
  warmup, total, end = ocfg.warmup_steps, ocfg.total_steps, peak * ocfg.end_lr_fraction

  def schedule(step):
    t = jnp.asarray(step, jnp.float32)
    warm = peak * (t + 1) / max(warmup, 1)
    progress = jnp.clip((t - warmup) / max(total - warmup, 1), 0.0, 1.0)
    cosine = end + (peak - end) * 0.5 * (1 + jnp.cos(jnp.pi * progress))
    return jnp.where(t < warmup, warm, cosine)

  return schedule


def param_labels(params):
  """'muon' for layers/{w_qkvg, w_out, w1, w2, w3}, 'adamw' for every other leaf."""

  def label(path, x):
    names = path_names(path)
    if not is_muon_leaf(names):
      return "adamw"
    if len(x.shape) != 3:
      raise ValueError(
        f"{'/'.join(names)} has shape {tuple(x.shape)}: expected a layer stack "
        "[L, fan_in, fan_out]. Parameters come from laplace_jax.model.init_params."
      )
    return "muon"

  return jax.tree_util.tree_map_with_path(label, params)


def _adamw_decay_mask(params):
  return jax.tree_util.tree_map_with_path(lambda path, _: path_names(path)[-1] in ADAMW_DECAYED, params)


def make_optimizer(
  ocfg: OptimizerConfig = OptimizerConfig(), *, mesh: Mesh | None = None
) -> optax.GradientTransformation:
  """Clip by global norm, then Muon on the hidden matrices and AdamW on the rest (see the module doc)."""
  muon_tx = muon(
    lr_schedule(ocfg.muon_lr, ocfg),
    beta=ocfg.muon_beta,
    nesterov=ocfg.muon_nesterov,
    ns_steps=ocfg.muon_ns_steps,
    weight_decay=ocfg.muon_weight_decay,
    scale_mode=ocfg.muon_scale_mode,
    mesh=mesh,
    distribution=ocfg.muon_distribution,
    ns_dtype=None if ocfg.muon_ns_dtype == "float32" else jnp.bfloat16,
  )
  adamw_tx = adamw(
    lr_schedule(ocfg.adamw_lr, ocfg),
    b1=ocfg.adamw_b1,
    b2=ocfg.adamw_b2,
    eps=ocfg.adamw_eps,
    weight_decay=ocfg.adamw_weight_decay,
    mask=_adamw_decay_mask,
  )
  parts = optax.partition({"muon": muon_tx, "adamw": adamw_tx}, param_labels)
  return optax.chain(optax.clip_by_global_norm(ocfg.clip_norm), parts) if ocfg.clip_norm else parts


# ---- gradient accumulation ------------------------------------------------------------------------


def split_microbatches(batch, n_micro: int):
  """[B, ...] leaves -> [n_micro, B/n_micro, ...]. Micro-batch k takes rows k, k+n, k+2n, ... so each
  device's rows of a batch-sharded array stay on that device (no resharding)."""

  def split(path, x):
    B = x.shape[0]
    if B % n_micro:
      raise ValueError(
        f"batch/{'/'.join(path_names(path))}: batch size {B} does not split into {n_micro} "
        f"micro-batches. Use a batch size that is a multiple of {n_micro}."
      )
    return jnp.swapaxes(x.reshape((B // n_micro, n_micro) + x.shape[1:]), 0, 1)

  return jax.tree_util.tree_map_with_path(split, batch)


def accumulate_gradients(loss_and_grad_fn: Callable, params, microbatches):
  """Token-weighted mean loss and gradient over micro-batches stacked on a leading axis (lax.scan).

  `loss_and_grad_fn(params, microbatch) -> ((loss_sum, aux), grads_of_loss_sum)`, i.e.
  `jax.value_and_grad(f, has_aux=True)` of an f returning the summed token loss and either the token count
  or a record of sums holding it in a `tokens` field (train_step.LossSums; its other fields, e.g. metric
  sums, are summed alongside). Returns (loss_sum / tokens, grads / tokens, summed aux), accumulated in fp32:
  every token weighs the same however the tokens fall into micro-batches. An aux field `carry` (state
  passing: each micro-batch's rows' recurrent state after their segment) is not summed but stacked over the
  micro-batches.
  """
  f32 = lambda t: jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), t)
  # (the sums, the carry): a record's carry is taken out of the sums (None: no carry, or a bare token count)
  split_carry = lambda aux: (aux.replace(carry=None), aux.carry) if hasattr(aux, "carry") else (aux, None)

  def body(carry, mb):
    loss_sum, aux_sum, grads = carry
    (l, aux), g = loss_and_grad_fn(params, mb)
    aux, out = split_carry(aux)
    return (
      loss_sum + l.astype(jnp.float32),
      jax.tree.map(jnp.add, aux_sum, f32(aux)),
      jax.tree.map(jnp.add, grads, f32(g)),
    ), out

  first = jax.tree.map(lambda x: x[0], microbatches)
  aux_shape = split_carry(jax.eval_shape(lambda: loss_and_grad_fn(params, first)[0][1]))[0]
  zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
  init = (
    jnp.zeros([], jnp.float32),
    jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), aux_shape),
    zeros,
  )
  (loss_sum, aux, grads), carries = jax.lax.scan(body, init, microbatches)
  tokens = getattr(aux, "tokens", aux)
  if carries is not None:
    aux = aux.replace(carry=carries)
  inv = 1.0 / jnp.maximum(tokens, 1.0)
  return loss_sum * inv, jax.tree.map(lambda g: g * inv, grads), aux
