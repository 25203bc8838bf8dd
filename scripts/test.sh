#!/usr/bin/env bash
# Build everything and run every test (unit and property tests, compile-fail
# tests, header self-containment, the installed-package consumer).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
cmake --preset release >/dev/null
cmake --build --preset release
ctest --preset release
