#!/usr/bin/env bash
# The serving benchmark as run on one H200 (docs/BENCHMARKS.md, "Serving"). Writes to ${OUT:-.}.
set -o pipefail
OUT=${OUT:-.}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 PYTHONPATH=$PWD
export JAX_COMPILATION_CACHE_DIR=/tmp/jax-cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
# The decode-step FLOP/s goal is stated on the small preset (fp32 compute).
timeout 150 python3 -m benchmarks serve_bench --sections flops --preset small --flops-slots 1280 --steps 10 \
  --matmul-size 8192 --json "$OUT/h200_small.json" 2>&1 | tee "$OUT/h200_small.txt"
# laplace-3b end to end: 1,280 slots as published, its baseline, contexts to 64K.
timeout 420 python3 -m benchmarks serve_bench --preset laplace-3b --throughput-preset laplace-3b \
  --concurrency 1,64,1280 --prompt-tokens 128 --steps 10 --contexts 1024,8192,65536 \
  --max-real-prefill 8192 --context-steps 20 --baseline-mem-gb 60 --matmul-size 8192 \
  --json "$OUT/h200_3b.json" 2>&1 | tee "$OUT/h200_3b.txt"
