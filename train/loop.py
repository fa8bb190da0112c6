"""The training driver: the step compiled (or only lowered, or only compiled), the run started or resumed,
its steps run with the hooks of train/hooks.py (metrics, evaluation, checkpoints, profile), then the export
and the sample."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from pathlib import Path
from typing import Any, NamedTuple, TypedDict

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from laplace_jax import platform, sharding
from laplace_jax.analysis import neuron_check
from laplace_jax.data import pipeline as data
from laplace_jax.data import recall_tasks as recall
from laplace_jax.model.config import LAYOUT_NEUTRAL
from laplace_jax.model.counts import flops_per_token, param_counts
from laplace_jax.training import checkpoint
from laplace_jax.training import optimizer as optim
from laplace_jax.training import train_step as ts
from train import hooks, prepare, resume
from train.hooks import log0
from train.run_config import RunConfig, TrainConfig


def describe_memory(compiled) -> str:
  m = compiled.memory_analysis()
  if m is None:
    return "memory analysis unavailable on this backend"
  gib = lambda b: b / 2**30
  total = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
  return (
    f"per device: arguments {gib(m.argument_size_in_bytes):.2f} GiB, outputs "
    f"{gib(m.output_size_in_bytes):.2f} GiB (aliased {gib(m.alias_size_in_bytes):.2f}), temporaries "
    f"{gib(m.temp_size_in_bytes):.2f} GiB; peak ≈ {gib(total):.2f} GiB"
  )


def ensure_data(tc: TrainConfig, vocab_size: int) -> dict:
  """The prepared data's manifest; the embedded corpus is prepared on first use of the default path."""
  path = Path(tc.data_dir)
  if not (path / "manifest.json").exists():
    if tc.data_dir != TrainConfig.data_dir:
      what = "no manifest.json there" if path.is_dir() else "no such directory"
      raise FileNotFoundError(
        f"--data_dir {path}: {what}. Prepare your text first: python -m train.prepare YOUR_FILE.txt -o {path} "
        f"(or leave out --data_dir to train on the embedded corpus, prepared into {TrainConfig.data_dir})"
      )
    if jax.process_index() == 0:
      log0(f"preparing the embedded corpus (King James Bible) into {path} …")
      prepare.main(["--corpus", "kjv", "-o", str(path), "--no_progress"])
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices("data prepared")
  manifest = data.load_manifest(path)
  data.check_vocab(manifest, vocab_size)
  return manifest


def eval_batch_size(tc: TrainConfig) -> int:
  """Sequences per held-out batch: --eval_batch, or the training batch."""
  return tc.eval_batch or tc.global_batch


