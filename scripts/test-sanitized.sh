#!/usr/bin/env bash
# Build the unit and property tests with AddressSanitizer and UBSan and run
# them (CI runs this after scripts/test.sh): heap overflows, use after free,
# leaks and undefined behaviour fail the run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
cmake --preset sanitize >/dev/null
cmake --build --preset sanitize
export OMP_WAIT_POLICY=PASSIVE UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
./build/sanitize/tests/lina_tests "$@"
