"""Build docs/eval/long-context.json from the runs' own result files, never from typed numbers.

    python -m benchmarks long_context_figures --passkey runs/longctx-sp runs/longctx-plain \
        --by_position runs/tiny-sp/by_position.json runs/tiny-plain/by_position.json \
        [--cost runs/state_passing_cost.txt [more runs]] [--machine "2-core CPU, jax 0.10.0"] [--markdown] \
        -o docs/eval/long-context.json

--passkey: `python -m train.recall` output directories (results.json: the grid, its --set overrides and each
cell's accuracy by (context, distance) and by (context, depth)). --by_position: `python -m train.eval
--by_position --json` files; the training run is found from the checkpoint path in each
(RUN/export/step_N) and its config read from its newest checkpoint (RUN/checkpoints/N/meta/metadata).
Each list sits beside the commands that produced it, rebuilt from those files. --cost: the lines printed by
`python -m benchmarks state_passing_cost` (benchmarks/step_cost.py), one file per run.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path


def passkey_command(run_dir: Path, saved: dict, cells: list[dict]) -> str:
  patterns = ",".join(dict.fromkeys(c["pattern"] for c in cells))
  sets = "".join(f" --set {s}" for s in saved.get("sets", []))
  return f"python -m train.recall --grid {saved['grid']} --sections passkey --patterns {patterns}{sets} -o {run_dir}"


def passkey_records(run_dir: Path) -> tuple[str, list[dict], list[dict], list[dict]]:
  """(command, records by (context, distance), records by (context, depth), one training record per cell:
  its loss every 1,000 steps and at the end, and its wall times) of one recall output dir."""
  saved = json.loads((run_dir / "results.json").read_text())
  cells = [c for c in saved["cells"] if c["task"].startswith("passkey")]
  if not cells:
    raise ValueError(f"{run_dir}/results.json has no passkey cell yet")
  grid = _grid(saved)
  by_distance, by_depth, training = [], [], []
  for c in cells:
    base = {
      "pattern": c["pattern"],
      "state_passing": bool(c.get("state_passing")),
      "train_len": int(c["task"].split(":")[1].split(",")[0]),
      "steps": c["steps"],
    }
    n = grid["passkey_examples"]
    for ctx, accs in sorted(c.get("passkey_distance", {}).items(), key=lambda kv: int(kv[0])):
      for dist, acc in sorted(accs.items(), key=lambda kv: int(kv[0])):
        by_distance.append({**base, "context": int(ctx), "distance": int(dist), "accuracy": acc, "n": n})
    for ctx, accs in sorted(c["passkey"].items(), key=lambda kv: int(kv[0])):
      for depth, acc in sorted(accs.items(), key=lambda kv: float(kv[0])):
        by_depth.append({**base, "context": int(ctx), "depth": float(depth), "accuracy": acc, "n": n})
    training.append(
      {
        **base,
        "batch": c["batch"],
        "final_loss": c["final_loss"],
        "loss_every_1000": {str(s): v for s, v in c.get("losses", []) if s % 1000 == 0},
        "train_s": round(c.get("train_s", 0)),
        "eval_s": round(c.get("eval_s", 0)),
      }
    )
  return passkey_command(run_dir, saved, cells), by_distance, by_depth, training


def _grid(saved: dict) -> dict:
  from train import recall

  return recall.with_overrides(recall.GRIDS[saved["grid"]], saved.get("sets", []))


def run_config(export: Path) -> dict:
  """The training run's saved config: RUN/export/step_N -> RUN/checkpoints/<newest>/meta/metadata."""
  from train import resume

  run = export.parent.parent
  steps = sorted((p for p in (run / "checkpoints").glob("*") if p.name.isdigit()), key=lambda p: int(p.name))
  if not steps:
    raise ValueError(f"{export}: no checkpoint under {run / 'checkpoints'} to read the run's config from")
  return resume.saved_run_config(json.loads((steps[-1] / "meta" / "metadata").read_text()))


def prepare_command(data_dir: str) -> str:
  """The train.prepare line of a built-in corpus, from its manifest (other data: a note)."""
  m = json.loads((Path(data_dir) / "manifest.json").read_text())
  if not m.get("corpus"):
    return f"# {data_dir}: prepared from files by python -m train.prepare"
  return f"python -m train.prepare --corpus {m['corpus']} -o {data_dir} --val_fraction {m['val_fraction']}"