def check_data(tc: TrainConfig, seq_len: int, vocab_size: int, batch_devices: int) -> None:
  """Every check of the run's data that needs no compile: the data directory and its manifest, a non-empty
  train split, and a held-out split (and --eval_batch) that fills one eval batch; raises naming the fix."""
  rows = batch_devices  # all processes' devices: a held-out batch is split over them, as a training batch is
  eb = eval_batch_size(tc)
  if tc.eval_batches and eb % rows:
    raise ValueError(
      f"--eval_batch {eb}{' (the global batch)' if not tc.eval_batch else ''}: expected a multiple of the "
      f"{rows} devices a batch is split over; use --eval_batch {max(rows, eb // rows * rows)}."
    )
  if tc.data_source:
    check_recall_vocab(tc.data_source, vocab_size)
    return
  manifest = ensure_data(tc, vocab_size)
  splits, where = manifest["splits"], f"--data_dir {tc.data_dir}"
  if not splits.get("train", {}).get("documents"):
    raise ValueError(
      f"{where}: the train split has no documents. Prepare more text, or keep more of it for training "
      f"(python -m train.prepare YOUR_FILE.txt -o {tc.data_dir} --overwrite --val_fraction 0.1)."
    )
  if not tc.eval_batches:
    return
  skip = "or run with --eval_batches 0 (no held-out loss)"
  val = splits.get("val", {})
  if not val.get("documents"):
    raise ValueError(
      f"{where}: the val split has no documents, so there is no held-out loss. Re-run python -m "
      f"train.prepare YOUR_FILE.txt -o {tc.data_dir} --overwrite (one text file alone is split into "
      f"documents and its last tenth held out; many files: a larger --val_fraction), {skip}."
    )
  width = seq_len + 1
  have = int(val["tokens"]) + int(val["documents"])  # each document is followed by EOS
  if have < eb * width:
    fit = have // width // rows * rows
    fixes = [f"--eval_batch {fit}"] if fit else []
    if not fit and have // rows - 1 >= 1:
      fixes.append(f"a --seq_len of at most {have // rows - 1} with --eval_batch {rows}")
    fixes.append(
      f"a larger val split (python -m train.prepare ... -o {tc.data_dir} --overwrite --val_fraction 0.2)"
    )
    raise ValueError(
      f"{where}: the val split holds {have:,} tokens (with EOS), fewer than one eval batch of --eval_batch "
      f"{eb} × (--seq_len {seq_len} + 1) = {eb * width:,}. Use " + ", or ".join(fixes) + f", {skip}."
    )


def check_recall_vocab(spec: str, vocab_size: int):
  if vocab_size < recall.task_vocab(spec):
    raise ValueError(
      f"--data_source {spec} uses {recall.task_vocab(spec)} token ids but the model has "
      f"vocab_size={vocab_size}; set --model.vocab_size {recall.task_vocab(spec)} or more."
    )


def segmented(tc: TrainConfig) -> bool:
  """Whether the run's batches hold segment ids: packed text documents (a recall example is one row)."""
  return tc.segment_ids and not tc.data_source


def make_train_data(tc: TrainConfig, seq_len: int, vocab_size: int):
  """The training stream: a recall task (--data_source) or the prepared text in --data_dir."""
  if tc.data_source:
    return recall.RecallStream(
      tc.data_source,
      seq_len=seq_len,
      global_batch=tc.global_batch,
      seed=tc.seed,
      process_index=jax.process_index(),
      process_count=jax.process_count(),
    )
  return data.make_train_iterator(
    tc.data_dir,
    seq_len=seq_len,
    global_batch_size=tc.global_batch,
    seed=tc.seed,
    vocab_size=vocab_size,
    contiguous=tc.state_passing,
    segment_ids=segmented(tc),
  )


def make_eval_data(tc: TrainConfig, seq_len: int, vocab_size: int, split: str = "val") -> list[ts.Batch]:
  """Held-out batches (this process's rows): the recall task's fixed test seeds, or the text's split."""
  if tc.data_source:
    b = eval_batch_size(tc) // jax.process_count()
    rows = slice(jax.process_index() * b, (jax.process_index() + 1) * b)
    return [
      jax.tree.map(lambda v: v[rows], batch)
      for batch in recall.eval_batches(
        tc.data_source, global_batch=eval_batch_size(tc), n_batches=tc.eval_batches
      )
    ]
  return data.make_eval_batches(
    tc.data_dir,
    seq_len=seq_len,
    global_batch_size=eval_batch_size(tc),
    max_batches=tc.eval_batches or None,
    vocab_size=vocab_size,
    split=split,
    segment_ids=segmented(tc),
  )


