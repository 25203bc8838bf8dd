// This machine's measured peak: fp32 FMA throughput (independent accumulators,
// so the loop is bound by the FMA ports, not by latency) and memory bandwidth
// (STREAM triad, a[i] = b[i] + s c[i], arrays far larger than the caches).
// Benchmarks report their rates as fractions of these two numbers.
//
//   peak [--threads T]
#include <fmt/core.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

using clock_type = std::chrono::steady_clock;

// 16 independent vectors of 8 floats: enough to cover FMA latency x ports.
double fma_gflops() {
  constexpr int lanes = 128;
  long iters = 20'000'000;
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    double total_flops = 0;
    auto t0 = clock_type::now();
#pragma omp parallel reduction(+ : total_flops)
    {
      alignas(64) float acc[lanes];
      for (int i = 0; i < lanes; ++i) acc[i] = 1.0f + static_cast<float>(i) * 1e-3f;
      float const a = 0.999999f, b = 1e-7f;
      for (long it = 0; it < iters; ++it) {
#pragma omp simd
        for (int i = 0; i < lanes; ++i) acc[i] = acc[i] * a + b;
      }
      float sink = 0;
      for (int i = 0; i < lanes; ++i) sink += acc[i];
      if (sink == 12345.f) std::abort();
      total_flops += 2.0 * lanes * static_cast<double>(iters);
    }
    double s = std::chrono::duration<double>(clock_type::now() - t0).count();
    best = std::max(best, total_flops / s / 1e9);
  }
  return best;
}

double triad_gbytes() {
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

}  // namespace

int main(int argc, char** argv) {
#ifdef _OPENMP
  if (argc == 3 && !std::strcmp(argv[1], "--threads")) omp_set_num_threads(std::atoi(argv[2]));
  int threads = omp_get_max_threads();
#else
  int threads = 1;
  (void)argc;
  (void)argv;
#endif
  fmt::print("threads {}: fp32 FMA peak {:.1f} GFLOP/s, triad bandwidth {:.1f} GB/s\n", threads, fma_gflops(),
             triad_gbytes());
}
