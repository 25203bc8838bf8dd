#!/usr/bin/env bash
# Build the unit and property tests with AddressSanitizer and UBSan and run
# them (CI runs this after scripts/test.sh): heap overflows, use after free,
# leaks and undefined behaviour fail the run. The preset (CMakePresets.json)
# compiles at -Og, the level meant for debugging (252 s instead of 355 s at -O0,
# the same tests passing; 2 cores, 2026-12-01), and keeps the instrumentation
# that finds memory errors and arithmetic UB cheap to compile: ASan's checks
# are calls rather than inline code, and UBSan leaves out `alignment`, `null`,
# `vptr` and `object-size` (a misaligned scalar read is harmless on x86 and an
# aligned vector load from a misaligned address faults; a null dereference
# faults too, and ASan reports either with its stack; lina's headers declare no
# virtual function; object-size repeats ASan's bounds). Measured on one file
# (tests/test_cpu.cpp, -Og, 2026-12-03): 46 s plain, 148 s with both sanitizers
# in full, 84 s as here (inline ASan checks cost 28 s of the difference, the
# alignment check 21 s); the whole build 458 s of CPU against 700 s in the
# previous CI run on this machine, and the tests run in 75 s.
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
# (two binaries: the kernels' properties and the plans', tests/CMakeLists.txt)
run() {
  local status=0
  for t in ./build/sanitize/tests/lina_tests ./build/sanitize/tests/lina_plan_tests; do "$t" "$@" || status=1; done
  return $status
}
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
