"""State passing (truncated BPTT) in the train step: two consecutive segments from the carried state score
exactly what one forward over the whole sequence scores; on the FSDP mesh, with micro-batches, any pattern."""

import functools

import jax
import numpy as np
import optax
import pytest

from laplace_jax import model, sharding
from laplace_jax.model.config import get_config
from laplace_jax.training import train_step as ts

# A larger init than the preset's makes the output depend on the context strongly enough to tell a carried
# state from a zero one.
CFG = get_config("tiny", vocab_size=128, chunk_size=16, init_std=0.1)


def _per_token_ce(params, tokens, cfg):
  """Reference: per-position cross-entropy of one forward from a zero state over all of `tokens`."""
  logits = np.asarray(model.forward(params, tokens[:, :-1], cfg=cfg), np.float64)
  lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
  return lse - np.take_along_axis(logits, tokens[:, 1:, None], -1)[..., 0]


def test_two_segments_with_carried_state_equal_the_full_sequence():
  micro_batches = 2  # each micro-batch's rows carry their own state
  mesh = sharding.make_mesh(data=2, fsdp=4)  # 8 simulated devices: the carry is sharded with the rows
  B, T = 16, 32
  opt = optax.sgd(0.0)  # parameters stay put, so each step scores its segment with the same model
  step = ts.compile_train_step(
    CFG,
    opt,
    mesh,
    global_batch=B,
    seq_len=T,
    state_passing=True,
    step_cfg=ts.StepConfig(micro_batches=micro_batches),
  )
  state = ts.init_train_state_on_mesh(CFG, opt, mesh, seed=0, carry_batch=B)
  assert set(state.carry.to_dict()) == {"gla", "conv", "pos"} and state.carry.gla.shape[0] == B
  tokens = np.random.default_rng(0).integers(0, CFG.vocab_size, (B, 2 * T + 1)).astype(np.int32)
  losses = []
  for s in range(2):
    seg = tokens[:, s * T : (s + 1) * T + 1]
    state, m = step(state, ts.Batch(inputs=seg[:, :-1], targets=seg[:, 1:]))
    losses.append(float(m.loss))
  assert np.asarray(state.carry.pos).tolist() == [2 * T] * B  # batch-major like every carry leaf
  ce = _per_token_ce(jax.device_get(state.params), tokens, CFG)
  np.testing.assert_allclose(losses, [ce[:, :T].mean(), ce[:, T:].mean()], rtol=2e-5)
  # Without the carry the second segment scores differently (the test can tell the two apart).
  fresh = ts.init_train_state_on_mesh(CFG, opt, mesh, seed=0, carry_batch=B)
  _, m = step(fresh, ts.Batch(inputs=tokens[:, T : 2 * T], targets=tokens[:, T + 1 :]))
  assert abs(float(m.loss) - ce[:, T:].mean()) > 20 * 2e-5 * ce[:, T:].mean()


def test_attention_layers_carry_nothing():
  mixers = "GA"
  cfg = CFG.replace(mixers=mixers)
  mesh = sharding.make_mesh(data=1, fsdp=8)
  opt = optax.adam(1e-2)
  step = ts.compile_train_step(cfg, opt, mesh, global_batch=8, seq_len=16, state_passing=True)
  state = ts.init_train_state_on_mesh(cfg, opt, mesh, seed=0, carry_batch=8)
  assert (
    set(state.carry.to_dict()) == {"gla", "conv", "pos"} and state.carry.gla.shape[1] == 1
  )  # one GLA layer
  assert set(ts.init_carry(CFG.replace(mixers="A"), 2).to_dict()) == {"conv", "pos"}
  tok = np.random.default_rng(1).integers(0, cfg.vocab_size, (8, 17)).astype(np.int32)
  for _ in range(2):
    state, m = step(state, ts.Batch(inputs=tok[:, :-1], targets=tok[:, 1:]))
    assert np.isfinite(float(m.loss))
  assert float(np.abs(np.asarray(state.carry.conv)).max()) > 0


def test_carry_must_match_the_batch():
  mesh = sharding.make_mesh(data=1, fsdp=8)
  abstract = ts.abstract_train_state(CFG, optax.sgd(0.1), mesh, carry_batch=8)
  with pytest.raises(ValueError, match="one state per row"):
    ts.compile_train_step(CFG, optax.sgd(0.1), mesh, global_batch=16, seq_len=16, abstract_state=abstract)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  from train import prepare

  d = tmp_path_factory.mktemp("data") / "kjv"
  prepare.main(
    ["--corpus", "kjv", "-o", str(d), "--max-documents", "20", "--val-fraction", "0.1", "--no-progress"]
  )
  return d


