// This machine's measured peak, for benchmarks to report fractions of it:
// FMA throughput (independent accumulators, so the loop is bound by the FMA
// ports, not by latency) in float or double, and memory bandwidth (STREAM
// triad, a[i] = b[i] + s c[i], arrays far larger than the caches). Both run
// on every OpenMP thread.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <vector>

namespace bench {

using clock_type = std::chrono::steady_clock;

// Best time of `reps` runs of f, in seconds (at least one run; no new run
// starts after ~2 s of repeats).
template <class F>
double best_seconds(F&& f, int reps) {
  double best = 1e30, spent = 0;
  for (int r = 0; r < reps && (r == 0 || spent < 2.0); ++r) {
    auto t0 = clock_type::now();
    f();
    double s = std::chrono::duration<double>(clock_type::now() - t0).count();
    best = std::min(best, s);
    spent += s;
  }
  return best;
}

// The widest vector the build targets, in bytes.
#if defined(__AVX512F__)
inline constexpr int vector_bytes = 64;
#elif defined(__AVX__)
inline constexpr int vector_bytes = 32;
#else
inline constexpr int vector_bytes = 16;
#endif

// Ten vectors of independent accumulators: enough to cover FMA latency x ports
// (4-5 cycles x 2 ports on current x86) and, with the two operands, within 16
// registers. (A fixed 128 lanes is 32 AVX2 vectors of doubles: they lived in
// memory and the probe read a quarter of the fp64 peak. An array of scalars
// under `omp simd` stayed in registers at -O3 only: at -O2 the probe read 40%
// of the peak, so the accumulators are vectors, their loop unrolled by pragma.)
template <class T = float>
double fma_gflops() {
  typedef T vec __attribute__((vector_size(vector_bytes)));
  constexpr int vectors = 10, lanes = vectors * vector_bytes / static_cast<int>(sizeof(T));
  long iters = 20'000'000;
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    double total_flops = 0;
    auto t0 = clock_type::now();
#pragma omp parallel reduction(+ : total_flops)
    {
      vec acc[vectors];
      for (int v = 0; v < vectors; ++v)
        for (int l = 0; l < lanes / vectors; ++l) acc[v][l] = T(1) + static_cast<T>(v * lanes / vectors + l) * T(1e-3);
      vec const a = T(0.999999) - vec{}, b = T(1e-7) - vec{};
      for (long it = 0; it < iters; ++it) {
#pragma GCC unroll 10
        for (int v = 0; v < vectors; ++v) acc[v] = acc[v] * a + b;
      }
      T sink = 0;
      for (int v = 0; v < vectors; ++v)
        for (int l = 0; l < lanes / vectors; ++l) sink += acc[v][l];
      if (sink == T(12345)) std::abort();
      total_flops += 2.0 * lanes * static_cast<double>(iters);
    }
    double s = std::chrono::duration<double>(clock_type::now() - t0).count();
    best = std::max(best, total_flops / s / 1e9);
  }
  return best;
}

inline double triad_gbytes() {
  std::size_t n = std::size_t(1) << 25;  // 3 arrays x 128 MiB
  std::vector<float> a(n, 0.f), b(n, 1.f), c(n, 2.f);
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) {
    auto t0 = clock_type::now();
#pragma omp parallel for simd schedule(static)
    for (std::size_t i = 0; i < n; ++i) a[i] = b[i] + 0.5f * c[i];
    double s = std::chrono::duration<double>(clock_type::now() - t0).count();
    best = std::max(best, 3.0 * sizeof(float) * static_cast<double>(n) / s / 1e9);
  }
  if (a[n / 2] != 2.f) std::abort();
  return best;
}

}  // namespace bench
