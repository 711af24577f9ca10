#!/usr/bin/env bash
# Soak test (not in CI): 30 minutes of mixed streaming load with cancels against its own
# `tokenstream serve`, printing the RSS of tritonserver and its backend stubs every 30 s, the RSS
# growth after a 2-minute warm-up (goal: under 5 %) and every error. Options go to scripts/soak.py:
#   bash scripts/soak.sh                          # the default model, 30 minutes
#   bash scripts/soak.sh --minutes 5 --model DIR  # shorter, another model
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" exec .venv/bin/python scripts/soak.py "$@"