def test_resumed_run_is_bit_identical_and_the_flag_is_checked(data_dir, tmp_path):
  """4 steps straight vs 2 + resume 2: the carried states and stream positions come back from the checkpoint."""
  import json

  from train.loop import run
  from train.run_config import load_config

  common = [
    "--preset",
    "tiny",
    "--model.vocab_size",
    "50304",
    "--global_batch",
    "8",
    "--seq_len",
    "32",
    "--mesh_data",
    "1",
    "--mesh_fsdp",
    "1",
    "--micro_batches",
    "2",
    "--eval_batches",
    "0",
    "--log_every",
    "1",
    "--no-progress",
    "--data_dir",
    str(data_dir),
    "--state_passing",
    "--optimizer.total_steps",
    "4",
  ]
  train = lambda out, steps, *extra: run(
    load_config(common + ["--out_dir", str(out), "--steps", str(steps), "--save_every", "2", *extra])
  )
  losses = lambda out: [
    json.loads(l)["loss"] for l in (out / "metrics.jsonl").read_text().splitlines() if "loss" in json.loads(l)
  ]
  train(tmp_path / "straight", 4)
  train(tmp_path / "resumed", 2)
  train(tmp_path / "resumed", 4)
  assert losses(tmp_path / "resumed") == losses(tmp_path / "straight")
  with pytest.raises(ValueError, match="train.state_passing: saved True, now False"):
    run(
      load_config(
        [a for a in common if a != "--state_passing"]
        + ["--out_dir", str(tmp_path / "resumed"), "--steps", "6"]
      )
    )


def test_a_carry_saved_before_pos_resumes_exactly_with_pos_zero(tmp_path):
  """Checkpoints from before the conv ring (commit 32107bb) hold each conv window oldest first and no carry.pos:
  read as a ring at pos = 0 the window continues the stream exactly (and at its true pos it would not); the
  resume restores such a checkpoint with pos = 0 on the abstract state's sharding."""
  from laplace_jax.training import checkpoint
  from train import resume

  params = model.init_params(CFG, jax.random.key(0))
  tokens = np.random.default_rng(2).integers(0, CFG.vocab_size, (2, 16)).astype(np.int32)
  # One compiled program per shape (op-by-op dispatch compiles each primitive): the three calls on the last
  # 9 tokens run the same executable, so only the carry they are given differs.
  forward_carry = jax.jit(functools.partial(model.forward_carry, cfg=CFG))
  _, carry = forward_carry(params, tokens[:, :7], model.init_carry(CFG, 2))  # pos 7: not ≡ 0 mod 4
  W = CFG.conv_size
  order = (np.asarray(carry.pos)[:, None] + np.arange(W)) % W  # the old layout: oldest input first
  old_conv = np.take_along_axis(np.asarray(carry.conv), order[None, :, :, None], axis=2)
  want, _ = forward_carry(params, tokens[:, 7:], carry)
  at = lambda pos: carry.replace(conv=old_conv, pos=np.full((2,), pos, np.int32))
  np.testing.assert_array_equal(forward_carry(params, tokens[:, 7:], at(0))[0], want)
  assert not np.allclose(forward_carry(params, tokens[:, 7:], at(7))[0], want, atol=1e-3)

  mesh = sharding.make_mesh(data=1, fsdp=8)
  opt = optax.sgd(0.0)
  abstract = ts.abstract_train_state(CFG, opt, mesh, carry_batch=8)
  state = ts.init_train_state_on_mesh(CFG, opt, mesh, seed=0, carry_batch=8)
  conv = np.random.default_rng(3).normal(size=state.carry.conv.shape).astype(np.float32)
  old = {**state.to_tree(), "carry": {"gla": state.carry.gla, "conv": conv}}  # the tree such checkpoints hold
  with checkpoint.Checkpointer(tmp_path / "ckpt") as ck:
    ck.save(3, old, force=True)
  restored, note = resume.restore_train_state(checkpoint.Checkpointer(tmp_path / "ckpt"), abstract)
  assert restored.step == 3 and "pos = 0" in note
  pos = restored.train_state.carry.pos
  assert np.asarray(pos).tolist() == [0] * 8 and pos.sharding == abstract.carry.pos.sharding
  np.testing.assert_array_equal(restored.train_state.carry.conv, conv)
  with checkpoint.Checkpointer(tmp_path / "ckpt") as ck:  # a checkpoint with carry.pos restores as saved
    ck.save(4, state.to_tree(), force=True)
  restored, note = resume.restore_train_state(checkpoint.Checkpointer(tmp_path / "ckpt"), abstract)
  assert restored.step == 4 and note is None
  # The newest step (with pos) damaged: the restore falls back to step 3, whose carry has no pos. Whether pos
  # is restored or zero-filled follows the step actually read, not the newest on disk.
  for f in (tmp_path / "ckpt" / "4" / "train_state").rglob("d/*"):  # step 4 loses its array data
    f.unlink()
  with checkpoint.Checkpointer(tmp_path / "ckpt") as ck:
    restored, note = resume.restore_train_state(ck, abstract)
  assert restored.step == 3 and "pos = 0" in note
  assert np.asarray(restored.train_state.carry.pos).tolist() == [0] * 8
  np.testing.assert_array_equal(restored.train_state.carry.conv, conv)
