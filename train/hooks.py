"""The training loop's hooks, each with one job: the metrics log, the held-out evaluation, the profile window,
the export for serving, the sample, the loss curve. train/loop.py's driver calls them."""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from pathlib import Path

import jax
from tqdm import tqdm

from laplace_jax.analysis import timing
from laplace_jax.data import tokenizer
from laplace_jax.inference import generate
from laplace_jax.training import checkpoint
from laplace_jax.training import train_step as ts
from train.run_config import TrainConfig


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


# metrics.jsonl key -> TensorBoard tag (`tensorboard --logdir RUN` shows them, beside a --profile_steps trace)
TB_TAGS = {
  "loss": "train/loss",
  "eval_loss": "eval/loss",
  "lr": "train/learning_rate",
  "grad_norm": "train/grad_norm",
  "tokens_per_s": "perf/tokens_per_s",
  "mfu": "perf/mfu",
}


class MetricsLog:
  """Each step's metrics: metrics.jsonl and TensorBoard event files in RUN/tensorboard (tensorboardX; every
  --log_every steps and the last), the progress bar, the run's first and last losses, and the stop after
  --max_bad_steps non-finite steps in a row."""

  def __init__(self, tc: TrainConfig, start: int, *, tokens_per_step: int, flops_per_token: float):
    self.tc = tc
    self.first_loss: float | None = None  # this run's first and last logged train losses
    self.last_loss: float | None = None
    self.tokens_per_s: float | None = None  # the last step's
    self.eval: float | None = None  # the last held-out loss
    self.tokens_per_step, self.flops_per_token = tokens_per_step, flops_per_token
    self.peak = host_matmul_peak_flops()
    self.ckpt_dir = Path(tc.out_dir) / "checkpoints"
    self.file = open(Path(tc.out_dir) / "metrics.jsonl", "a") if jax.process_index() == 0 else None
    self.tb = None
    if jax.process_index() == 0:
      from tensorboardX import SummaryWriter

      # a resumed run drops the events of the steps it redoes, as metrics.jsonl drops their rows
      self.tb = SummaryWriter(str(Path(tc.out_dir) / "tensorboard"), purge_step=start + 1 if start else None)
    self.bar = None
    if tc.progress and jax.process_index() == 0:
      self.bar = tqdm(total=tc.steps, initial=start, desc="train", unit="step", dynamic_ncols=True)
    self.since = time.perf_counter()  # when the previous step's metrics were in

  def restart_clock(self):
    self.since = time.perf_counter()

  def say(self, msg: str):
    self.bar.write(msg) if self.bar else log0(msg)

  def _write(self, row: dict):
    if self.file:
      self.file.write(json.dumps(row) + "\n")
      self.file.flush()
    if self.tb:
      for key, tag in TB_TAGS.items():
        if key in row:
          self.tb.add_scalar(tag, row[key], row["step"], walltime=row.get("time"))

  def record(self, i: int, m: ts.StepMetrics, wait: float):
    """Wait for step i's metrics and log them."""
    tc = self.tc
    m = jax.device_get(m)
    done = time.perf_counter()
    dt = done - self.since
    if int(m.bad_steps) >= tc.max_bad_steps:
      raise TrainingError(
        f"{int(m.bad_steps)} consecutive non-finite steps (loss {float(m.loss)}, "
        f"grad norm {float(m.grad_norm)}) at step {i}; stopping. The last checkpoint in "
        f"{self.ckpt_dir} is intact: lower the learning rates or check the data, then resume."
      )
    tps = self.tokens_per_step / dt
    assert m.lr is not None  # the loop's step is lowered with its schedule (train/loop.py's _lower)
    row = {
      "step": i,
      "loss": float(m.loss),
      "grad_norm": float(m.grad_norm),
      "lr": float(m.lr),
      "z_loss": float(m.z_loss),
      "skipped": bool(m.skipped),
      "tokens_per_s": tps,
      "mfu": tps * self.flops_per_token / self.peak,
      "input_wait_s": wait,
      "step_s": dt,
      "time": time.time(),
    }
    self.first_loss = self.first_loss or row["loss"]
    self.last_loss = row["loss"]
    self.tokens_per_s = tps
    if bool(m.skipped):
      log0(f"step {i}: non-finite loss or gradient, update skipped ({int(m.bad_steps)} in a row)")
    if i % tc.log_every == 0 or i == tc.steps:
      self._write(row)
    if self.bar:
      self.bar.set_postfix(loss=f"{row['loss']:.3f}", tok_s=f"{tps:,.0f}", mfu=f"{100 * row['mfu']:.1f}%")
      self.bar.update(1)
    self.since = done

  def eval_loss(self, i: int, loss: float):
    self.eval = loss
    self._write({"step": i, "eval_loss": loss})
    self.say(f"step {i}: held-out loss {loss:.4f}")

  def close(self):
    if self.bar:
      self.bar.close()
    if self.file:
      self.file.close()
    if self.tb:
      self.tb.close()


