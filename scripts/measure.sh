#!/usr/bin/env bash
# The figures of a release note in one run: the default model behind `tokenstream serve`, measured
# over grpc, sse and ws at concurrency 1, 4 and 16, the shutdown time, then the engine in-process
# against HF generate. Writes everything under bench-results/. About 10 minutes on a 2-core CPU.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=bench-results
mkdir -p $OUT
TS=.venv/bin/tokenstream
COMMON="--triton 127.0.0.1:18001 --url http://127.0.0.1:18000 --bridge ws://127.0.0.1:18080/ws --output-tokens 64 --warmup 2 --no-progress"
# the server started, waited for and stopped by scripts/served.py (SIGINT, as Ctrl-C would)
.venv/bin/python scripts/served.py --log $OUT/serve.log --timeout 300 --stop-signal INT \
    --server "$TS serve --http-port 18000 --grpc-port 18001 --metrics-port 18002 --bridge-port 18080" \
    --ready http://127.0.0.1:18000/v2/health/ready --ready http://127.0.0.1:18080/healthz \
    --run "$TS bench --transport grpc,sse,ws --concurrency 1 --requests 8 $COMMON --out $OUT/serve-c1 > $OUT/serve-c1.txt 2>&1" \
    --run "$TS bench --transport grpc,sse,ws --concurrency 4,16 --requests 32 $COMMON --out $OUT/serve-c4-16 > $OUT/serve-c4-16.txt 2>&1" \
    > $OUT/served.txt
[ $? -eq 2 ] && { echo "tokenstream serve was not ready: see $OUT/serve.log" >&2; exit 1; }
{
    grep "stopped in" $OUT/served.txt | sed 's/^served:/serve/'
    echo "shm files left: $(ls /dev/shm | grep -c -E 'tokenstream|triton_python')"
    echo "stub processes left: $(pgrep -fc 'triton_python_backend_stub.*tokenstream-repo')"
} > $OUT/stop.txt
.venv/bin/python -m clients.bench.engine --dtype bfloat16 --concurrency 1,4,16 --output-tokens 64 --baseline-requests 6 --rounds 2 --out $OUT/engine-bf16.json > $OUT/engine-bf16.txt 2>&1
echo DONE
