"""The training loop: mesh, compiled step, grain data, Orbax checkpoints, metrics, eval, loss curve."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import time
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils
from tqdm import tqdm

from laplace_jax import (
  checkpoint,
  data,
  generate,
  neuron_check,
  platform,
  recall,
  sharding,
  timing,
  tokenizer,
)
from laplace_jax import optimizer as optim
from laplace_jax import train_step as ts
from laplace_jax.counts import flops_per_token, param_counts
from train import prepare, resume
from train.config import RunConfig, TrainConfig


class TrainingError(RuntimeError):
  """A run that cannot go on (e.g. a run of non-finite steps); the last checkpoint is intact."""


def log0(*a):
  if jax.process_index() == 0:
    print(*a, flush=True)


@functools.cache  # measured once per process (seven 2048³ matmuls: seconds on a CPU, for every run in a test)
def host_matmul_peak_flops() -> float:
  """Measured fp32 matmul FLOP/s of this process's devices: the denominator of the MFU we report."""
  per_device = timing.matmul_peak_flops()
  # Simulated CPU devices share the host's cores: the host's peak is one device's, not N of them.
  n_dev = 1 if jax.default_backend() == "cpu" else jax.local_device_count()
  return per_device * n_dev * jax.process_count()


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
      raise FileNotFoundError(
        f"--data_dir {path}: no manifest.json there. Prepare it first: "
        f"python -m train.prepare YOUR_FILES -o {path}"
      )
    if jax.process_index() == 0:
      log0(f"preparing the embedded corpus (King James Bible) into {path} …")
      prepare.main(["--corpus", "kjv", "-o", str(path), "--no_progress"])
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices("data prepared")
  manifest = data.load_manifest(path)
  data.check_vocab(manifest, vocab_size)
  return manifest


def check_recall_vocab(spec: str, vocab_size: int):
  if vocab_size < recall.task_vocab(spec):
    raise ValueError(
      f"--data_source {spec} uses {recall.task_vocab(spec)} token ids but the model has "
      f"vocab_size={vocab_size}; set --model.vocab_size {recall.task_vocab(spec)} or more."
    )


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
  )


def make_eval_data(tc: TrainConfig, seq_len: int, vocab_size: int, split: str = "val") -> list[dict]:
  """Held-out batches (this process's rows): the recall task's fixed test seeds, or the text's split."""
  if tc.data_source:
    b = tc.global_batch // jax.process_count()
    rows = slice(jax.process_index() * b, (jax.process_index() + 1) * b)
    return [
      {k: v[rows] for k, v in batch.items()}
      for batch in recall.eval_batches(
        tc.data_source, global_batch=tc.global_batch, n_batches=tc.eval_batches
      )
    ]
  return data.make_eval_batches(
    tc.data_dir,
    seq_len=seq_len,
    global_batch_size=tc.global_batch,
    max_batches=tc.eval_batches or None,
    vocab_size=vocab_size,
    split=split,
  )


def _write_loss_curve(metrics_path: Path, png: Path):
  import matplotlib  # only where a plot is drawn: a heavy import

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  rows = [json.loads(l) for l in metrics_path.read_text().splitlines() if l.strip()]
  train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
  evals = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
  fig, ax = plt.subplots(figsize=(7, 4))
  if train:
    ax.plot(*zip(*train), label="train loss")
  if evals:
    ax.plot(*zip(*evals), "o-", label="held-out loss")
  ax.set_xlabel("step")
  ax.set_ylabel("cross-entropy (nats/token)")
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(png, dpi=100)
  plt.close(fig)


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


def run(rc: RunConfig) -> dict:
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


