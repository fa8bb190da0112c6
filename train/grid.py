"""What the recall grids (train/recall.py, train/zoology.py) share: the 2-layer model, the compiled train step,
the greedy scoring of answers, progress bars, and the resumable results file (a rerun skips finished cells).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from tqdm import tqdm

from laplace_jax.data import recall_tasks as recall
from laplace_jax.inference import generate
from laplace_jax.model.config import LaplaceConfig, get_config
from laplace_jax.training import train_step

DEFAULT_WINDOW = 2048  # tokens a sliding-window layer (S) sees when a grid does not say


def model_config(pattern: str, width: int, task: str, window: int = DEFAULT_WINDOW) -> LaplaceConfig:
  """The grids' 2-layer model: the published ratios (d_k = D/2H, d_v = D/H) at 4 heads, GLU 2·D; S layers
  see the last `window` tokens."""
  seq = recall.parse_task(task)[1][0]
  return get_config("tiny").replace(
    vocab_size=recall.task_vocab(task),
    d_model=width,
    n_layers=2,
    n_heads=4,
    d_k=width // 8,
    d_v=width // 4,
    d_ff=2 * width,
    max_seq_len=seq,
    chunk_size=min(64, seq),
    mixers=pattern,
    gla_form="scan",
    remat=False,
    compute_dtype="float32",
    window=window,
  )


def jit_step(cfg: LaplaceConfig, opt):
  """The library's train step (laplace_jax/training/train_step.py) for this model and optimizer, compiled once."""
  return jax.jit(functools.partial(train_step.train_step, cfg=cfg, optimizer=opt), donate_argnums=0)


def progress_bar(progress: bool, total: int, desc: str, unit: str = "step", leave: bool = False):
  """A tqdm bar, or None when `progress` is off."""
  if not progress:
    return None
  return tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True, leave=leave)


def answers_right(params, cfg: LaplaceConfig, batches) -> np.ndarray:
  """[rows, J] bool over the batches' rows in order: whether each scored position's greedy next token
  (laplace_jax.inference.generate.greedy_next) is the answer."""
  right = []
  for b in batches:
    pos = recall.scored_positions(b.weights)
    right.append(
      generate.greedy_next(params, b.inputs, pos, cfg=cfg) == np.take_along_axis(b.targets, pos, 1)
    )
  return np.concatenate(right)


def load_results(path: Path, fresh: dict) -> dict:
  """The results file at `path`, or `fresh` (with an empty "cells" list) when there is none yet."""
  return json.loads(path.read_text()) if path.exists() else fresh


def run_pending(
  grid_name: str,
  path: Path,
  saved: dict,
  cells: Sequence[Any],
  run: Callable[[Any], dict],
  report: Callable[[Any, dict], str],
  *,
  progress: bool = False,
) -> None:
  """Run each cell whose key `saved["cells"]` lacks, in order: append its row (`run(cell)`, holding "key") and
  rewrite `path` after every cell, so that an interrupted grid resumes where it stopped; print
  `report(cell, row)` after each. `progress`: a bar over the cells."""
  path.parent.mkdir(parents=True, exist_ok=True)
  done = {r["key"] for r in saved["cells"]}
  todo = [c for c in cells if c.key not in done]
  print(
    f"grid {grid_name}: {len(todo)} cells to run ({len(done)} done) on {jax.default_backend()}", flush=True
  )
  bar = progress_bar(progress, len(todo), "cells", unit="cell", leave=True)
  for cell in todo:
    row = run(cell)
    saved["cells"].append(row)
    path.write_text(json.dumps(saved, indent=1))
    msg = report(cell, row)
    if bar:
      bar.write(msg)
      bar.update(1)
    else:
      print(msg, flush=True)
  if bar:
    bar.close()
