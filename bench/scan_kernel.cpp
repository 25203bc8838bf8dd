// The CPU backend's scan kernel (kernels::scan_contract) against the
// row-by-row loop it replaced: N = 4096 rows, (da, db) = (C, M + 1) for the
// usual head sizes, float and double, forward and reverse, one thread.
// Rates count 4 N da db flops (the state update and the contraction, a
// multiply-add being 2 flops).
//
//   scan_kernel [--n 4096] [--reps 20] [--da D --db E]   (one size instead of the three)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <lina/cpu/kernels.hpp>
#include <utility>
#include <vector>

using namespace lina::cpu;
using idx = lina::cpu::index;

namespace {

// The row-by-row scan scan_contract used before it was chunked (the baseline):
// per row, a rank-1 update of the state, then a vector-matrix product.
template <class T>
void scan_rows(matrix<T> const& a, matrix<T> const& b, matrix<T>&& c_in, matrix<T>& out, T* state, bool reverse) {
  matrix<T> c = kernels::rows_contiguous(std::move(c_in));
  idx n = b.rows, da = b.cols, db = c.cols;
  for (idx t = 0; t < n; ++t) {
    idx i = reverse ? n - 1 - t : t;
    T const* ci = c.data + i * c.rs;
    for (idx p = 0; p < da; ++p) {
      T bp = b(i, p);
      T* s = state + p * db;
#pragma omp simd
      for (idx q = 0; q < db; ++q) s[q] += bp * ci[q];
    }
    T* o = out.row_mut(i);
    for (idx q = 0; q < db; ++q) o[q] = T(0);
    for (idx p = 0; p < da; ++p) {
      T ap = a(i, p);
      T const* s = state + p * db;
#pragma omp simd
      for (idx q = 0; q < db; ++q) o[q] += ap * s[q];
    }
  }
}

using clock_type = std::chrono::steady_clock;

template <class T, class Scan>
double best_ms(Scan scan, idx n, idx da, idx db, bool reverse, int reps) {
  std::vector<T> a(static_cast<std::size_t>(n * da)), b(a.size()), c(static_cast<std::size_t>(n * db));
  unsigned x = 1;
  auto next = [&] {
    x = x * 1664525u + 1013904223u;
    return static_cast<T>((x >> 8) * 0x1.0p-24 * 0.5);  // [0, 0.5): positive, like φ(Q), φ(K), [V|1]
  };
  for (auto& v : a) v = next();
  for (auto& v : b) v = next();
  for (auto& v : c) v = next();
  std::vector<T> state(static_cast<std::size_t>(da * db));
  matrix<T> out = allocate<T>(n, db);
  auto va = view<T>(a.data(), n, da, da, 1), vb = view<T>(b.data(), n, da, da, 1);
  double best = 1e300;
  for (int r = 0; r < reps; ++r) {
    std::fill(state.begin(), state.end(), T(0));
    auto t0 = clock_type::now();
    scan(va, vb, view<T>(c.data(), n, db, db, 1), out, state.data(), reverse);
    best = std::min(best, std::chrono::duration<double, std::milli>(clock_type::now() - t0).count());
  }
  return best;
}

template <class T>
void row(idx n, idx da, idx db, bool reverse, int reps) {
  auto old_scan = [](auto const& a, auto const& b, matrix<T>&& c, matrix<T>& o, T* s, bool r) {
    scan_rows(a, b, std::move(c), o, s, r);
  };
  auto new_scan = [](auto const& a, auto const& b, matrix<T>&& c, matrix<T>& o, T* s, bool r) {
    kernels::scan_contract(a, b, std::move(c), o, s, r);
  };
  double old_ms = best_ms<T>(old_scan, n, da, db, reverse, reps);
  double new_ms = best_ms<T>(new_scan, n, da, db, reverse, reps);
  double flops = 4.0 * double(n) * double(da) * double(db);
  std::printf("%-6s %-7s %4td %4td | %8.3f %7.1f | %8.3f %7.1f | %5.2fx\n", sizeof(T) == 4 ? "float" : "double",
              reverse ? "reverse" : "forward", da, db, old_ms, flops / old_ms / 1e6, new_ms, flops / new_ms / 1e6,
              old_ms / new_ms);
}

}  // namespace

int main(int argc, char** argv) {
  idx n = 4096;
  int reps = 20;
  idx da = 0, db = 0;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--n")) n = std::atol(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--reps")) reps = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--da")) da = std::atol(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--db")) db = std::atol(argv[i + 1]);
    else {
      std::fprintf(stderr, "usage: scan_kernel [--n 4096] [--reps 20] [--da D --db E]\n");
      return 2;
    }
  }
  std::printf("N = %td, best of %d; chunk = %td rows\n", n, reps, kernels::scan_chunk_rows);
  std::printf("type   dir       da   db |   old ms  GFLOP/s |   new ms  GFLOP/s | speedup\n");
  std::vector<std::pair<idx, idx>> sizes = {{64, 65}, {32, 33}, {128, 129}};
  if (da > 0 && db > 0) sizes = {{da, db}};
  for (bool reverse : {false, true})
    for (auto const& [sa, sb] : sizes) row<float>(n, sa, sb, reverse, reps);
  for (bool reverse : {false, true})
    for (auto const& [sa, sb] : sizes) row<double>(n, sa, sb, reverse, reps);
}
