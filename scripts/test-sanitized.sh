#!/usr/bin/env bash
# Build the kernels' unit and property tests (lina_tests) with AddressSanitizer
# and UBSan and run them (CI runs this after scripts/test.sh): heap overflows,
# use after free, leaks and undefined behaviour fail the run. The plan tests
# (lina_plan_tests) are already built with AddressSanitizer by scripts/test.sh,
# at -Og like here: one build of them, not two (LINA_SANITIZE_ADDRESS,
# tests/CMakeLists.txt, has the flags and why). The preset (CMakePresets.json)
# compiles at -Og, the level meant for debugging (252 s instead of 355 s at
# -O0, the same tests passing; 2 cores, 2026-12-01).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
cmake --preset sanitize >/dev/null
cmake --build --preset sanitize
export OMP_WAIT_POLICY=PASSIVE UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
# The both-orders properties draw a third of their random shapes here (the first
# ones: tests/support.hpp, test::trials): the same code paths unoptimised under ASan,
# where their quadratic oracles took 180 of the run's 276 CPU-seconds.
export LINA_TEST_TRIALS_DIVISOR=3
run() { ./build/sanitize/tests/lina_tests "$@"; }
if [ $# -gt 0 ]; then run "$@"; exit; fi

# The instrumented tests run on one core each, so two halves run side by side:
# the <double> instances of the typed tests, and everything else (the two take
# about as long: 2 × ~2 min instead of ~4.5 min in a row on a 2-core machine).
logs=$(mktemp -d)
run -tc='*<double>*' >"$logs/double.log" 2>&1 & double=$!
run -tce='*<double>*' >"$logs/rest.log" 2>&1 & rest=$!
status=0
wait "$double" || status=1
wait "$rest" || status=1
for half in double rest; do echo "== sanitized tests: $half"; cat "$logs/$half.log"; done
rm -rf "$logs"
exit $status
