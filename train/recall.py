"""`python -m train.recall`: a named grid of recall experiments, trained and scored end to end.

Each cell trains a fresh 2-layer model (mixer pattern × task × width) on a recall task generated on the fly
(laplace_jax.data.recall_tasks), with the project's Muon + AdamW, the loss taken at the scored positions only (the LM
head runs there alone), then scores it on a fixed held-out set: MQAR accuracy over the query positions;
passkey exact match of the 5 greedy digits through the explicit-state prefill + decode_step (constant
memory for GLA at any length), by context and depth and by context and distance (filler tokens between the
key and the question). `state_passing` (a grid setting: `--set state_passing=true`) trains each batch row
as one stream of prompts, every step starting from the row's recurrent state at the end of the previous
step (no gradient across the boundary): the model learns to read states that have seen far more than one
training sequence. Results go to OUT/results.json after every cell (a rerun skips finished cells) and plots
to OUT/*.png.

    python -m train.recall --quick -o runs/recall-quick        # ≈30 min on a 2-core CPU
    python -m train.recall --grid full -o runs/recall-full     # the full grid: an accelerator's job
    python -m train.recall --grid longctx --set state_passing=true -o runs/longctx-sp   # to 64K
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time
from pathlib import Path

import numpy as np

from laplace_jax import cli, platform
from laplace_jax.data import recall_tasks as recall
from laplace_jax.inference import generate
from laplace_jax.model.counts import param_counts
from laplace_jax.platform import PRNG_CHOICES
from laplace_jax.training import optimizer as optim
from laplace_jax.training import train_step
from train import zoology
from train.grid import (
  DEFAULT_WINDOW,
  answers_right,
  jit_step,
  load_results,
  model_config,
  progress_bar,
  run_pending,
)

PATTERNS = ("G", "GA", "A")  # Laplace, a hybrid (GLA then attention), the attention baseline
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
DISTANCES = (64, 256, 1024, 4096, 16384)  # filler tokens between the key sentence and the question

# Same steps, batch and sequence for every pattern of a task: equal training tokens; widths give equal
# parameters within 1% (attention spends W_qkvg + W_out's budget).
GRIDS = {
  # A look at every section within 30 CPU minutes: (64, 4) at vocabulary 256, 1,000 x 64 sequences, AdamW
  # 1e-3 + Muon 0.02. Too short for attention to pass the 99% check (it needs ~3,000 steps here):
  # read the recipe grid for numbers. Passkey: trained at 256 tokens with AdamW 3e-3 (attention answers
  # every training prompt from step ~300).
  "quick": dict(
    width=64,
    mqar=("mqar:64,4,256",),
    mqar_steps=1000,
    mqar_batch=64,
    state_task="mqar:64,4,256",
    state_widths=(32,),
    passkey="passkey:256",
    passkey_steps=1000,
    passkey_batch=16,
    passkey_contexts=(1024, 4096, 16384),
    passkey_examples=1,
    eval_examples=512,
    adamw_lr=1e-3,
    passkey_adamw_lr=3e-3,
    muon_lr=0.02,
    passkey_distances=DISTANCES,
    state_passing=False,
  ),
  # The recipe check on the CPU (~1.5 h): (64, 4) at vocabulary 256 (not the full grid's 8,192: a d128
  # model learned nothing of it in 1,500 steps), 3,000 x 64 sequences, AdamW 1e-3 + Muon 0.02 (400 steps
  # at AdamW 3e-2 left attention at 25%; this recipe takes it to 99.6%); GLA's state curve beside it.
  "recipe": dict(
    width=64,
    mqar=("mqar:64,4,256",),
    mqar_steps=3000,
    mqar_batch=64,
    state_task="mqar:64,4,256",
    state_widths=(32, 128),
    passkey="passkey:256",
    passkey_steps=3000,
    passkey_batch=16,
    passkey_contexts=(256, 1024, 4096, 16384),
    passkey_examples=4,
    eval_examples=512,
    adamw_lr=1e-3,
    passkey_adamw_lr=3e-3,
    muon_lr=0.02,
    passkey_distances=DISTANCES,
    state_passing=False,
  ),
  # GLA trained at 256 tokens, passkey scored by (context, distance) to 64K; run once with
  # --set state_passing=true and once without (same steps). 6,000 steps is where GLA learned the task at
  # 256 tokens without state passing (docs/EVAL.md): about 25 min per cell on a 2-core CPU.
  "longctx": dict(
    width=64,
    mqar=(),
    mqar_steps=0,
    mqar_batch=0,
    state_task="mqar:64,4,256",
    state_widths=(),
    passkey="passkey:256",
    passkey_steps=6000,
    passkey_batch=16,
    passkey_contexts=(256, 1024, 4096, 16384, 65536),
    passkey_examples=4,
    eval_examples=0,
    adamw_lr=1e-3,
    passkey_adamw_lr=3e-3,
    muon_lr=0.02,
    passkey_distances=DISTANCES,
    state_passing=False,
  ),
  # a seconds-long end-to-end check (tests/programs/train/test_recall_program.py), not an experiment. MQAR at passkey's
  # shapes (vocabulary 32, 64 tokens, 5 scored positions per row, batch 8, same steps and learning rates):
  # a pattern's passkey cell trains with the very program its MQAR cell compiled (a compilation-cache read).
  "smoke": dict(
    width=32,
    mqar=("mqar:64,5,32",),
    mqar_steps=3,
    mqar_batch=8,
    state_task="mqar:64,5,32",
    state_widths=(16,),
    passkey="passkey:64",
    passkey_steps=3,
    passkey_batch=8,
    passkey_contexts=(64,),
    passkey_examples=1,
    eval_examples=16,
    adamw_lr=1e-2,
    passkey_adamw_lr=1e-2,
    muon_lr=0.02,
    passkey_distances=(8, 16),
    state_passing=False,
  ),
  # The full grid (vocabulary 8,192, every Zoology setting, passkey to 16K): an accelerator's job.
  "full": dict(
    width=128,
    mqar=("mqar:64,4", "mqar:128,8", "mqar:256,16", "mqar:512,64"),
    mqar_steps=20_000,
    mqar_batch=64,
    state_task="mqar:256,16",
    state_widths=(64, 256),
    passkey="passkey:1024",
    passkey_steps=5_000,
    passkey_batch=32,
    passkey_contexts=(1024, 2048, 4096, 8192, 16384),
    passkey_examples=20,
    eval_examples=3_000,
    adamw_lr=1e-3,
    passkey_adamw_lr=3e-3,
    muon_lr=0.02,
    passkey_distances=DISTANCES,
    state_passing=False,
  ),
}


# Settings a grid may leave out (--set adds them): the sliding-window layers' window (patterns with S).
OPTIONAL = {"window": DEFAULT_WINDOW}


@dataclasses.dataclass(frozen=True)
class Cell:
  task: str
  pattern: str
  width: int
  steps: int
  batch: int
  seed: int = 0  # the model's initialisation and its training batches (the held-out set is fixed)
  state_passing: bool = False

  @property
  def key(self) -> str:
    seed = f"|s{self.seed}" if self.seed else ""  # seed 0's keys are those of results saved before seeds
    sp = "|sp" if self.state_passing else ""
    return f"{self.task}|{self.pattern}|d{self.width}|{self.steps}x{self.batch}{seed}{sp}"


def cells_of(grid: dict, sections, seeds=(0,), patterns=PATTERNS) -> list[Cell]:
  cells = []
  if "mqar" in sections:
    cells += [
      Cell(t, p, grid["width"], grid["mqar_steps"], grid["mqar_batch"])
      for t in grid["mqar"]
      for p in patterns
    ]
  if "state" in sections:
    cells += [
      Cell(grid["state_task"], "G", w, grid["mqar_steps"], grid["mqar_batch"]) for w in grid["state_widths"]
    ]
  if "passkey" in sections:
    cells += [
      Cell(grid["passkey"], p, grid["width"], grid["passkey_steps"], grid["passkey_batch"]) for p in patterns
    ]
  sp = bool(grid.get("state_passing", False))
  return list(dict.fromkeys(dataclasses.replace(c, seed=s, state_passing=sp) for s in seeds for c in cells))


@functools.lru_cache(maxsize=8)
def _optimizer_and_step(cfg, ocfg: optim.OptimizerConfig):
  """One optimizer and jitted step per (model, optimizer config), so cells that share both (every seed of a
  cell; the smoke grid's passkey cell after its pattern's MQAR cell) trace and compile the step once."""
  opt = optim.make_optimizer(ocfg)
  return opt, jit_step(cfg, opt)


def train_cell(cell: Cell, grid: dict, *, progress: bool = True):
  """Train one cell through the library's train step (each batch scored at its answer positions only);
  returns (params, cfg, {final_loss, train_s, losses})."""
  cfg = model_config(cell.pattern, cell.width, cell.task, grid.get("window", OPTIONAL["window"]))
  adamw_lr = grid["passkey_adamw_lr" if cell.task.startswith("passkey") else "adamw_lr"]
  ocfg = optim.OptimizerConfig(
    total_steps=cell.steps, warmup_steps=max(1, cell.steps // 20), adamw_lr=adamw_lr, muon_lr=grid["muon_lr"]
  )
  opt, step = _optimizer_and_step(cfg, ocfg)
  # state passing: each row's recurrent state after its previous batch starts its next (train_step's carry)
  state = train_step.init_train_state(
    cfg, opt, cell.seed, carry_batch=cell.batch if cell.state_passing else 0
  )
  stream = recall.RecallStream(cell.task, seq_len=cfg.max_seq_len, global_batch=cell.batch, seed=cell.seed)
  bar = progress_bar(progress, cell.steps, f"{cell.pattern:>3} {cell.task} d{cell.width}")
  losses, t0 = [], time.perf_counter()
  for i in range(cell.steps):
    b = next(stream)
    state, metrics = step(state, b.replace(positions=recall.scored_positions(b.weights)))
    if i % 10 == 9 or i == cell.steps - 1:
      losses.append((i + 1, float(metrics.loss)))
      if bar:
        bar.set_postfix(loss=f"{losses[-1][1]:.3f}")
    if bar:
      bar.update(1)
  if bar:
    bar.close()
  return (
    state.params,
    cfg,
    {"final_loss": losses[-1][1], "train_s": time.perf_counter() - t0, "losses": losses},
  )


def answer_accuracy(params, cfg, batches) -> float:
  """Share of scored positions whose greedy next token is the answer."""
  return float(answers_right(params, cfg, batches).mean())


def mqar_accuracy(params, cfg, task: str, n_examples: int, batch: int = 64) -> float:
  """Accuracy over the query positions of a fixed held-out set (seeds apart from training's)."""
  return answer_accuracy(
    params, cfg, recall.eval_batches(task, global_batch=batch, n_batches=max(1, n_examples // batch))
  )


def _passkey_exact(params, cfg, ctx: int, n_examples: int, **place) -> float:
  """Exact-match rate of the greedy 5-digit answer over `n_examples` prompts (one batch) placed by
  `depth=` or `distance=`, generated by laplace_jax.inference.generate (chunked prefill: constant memory for GLA)."""
  ex = [recall.passkey_example(10**6 + e, ctx, **place) for e in range(n_examples)]
  prompts, answers = np.stack([p for p, _ in ex]), np.stack([a for _, a in ex])
  got = generate.generate_batch(params, prompts, recall.PASSKEY_DIGITS, cfg=cfg)
  return float((got == answers).all(1).mean())


def _eval_config(cfg):
  """The trained model's config for scoring long prompts: prefill chunks of 512 tokens (the chunked GLA
  is exact at any chunk length; fewer host round trips at 64K)."""
  chunk = max(cfg.chunk_size, 512)
  return cfg.replace(chunk_size=chunk, max_seq_len=-(-cfg.max_seq_len // chunk) * chunk)


def passkey_accuracy(params, cfg, contexts, depths, n_examples: int) -> dict:
  """{context: {depth: exact-match rate}} of the greedy 5-digit answer via prefill + decode_step."""
  cfg = _eval_config(cfg)
  return {ctx: {d: _passkey_exact(params, cfg, ctx, n_examples, depth=d) for d in depths} for ctx in contexts}


def passkey_distance_accuracy(params, cfg, contexts, distances, n_examples: int) -> dict:
  """{context: {distance: exact-match rate}} for each distance that fits the context (the others absent)."""
  cfg = _eval_config(cfg)
  return {
    ctx: {
      d: _passkey_exact(params, cfg, ctx, n_examples, distance=d)
      for d in distances
      if d <= recall.max_passkey_distance(ctx)
    }
    for ctx in contexts
  }


def state_per_layer(cfg) -> int:
  return cfg.n_heads * cfg.d_k * cfg.d_v


def run_cell(cell: Cell, grid: dict, progress: bool) -> dict:
  params, cfg, info = train_cell(cell, grid, progress=progress)
  row = {
    "key": cell.key,
    **dataclasses.asdict(cell),
    "params": param_counts(cfg)["total"],
    "gla_state_per_layer": state_per_layer(cfg),
    "train_tokens": cell.steps * cell.batch * cfg.max_seq_len,
    **info,
  }
  t0 = time.perf_counter()
  if cell.task.startswith("mqar"):
    row["accuracy"] = mqar_accuracy(params, cfg, cell.task, grid["eval_examples"])
  else:
    row["passkey"] = passkey_accuracy(params, cfg, grid["passkey_contexts"], DEPTHS, grid["passkey_examples"])
    row["passkey_distance"] = passkey_distance_accuracy(
      params, cfg, grid["passkey_contexts"], grid["passkey_distances"], grid["passkey_examples"]
    )
  row["eval_s"] = time.perf_counter() - t0
  return row


def _seed_means(points) -> list[tuple]:
  """(x, y) points, several seeds per x -> sorted (x, mean y)."""
  by_x: dict = {}
  for x, y in points:
    by_x.setdefault(x, []).append(y)
  return sorted((x, sum(ys) / len(ys)) for x, ys in by_x.items())


def plot(results: list[dict], out: Path):
  import matplotlib  # only where a plot is drawn: a heavy import

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  mq = [r for r in results if r["task"].startswith("mqar")]
  widths = sorted({r["width"] for r in mq})
  if mq:
    w0 = max(widths, key=lambda w: sum(r["width"] == w for r in mq))
    fig, ax = plt.subplots(figsize=(6, 4))
    for p in PATTERNS:
      pts = _seed_means(
        (recall.parse_task(r["task"])[1][1], r["accuracy"])
        for r in mq
        if r["pattern"] == p and r["width"] == w0
      )
      if pts:
        ax.plot(*zip(*pts), "o-", label={"G": "GLA (Laplace)", "GA": "hybrid GA", "A": "attention"}.get(p, p))
    ax.set_xlabel("key-value pairs")
    ax.set_ylabel("MQAR accuracy")
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, 1.02)
    ax.set_title(f"MQAR, d_model {w0}, 2 layers")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "mqar_pairs.png", dpi=100)
    plt.close(fig)
    g = sorted({r["task"] for r in mq if r["pattern"] == "G"})
    fig, ax = plt.subplots(figsize=(6, 4))
    for t in g:
      pts = _seed_means(
        (r["gla_state_per_layer"], r["accuracy"]) for r in mq if r["pattern"] == "G" and r["task"] == t
      )
      if len(pts) > 1:
        ax.plot(*zip(*pts), "o-", label=t)
    ax.set_xlabel("GLA state per layer (heads × d_k × d_v)")
    ax.set_ylabel("MQAR accuracy")
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    if ax.lines:
      ax.legend()
    fig.tight_layout()
    fig.savefig(out / "mqar_state.png", dpi=100)
    plt.close(fig)
  _passkey_heatmaps([r for r in results if "passkey" in r], "passkey", "depth", out / "passkey.png")
  _passkey_heatmaps(
    [r for r in results if "passkey_distance" in r],
    "passkey_distance",
    "distance from the question (tokens)",
    out / "passkey_distance.png",
  )


def _passkey_heatmaps(cells: list[dict], field: str, ylabel: str, png: Path):
  """One heat map per cell: accuracy by (context, `field`'s inner key); blank where a value does not fit."""
  if not cells:
    return
  import matplotlib  # only where a plot is drawn: a heavy import

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, len(cells), figsize=(4.5 * len(cells), 3.8), squeeze=False)
  for ax, r in zip(axes[0], cells):
    ctxs = sorted(r[field], key=int)
    ys = sorted({y for c in ctxs for y in r[field][c]}, key=float)
    m = np.array([[r[field][c].get(y, np.nan) for c in ctxs] for y in ys], float)
    ax.imshow(m, vmin=0, vmax=1, cmap="viridis", aspect="auto", origin="lower")
    ax.set_xticks(range(len(ctxs)), [str(c) for c in ctxs])
    ax.set_yticks(range(len(ys)), [str(y) for y in ys])
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel(ylabel)
    sp = ", state passing" if r.get("state_passing") else ""
    ax.set_title(f"passkey, {r['pattern']}, {r['steps']:,} steps{sp}", fontsize=9)
    for i in range(m.shape[0]):
      for j in range(m.shape[1]):
        if not np.isnan(m[i, j]):
          ax.text(j, i, f"{m[i, j]:.0%}", ha="center", va="center", color="w" if m[i, j] < 0.5 else "k")
  fig.tight_layout()
  fig.savefig(png, dpi=100)
  plt.close(fig)


def with_overrides(grid: dict, sets: list[str]) -> dict:
  """The grid with `--set KEY=VALUE` applied; each value parsed as the type the grid has for KEY (lists:
  numbers split at commas, tasks at semicolons)."""
  grid = dict(grid)
  for item in sets:
    key, eq, text = item.partition("=")
    if not eq or key not in grid:
      raise ValueError(f"--set {item!r}: expected KEY=VALUE with KEY one of {', '.join(sorted(grid))}")
    old = grid[key]
    try:
      if isinstance(old, tuple):
        kind = type(old[0]) if old else (str if key in ("mqar",) else int)
        sep = ";" if kind is str else ","  # tasks hold commas: --set "mqar=mqar:64,4;mqar:128,8"
        grid[key] = tuple(kind(v) for v in text.split(sep) if v)
      elif isinstance(old, bool):
        grid[key] = {"true": True, "1": True, "false": False, "0": False}[text.lower()]
      else:
        grid[key] = type(old)(text)
    except (ValueError, KeyError):
      raise ValueError(f"--set {item!r}: {key} takes {type(old).__name__} values (now {old!r})") from None
  return grid


def build_parser() -> argparse.ArgumentParser:
  ap = cli.FlagParser(
    prog="python -m train.recall", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  ap.add_argument(
    "--grid",
    choices=sorted(GRIDS) + sorted(zoology.GRIDS),
    default="full",
    help="the named grid of cells (GRIDS above; zoology, zoology-cpu: train/zoology.py)",
  )
  ap.add_argument("--quick", action="store_true", help="the quick grid (same as --grid quick)")
  ap.add_argument("--sections", default="mqar,state,passkey", help="comma list of mqar, state, passkey")
  ap.add_argument(
    "--seeds",
    default="0",
    help="comma list of seeds: each cell is trained once per seed (plots show the mean)",
  )
  ap.add_argument(
    "--patterns",
    default=None,
    help="comma list of mixer patterns for the 2-layer models (G = "
    "GLA, A = attention, S = sliding-window attention over --set window=N tokens; a pattern's length "
    f"divides 2: G, A, S, GA, GS); default {','.join(PATTERNS)}, for the zoology grids "
    f"{','.join(zoology.PATTERNS)} (S over a quarter of the sequence)",
  )
  ap.add_argument(
    "--set",
    dest="sets",
    action="append",
    default=[],
    metavar="KEY=VALUE",
    help="override one setting of the grid, e.g. --set width=128 --set mqar=mqar:64,4,256 "
    "--set adamw_lr=3e-3 (repeatable; a results directory keeps to one set of settings)",
  )
  ap.add_argument(
    "--prng",
    default="auto",
    choices=PRNG_CHOICES,
    help="JAX's PRNG implementation for the "
    "models' initialisation: auto (rbg on Neuron, threefry elsewhere) | threefry | rbg | unsafe_rbg "
    "(a results directory keeps to one)",
  )
  ap.add_argument("-o", "--out", default="runs/recall", help="output directory (results.json, *.png)")
  ap.add_argument("--progress", action=cli.Toggle, default=True, help="progress bars (default: on)")
  return ap


def _lists(args) -> tuple[list[str], tuple[int, ...], tuple[str, ...]]:
  """(sections, seeds, patterns) from their comma-list flags; ValueError naming the flag and the fix."""
  sections = [s for s in args.sections.split(",") if s]
  bad = set(sections) - {"mqar", "state", "passkey"}
  if bad:
    raise ValueError(f"--sections {args.sections!r}: unknown {sorted(bad)}; choose from mqar, state, passkey")
  try:
    seeds = tuple(dict.fromkeys(int(v) for v in args.seeds.split(",")))
  except ValueError:
    seeds = ()
  if not seeds or min(seeds) < 0 or max(seeds) >= 1000:
    raise ValueError(
      f"--seeds {args.seeds!r}: expected a comma list of integers in [0, 1000) (the held-out "
      "sets use seeds from 10^9 up, so training seeds stay apart from them)"
    )
  patterns = tuple(p for p in (args.patterns or "").split(",") if p)
  if args.patterns is not None and not patterns:
    raise ValueError(f"--patterns {args.patterns!r}: no pattern given; e.g. G,GA,A")
  return sections, seeds, patterns


def main(argv=None) -> int:
  args = build_parser().parse_args(argv)
  grid_name = "quick" if args.quick else args.grid
  try:
    sections, seeds, patterns = _lists(args)
    if grid_name in zoology.GRIDS:
      grid = with_overrides({**zoology.OPTIONAL, **zoology.GRIDS[grid_name]}, args.sets)
    else:
      grid = with_overrides({**OPTIONAL, **GRIDS[grid_name]}, args.sets)
      cells = cells_of(grid, sections, seeds, patterns or PATTERNS)
      for cell in cells:  # the model config checks each pattern, width and task, naming the value and the fix
        model_config(cell.pattern, cell.width, cell.task, grid["window"])
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if grid_name in zoology.GRIDS:
    platform.use_prng(args.prng)
    argv = sys.argv[1:] if argv is None else list(argv)
    return zoology.main(grid_name, grid, patterns, seeds, Path(args.out), args.progress, argv)
  return _run_grid(args, grid_name, grid, cells)


def _run_grid(args, grid_name: str, grid: dict, cells: list[Cell]) -> int:
  """The recall grid's pending cells trained and scored into --out's results.json (plotted after each);
  2 when that file holds another grid or PRNG."""
  out = Path(args.out)
  path = out / "results.json"
  prng = platform.use_prng(args.prng)  # before any key is made
  saved = load_results(path, {"grid": grid_name, "sets": args.sets, "prng": prng, "cells": []})
  if saved.get("grid") != grid_name or saved.get("sets", []) != args.sets:
    print(
      f"error: {path} holds the {saved.get('grid')!r} grid with --set {saved.get('sets', [])}, not "
      f"{grid_name!r} with --set {args.sets}; use another --out.",
      file=sys.stderr,
    )
    return 2
  if saved.get("prng", "threefry") != prng:  # results from before --prng: JAX's default, threefry
    print(
      f"error: {path} holds cells initialised with the {saved.get('prng', 'threefry')!r} PRNG, not {prng!r}; "
      f"pass --prng {saved.get('prng', 'threefry')} or use another --out.",
      file=sys.stderr,
    )
    return 2

  def report(cell: Cell, row: dict) -> str:
    plot(saved["cells"], out)
    msg = (
      f"{cell.key}: accuracy {row['accuracy']:.3f}"
      if "accuracy" in row
      else f"{cell.key}: passkey {json.dumps(row['passkey'])}"
    )
    return msg + f" (train {row['train_s']:.0f} s, eval {row['eval_s']:.0f} s)"

  run_pending(
    grid_name, path, saved, cells, lambda c: run_cell(c, grid, args.progress), report, progress=args.progress
  )
  plot(saved["cells"], out)
  print(f"results: {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