def _open_run(rc: RunConfig, prng_impl: str):
  """(rc, checkpointer, latest step): on resume, rc reconciled with the run config saved at that step."""
  tc = rc.train
  out = Path(tc.out_dir)
  out.mkdir(parents=True, exist_ok=True)
  ckpt_dir = out / "checkpoints"
  ckpt = checkpoint.Checkpointer(ckpt_dir, max_to_keep=tc.keep_checkpoints)
  try:
    latest = ckpt.latest_step()
    if latest is not None and not tc.resume:
      raise ValueError(
        f"--no_resume, but {ckpt_dir} already holds checkpoints (latest step {latest}); "
        "use another --out_dir or remove that directory to start afresh."
      )
    if latest is not None:
      meta = ckpt.metadata(latest)
      saved = resume.saved_run_config(meta)
      resume.check_prng(prng_impl, meta, where=f"{ckpt_dir} at step {latest}")
      rc, notes = resume.reconcile(rc, saved, where=f"{ckpt_dir} at step {latest}")
      for n in notes:
        log0(f"resume: {n}")
  except BaseException:
    ckpt.close()
    raise
  return rc, ckpt, latest


def run(rc: RunConfig) -> RunSummary:
  """Train as configured; returns a summary (first/last loss, eval loss, steps, tokens/s)."""
  ckpt = latest = None
  tc = rc.train
  with platform.lowering_for(tc.target) if tc.target else contextlib.nullcontext():
    prng_impl = platform.prng_impl(tc.prng)  # python -m train has set it already; callers in-process have not
  with platform.using_prng(prng_impl):
    if not (tc.compile_only or tc.target):
      rc, ckpt, latest = _open_run(rc, prng_impl)
    try:
      return _run(rc, ckpt, latest, prng_impl)
    finally:
      if ckpt is not None:
        ckpt.close()


class RunSummary(TypedDict, total=False):
  """What `run` returns (`python -m train` prints it as one JSON line). Each mode fills its own fields."""

  # --target: the step lowered for another platform and checked, never compiled
  lower_s: float
  violations: int  # conformance violations found (python -m train exits 1 if any)
  by_rule: dict  # program -> rule -> count
  # --compile_only, and training
  compile_s: float
  memory: dict | None  # --compile_only: the compiled step's per-device bytes (None: no memory analysis)
  # training
  start_step: int  # 0, or the checkpoint's step the run resumed from
  end_step: int
  first_loss: float | None  # the first and last logged train losses of this run
  last_loss: float | None
  eval_loss: float | None  # the last held-out loss (None: --eval_batches 0)
  tokens_per_s: float  # the last step's
  export: str  # the params exported for serving
  sample: str  # --sample_tokens: the prompt and the text sampled from the export


class CompiledStep(NamedTuple):
  """The run's compiled train step and what it was compiled for."""

  mesh: Mesh
  optimizer: Any  # optax.GradientTransformation made for the mesh
  abstract: ts.TrainState  # the train state's shapes and shardings
  compiled: Any  # the executable: (state, batch) -> (state, StepMetrics)
  compile_s: float  # seconds to lower and compile it (or to find it compiled)
  how: str  # "compiled", or how an earlier run's executable was reused


def _run(rc: RunConfig, ckpt, latest, prng_impl: str) -> RunSummary:
  """The driver: compile (or lower) the step, start or resume, train with the hooks, export, sample."""
  tc, cfg = rc.train, rc.model
  seq_len = tc.seq_len or cfg.max_seq_len
  step = _compile(rc, latest, seq_len, prng_impl)
  if not isinstance(step, CompiledStep):  # --target: the lowered step's report
    return step
  log0(f"train step {step.how} in {step.compile_s:.1f} s; {describe_memory(step.compiled)}")
  if tc.compile_only:
    return RunSummary(compile_s=step.compile_s, memory=_memory_bytes(step.compiled))

  out = Path(tc.out_dir)
  it = make_train_data(tc, seq_len, cfg.vocab_size)
  state, start = _start(rc, step, ckpt, latest, it, out)
  summary = RunSummary(
    start_step=start, first_loss=None, last_loss=None, eval_loss=None, compile_s=step.compile_s
  )
  to_global, evaluate = _placement(rc, step, seq_len)
  run_meta = resume.checkpoint_metadata(rc, prng_impl)
  save = lambda i, state: ckpt.save(
    i, state.to_tree(), data_state=it.get_state(), metadata=run_meta, force=i == tc.steps
  )
  flops = flops_per_token(cfg, seq_len=seq_len)
  log = hooks.MetricsLog(tc, start, tokens_per_step=tc.global_batch * seq_len, flops_per_token=flops)
  profile = hooks.Profile(tc, start, out / "profile", log.say)
  try:
    state = _train_steps(step.compiled, state, it, start, tc, to_global, log, evaluate, save, profile)
  finally:
    profile.close()
    ckpt.close()  # waits for the last save before the export below
    it.close()
    log.close()
  summary["first_loss"], summary["last_loss"], summary["eval_loss"] = log.first_loss, log.last_loss, log.eval
  if log.tokens_per_s is not None:
    summary["tokens_per_s"] = log.tokens_per_s
  summary["end_step"] = tc.steps
  return _finish(summary, state, rc, out)


