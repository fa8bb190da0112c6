"""`python -m train.recall --grid zoology`: MQAR on Zoology's own protocol (Arora et al., ICLR 2024, figure 2).

Taken from HazyResearch/zoology's figure-2 configs (experiments/paper_configs/iclr24_zoology_figure2) and its
data/multiquery_ar.py, trainer and model defaults: vocabulary 8,192, keys from the lower half and values from
the upper, zero filler, a label only at the query positions, power-law query gaps (a = 0.01); (sequence,
pairs) ∈ {(64, 4), (128, 8), (256, 16)}; 100,000 training and 3,000 test sequences, fixed, in the same
batches every epoch (512 sequences, 256 at 256 tokens); two mixer layers without MLPs, attention with one
head; AdamW on every parameter (β = 0.9, 0.999, weight decay 0.1, no clipping, no warm-up), the learning rate
cosine-annealed to 0 over the epochs (stepped once per epoch); learning rates logspace(−4, −2, 4), the best
reported; at most 64 epochs, stopping after the first epoch whose test accuracy exceeds 0.99. A cell's
accuracy is that of its last epoch (Zoology's figure reads the last value logged, best over learning rates).

`zoology-cpu` keeps Zoology's 100,000 training sequences and cuts the passes over them instead: one epoch at
batch 32 or 64 (3,125 or 1,562 steps), the cosine stepped per step (`anneal="step"`: per epoch, one epoch
would hold the peak throughout). A small fixed set seen many times is memorised, not learned: at (64, 4),
batch 64 and ~1,550 steps, 24 epochs over 4,096 sequences took attention's training loss to 0.07 at 0.10%
test accuracy (chance), one epoch over 100,000 to 98.9% (docs/EVAL.md).

Each cell trains through the library's train step (laplace_jax/training/train_step.py, scored at the query positions
only) and is scored by laplace_jax.inference.generate.greedy_next. Where this differs from Zoology's models (docs/EVAL.md,
"Zoology's protocol"): our layers keep the 4-tap short conv before every mixer, attention uses RoPE instead of
learned absolute positions, the LM head is untied, there is no dropout, and an epoch drops the last partial
batch. `S` windows are a quarter of the sequence (window_div = 4).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import platform as host_platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from laplace_jax.data import recall_tasks as recall
from laplace_jax.model.counts import param_counts, state_bytes_per_sequence
from laplace_jax.training import train_step
from laplace_jax.training.adamw import adamw
from train.grid import answers_right, jit_step, load_results, progress_bar, run_pending
from train.grid import model_config as grid_model

CELL_KEYED = ("tasks", "batches", "widths", "lrs")  # settings each cell's key records
PATTERNS = ("A", "G", "S", "GS")  # attention, Laplace (GLA), sliding window, GLA then sliding window
LRS = tuple(10.0 ** (-4 + 2 * i / 3) for i in range(4))  # numpy.logspace(-4, -2, 4)

ANNEALS = ("epoch", "step")  # the cosine stepped once per epoch (Zoology's) or once per optimizer step

GRIDS = {
  # Zoology's figure-2 protocol at its own sizes: an accelerator's job (48 cells per width, ≤ 64 epochs).
  "zoology": dict(
    tasks=("zoology:64,4", "zoology:128,8", "zoology:256,16"),
    batches=(512, 512, 256),
    widths=(64, 128, 256, 512),
    lrs=LRS,
    epochs=64,
    train_examples=100_000,
    test_examples=3_000,
    early_stop=0.99,
    weight_decay=0.1,
    window_div=4,
    anneal="epoch",
    evals_per_epoch=1,
  ),
  # The same protocol cut to fit a shared 2-core CPU (docs/EVAL.md): one width (64), two of Zoology's four
  # learning rates, the best read as Zoology does (2.15e-3 suits attention: 99.2% at (256, 16), 98.7% at 1e-2
  # at (64, 4); 1e-2 is the one at which the window layers leave chance in one pass: S 0.11% -> 60.3%, GS
  # 2.7% -> 58.8% at (256, 16)), Zoology's 100,000 training sequences seen once (Zoology:
  # up to 64 times), the cosine per step, 512 test sequences. Batch 64 at (256, 16) (1,562 steps); 32 at
  # the two shorter settings (3,125 steps), whose 4 and 8 queries per sequence give a quarter and a half
  # of the answers to learn from: at batch 64 attention ended at 98.9% and 98.1% there.
  "zoology-cpu": dict(
    tasks=("zoology:64,4", "zoology:128,8", "zoology:256,16"),
    batches=(32, 32, 64),
    widths=(64,),
    lrs=LRS[2:],
    epochs=1,
    train_examples=100_000,
    test_examples=512,
    early_stop=0.99,
    weight_decay=0.1,
    window_div=4,
    anneal="step",
    evals_per_epoch=8,
  ),
}
# Settings a grid may leave out (`--set` adds them); a results file records one only when it is not its default.
# labels=within_window is a control, not Zoology's protocol: the training queries whose value lies beyond the
# window of seq_len / window_div tokens are left unscored (weight 0), so a window layer is never asked what it
# cannot see; the test set still scores every query.
OPTIONAL = {"labels": "all"}
LABELS = ("all", "within_window")
# Settings that only add observations (a learning curve: the test set scored evals_per_epoch times an epoch, the
# last at its end) and change nothing that trains: a results file's settings are matched without them.
OBSERVING = ("evals_per_epoch",)


@dataclasses.dataclass(frozen=True)
class ZCell:
  task: str
  pattern: str
  width: int
  lr: float
  batch: int
  seed: int = 0

  @property
  def key(self) -> str:
    return f"{self.task}|{self.pattern}|d{self.width}|lr{self.lr:.3g}|b{self.batch}|s{self.seed}"


def model_config(pattern: str, width: int, task: str, window_div: int):
  """Zoology's MQAR model in our layers: 2 mixer-only layers (no FFN), attention with one head over d_model,
  GLA with 4 heads at the published ratios, sliding windows of seq_len / window_div."""
  seq = recall.parse_task(task)[1][0]
  if seq % window_div:
    raise ValueError(f"window_div={window_div}: expected a divisor of the sequence length {seq}.")
  return grid_model(pattern, width, task, window=seq // window_div).replace(ffn=False, attn_heads=1)


def cells_of(grid: dict, patterns, seeds=(0,)) -> list[ZCell]:
  if len(grid["batches"]) != len(grid["tasks"]):
    raise ValueError(
      f"batches {grid['batches']} and tasks {grid['tasks']}: expected one batch size per task."
    )
  for t in grid["tasks"]:
    if recall.parse_task(t)[0] != "zoology":
      raise ValueError(f"task {t!r}: the zoology grids take zoology:SEQ,PAIRS[,VOCAB] tasks.")
  cosine(1.0, 1, 1, grid["anneal"])  # names a bad anneal before anything trains
  if grid.get("labels", "all") not in LABELS:
    raise ValueError(
      f"labels={grid['labels']!r}: expected one of {LABELS} (every query trains, as in Zoology, or "
      "only those whose value lies within the window: a control)."
    )
  curve_marks(1, grid.get("evals_per_epoch", 1))
  return [
    ZCell(t, p, w, lr, b, s)
    for s in seeds
    for t, b in zip(grid["tasks"], grid["batches"])
    for p in patterns
    for w in grid["widths"]
    for lr in grid["lrs"]
  ]


@functools.lru_cache(maxsize=2)
def data(task: str, n_train: int, n_test: int):
  """The fixed training and test sets of a task (Zoology draws them once, from seeds apart)."""
  nums = recall.parse_task(task)[1]
  return recall.zoology_batch(0, n_train, *nums), recall.zoology_batch(10**9, n_test, *nums)


def cosine(peak: float, epochs: int, steps_per_epoch: int, anneal: str):
  """The learning rate at each optimizer step: cosine from `peak` to 0 over the epochs, stepped once per epoch
  (anneal="epoch": Zoology's CosineAnnealingLR(T_max=epochs, eta_min=0)) or once per step ("step")."""
  if anneal not in ANNEALS:
    raise ValueError(
      f"anneal={anneal!r}: expected one of {ANNEALS} (the cosine stepped per epoch, as "
      "Zoology does, or per optimizer step)."
    )
  total = epochs * steps_per_epoch if anneal == "step" else epochs
  per = 1 if anneal == "step" else steps_per_epoch

  def schedule(step):
    t = jnp.floor(jnp.asarray(step, jnp.float32) / per)
    return peak * 0.5 * (1 + jnp.cos(jnp.pi * t / total))

  return schedule


def _batches(d: train_step.Batch, size: int, drop_last: bool) -> list[train_step.Batch]:
  n = d.inputs.shape[0]
  stop = n - n % size if drop_last else n
  return [jax.tree.map(lambda v: v[i : i + size], d) for i in range(0, stop, size)]


def train_batches(train: train_step.Batch, size: int, labels: str, window: int) -> list[train_step.Batch]:
  """An epoch's full batches, each with its scored positions; labels="within_window" unscores (weight 0) the
  queries whose value lies `window` or more tokens back."""
  batches = _batches(train, size, drop_last=True)
  if not batches:
    raise ValueError(f"train_examples={train.inputs.shape[0]} < batch {size}: no full batch to train on.")
  out = []
  for b in batches:
    pos_BxJ = recall.scored_positions(b.weights)
    b = b.replace(positions=pos_BxJ)
    if labels == "within_window":
      weights_BxT = np.array(b.weights)  # a copy: the task's data (cached) stays as drawn
      np.put_along_axis(weights_BxT, pos_BxJ, (value_distance(b) < window).astype(np.float32), axis=1)
      b = b.replace(weights=weights_BxT)
    out.append(b)
  return out


def run_cell(cell: ZCell, grid: dict, progress: bool) -> dict:
  cfg = model_config(cell.pattern, cell.width, cell.task, grid["window_div"])
  train, test = data(cell.task, grid["train_examples"], grid["test_examples"])
  batches = train_batches(train, cell.batch, grid.get("labels", "all"), cfg.window)
  test_batches = _batches(test, min(512, grid["test_examples"]), drop_last=False)
  opt = adamw(
    cosine(cell.lr, grid["epochs"], len(batches), grid["anneal"]),
    b1=0.9,
    b2=0.999,
    eps=1e-8,
    weight_decay=grid["weight_decay"],
  )  # every parameter decayed, as torch's AdamW(model.parameters())
  state = train_step.init_train_state(cfg, opt, cell.seed)
  step = jit_step(cfg, opt)
  history, losses, curve, t0 = [], [], [], time.perf_counter()
  marks = curve_marks(len(batches), grid.get("evals_per_epoch", 1))
  bar = progress_bar(
    progress, grid["epochs"] * len(batches), f"{cell.pattern:>3} {cell.task} lr {cell.lr:.2g}"
  )
  for epoch in range(grid["epochs"]):
    since = []  # the training losses since the last point of the curve
    for i, b in enumerate(batches):
      state, metrics = step(state, b)
      since.append(metrics.loss)
      if bar:
        bar.update(1)
      if i + 1 in marks:  # the epoch's last mark is its end: `right` is then the final params' answers
        right = answers_right(state.params, cfg, test_batches)
        curve.append([epoch * len(batches) + i + 1, float(sum(since)) / len(since), float(right.mean())])
        since = []
    losses.append(float(metrics.loss))
    history.append(curve[-1][2])
    if bar:
      bar.set_postfix(loss=f"{losses[-1]:.3f}", acc=f"{history[-1]:.3f}")
    if history[-1] > grid["early_stop"]:
      break
  if bar:
    bar.close()
  seq, pairs = recall.parse_task(cell.task)[1][:2]
  return {
    "key": cell.key,
    "pattern": cell.pattern,
    "window": cfg.window if "S" in cell.pattern else None,
    "d_model": cell.width,
    "seq_len": seq,
    "pairs": pairs,
    "vocab": cfg.vocab_size,
    "lr": cell.lr,
    "epochs": len(history),
    "accuracy": history[-1],
    "state_bytes_per_seq": state_bytes_per_sequence(cfg, context=seq),
    "batch": cell.batch,
    "train_examples": len(batches) * cell.batch,
    "steps": len(history) * len(batches),
    "params": param_counts(cfg)["total"],
    "accuracy_by_epoch": history,
    "loss_by_epoch": losses,
    "curve": curve,
    "train_s": time.perf_counter() - t0,
    **reach(right, value_distance(test) < cfg.window),
  }


def reach(right_BxJ, near_BxJ) -> dict:
  """The final test accuracy split by where each query's value lies: within the window of seq_len / window_div
  tokens (what an S layer can see), or beyond it; and the share within."""
  return {
    "within_window": float(near_BxJ.mean()),
    "accuracy_within_window": float(right_BxJ[near_BxJ].mean()),
    "accuracy_beyond_window": float(right_BxJ[~near_BxJ].mean()),
  }


def value_distance(d: train_step.Batch) -> np.ndarray:
  """[B, J] for each query of a Zoology batch (its scored positions, in order): the tokens from its pair's value
  to the query, t_query − (t_key + 1). A window of W tokens (the query's own position included) sees the value
  iff this is < W."""
  x = d.inputs
  pos_BxJ = recall.scored_positions(d.weights) if d.positions is None else d.positions
  n = pos_BxJ.shape[1]
  keys_BxJ = x[:, 0 : 2 * n : 2]
  asked_BxJ = np.take_along_axis(x, pos_BxJ, axis=1)
  pair_BxJ = np.argmax(asked_BxJ[:, :, None] == keys_BxJ[:, None, :], axis=2)  # keys are distinct in a row
  return pos_BxJ - (2 * pair_BxJ + 1)


def curve_marks(steps_per_epoch: int, evals_per_epoch: int) -> set[int]:
  """The steps of an epoch (1-based) after which the test set is scored: evals_per_epoch of them, evenly spaced,
  the last at the epoch's end."""
  if not isinstance(evals_per_epoch, int) or evals_per_epoch < 1:
    raise ValueError(
      f"evals_per_epoch={evals_per_epoch!r}: expected a positive integer (1: at each epoch's end)."
    )
  return {round(steps_per_epoch * (k + 1) / evals_per_epoch) for k in range(evals_per_epoch)} - {0}


def machine() -> str:
  return (
    f"{os.cpu_count()}-core {host_platform.machine()} {jax.default_backend().upper()}"
    f" ({host_platform.processor() or host_platform.system()}), jax {jax.__version__}"
  )


def best_per_cell(cells: list[dict]) -> list[dict]:
  """The best learning rate's record of each (pattern, d_model, seq_len, pairs)."""
  best: dict = {}
  for c in cells:
    k = (c["pattern"], c["d_model"], c["seq_len"], c["pairs"])
    if k not in best or c["accuracy"] > best[k]["accuracy"]:
      best[k] = c
  return list(best.values())


def main(grid_name: str, grid: dict, patterns, seeds, out: Path, progress: bool, argv) -> int:
  patterns = patterns or PATTERNS
  try:
    cells = cells_of(grid, patterns, seeds)
    for c in cells:  # every pattern, width and task checked before the first cell trains
      model_config(c.pattern, c.width, c.task, grid["window_div"])
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  path = out / "zoology.json"
  command = "python -m train.recall " + " ".join(argv)
  # A cell's key names its task, pattern, width, lr and batch; the file keeps the rest of the settings one, so
  # several invocations (e.g. the most wanted cells first) can fill one file.
  settings = {
    k: v
    for k, v in json.loads(json.dumps(grid)).items()
    if k not in CELL_KEYED + OBSERVING and not (k in OPTIONAL and v == OPTIONAL[k])
  }
  saved = load_results(
    path, {"command": command, "machine": machine(), "grid": grid_name, "settings": settings, "cells": []}
  )
  if saved.get("grid") != grid_name or saved.get("settings") != settings:
    print(
      f"error: {path} holds the {saved.get('grid')!r} grid with settings {saved.get('settings')}, not "
      f"{grid_name!r} with {settings}; use another --out.",
      file=sys.stderr,
    )
    return 2
  if command not in saved["command"].split(" && "):
    saved["command"] += " && " + command
  run_pending(
    grid_name,
    path,
    saved,
    cells,
    lambda c: run_cell(c, grid, progress),
    lambda c, row: (
      f"{c.key}: accuracy {row['accuracy']:.3f} after {row['epochs']} epochs ({row['train_s']:.0f} s)"
    ),
  )
  for r in sorted(best_per_cell(saved["cells"]), key=lambda r: (r["seq_len"], r["pattern"])):
    print(
      f"best  {r['pattern']:>2} d{r['d_model']} ({r['seq_len']}, {r['pairs']}): {r['accuracy']:.3f} "
      f"at lr {r['lr']:.3g}"
    )
  print(f"results: {path}")
  return 0
