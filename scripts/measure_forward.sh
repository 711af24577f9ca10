#!/usr/bin/env bash
# The figures of docs/performance.md in one run, on the default model (bf16) behind
# `tokenstream serve` on ports 1800x:
#   1. the engine in-process: HF generate, our engine on the Hugging Face forward and on ours;
#   2. single requests at concurrency 1 and 16 (closed loop: a new request as each one ends), over
#      gRPC, with --forward compact and with --forward hf (and, with CHUNKS="64 128 ...", the
#      compact forward at each prefill chunk size);
#   3. 10-turn conversations with the prefix cache on and off, and their per-turn comparison.
# Writes everything under bench-results/forward/. About 40 minutes on a 2-core CPU.
# Usage: scripts/measure_forward.sh [engine] [single] [multi]   (default: all three)
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=bench-results/forward
mkdir -p $OUT
PARTS=${*:-engine single multi}
CHUNKS=${CHUNKS:-}
TS=.venv/bin/tokenstream
PORTS="--http-port 18000 --grpc-port 18001 --metrics-port 18002 --supervisor-port 18003 --no-bridge"
TARGET="--triton 127.0.0.1:18001 --url http://127.0.0.1:18000 --no-progress --no-plot"
WORKLOAD="--output-tokens 64 --temperature 0 --warmup 2"

served() {  # served NAME "SERVE OPTIONS" COMMAND...: the commands against a fresh serve
    local name=$1 options=$2 runs=() line
    shift 2
    for line in "$@"; do runs+=(--run "$line"); done
    .venv/bin/python scripts/served.py --server "$TS serve $PORTS $options" \
        --ready http://127.0.0.1:18003/ready --timeout 600 --stop-signal INT \
        --log $OUT/serve-$name.log "${runs[@]}"
    [ $? -eq 2 ] && { echo "serve $name was not ready: see $OUT/serve-$name.log" >&2; exit 1; }
    return 0
}

for part in $PARTS; do
    case $part in
    engine)
        $TS engine-bench --dtype bfloat16 --forward compact,hf --concurrency 1,16 \
            --output-tokens 64 --temperature 0 --baseline-requests 6 --rounds 2 \
            --out $OUT/engine.json > $OUT/engine.txt 2>&1
        ;;
    single)
        for forward in compact hf; do
            served $forward "--forward $forward --models chat" \
                "$TS bench $TARGET $WORKLOAD --concurrency 1 --requests 8 --out $OUT/$forward-c1 > $OUT/$forward-c1.txt 2>&1" \
                "$TS bench $TARGET $WORKLOAD --concurrency 16 --requests 48 --out $OUT/$forward-c16 > $OUT/$forward-c16.txt 2>&1"
        done
        for chunk in $CHUNKS; do
            served chunk$chunk "--forward compact --models chat --prefill-chunk-tokens $chunk" \
                "$TS bench $TARGET $WORKLOAD --concurrency 16 --requests 48 --out $OUT/chunk$chunk-c16 > $OUT/chunk$chunk-c16.txt 2>&1"
        done
        ;;
    multi)
        for cache in off on; do
            served cache-$cache "--models chat --prefix-cache $cache" \
                "$TS bench $TARGET --multi-turn 10 --conversations 4 --concurrency 4 --max-tokens 64 --temperature 0 --warmup 0 --out $OUT/multi-$cache > $OUT/multi-$cache.txt 2>&1"
        done
        $TS bench --compare $OUT/multi-off/bench.json $OUT/multi-on/bench.json \
            > $OUT/multi-compare.txt 2>&1
        ;;
    esac
done
echo DONE