def _compile(rc: RunConfig, latest, seq_len: int, prng_impl: str) -> CompiledStep | RunSummary:
  """The step compiled for the run's mesh (or reused from an earlier run in this process), after every check
  that needs no compile; with --target, the step lowered with that platform's choices and its report."""
  tc, cfg = rc.train, rc.model
  weighted = bool(tc.data_source)  # recall tasks score only their answers
  carry_batch = tc.global_batch if tc.state_passing else 0  # state passing: one carried state per row
  # --target: every per-platform choice (optimizer, params, step) made as on that platform, lowered only.
  with platform.lowering_for(tc.target) if tc.target else contextlib.nullcontext():
    mesh = sharding.make_mesh(data=tc.mesh_data, fsdp=tc.mesh_fsdp or None, context=tc.mesh_context)
    counts = param_counts(cfg)
    log0(
      f"model: {counts['total'] / 1e6:.2f}M parameters (Muon {counts['muon'] / 1e6:.2f}M, AdamW "
      f"{counts['adamw'] / 1e6:.2f}M); mesh {dict(mesh.shape)} over {jax.device_count()} "
      f"{tc.target or jax.default_backend()} device(s), {jax.process_count()} process(es)"
      + ("" if tc.data_source else f"; packed documents {'apart' if segmented(tc) else 'read as one stream'}")
    )
    if not (tc.compile_only or tc.target):  # everything checkable, before the compile
      check_data(tc, seq_len, cfg.vocab_size, mesh.devices.size // sharding.context_size(mesh))
      if tc.init_from and latest is None:
        _check_init_from(tc.init_from, cfg)
    key = _step_key(rc, mesh, seq_len, weighted, carry_batch, prng_impl)
    t0 = time.perf_counter()
    if tc.target or key not in _COMPILED:
      opt = optim.make_optimizer(rc.optimizer, mesh=mesh)
      abstract = ts.abstract_train_state(
        cfg, opt, mesh, seed=tc.seed, carry_batch=carry_batch, segmented=segmented(tc)
      )
      lowered = _lower(rc, opt, mesh, abstract, seq_len, weighted)
      lower_s = time.perf_counter() - t0
      if tc.target:
        return _target_report(tc, lowered, lower_s)
      _remember(key, (opt, abstract, lowered.compile()))
      how = "compiled"
    else:
      _COMPILED[key] = _COMPILED.pop(key)  # most recently used last
      how = "reused (compiled by an earlier run in this process)"
  opt, abstract, compiled = _COMPILED[key]
  return CompiledStep(mesh, opt, abstract, compiled, time.perf_counter() - t0, how)


def _start(rc: RunConfig, step: CompiledStep, ckpt, latest, it, out: Path) -> tuple[ts.TrainState, int]:
  """(state, first step - 1): resumed from the latest checkpoint, or fresh (with --init_from's params)."""
  tc = rc.train
  if latest is not None:
    return _resume(ckpt, step.abstract, it, out)
  state = ts.init_train_state_on_mesh(
    rc.model,
    step.optimizer,
    step.mesh,
    seed=tc.seed,
    carry_batch=tc.global_batch if tc.state_passing else 0,
    segmented=segmented(tc),
  )
  if tc.init_from:
    state = _init_from(state, tc.init_from)
  return state, 0


def _placement(rc: RunConfig, step: CompiledStep, seq_len: int):
  """(to_global, evaluate): this process's rows of a batch put on the mesh as the step takes them, and the
  held-out evaluation (params -> loss) over the run's eval batches."""
  tc, cfg = rc.train, rc.model

  def placer(global_batch: int):
    abstract = ts.abstract_batch(
      global_batch, seq_len, step.mesh, weighted=bool(tc.data_source), segmented=segmented(tc)
    )
    shardings = jax.tree.map(lambda s: s.sharding, abstract)
    place = lambda b: jax.tree.map(
      lambda sh, x: jax.make_array_from_process_local_data(sh, np.asarray(x)), shardings, b
    )
    return shardings, place

  _, to_global = placer(tc.global_batch)
  eval_batches = make_eval_data(tc, seq_len, cfg.vocab_size) if tc.eval_batches else []
  eval_sh, eval_to_global = placer(eval_batch_size(tc))
  return to_global, hooks.make_evaluator(cfg, eval_batches, step.abstract, eval_sh, eval_to_global)


def _finish(summary: RunSummary, state, rc: RunConfig, out: Path) -> RunSummary:
  """After the last step: the params exported for serving, the loss curve drawn, --sample_tokens sampled."""
  tc, cfg = rc.train, rc.model
  export = hooks.export(state.params, out, cfg, tc.steps)
  summary["export"] = str(export)
  if jax.process_index() == 0:
    hooks.write_loss_curve(out / "metrics.jsonl", out / "loss.png")
    log0(f"loss curve: {out / 'loss.png'}; params for serving: {export}")
  if tc.sample_tokens:
    sample = hooks.sample(export, tc, cfg)
    if sample is not None:
      summary["sample"] = sample
  return summary


# The train steps compiled by the last few runs of this process, by everything their program depends on: a
# later run with the same model, optimizer, shapes, mesh and PRNG (a resumed or extended run, a sweep over
# seeds or data in one process) takes the executable as it is instead of tracing and compiling it again.
_COMPILED: dict = {}  # key -> (optimizer, abstract train state, compiled step), least recently used first
_MAX_COMPILED = 4


def _step_key(rc: RunConfig, mesh, seq_len: int, weighted: bool, carry_batch: int, prng_impl: str) -> tuple:
  tc = rc.train
  return (
    rc.model,
    rc.optimizer,
    mesh,
    tc.global_batch,
    seq_len,
    tc.micro_batches,
    tc.z_loss,
    weighted,
    segmented(tc),
    carry_batch,
    prng_impl,
    jax.config.jax_default_matmul_precision,  # type: ignore[attr-defined]  # a flag JAX declares at run time
  )


def _remember(key: tuple, entry: tuple):
  _COMPILED[key] = entry
  while len(_COMPILED) > _MAX_COMPILED:
    del _COMPILED[next(iter(_COMPILED))]


def _train_steps(compiled, state, it, start, tc, to_global, log, evaluate, save, profile):
  """Steps start + 1 .. tc.steps; each step's metrics read while the next runs, except before an eval or a
  save, which see every step before them logged. Returns the last state."""
  pending = None
  for i in range(start + 1, tc.steps + 1):
    profile.before(i)
    b = next(it)
    wait = it.last_wait_s
    with jax.profiler.StepTraceAnnotation("train", step_num=i):
      state, m = compiled(state, to_global(b))
    profile.after(i, state)
    if pending:  # read the previous step's metrics while this one runs (one step of lag, no stall)
      log.record(*pending)
    pending = (i, m, wait)
    is_eval = tc.eval_batches and ((tc.eval_every and i % tc.eval_every == 0) or i == tc.steps)
    is_save = i % tc.save_every == 0 or i == tc.steps
    if is_eval or is_save:
      log.record(*pending)
      pending = None
      if is_eval:
        log.eval_loss(i, evaluate(state.params))
      if is_save:
        save(i, state)
      log.restart_clock()  # eval and save time is not step time
  return state


def _lower(rc: RunConfig, opt, mesh, abstract, seq_len: int, weighted: bool):
  """The train step lowered for the mesh (and, under lowering_for, the target's choices)."""
  tc, cfg = rc.train, rc.model
  return ts.lower_train_step(
    cfg,
    opt,
    mesh,
    global_batch=tc.global_batch,
    seq_len=seq_len,
    step_cfg=ts.StepConfig(micro_batches=tc.micro_batches, z_loss=tc.z_loss),
    lr_schedule=optim.lr_schedule(rc.optimizer.adamw_lr, rc.optimizer),  # reported as "lr"
    abstract_state=abstract,
    weighted=weighted,
    segmented=segmented(tc),
  )


def _target_report(tc: TrainConfig, lowered, lower_s: float) -> RunSummary:
  """--target: the lowered step checked against the target's limits (neuron_check)."""
  reports, text = neuron_check.check_programs({"train_step": lowered.as_text()}, tc.hlo_dir or None)
  log0(f"train step lowered for {tc.target} in {lower_s:.1f} s (not compiled)\n{text}")
  return RunSummary(
    lower_s=lower_s,
    violations=sum(len(r.violations) for r in reports.values()),
    by_rule={k: r.counts() for k, r in reports.items()},
  )


def _memory_bytes(compiled) -> dict | None:
  m = compiled.memory_analysis()
  if m is None:
    return None
  return {
    "argument_bytes": m.argument_size_in_bytes,
    "output_bytes": m.output_size_in_bytes,
    "alias_bytes": m.alias_size_in_bytes,
    "temp_bytes": m.temp_size_in_bytes,
  }


def _check_init_from(path: str, cfg) -> None:
  """Refuses an export whose model is not this run's (fields that leave the params' layout alone excepted)."""
  saved = checkpoint.export_config(path)
  diffs = [
    f"{f.name}: the export's {getattr(saved, f.name)!r}, this run's {getattr(cfg, f.name)!r}"
    for f in dataclasses.fields(cfg)
    if f.name not in LAYOUT_NEUTRAL and getattr(saved, f.name) != getattr(cfg, f.name)
  ]
  if diffs:
    raise ValueError(
      f"--init_from {path}: its model is not this run's ({'; '.join(diffs)}). Pass the export's model "
      "(--preset and --model.* flags as it was trained), or another export."
    )


def _init_from(state, path: str):
  """The fresh state with the export's params in place of the random ones (placed and typed as they are)."""
  params, _ = checkpoint.load_export(path, shardings=jax.tree.map(lambda x: x.sharding, state.params))
  log0(f"params from {path} (a fresh optimizer state)")
  return state.replace(params=jax.tree.map(lambda old, new: new.astype(old.dtype), state.params, params))


def _resume(ckpt, abstract, it, out: Path):
  """(state, step) restored from the latest checkpoint, the data iterator put where it was, and the metrics
  rows of later steps dropped (they are redone). The config was compared in _open_run."""
  restored, note = resume.restore_train_state(ckpt, abstract)
  if note:
    log0(note)
  if restored.data_state is not None:
    it.set_state(restored.data_state)
  start = restored.step
  log0(f"resumed from {out / 'checkpoints'} at step {start}")
  if jax.process_index() == 0:
    dropped = resume.drop_rows_after(out / "metrics.jsonl", start)
    if dropped:
      log0(f"resume: dropped {dropped} metrics row(s) of steps after {start} (they are redone)")
  return restored.train_state, start
