#!/usr/bin/env bash
# Kernel and training figures as run on one H200 (docs/BENCHMARKS.md). Writes logs to ${OUT:-.}.
set -o pipefail
OUT=${OUT:-.}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 PYTHONPATH=$PWD
python3 -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, jax.devices())"
timeout 150 python3 -m benchmarks gla_speed --lengths 2048 8192 16384 --token-scan-max 16384 \
  --softmax-max 16384 2>&1 | tee "$OUT/gla_fp32.txt"
timeout 120 python3 -m benchmarks train_throughput --preset small --batch 16 --seq-len 2048 \
  --compute-dtype bfloat16 --matmul-size 8192 --steps 5 2>&1 | tee "$OUT/train_small_bf16.txt"