def make_evaluator(cfg, eval_batches: list[ts.Batch], abstract, batch_sh, to_global):
  """params -> the held-out loss (nats per scored token) over `eval_batches` (this process's rows)."""
  eval_fn = _eval_fn(cfg, *flat_key(jax.tree.map(lambda s: s.sharding, abstract.params)), *flat_key(batch_sh))

  def evaluate(params) -> float:
    ce = tok = 0.0
    for b in eval_batches:
      aux = eval_fn(params, to_global(b))
      ce, tok = ce + float(aux.ce), tok + float(aux.tokens)
    return ce / max(tok, 1.0)

  return evaluate


def flat_key(tree) -> tuple:
  """(leaves as a tuple, treedef): a pytree of shardings as a hashable cache key, for the jitted functions
  kept per model and layout (`functools.lru_cache`)."""
  leaves, treedef = jax.tree.flatten(tree)
  return tuple(leaves), treedef


@functools.lru_cache(maxsize=8)  # one jitted loss per model and layout: later runs of it reuse the executable
def _eval_fn(cfg, params_sh: tuple, params_def, batch_sh: tuple, batch_def):
  return jax.jit(
    lambda p, b: ts.loss_sums(p, b, cfg=cfg)[1],
    in_shardings=(jax.tree.unflatten(params_def, params_sh), jax.tree.unflatten(batch_def, batch_sh)),
  )


class Profile:
  """--profile_steps N: a jax.profiler trace of N steps, skipping the first step of a run that has more
  (warm-up: first transfers, allocator growth)."""

  def __init__(self, tc: TrainConfig, start: int, directory: Path, say):
    self.dir, self.say, self.tracing = directory, say, False
    self.first = start + 1 + (tc.steps - start > tc.profile_steps)
    self.last = min(tc.steps, self.first + tc.profile_steps - 1) if tc.profile_steps else -1
    self.on = bool(tc.profile_steps)

  def before(self, i: int):
    if self.on and i == self.first:
      jax.profiler.start_trace(str(self.dir))
      self.tracing = True

  def after(self, i: int, state):
    if i == self.last:
      jax.block_until_ready(state)
      jax.profiler.stop_trace()
      self.tracing = False
      self.say(
        f"profile of steps {self.first}-{self.last}: {self.dir} (tensorboard --logdir, or "
        "ui.perfetto.dev with the .trace.json.gz)"
      )

  def close(self):
    if self.tracing:
      jax.profiler.stop_trace()
      self.tracing = False


def export(params, out: Path, cfg, step: int) -> Path:
  """The params for serving, out/export/step_N, unless already there (every process takes part in an Orbax
  save)."""
  export = out / "export" / f"step_{step}"
  if not export.exists():
    checkpoint.export_params(params, export, config=dataclasses.asdict(cfg))
  return export


def sample(export: Path, tc: TrainConfig, cfg) -> str | None:
  """--sample_tokens: text sampled from the exported checkpoint through the explicit-state decode, up to
  <|endoftext|> (shown) or --sample_tokens (process 0's; None on the others)."""
  params = checkpoint.load_params(export, config=dataclasses.asdict(cfg))  # the checkpoint, as host arrays
  if jax.process_index() != 0:
    return None
  out = generate.complete(
    params, cfg, tc.sample_prompt, tc.sample_tokens, temperature=0.8, top_k=40, seed=tc.seed
  )
  sample = tc.sample_prompt + out.text + (tokenizer.EOS_TEXT if out.stop == "stop" else "")
  log0("sample (explicit-state decode):\n" + sample)
  return sample


def write_loss_curve(metrics_path: Path, png: Path):
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
