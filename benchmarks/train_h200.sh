#!/usr/bin/env bash
# Training at scale on one H200 (docs/BENCHMARKS.md "Prepared, not run"): laplace-3b's full train
# step (bf16 compute, fp32 master weights and optimizer state, remat per layer, 524,288 tokens per step as
# 16 micro-batches of 16 × 2,048), `small` with fp32 and bf16 Newton–Schulz, the long-context step, and a
# profile of a few steps. Prepared and not yet run: no GPU was lent when it was written. Logs go to ${OUT:-.}.
set -o pipefail
OUT=${OUT:-.}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 PYTHONPATH=$PWD
python3 -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, jax.devices())"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
# laplace-3b: goal >= 40% MFU (~22k tokens/s). 256 sequences per step as 16 micro-batches of 16.
timeout 420 python3 -m benchmarks train_throughput --preset laplace-3b --batch 256 --micro-batches 16 \
  --seq-len 2048 --compute-dtype bfloat16 --matmul-size 8192 --steps 3 --muon-ns-dtype bfloat16 \
  2>&1 | tee "$OUT/train_3b_bf16ns.txt"
# small: goal >= 45% MFU; Muon's time share <= 1.25x its FLOP share with bf16 Newton-Schulz.
for ns in float32 bfloat16; do
  timeout 150 python3 -m benchmarks train_throughput --preset small --batch 16 --seq-len 2048 \
    --compute-dtype bfloat16 --matmul-size 8192 --steps 5 --muon-ns-dtype $ns 2>&1 | tee "$OUT/train_small_$ns.txt"
done
# Long context, same tokens per step: time and activation memory per token (gla_form auto = parallel here).
timeout 300 python3 -m benchmarks long_context --preset small --compute-dtype bfloat16 \
  --lengths 2048 8192 16384 32768 --tokens-per-step 65536 --steps 3 2>&1 | tee "$OUT/long_context.txt"
# A profile of 3 steps of the training program (TensorBoard / Perfetto), on the embedded corpus.
timeout 300 python3 -m train --preset small --steps 6 --global_batch 16 --seq_len 2048 --profile_steps 3 \
  --model.compute_dtype bfloat16 --eval_batches 0 --no-progress --out_dir "$OUT/profile_run" 2>&1 \
  | tee "$OUT/profile_run.txt"
