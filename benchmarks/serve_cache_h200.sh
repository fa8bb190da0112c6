#!/usr/bin/env bash
# The state-cache benchmarks for one H200 — NOT YET RUN on one (docs/BENCHMARKS.md says so).
# The decode goal is stated at the largest slot count: copying finished states out must leave laplace-3b's
# engine within 5% of its cache-off tokens/s at 1,280 slots. Writes to ${OUT:-.}.
set -o pipefail
OUT=${OUT:-.}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 PYTHONPATH=$PWD
export JAX_COMPILATION_CACHE_DIR=/tmp/jax-cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
timeout 400 python3 -m benchmarks serve_bench --sections cache_overhead --cache-preset laplace-3b --overhead-slots 1280 \
  --json "$OUT/h200_cache_overhead.json" 2>&1 | tee "$OUT/h200_cache_overhead.txt"
timeout 400 python3 -m benchmarks serve_bench --sections agent --cache-preset small --agent-conversations 64 \
  --agent-turns 20 --json "$OUT/h200_agent.json" 2>&1 | tee "$OUT/h200_agent.txt"
