"""Held-out loss of `tiny` trained on packed rows with documents apart (segment ids) and without (each row one
stream), at the same tokens, seed and data order; each scored with train.eval per document (segment ids: every
document as if alone in its window) and as one stream, split by a document's order in its window.

    python -m benchmarks packed_documents [--steps 100] [--seq_len 256] [--global_batch 16] [--out DIR]

Prepares the embedded corpus into DIR/kjv if missing; trains DIR/apart and DIR/stream (resuming finished runs);
prints one JSON line per (trained, scored) pair and a markdown table. One CPU device.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from train import prepare
from train.eval import evaluate
from train.loop import run
from train.run_config import load_config


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--steps", type=int, default=100)
  ap.add_argument("--seq_len", type=int, default=256)
  ap.add_argument("--global_batch", type=int, default=16)
  ap.add_argument("--out", default="runs/packed_documents")
  a = ap.parse_args(argv)
  out = Path(a.out)
  data_dir = out / "kjv"
  if not (data_dir / "manifest.json").exists():
    prepare.main(["--corpus", "kjv", "-o", str(data_dir), "--no-progress"])
  common = [
    "--preset", "tiny", "--data_dir", str(data_dir), "--steps", str(a.steps), "--seq_len", str(a.seq_len),
    "--global_batch", str(a.global_batch), "--mesh_data", "1", "--mesh_fsdp", "1", "--eval_batches", "0",
    "--save_every", str(a.steps), "--no-progress",
  ]  # fmt: skip
  rows = []
  for name, flag in (("apart", "--segment_ids"), ("stream", "--no_segment_ids")):
    summary = run(load_config([*common, flag, "--out_dir", str(out / name)]))
    for scored in (True, False):
      res = evaluate(summary["export"], data_dir, seq_len=a.seq_len, global_batch=8, segment_ids=scored)
      row = {"trained": name, "scored_apart": scored, "train_tokens_per_s": summary.get("tokens_per_s")}
      row |= {k: res[k] for k in ("loss", "loss_first_document", "loss_later_documents", "tokens")}
      row["tokens_later_documents"] = res["tokens_later_documents"]
      print(json.dumps(row), flush=True)
      rows.append(row)
  print("| trained | scored | held-out loss | first document of a window | later documents |")
  print("|---|---|---|---|---|")
  for r in rows:
    scored = "apart" if r["scored_apart"] else "one stream"
    print(
      f"| {r['trained']} | {scored} | {r['loss']:.4f} | {r['loss_first_document']:.4f} | "
      f"{r['loss_later_documents']:.4f} |"
    )


if __name__ == "__main__":
  main()
