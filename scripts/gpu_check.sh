#!/usr/bin/env bash
# A GPU check in one command, on a machine with an NVIDIA GPU and the project's .venv
# (scripts/setup.sh). It installs nothing. It runs:
#   1. the compact forward's tests (tests/test_streaming_backend/test_forward/: llama, layers, slots);
#   2. the decode step alone (scripts/forward_bench.py): Hugging Face, the compact forward eager,
#      torch.compile'd and CUDA-graphed, at 1 and 16 streams;
#   3. the engine in-process (`tokenstream engine-bench`): compact vs hf at 1 and 16 streams;
#   4. a short served run: `tokenstream serve` with --compile off, then on, and `tokenstream
#      bench` at concurrency 1 and 16 over gRPC (the server started by scripts/served.py);
# then prints one table. Everything lands under $OUT (default bench-results/gpu-check).
# Exit status: 0 all ran, 1 a step failed (the table says which), 2 no GPU or no .venv (nothing
# run). Ports 1850x; set DTYPE (default auto) or OUT to change those.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-.venv/bin/python}
TS=${TOKENSTREAM:-.venv/bin/tokenstream}
OUT=${OUT:-bench-results/gpu-check}
DTYPE=${DTYPE:-auto}

if [ ! -x "$PY" ] || [ ! -x "$TS" ]; then
    echo "gpu_check: no project environment at $PY (run scripts/setup.sh first); nothing run" >&2
    exit 2
fi
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: no CUDA GPU visible to torch (torch.cuda.is_available() is False):" \
        "this check needs one; nothing run" >&2
    exit 2
fi
mkdir -p "$OUT"
"$PY" -c "import torch; print('GPU:', torch.cuda.get_device_name(0), '| torch', torch.__version__)"
FAILED=""
step() {  # step NAME COMMAND...: run, log to $OUT/NAME.txt, remember a failure
    local name=$1; shift
    echo "== $name: $*"
    if ! "$@" > "$OUT/$name.txt" 2>&1; then
        FAILED="$FAILED $name"
        echo "   FAILED (see $OUT/$name.txt)"
    fi
}

step tests "$PY" -m pytest -q tests/test_streaming_backend/test_forward/test_forward_llama.py \
    tests/test_streaming_backend/test_forward/test_forward_layers.py \
    tests/test_streaming_backend/test_forward/test_forward_slots.py
step forward env PYTHONPATH="$PWD" "$PY" scripts/forward_bench.py --dtype "$DTYPE" \
    --systems hf,eager,compiled,graphs --batch 1,16 --steps 64 --rounds 3 \
    --out "$OUT/forward.json"
step engine "$TS" engine-bench --dtype "$DTYPE" --forward compact,hf --concurrency 1,16 \
    --output-tokens 64 --temperature 0 --baseline-requests 4 --rounds 2 \
    --out "$OUT/engine.json"

PORTS="--http-port 18500 --grpc-port 18501 --metrics-port 18502 --supervisor-port 18503"
TARGET="--triton 127.0.0.1:18501 --url http://127.0.0.1:18500 --no-progress --no-plot"
served() {  # served COMPILE: serve with --compile COMPILE, bench at 1 and 16, stop
    local compile=$1 c runs=()
    for c in 1 16; do
        runs+=(--run "$TS bench $TARGET --output-tokens 64 --temperature 0 --warmup 2 --concurrency $c --requests $((c * 3)) --out $OUT/served-compile-$compile-c$c")
    done
    "$PY" scripts/served.py --ready http://127.0.0.1:18503/ready --timeout 900 --stop-signal INT \
        --server "$TS serve $PORTS --no-bridge --models chat --dtype $DTYPE --compile $compile" \
        --log "$OUT/serve-compile-$compile.log" "${runs[@]}"
}
step served-compile-off served off
step served-compile-on served on

"$PY" scripts/gpu_check_table.py "$OUT" $FAILED
[ -z "$FAILED" ]