def train_command(rc: dict) -> str:
  t = rc["train"]
  flags = [
    f"--preset {t['preset']}",
    f"--data_dir {t['data_dir']}",
    f"--out_dir {t['out_dir']}",
    f"--steps {t['steps']}",
    f"--global_batch {t['global_batch']}",
  ]
  flags += [f"--seq_len {t['seq_len']}"] if t["seq_len"] else []
  flags += ["--state_passing"] if t["state_passing"] else []
  return "python -m train " + " ".join(flags)


def by_position_records(path: Path) -> tuple[list[str], list[dict]]:
  res = json.loads(path.read_text())
  rc = run_config(Path(res["checkpoint"]))
  t = rc["train"]
  train_len = t["seq_len"] or rc["model"]["max_seq_len"]
  reset = res.get("reset_every", 0)
  run = f"{t['preset']}-{Path(t['out_dir']).name}" + (f"-reset{reset}" if reset else "")
  flags = f" --segment {res['segment']} --reset_every {reset}" if reset else ""
  cmds = [
    prepare_command(res["data_dir"]),
    train_command(rc),
    f"python -m train.eval --by_position{flags} --checkpoint {res['checkpoint']} "
    f"--data_dir {res['data_dir']} --json {path}",
  ]
  recs = [
    {
      "run": run,
      "state_passing": bool(t["state_passing"]),
      "train_len": train_len,
      "position_lo": b["position_lo"],
      "position_hi": b["position_hi"],
      "loss": b["loss"],
      "tokens": b["tokens"],
    }
    for b in res["buckets"]
    if b["tokens"]
  ]
  return cmds, recs


def reach(half_lives, distances) -> list[dict]:
  """What a fixed-decay head keeps of a token `d` tokens back: 2^(-d / T) for half-life T."""
  return [
    {
      "half_life": round(float(t), 2),
      "kept": {str(d): float(f"{2 ** (-d / t):.3g}") for d in distances},
      "reach_1pct": round(float(t) * math.log2(100)),
    }
    for t in half_lives
  ]


def dumps(obj: dict) -> str:
  """JSON with one record per line: the lists stay readable and diffable."""
  lines = []
  for k, v in obj.items():
    if isinstance(v, list) and v and isinstance(v[0], dict):
      lines.append(f" {json.dumps(k)}: [\n" + ",\n".join(f"  {json.dumps(r)}" for r in v) + "\n ]")
    else:
      lines.append(f" {json.dumps(k)}: {json.dumps(v)}")
  return "{\n" + ",\n".join(lines) + "\n}\n"


def markdown(out: dict) -> str:
  """The JSON's tables as docs/EVAL.md shows them: passkey accuracy by distance × context per cell, then
  loss by position per run, side by side."""
  parts = []
  cells = {}
  for r in out["passkey"]:
    cells.setdefault((r["pattern"], r["state_passing"], r["steps"]), []).append(r)
  for (pattern, sp, steps), recs in cells.items():
    ctxs = sorted({r["context"] for r in recs})
    dists = sorted({r["distance"] for r in recs})
    acc = {(r["context"], r["distance"]): r["accuracy"] for r in recs}
    parts.append(
      f"**{pattern}, {'with' if sp else 'without'} state passing, {steps:,} steps** "
      f"(accuracy over {recs[0]['n']} prompts per cell; blank: the distance does not fit)\n"
    )
    parts.append("| distance | " + " | ".join(f"{c:,}" for c in ctxs) + " |")
    parts.append("|---|" + "---:|" * len(ctxs))
    for d in dists:
      parts.append(
        f"| {d:,} | " + " | ".join(f"{acc[c, d]:.0%}" if (c, d) in acc else "" for c in ctxs) + " |"
      )
    parts.append("")
  if out["passkey_training"]:
    steps = sorted({int(k) for r in out["passkey_training"] for k in r["loss_every_1000"]})
    parts.append("| training loss at step | " + " | ".join(f"{k:,}" for k in steps) + " |")
    parts.append("|---|" + "---:|" * len(steps))
    for r in out["passkey_training"]:
      parts.append(
        f"| {r['pattern']}, {'with' if r['state_passing'] else 'without'} state passing | "
        + " | ".join(f"{r['loss_every_1000'].get(str(k), float('nan')):.2f}" for k in steps)
        + " |"
      )
    parts.append("")
  runs = list(dict.fromkeys(r["run"] for r in out["loss_by_position"]))
  if runs:
    loss = {(r["run"], r["position_lo"]): r for r in out["loss_by_position"]}
    los = sorted({r["position_lo"] for r in out["loss_by_position"]})
    parts.append("| positions | " + " | ".join(runs) + " | tokens |")
    parts.append("|---|" + "---:|" * (len(runs) + 1))
    for lo in los:
      row = [loss.get((run, lo)) for run in runs]
      hi = next(r for r in row if r)["position_hi"]
      toks = next(r for r in row if r)["tokens"]
      parts.append(
        f"| [{lo:,}, {hi:,}) | " + " | ".join(f"{r['loss']:.3f}" if r else "" for r in row) + f" | {toks:,} |"
      )
    parts.append("")
  heads = out.get("head_reach", {}).get("heads", [])
  if heads:
    ds = list(heads[0]["kept"])
    parts.append("| head half-life (tokens) | " + " | ".join(f"{int(d):,} back" for d in ds) + " | 1% at |")
    parts.append("|---|" + "---:|" * (len(ds) + 1))
    for h in heads:
      kept = [
        f"{v:.0%}" if v >= 0.01 else f"{v:.1%}" if v >= 0.001 else f"{v:.0e}" if v else "0"
        for v in h["kept"].values()
      ]
      parts.append(f"| {h['half_life']:g} | " + " | ".join(kept) + f" | {h['reach_1pct']:,} |")
    parts.append("")
  return "\n".join(parts)


