// This machine's measured peak (bench/probes.hpp): FMA throughput in fp32 and
// fp64, and memory bandwidth (STREAM triad). Benchmarks report their rates as
// fractions of these numbers.
//
//   peak [--threads T]
#include <fmt/core.h>

#include <cstdlib>
#include <cstring>

#include "probes.hpp"

#ifdef _OPENMP
#include <omp.h>
#endif

int main(int argc, char** argv) {
#ifdef _OPENMP
  if (argc == 3 && !std::strcmp(argv[1], "--threads")) omp_set_num_threads(std::atoi(argv[2]));
  int threads = omp_get_max_threads();
#else
  int threads = 1;
  (void)argc;
  (void)argv;
#endif
  fmt::print("threads {}: fp32 FMA peak {:.1f} GFLOP/s, fp64 {:.1f} GFLOP/s, triad bandwidth {:.1f} GB/s\n", threads,
             bench::fma_gflops<float>(), bench::fma_gflops<double>(), bench::triad_gbytes());
}
