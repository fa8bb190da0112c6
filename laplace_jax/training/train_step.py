"""The training step: token-weighted loss, micro-batch accumulation, skip on non-finite, AOT compile on a mesh.

    state: TrainState(params, opt_state, step, rng, bad_steps, carry=None | Carry)
    batch: Batch(inputs, targets, weights=None, positions=None, carry=None, segment_ids=None)
(laplace_jax/training/train_state.py gives every field's shape and dtype.)

State passing (truncated BPTT): row b of every batch continues row b's token stream of the previous step,
so the step starts that row from its carried recurrent state (stop_gradient: no gradient crosses the
segment boundary) and stores the state after its last token. The carry (`Carry`) is batch-major so that it
shards, and splits into micro-batches, exactly as the batch's rows do; it is part of the state and so of every
checkpoint (carry.pos, carry.conv, carry.gla; carry.segment with segment ids). A non-finite step resets it to
zero (its states may hold the NaN).

`compile_train_step` lowers and compiles the step once, with explicit in/out shardings and the state donated,
so a run never recompiles; `abstract_train_state` gives the state's shapes and shardings without allocating.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import optax
from flax import struct
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from laplace_jax import fsdp, model, sharding
from laplace_jax.array_types import Array
from laplace_jax.model.config import LaplaceConfig
from laplace_jax.model.counts import param_shapes
from laplace_jax.ops import context_parallel
from laplace_jax.training import optimizer as optim
from laplace_jax.training.train_state import Batch, Carry, TrainState

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class StepConfig:
  """Settings of the compiled step (not of the model or the optimizer)."""

  micro_batches: int = 1  # the global batch is split into this many sequential micro-batches
  z_loss: float = 0.0  # weight of logsumexp² (keeps the softmax normaliser near 1)

  def __post_init__(self):
    if not isinstance(self.micro_batches, int) or self.micro_batches < 1:
      raise ValueError(f"micro_batches={self.micro_batches!r}: expected a positive integer.")
    if not self.z_loss >= 0:
      raise ValueError(f"z_loss={self.z_loss!r}: expected a weight >= 0 (0 disables it).")


@struct.dataclass
class LossSums:
  """`loss_sums`' aux: sums over the batch's scored tokens, all fp32 [] (summed again over micro-batches and
  devices), and the carry after the batch (state passing; stacked over micro-batches, never summed)."""

  ce: Array  # Σ weight · cross-entropy
  z: Array  # Σ weight · logsumexp² (the z-loss, before its weight)
  tokens: Array  # Σ weights: the tokens the sums are over
  carry: Carry | None = None  # state passing: the rows' state after their last input (no gradient)

  if TYPE_CHECKING:  # made by flax.struct.dataclass; declared here for type checkers

    def replace(self, **updates: Any) -> LossSums: ...


@struct.dataclass
class StepMetrics:
  """What one train step reports, replicated scalars (metrics.jsonl's and TensorBoard's names come from
  these fields: train/hooks.py)."""

  loss: Array  # f32: mean cross-entropy per scored token (the z-loss excluded)
  z_loss: Array  # f32: mean logsumexp² per scored token
  grad_norm: Array  # f32: global norm of the token-averaged gradient (before clipping)
  tokens: Array  # f32: Σ loss weights of the step's batch
  skipped: Array  # bool: the loss or gradient was not finite, so the update was not applied
  bad_steps: Array  # int32: consecutive skipped steps, this one included (0 after a good step)
  lr: Array | None = None  # f32: the schedule's learning rate at this step (None: no schedule given)


def init_carry(cfg: LaplaceConfig, batch: int, segmented: bool = False) -> Carry:
  """The zero carry of `batch` rows (model.init_carry's, batch-major); `segmented`: with the rows' last
  segment ids (packed documents), 0."""
  segment = jnp.zeros((batch,), jnp.int32) if segmented else None
  return Carry.from_state(model.init_carry(cfg, batch), segment)


def loss_sums(params, batch: Batch, *, cfg: LaplaceConfig, z_loss: float = 0.0) -> tuple[Array, LossSums]:
  """(Σ weighted token loss incl. z-loss, LossSums(ce=Σ ce, z=Σ z, tokens=Σ weights)), all fp32.

  A batch with a carry (state passing) starts from it, and the aux's carry is the state after the batch. A batch
  with positions [B, J] scores those positions only (targets and weights read there): recall tasks answer
  at a few positions per row, and the LM head's cost falls by T/J. A batch with segment ids computes each
  packed document as if alone in its row."""
  carry = None
  pos_BxJ, seg_BxT = batch.positions, batch.segment_ids
  if batch.carry is not None:
    first_start_B = None
    if seg_BxT is not None:  # a row whose first input's id is not its previous step's last begins anew
      if batch.carry.segment is None:
        raise ValueError(
          "a batch with segment ids and a carry without them: make the train state with "
          "init_train_state(..., segmented=True) (its carry keeps each row's last segment id)."
        )
      first_start_B = seg_BxT[:, 0] != batch.carry.segment
    logits_BxTxY, carry = model.forward_carry(
      params,
      batch.inputs,
      batch.carry.to_state(),
      cfg=cfg,
      segment_ids_BxT=seg_BxT,
      first_start_B=first_start_B,
    )
    logits_BxTxY = logits_BxTxY.astype(F32)
    if pos_BxJ is not None:
      logits_BxTxY = jnp.take_along_axis(logits_BxTxY, pos_BxJ[..., None], axis=1)
  else:
    logits_BxTxY = model.forward(
      params, batch.inputs, cfg=cfg, positions_BxJ=pos_BxJ, segment_ids_BxT=seg_BxT
    ).astype(F32)
  targets_BxT = batch.targets
  w_BxT = (jnp.ones(targets_BxT.shape, F32) if batch.weights is None else batch.weights).astype(F32)
  if pos_BxJ is not None:  # [B, J] from here on
    targets_BxT, w_BxT = (jnp.take_along_axis(x, pos_BxJ, axis=1) for x in (targets_BxT, w_BxT))
  lse_BxT = jax.nn.logsumexp(logits_BxTxY, axis=-1)
  target_logit = jnp.take_along_axis(logits_BxTxY, targets_BxT[..., None], axis=-1)[..., 0]
  ce = jnp.sum((lse_BxT - target_logit) * w_BxT)
  z = jnp.sum(jnp.square(lse_BxT) * w_BxT)
  aux = LossSums(ce=ce, z=z, tokens=jnp.sum(w_BxT))
  if carry is not None:
    assert batch.carry is not None
    segment_B = batch.carry.segment if seg_BxT is None else seg_BxT[:, -1]
    sp = context_parallel.span()
    if sp is not None and segment_B is not None:  # the row's last id, on the last span
      segment_B = context_parallel.from_last(segment_B, sp)
    aux = aux.replace(carry=jax.lax.stop_gradient(Carry.from_state(carry, segment_B)))
  return ce + z_loss * z, aux


def fsdp_grad_fn(params, *, cfg: LaplaceConfig, mesh: Mesh, z_loss: float = 0.0, carry: bool = False):
  """grad_fn(params, microbatch) -> ((loss_sum, aux sums), grads) with FSDP written out: per device, the
  weights are gathered in the compute dtype where they are used (each layer's inside its remat) and the
  gradients reduce-scattered in fp32 (laplace_jax/fsdp.py). Same results as the unsharded value_and_grad.
  `carry`: the micro-batch holds a carry and aux returns the new one, per device's rows (not summed).
  With a "context" mesh axis each device computes a span of its rows (laplace_jax/ops/context_parallel.py), and
  the sums run over that axis too."""
  specs = sharding.param_specs(params, mesh)
  top_shapes = param_shapes(cfg)["model"]
  summed = sharding.BATCH_AXES + ((sharding.CONTEXT,) if sharding.context_size(mesh) > 1 else ())

  def local_loss(p, mb):
    p = {**p, **fsdp.gather_tree({k: p[k] for k in top_shapes}, top_shapes, cfg.compute_dtype)}
    return loss_sums(p, mb, cfg=cfg, z_loss=z_loss)

  def per_device(p, mb):
    (loss, aux), grads = jax.value_and_grad(local_loss, has_aux=True)(p, mb)
    # Sharded leaves come back reduce-scattered (fsdp.gather's backward); whole ones (norm scales, conv,
    # biases: ≈0.02% of laplace-3b) hold this device's partial sum.
    grads = jax.tree.map(
      lambda g, spec: g if any(spec) else jax.lax.psum(g, summed),
      grads,
      specs,
      is_leaf=lambda x: isinstance(x, P),
    )
    loss, sums = jax.lax.psum((loss, aux.replace(carry=None)), summed)
    return (loss, sums.replace(carry=aux.carry)), grads  # the carry: this device's rows, not summed

  rows = P(sharding.BATCH_AXES)
  aux_spec = LossSums(ce=P(), z=P(), tokens=P(), carry=rows) if carry else P()  # type: ignore[arg-type]

  def grad_fn(p, mb: Batch):
    # check_vma=False: the model's scans start from zero carries that the per-device type check would need
    # marked as varying; the collectives here are written out, so nothing relies on it.
    return jax.shard_map(
      per_device,
      mesh=mesh,
      in_specs=(specs, batch_partition_specs(mb, mesh)),
      out_specs=((P(), aux_spec), specs),
      check_vma=False,
    )(p, mb)

  return grad_fn


def batch_partition_specs(batch: Batch, mesh: Mesh) -> Batch:
  """Each field's PartitionSpec: rows over the batch axes; per-token fields' sequence over "context" when
  the mesh has it (a carry, and scored positions, hold whole rows)."""
  rows = P(sharding.BATCH_AXES)
  tok = sharding.token_spec(batch.inputs.shape, mesh)
  return Batch(
    inputs=tok,
    targets=tok,
    weights=None if batch.weights is None else tok,
    positions=None if batch.positions is None else rows,
    carry=None if batch.carry is None else rows,  # type: ignore[arg-type]  # a spec where the Carry sits
    segment_ids=None if batch.segment_ids is None else tok,
  )


def train_step(
  state: TrainState,
  batch: Batch,
  *,
  cfg: LaplaceConfig,
  optimizer: optax.GradientTransformation,
  step_cfg: StepConfig = StepConfig(),
  mesh: Mesh | None = None,
  lr_schedule=None,
) -> tuple[TrainState, StepMetrics]:
  """One optimizer step over the global batch, accumulated over micro-batches; pure."""
  params = state.params
  if state.carry is not None:
    batch = batch.replace(carry=state.carry)
  grad_fn = jax.value_and_grad(lambda p, mb: loss_sums(p, mb, cfg=cfg, z_loss=step_cfg.z_loss), has_aux=True)
  micro = optim.split_microbatches(batch, step_cfg.micro_batches)  # [m, B/m, ...], rows interleaved
  if mesh is not None:  # each micro-batch stays spread over every device
    specs = batch_partition_specs(jax.tree.map(lambda x: x[0], micro), mesh)
    pin = lambda spec, x: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(None, *spec)))
    micro = jax.tree.map(
      lambda spec, field: jax.tree.map(lambda x: pin(spec, x), field),
      specs,
      micro,
      is_leaf=lambda x: isinstance(x, P),
    )
    grad_fn = fsdp_grad_fn(params, cfg=cfg, mesh=mesh, z_loss=step_cfg.z_loss, carry=state.carry is not None)
  _, grads, aux = optim.accumulate_gradients(grad_fn, params, micro)
  carry_micro = aux.carry  # [m, B/m, ...]: back to [B, ...] in split_microbatches' row order
  n_tok = jnp.maximum(aux.tokens, 1.0)
  loss = aux.ce / n_tok
  grad_norm = optax.tree.norm(grads)

  updates, new_opt = optimizer.update(grads, state.opt_state, params)
  new_params = optax.apply_updates(params, updates)
  # A non-finite loss or gradient leaves params and optimizer state untouched; the host counts the run.
  ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)
  new_carry = None
  if carry_micro is not None:
    merge = lambda x: jnp.swapaxes(x, 0, 1).reshape((-1,) + x.shape[2:])
    new_carry = jax.tree.map(lambda c: jnp.where(ok, merge(c), jnp.zeros((), c.dtype)), carry_micro)
  new_state = TrainState(
    params=keep(new_params, params),
    opt_state=keep(new_opt, state.opt_state),
    step=state.step + ok.astype(jnp.int32),
    rng=state.rng,
    bad_steps=jnp.where(ok, 0, state.bad_steps + 1),
    carry=new_carry,
  )
  metrics = StepMetrics(
    loss=loss,
    z_loss=aux.z / n_tok,
    grad_norm=grad_norm,
    tokens=aux.tokens,
    skipped=~ok,
    bad_steps=new_state.bad_steps,
    lr=None if lr_schedule is None else jnp.asarray(lr_schedule(state.step), F32),
  )
  return new_state, metrics


# ---- state, shardings, compile --------------------------------------------------------------------


def init_train_state(
  cfg: LaplaceConfig,
  optimizer: optax.GradientTransformation,
  seed: int,
  carry_batch: int = 0,
  segmented: bool = False,
) -> TrainState:
  """`carry_batch` > 0: state passing, a zero carry for that many rows (the global batch), with the rows'
  last segment ids if `segmented` (packed documents)."""
  key = jax.random.key(seed)
  params = model.init_params(cfg, key)
  return TrainState(
    params=params,
    opt_state=optimizer.init(params),
    step=jnp.zeros((), jnp.int32),
    rng=jax.random.key_data(key),
    bad_steps=jnp.zeros((), jnp.int32),
    carry=init_carry(cfg, carry_batch, segmented) if carry_batch else None,
  )


def train_state_shardings(abstract_state: TrainState, mesh: Mesh) -> TrainState:
  """FSDP shardings for params and optimizer state (same rule, so moments sit with their params)."""
  rep = sharding.replicated(mesh)
  carry = abstract_state.carry
  if carry is not None:  # sharded with the batch's rows
    carry = jax.tree.map(lambda c: NamedSharding(mesh, sharding.batch_spec(c.shape, mesh)), carry)
  return TrainState(
    params=sharding.param_shardings(abstract_state.params, mesh),
    opt_state=sharding.param_shardings(abstract_state.opt_state, mesh),
    step=rep,
    rng=rep,
    bad_steps=rep,
    carry=carry,
  )


def abstract_train_state(
  cfg: LaplaceConfig,
  optimizer,
  mesh: Mesh | None = None,
  seed: int = 0,
  carry_batch: int = 0,
  segmented: bool = False,
) -> TrainState:
  """ShapeDtypeStructs of the train state (with shardings when a mesh is given); allocates nothing."""
  shapes = jax.eval_shape(lambda: init_train_state(cfg, optimizer, seed, carry_batch, segmented))
  if mesh is None:
    return shapes
  shards = train_state_shardings(shapes, mesh)
  return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shards)


def init_train_state_on_mesh(
  cfg: LaplaceConfig, optimizer, mesh: Mesh, seed: int, carry_batch: int = 0, segmented: bool = False
) -> TrainState:
  """Create the train state directly in its sharded layout (no full copy on one device)."""
  abstract = abstract_train_state(cfg, optimizer, mesh, seed, carry_batch, segmented)
  shards = jax.tree.map(lambda s: s.sharding, abstract)
  return jax.jit(
    lambda: init_train_state(cfg, optimizer, seed, carry_batch, segmented), out_shardings=shards
  )()


def abstract_batch(
  global_batch: int,
  seq_len: int,
  mesh: Mesh | None = None,
  *,
  weighted: bool = False,
  segmented: bool = False,
) -> Batch:
  """Batch shapes; `weighted` adds per-token loss weights (recall tasks score only their answers),
  `segmented` the packed rows' document ids."""
  sh = None if mesh is None else NamedSharding(mesh, sharding.token_spec((global_batch, seq_len), mesh))
  tok = jax.ShapeDtypeStruct((global_batch, seq_len), jnp.int32, sharding=sh)
  weights = jax.ShapeDtypeStruct((global_batch, seq_len), jnp.float32, sharding=sh) if weighted else None
  return Batch(inputs=tok, targets=tok, weights=weights, segment_ids=tok if segmented else None)


def compile_train_step(
  cfg: LaplaceConfig,
  optimizer,
  mesh: Mesh,
  *,
  global_batch: int,
  seq_len: int,
  step_cfg: StepConfig = StepConfig(),
  lr_schedule=None,
  abstract_state=None,
  weighted: bool = False,
  state_passing: bool = False,
  segmented: bool = False,
) -> Any:
  """Lower and compile the step ahead of time for these shapes and shardings; returns the executable.

  Raises ValueError before compiling when the batch does not split over the mesh or the micro-batches."""
  return lower_train_step(
    cfg,
    optimizer,
    mesh,
    global_batch=global_batch,
    seq_len=seq_len,
    step_cfg=step_cfg,
    lr_schedule=lr_schedule,
    abstract_state=abstract_state,
    weighted=weighted,
    state_passing=state_passing,
    segmented=segmented,
  ).compile()


def lower_train_step(
  cfg: LaplaceConfig,
  optimizer,
  mesh: Mesh,
  *,
  global_batch: int,
  seq_len: int,
  step_cfg: StepConfig = StepConfig(),
  lr_schedule=None,
  abstract_state=None,
  weighted: bool = False,
  state_passing: bool = False,
  segmented: bool = False,
) -> Any:
  """The step lowered (not compiled) from abstract shapes: `.as_text()` is its StableHLO, `.compile()` the
  executable. Inside `platform.lowering_for(target)` it records the choices made for that target."""
  n_dev = mesh.devices.size // sharding.context_size(mesh)  # a context axis splits rows, not the batch
  if global_batch % (step_cfg.micro_batches * n_dev):
    raise ValueError(
      f"global batch {global_batch} must split into micro_batches={step_cfg.micro_batches} "
      f"× {n_dev} devices (a multiple of {step_cfg.micro_batches * n_dev}); change the batch size "
      "or the number of micro-batches."
    )
  n_ctx = sharding.context_size(mesh)
  span = seq_len // n_ctx
  if seq_len % n_ctx or span < max(cfg.conv_size, cfg.window if "S" in cfg.mixers else 1):
    raise ValueError(
      f"seq_len {seq_len} over a context axis of {n_ctx} devices: each device's span must be a whole "
      f"{seq_len / n_ctx:g} tokens of at least the conv's {cfg.conv_size}"
      + (f" and the window's {cfg.window}" if "S" in cfg.mixers else "")
      + f"; use a multiple of {n_ctx} that is long enough, or a smaller --mesh_context."
    )
  if abstract_state is None:
    abstract_state = abstract_train_state(
      cfg, optimizer, mesh, carry_batch=global_batch if state_passing else 0, segmented=segmented
    )
  state = abstract_state
  if state.carry is not None and jax.tree.leaves(state.carry)[0].shape[0] != global_batch:
    raise ValueError(
      f"the state's carry holds {jax.tree.leaves(state.carry)[0].shape[0]} rows but the "
      f"global batch has {global_batch}: state passing carries one state per row."
    )
  if state.carry is not None and segmented != (state.carry.segment is not None):
    raise ValueError(
      f"segmented={segmented} with a carry {'without' if segmented else 'with'} segment ids: make the state "
      f"with abstract_train_state(..., segmented={segmented}), as the batches are."
    )
  batch = abstract_batch(global_batch, seq_len, mesh, weighted=weighted, segmented=segmented)
  state_sh = jax.tree.map(lambda s: s.sharding, state)
  batch_sh = jax.tree.map(lambda s: s.sharding, batch)

  def step(state, batch):
    return train_step(
      state, batch, cfg=cfg, optimizer=optimizer, step_cfg=step_cfg, mesh=mesh, lr_schedule=lr_schedule
    )

  jitted = jax.jit(
    step,
    in_shardings=(state_sh, batch_sh),
    out_shardings=(state_sh, sharding.replicated(mesh)),
    donate_argnums=0,
  )
  with jax.set_mesh(mesh):  # lets the model pin its activations' batch sharding
    return jitted.lower(state, batch)