def main(argv=None) -> int:
  from laplace_jax import cli

  ap = cli.FlagParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--passkey", nargs="*", default=[], help="train.recall output directories")
  ap.add_argument("--by_position", nargs="*", default=[], help="train.eval --by_position --json files")
  ap.add_argument(
    "--cost",
    nargs="*",
    default=[],
    help="files holding `python -m benchmarks state_passing_cost`'s output "
    "(its command on the first line after '$ '), one per run",
  )
  ap.add_argument("--machine", default="2-core CPU (shared), jax 0.10.0", help="where the runs ran")
  ap.add_argument("-o", "--out", default="docs/eval/long-context.json", help="the JSON to write")
  ap.add_argument("--markdown", action="store_true", help="also print the tables for docs/EVAL.md")
  a = ap.parse_args(argv)
  out = {
    "machine": a.machine,
    "passkey_commands": [],
    "passkey": [],
    "passkey_depth": [],
    "passkey_training": [],
    "loss_by_position_commands": [],
    "loss_by_position": [],
  }
  for d in a.passkey:
    cmd, dist, depth, training = passkey_records(Path(d))
    out["passkey_commands"].append(cmd)
    out["passkey"] += dist
    out["passkey_depth"] += depth
    out["passkey_training"] += training
  for p in a.by_position:
    cmds, recs = by_position_records(Path(p))
    out["loss_by_position_commands"] += [c for c in cmds if c not in out["loss_by_position_commands"]]
    out["loss_by_position"] += recs
  out["state_passing_cost_commands"], out["state_passing_cost"] = [], []
  for f in a.cost:
    text = Path(f).read_text()
    m = re.search(r"plain ([\d.]+) ms, state passing ([\d.]+) ms, ratio ([\d.]+)", text)
    if not m:
      raise SystemExit(f"--cost {f}: no 'plain … ms, state passing … ms, ratio …' line in it")
    cmd = text.splitlines()[0].removeprefix("$ ").strip()
    if cmd not in out["state_passing_cost_commands"]:
      out["state_passing_cost_commands"].append(cmd)
    out["state_passing_cost"].append(
      {"plain_ms": float(m[1]), "state_passing_ms": float(m[2]), "ratio": float(m[3])}
    )
  from laplace_jax.model.config import decay_half_lives, get_config

  out["head_reach"] = {
    "note": "share of a token d tokens back that a fixed-decay head keeps, 2^(-d/T); "
    "reach_1pct: the distance where it falls to 1% (T·log2 100)",
    "heads": reach(decay_half_lives(get_config("tiny")), (64, 256, 1024, 4096, 16384, 65536)),
  }
  Path(a.out).write_text(dumps(out))
  print(
    f"wrote {a.out}: {len(out['passkey'])} passkey records, {len(out['loss_by_position'])} by-position records"
  )
  if a.markdown:
    print(markdown(out))
  return 0


if __name__ == "__main__":
  sys.exit(main())
