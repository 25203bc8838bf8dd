#!/usr/bin/env bash
# What a translation unit that uses lina costs to compile: bench/compile_cost.cpp
# at each setting, one compile at a time, with the flags a user's optimised build
# would have (CXX, CXXFLAGS override them). Prints seconds and peak memory
# (docs/dsl.md, "What it costs to compile").
set -euo pipefail
cd "$(dirname "$0")/.."
cxx=${CXX:-g++}
flags=${CXXFLAGS:--O2 -march=native}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
one() {  # one <label> <-D settings...>
  local label=$1
  shift
  /usr/bin/time -f "%e %M" -o "$out/time" "$cxx" -std=gnu++20 $flags -fopenmp -DFMT_SHARED -I include \
    -I backends/cpu/include "$@" -c bench/compile_cost.cpp -o "$out/x.o"
  read -r s kb <"$out/time"
  printf '%-58s %6.1f s %6d MiB\n' "$label" "$s" $((kb / 1024))
}
echo "$cxx $flags ($("$cxx" --version | head -1))"
one "headers and the expression" -DSTAGE=0 -DPLANS=1 -DDOUBLE=0
one "+ compile(e)" -DSTAGE=1 -DPLANS=1 -DDOUBLE=0
one "+ cpu::evaluate, fp32" -DSTAGE=2 -DPLANS=1 -DDOUBLE=0
one "+ cpu::gradient" -DSTAGE=3 -DPLANS=1 -DDOUBLE=0
one "evaluate, order::linear" -DSTAGE=2 -DPLANS=1 -DDOUBLE=0 -DLINEAR=1
one "evaluate + gradient, order::linear" -DSTAGE=3 -DPLANS=1 -DDOUBLE=0 -DLINEAR=1
one "evaluate, fp32 and fp64" -DSTAGE=2 -DPLANS=1 -DDOUBLE=1
one "evaluate, two plans" -DSTAGE=2 -DPLANS=2 -DDOUBLE=0
one "evaluate, three plans" -DSTAGE=2 -DPLANS=3 -DDOUBLE=0
