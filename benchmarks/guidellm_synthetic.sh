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

engine-run serve "$ENGINE" --port "$PORT" "$@" > "$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill -TERM $SERVER 2> /dev/null && wait $SERVER 2> /dev/null || true' EXIT

healthy() { python3 -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)" "$URL/health" 2> /dev/null; }
until healthy; do
    if ! kill -0 $SERVER 2> /dev/null; then
        echo "guidellm_synthetic: engine-run serve exited:" >&2
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

echo "server: requests answered with an HTTP error, by status (none if empty):"
python3 -c "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1]).read().decode())" "$URL/metrics" |
    grep '^kiln_http_errors_total' || true
