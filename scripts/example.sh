#!/usr/bin/env bash
# Build and run the main example: both orderings of causal and non-causal
# linear attention, timed for N = 256 ... 16384. Arguments go to the example.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
cmake --preset release >/dev/null
cmake --build --preset release --target orderings
./build/release/examples/orderings "$@"