def _run(rc: RunConfig, ckpt, latest, prng_impl: str) -> dict:
  tc, cfg = rc.train, rc.model
  cfg_dict = dataclasses.asdict(cfg)  # saved with every export and checked on load (checkpoints: resume)
  seq_len = tc.seq_len or cfg.max_seq_len
  weighted = bool(tc.data_source)  # recall tasks score only their answers
  # --target: every per-platform choice (optimizer, params, step) made as on that platform, lowered only.
  with platform.lowering_for(tc.target) if tc.target else contextlib.nullcontext():
    mesh = sharding.make_mesh(data=tc.mesh_data, fsdp=tc.mesh_fsdp or None)
    opt = optim.make_optimizer(rc.optimizer, mesh=mesh)
    lr_schedule = optim.lr_schedule(rc.optimizer.adamw_lr, rc.optimizer)  # reported as "lr"
    step_cfg = ts.StepConfig(micro_batches=tc.micro_batches, z_loss=tc.z_loss)
    counts = param_counts(cfg)
    log0(
      f"model: {counts['total'] / 1e6:.2f}M parameters (Muon {counts['muon'] / 1e6:.2f}M, AdamW "
      f"{counts['adamw'] / 1e6:.2f}M); mesh {dict(mesh.shape)} over {jax.device_count()} "
      f"{tc.target or jax.default_backend()} device(s), {jax.process_count()} process(es)"
    )
    carry_batch = tc.global_batch if tc.state_passing else 0  # state passing: one carried state per row
    abstract = ts.abstract_train_state(cfg, opt, mesh, seed=tc.seed, carry_batch=carry_batch)
    t0 = time.perf_counter()
    lowered = ts.lower_train_step(
      cfg,
      opt,
      mesh,
      global_batch=tc.global_batch,
      seq_len=seq_len,
      step_cfg=step_cfg,
      lr_schedule=lr_schedule,
      abstract_state=abstract,
      weighted=weighted,
    )
    lower_s = time.perf_counter() - t0
  if tc.target:
    reports, text = neuron_check.check_programs({"train_step": lowered.as_text()}, tc.hlo_dir or None)
    log0(f"train step lowered for {tc.target} in {lower_s:.1f} s (not compiled)\n{text}")
    return {
      "lower_s": lower_s,
      "violations": sum(len(r.violations) for r in reports.values()),
      "by_rule": {k: r.counts() for k, r in reports.items()},
    }
  compiled = lowered.compile()
  compile_s = time.perf_counter() - t0
  log0(f"train step compiled in {compile_s:.1f} s; {describe_memory(compiled)}")
  if tc.compile_only:
    m = compiled.memory_analysis()
    return {
      "compile_s": compile_s,
      "memory": None
      if m is None
      else {
        "argument_bytes": m.argument_size_in_bytes,
        "output_bytes": m.output_size_in_bytes,
        "alias_bytes": m.alias_size_in_bytes,
        "temp_bytes": m.temp_size_in_bytes,
      },
    }

  if tc.data_source:
    check_recall_vocab(tc.data_source, cfg.vocab_size)
  else:
    ensure_data(tc, cfg.vocab_size)
  out = Path(tc.out_dir)
  ckpt_dir = out / "checkpoints"
  it = make_train_data(tc, seq_len, cfg.vocab_size)
  metrics_path = out / "metrics.jsonl"
  if latest is not None:
    restored, note = resume.restore_train_state(ckpt, abstract)  # the config was compared in _open_run
    if note:
      log0(note)
    state, start = restored.train_state, restored.step
    if restored.data_state is not None:
      it.set_state(restored.data_state)
    log0(f"resumed from {ckpt_dir} at step {start}")
    if jax.process_index() == 0:
      dropped = resume.drop_rows_after(metrics_path, start)
      if dropped:
        log0(f"resume: dropped {dropped} metrics row(s) of steps after {start} (they are redone)")
  else:
    state, start = ts.init_train_state_on_mesh(cfg, opt, mesh, seed=tc.seed, carry_batch=carry_batch), 0
  run_meta = resume.checkpoint_metadata(rc, prng_impl)

  eval_batches = make_eval_data(tc, seq_len, cfg.vocab_size) if tc.eval_batches else []
  batch_sh = jax.tree.map(
    lambda s: s.sharding, ts.abstract_batch(tc.global_batch, seq_len, mesh, weighted=weighted)
  )
  to_global = lambda b: jax.tree.map(
    lambda sh, x: jax.make_array_from_process_local_data(sh, np.asarray(x)), batch_sh, ts.Batch(**b)
  )
  eval_fn = jax.jit(
    lambda p, b: ts.loss_sums(p, b, cfg=cfg)[1],
    in_shardings=(jax.tree.map(lambda s: s.sharding, abstract.params), batch_sh),
  )

  def evaluate(params):
    ce = tok = 0.0
    for b in eval_batches:
      aux = eval_fn(params, to_global(b))
      ce, tok = ce + float(aux["ce"]), tok + float(aux["tokens"])
    return ce / max(tok, 1.0)

  peak = host_matmul_peak_flops()
  fpt = flops_per_token(cfg.replace(chunk_size=min(cfg.chunk_size, seq_len)))
  mfile = open(metrics_path, "a") if jax.process_index() == 0 else None
  bar = None
  if tc.progress and jax.process_index() == 0:
    bar = tqdm(total=tc.steps, initial=start, desc="train", unit="step", dynamic_ncols=True)
  summary = {
    "start_step": start,
    "first_loss": None,
    "last_loss": None,
    "eval_loss": None,
    "compile_s": compile_s,
  }
  tokens_per_step = tc.global_batch * seq_len

  def record(i, m, wait, since):
    """Wait for step i's metrics, log them; `since` is when the previous step's metrics were in."""
    m = jax.device_get(m)
    done = time.perf_counter()
    dt = done - since
    if int(m["bad_steps"]) >= tc.max_bad_steps:
      raise TrainingError(
        f"{int(m['bad_steps'])} consecutive non-finite steps (loss {float(m['loss'])}, "
        f"grad norm {float(m['grad_norm'])}) at step {i}; stopping. The last checkpoint in "
        f"{ckpt_dir} is intact: lower the learning rates or check the data, then resume."
      )
    tps = tokens_per_step / dt
    row = {
      "step": i,
      "loss": float(m["loss"]),
      "grad_norm": float(m["grad_norm"]),
      "lr": float(m["lr"]),
      "z_loss": float(m["z_loss"]),
      "skipped": bool(m["skipped"]),
      "tokens_per_s": tps,
      "mfu": tps * fpt / peak,
      "input_wait_s": wait,
      "step_s": dt,
      "time": time.time(),
    }
    summary["first_loss"] = summary["first_loss"] or row["loss"]
    summary["last_loss"] = row["loss"]
    summary["tokens_per_s"] = tps
    if bool(m["skipped"]):
      log0(f"step {i}: non-finite loss or gradient, update skipped ({int(m['bad_steps'])} in a row)")
    if mfile and (i % tc.log_every == 0 or i == tc.steps):
      mfile.write(json.dumps(row) + "\n")
      mfile.flush()
    if bar:
      bar.set_postfix(loss=f"{row['loss']:.3f}", tok_s=f"{tps:,.0f}", mfu=f"{100 * row['mfu']:.1f}%")
      bar.update(1)
    return done

  def say(msg):
    bar.write(msg) if bar else log0(msg)

  since, pending = time.perf_counter(), None
  # The profile skips the first step (warm-up: first transfers, allocator growth) when the run has more.
  prof_first = start + 1 + (tc.steps - start > tc.profile_steps)
  prof_last = min(tc.steps, prof_first + tc.profile_steps - 1) if tc.profile_steps else -1
  tracing = False
  try:
    for i in range(start + 1, tc.steps + 1):
      if i == prof_first and tc.profile_steps:
        jax.profiler.start_trace(str(out / "profile"))
        tracing = True
      b = next(it)
      wait = it.last_wait_s
      with jax.profiler.StepTraceAnnotation("train", step_num=i):
        state, m = compiled(state, to_global(b))
      if i == prof_last:
        jax.block_until_ready(state)
        jax.profiler.stop_trace()
        tracing = False
        say(
          f"profile of steps {prof_first}-{prof_last}: {out / 'profile'} (tensorboard --logdir, or "
          "ui.perfetto.dev with the .trace.json.gz)"
        )
      if pending:  # read the previous step's metrics while this one runs (one step of lag, no stall)
        since = record(*pending, since)
      pending = (i, m, wait)
      is_eval = tc.eval_batches and ((tc.eval_every and i % tc.eval_every == 0) or i == tc.steps)
      is_save = i % tc.save_every == 0 or i == tc.steps
      if is_eval or is_save:
        record(*pending, since)
        pending = None
        if is_eval:
          summary["eval_loss"] = evaluate(state.params)
          if mfile:
            mfile.write(json.dumps({"step": i, "eval_loss": summary["eval_loss"]}) + "\n")
            mfile.flush()
          say(f"step {i}: held-out loss {summary['eval_loss']:.4f}")
        if is_save:
          ckpt.save(i, state.to_tree(), data_state=it.get_state(), metadata=run_meta, force=i == tc.steps)
        since = time.perf_counter()  # eval and save time is not step time
  finally:
    if tracing:
      jax.profiler.stop_trace()
    ckpt.close()  # waits for the last save before the export below
    it.close()
    if bar:
      bar.close()
    if mfile:
      mfile.close()

  summary["end_step"] = tc.steps
  export = out / "export" / f"step_{tc.steps}"
  if not export.exists():  # every process takes part in an Orbax save
    checkpoint.export_params(state.params, export, config=cfg_dict)
  summary["export"] = str(export)
  if jax.process_index() == 0:
    _write_loss_curve(metrics_path, out / "loss.png")
    log0(f"loss curve: {out / 'loss.png'}; params for serving: {export}")
  if tc.sample_tokens:
    params = checkpoint.load_params(export, config=cfg_dict)  # the checkpoint, as host arrays
    if jax.process_index() == 0:
      ids = generate.generate(
        params,
        tokenizer.encode(tc.sample_prompt),
        tc.sample_tokens,
        cfg=cfg,
        valid_vocab=tokenizer.VOCAB_SIZE,
        seed=tc.seed,
      )
      summary["sample"] = tc.sample_prompt + tokenizer.decode(ids)
      log0("sample (explicit-state decode):\n" + summary["sample"])
  return summary
