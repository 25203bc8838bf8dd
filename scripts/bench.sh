#!/usr/bin/env bash
# Build and run the CPU benchmark suite (bench/suite.cpp): prints the tables
# of docs/benchmarks.md (every rate against the FMA peak and triad bandwidth
# measured in the same run), writes CSVs to build/release/bench-results/, and
# draws docs/img/orders.png (time against N, both orders) and
# docs/img/gflops.png (GFLOP/s against N) with gnuplot. Arguments go to the
# suite (e.g. --quick).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
if ! command -v gnuplot >/dev/null; then
  if [ "$(id -u)" -eq 0 ]; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends gnuplot-nox >/dev/null ||
      { apt-get update >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends gnuplot-nox >/dev/null; }
  else
    echo "bench.sh: gnuplot is missing (apt-get install gnuplot-nox); the plots are skipped" >&2
  fi
fi
cmake --preset release >/dev/null
cmake --build --preset release --target suite
out=build/release/bench-results
mkdir -p "$out" docs/img
./build/release/bench/suite --csv "$out/suite.csv" --orders-csv "$out/orders.csv" "$@"
command -v gnuplot >/dev/null || exit 0
gnuplot <<GP
set datafile separator ","
set terminal pngcairo size 900,560 noenhanced
set logscale xy 2
set grid
set key top left
set xlabel "N (tokens)"
set output "docs/img/orders.png"
set title "causal elu+1 forward, float, B·H = 8, D = M = 64: time against N"
set ylabel "ms"
plot "$out/orders.csv" skip 1 using 1:2 with linespoints title "quadratic order", \
     "$out/orders.csv" skip 1 using 1:3 with linespoints title "linear order"
set output "docs/img/gflops.png"
set title "linear order, float, B·H = 8: GFLOP/s against N"
set ylabel "GFLOP/s"
unset logscale y
plot for [d in "32 64 128"] "< awk -F, '\$1==\"elu+1\" && \$2==\"causal\" && \$3==\"fwd\" && \$4==\"float\" && \$5==8 && \$7==" . d . "' $out/suite.csv" \
       using 6:11 with linespoints title "causal fwd D=M=" . d, \
     for [d in "32 64 128"] "< awk -F, '\$1==\"elu+1\" && \$2==\"causal\" && \$3==\"bwd\" && \$4==\"float\" && \$5==8 && \$7==" . d . "' $out/suite.csv" \
       using 6:11 with linespoints dashtype 2 title "causal bwd D=M=" . d
GP
echo "plots: docs/img/orders.png docs/img/gflops.png"
