#!/usr/bin/env bash
# The decode benchmarks on one H200 (docs/BENCHMARKS.md, "Prepared, not run"): NOT RUN YET (no GPU was lent
# when it was written). Writes to ${OUT:-.}. About 8 minutes.
set -o pipefail
OUT=${OUT:-.}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 PYTHONPATH=$PWD
export JAX_COMPILATION_CACHE_DIR=/tmp/jax-cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
# 1. The Pallas kernel against the XLA step and the memory floor, one laplace-3b layer at 1,280 slots
#    (each implementation is first checked against recurrent_simple_gla_step; a kernel that does not
#    compile falls back to XLA with a log line, which this output shows).
timeout 150 python3 -m benchmarks gla_decode_speed --preset laplace-3b --slots 1280 --layers 2 \
  --impls xla,pallas --steps 10 --rounds 3 2>&1 | tee "$OUT/h200_gla_decode.txt"
# 2. Bytes the compiled decode step moves on the GPU (the same counter as on the CPU).
timeout 120 python3 -m benchmarks decode_bytes --preset laplace-3b --slots 1280 \
  --json "$OUT/h200_decode_bytes.json" 2>&1 | tee "$OUT/h200_decode_bytes.txt"
# 3. Engine tokens/s against the bare decode step and the state read+write floor (goal: >= 45,000 at 1,280).
timeout 330 python3 -m benchmarks serve_bench --sections overhead --throughput-preset laplace-3b \
  --concurrency 64,256,1280 --prompt-tokens 16 --steps 10 --overhead-rounds 3 \
  --json "$OUT/h200_overhead.json" 2>&1 | tee "$OUT/h200_overhead.txt"
