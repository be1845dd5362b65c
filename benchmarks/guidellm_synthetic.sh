#!/usr/bin/env bash
# guidellm's synthetic benchmark, unmodified, against `engine-run serve`: fixed prompt and output
# lengths at a few concurrency levels; prints guidellm's summary tables, then the server's error count.
#
#   benchmarks/guidellm_synthetic.sh [ENGINE_DIR] [engine-run serve options...]
#
# ENGINE_DIR defaults to engines/smollm2-135m. Settings come from the environment:
#   STREAMS=1,4,8          concurrency levels (one guidellm benchmark each)
#   PROMPT_TOKENS=128      OUTPUT_TOKENS=64
#   MAX_SECONDS=30         MAX_REQUESTS=64     per level, whichever comes first
#   ENDPOINT=/v1/chat/completions              or /v1/completions
#   PORT=8011  OUT=<new temporary directory>   (server.log, benchmarks.json)
#   GUIDELLM=/tmp/venv-guidellm/bin/guidellm if it exists, else guidellm on PATH
#   SERVER=kiln            or vllm: the same load against vLLM's CPU build serving the same weights (SmolLM2 as
#                          float32 safetensors, converted once by benchmarks/bench_serving.py's hf_directory),
#                          VLLM_PYTHON=/tmp/venv-vllm/bin/python, THREADS=<this process's CPUs>
#
# guidellm is a benchmark tool, not a dependency of Kiln: install it in a virtual environment of its own,
#   python -m venv /tmp/venv-guidellm && /tmp/venv-guidellm/bin/pip install guidellm   # 0.8.1 was used
# It counts synthetic prompt tokens with the engine's own tokenizer (ENGINE_DIR), so nothing is
# downloaded, and sends "ignore_eos": true, so every request generates OUTPUT_TOKENS tokens.

set -euo pipefail

ENGINE=${1:-engines/smollm2-135m}
shift || true
STREAMS=${STREAMS:-1,4,8}
PROMPT_TOKENS=${PROMPT_TOKENS:-128}
OUTPUT_TOKENS=${OUTPUT_TOKENS:-64}
MAX_SECONDS=${MAX_SECONDS:-30}
MAX_REQUESTS=${MAX_REQUESTS:-64}
ENDPOINT=${ENDPOINT:-/v1/chat/completions}
PORT=${PORT:-8011}
OUT=${OUT:-$(mktemp -d -t kiln-guidellm.XXXXXX)}
if [[ -z ${GUIDELLM:-} ]]; then
    if [[ -x /tmp/venv-guidellm/bin/guidellm ]]; then GUIDELLM=/tmp/venv-guidellm/bin/guidellm; else GUIDELLM=guidellm; fi
fi
URL=http://127.0.0.1:$PORT

if [[ ! -f $ENGINE/manifest.json ]]; then
    echo "guidellm_synthetic: $ENGINE is not an engine directory (build one with engine-build build)" >&2
    exit 2
fi
if ! command -v "$GUIDELLM" > /dev/null; then
    echo "guidellm_synthetic: $GUIDELLM not found; install guidellm as this script's header says, or set GUIDELLM" >&2
    exit 2
fi
mkdir -p "$OUT"
echo "guidellm $("$GUIDELLM" --version | sed 's/.*version: //'), engine $ENGINE, output in $OUT" >&2

SERVER=${SERVER:-kiln}
if [[ $SERVER == vllm ]]; then
    VLLM_PYTHON=${VLLM_PYTHON:-/tmp/venv-vllm/bin/python}
    THREADS=${THREADS:-$(python3 -c "import os; print(len(os.sched_getaffinity(0)))")}
    if [[ ! -x $VLLM_PYTHON ]]; then
        echo "guidellm_synthetic: no vLLM at $VLLM_PYTHON (benchmarks/bench_serving.py's header says how to install it)" >&2
        exit 2
    fi
    HF_DIR=$(cd "$(dirname "$0")" && python3 -c "import sys; from pathlib import Path; import bench_serving as b; \
print(b.hf_directory(b.smollm2_gguf(), Path(sys.argv[1])))" "${TMPDIR:-/tmp}/kiln-bench-smollm2-135m-hf")
    MODEL=$(python3 -c "import json, sys; print(json.load(open(sys.argv[1]))['model']['name'])" "$ENGINE/manifest.json")
    VLLM_CPU_OMP_THREADS_BIND=0-$((THREADS - 1)) VLLM_CPU_KVCACHE_SPACE=4 "$VLLM_PYTHON" -m vllm.entrypoints.openai.api_server \
        --model "$HF_DIR" --served-model-name "$MODEL" --host 127.0.0.1 --port "$PORT" --dtype float32 \
        --max-model-len 2048 > "$OUT/server.log" 2>&1 &
    READY=$URL/v1/models
else
    engine-run serve "$ENGINE" --port "$PORT" "$@" > "$OUT/server.log" 2>&1 &
    READY=$URL/health
fi
PID=$!
trap 'kill -TERM $PID 2> /dev/null && wait $PID 2> /dev/null || true' EXIT

healthy() { python3 -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)" "$READY" 2> /dev/null; }
until healthy; do
    if ! kill -0 $PID 2> /dev/null; then
        echo "guidellm_synthetic: the $SERVER server exited:" >&2
        cat "$OUT/server.log" >&2
        exit 1
    fi
    sleep 0.5
done

"$GUIDELLM" run \
    --backend "kind=openai_http,target=$URL,request_format=$ENDPOINT" \
    --tokenizer "kind=huggingface_auto,model=$ENGINE" \
    --data "kind=synthetic_text,prompt_tokens=$PROMPT_TOKENS,output_tokens=$OUTPUT_TOKENS" \
    --profile kind=concurrent,streams=1 --override profile.streams "$STREAMS" \
    --constraint "kind=max_duration,seconds=$MAX_SECONDS" --constraint "kind=max_requests,count=$MAX_REQUESTS" \
    --output "kind=json,path=$OUT/benchmarks.json" \
    --disable-progress

[[ $SERVER == kiln ]] || exit 0
echo "server: requests answered with an HTTP error, by status (none if empty):"
python3 -c "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1]).read().decode())" "$URL/metrics" |
    grep '^kiln_http_errors_total' || true
