// One suffix scan for both ∂K and ∂V against the two a backward would run
// otherwise (the kernel alone: kernels::scan_rows with a second output).
//
// The two scans read one running sum, S_i = Σ_{j≥i} φ(q_j) t_jᵀ (C x M+1):
// ∂V's rows are φ(k_i)ᵀ S_i (a contraction over S's rows, the scan kernel's
// natural form) and ∂φ(K)'s rows are S_i [v_i|1] (over its columns), which
// otherwise come from a second scan over the transposed sum. One scan updates
// S once and produces both: per state element and row 3 multiply-adds instead
// of 4, but the second contraction runs along the SIMD lanes, so each row's
// sums of a register tile go through a transposing reduction
// (simd::add_lane_sums).
//
//   combined_scan [--n 4096] [--c 64] [--m 65] [--reps 20]   (float and double, one thread)
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <lina/cpu/kernels.hpp>
#include <vector>

using namespace lina::cpu;
using idx = lina::cpu::index;

namespace {

template <class T>
void compare(idx n, idx da, idx db, int reps) {
  auto sz = [](idx r, idx cl) { return static_cast<std::size_t>(r * cl); };
  std::vector<T> a(sz(n, db)), b(sz(n, da)), c(sz(n, db)), x(sz(n, da));
  unsigned r = 1;
  for (auto* v : {&a, &b, &c, &x})
    for (auto& e : *v) {
      r = r * 1664525u + 1013904223u;
      e = static_cast<T>((r >> 8) * 0x1.0p-24 - 0.5);
    }
  auto mk = [](std::vector<T>& v, idx rows, idx cols) { return view<T>(v.data(), rows, cols, cols, 1); };
  // the state S = Σ b cᵀ (da x db); output 1 = S x (da), output 2 = aᵀ S (db)
  std::vector<T> o1_two(sz(n, da)), o2_two(sz(n, db)), o1(sz(n, da)), o2(sz(n, db));
  matrix<T> ma = mk(a, n, db), mb = mk(b, n, da), mc = mk(c, n, db), mx = mk(x, n, da);
  matrix<T> out1 = mk(o1, n, da), out2 = mk(o2, n, db), ref1 = mk(o1_two, n, da), ref2 = mk(o2_two, n, db);
  using rows = kernels::matrix_rows<T>;
  using sink = kernels::matrix_sink<T>;
  rows ar{ma}, br{mb}, cr{mc}, xr{mx};
  sink s1{out1}, s2{out2};
  kernels::second<rows, sink> sec{ar, s1};
  std::vector<T> scratch(std::max(kernels::scan_scratch_size<T>(n, xr, br, cr, s2, sec),
                                  std::max(kernels::scan_scratch_size(mb, mc), kernels::scan_scratch_size(mc, mb))));
  using clock = std::chrono::steady_clock;
  double two = 1e300, one = 1e300;
  for (int rep = 0; rep < reps; ++rep) {
    std::vector<T> st1(sz(da, db)), st2(sz(db, da)), st(sz(da, db));
    auto t0 = clock::now();
    kernels::scan_contract(ma, mc, mb, ref1, st2.data(), true, scratch.data());  // ∂K's scan: Sᵀ = Σ c bᵀ
    kernels::scan_contract(mx, mb, mc, ref2, st1.data(), true, scratch.data());  // ∂V's scan: S = Σ b cᵀ
    auto t1 = clock::now();
    // the dual scan: x's rows contract S over its rows (output 2), a's over its columns (output 1)
    kernels::scan_rows(xr, br, cr, s2, 0, n, st.data(), true, scratch.data(), sec);
    auto t2 = clock::now();
    two = std::min(two, std::chrono::duration<double, std::milli>(t1 - t0).count());
    one = std::min(one, std::chrono::duration<double, std::milli>(t2 - t1).count());
  }
  double diff = 0, scale = 0;
  for (std::size_t i = 0; i < o1.size(); ++i)
    diff = std::max(diff, double(std::abs(o1[i] - o1_two[i]))), scale = std::max(scale, double(std::abs(o1_two[i])));
  for (std::size_t i = 0; i < o2.size(); ++i)
    diff = std::max(diff, double(std::abs(o2[i] - o2_two[i]))), scale = std::max(scale, double(std::abs(o2_two[i])));
  std::printf("%-6s N = %td, C = %td, M+1 = %td: two suffix scans %8.3f ms, one dual scan %8.3f ms: %.2fx "
              "(largest difference %.1e of the largest output)\n",
              sizeof(T) == 4 ? "float" : "double", n, da, db, two, one, two / one, diff / scale);
}

}  // namespace

int main(int argc, char** argv) {
  idx n = 4096, da = 0, db = 0;
  int reps = 20;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--n")) n = std::atol(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--c")) da = std::atol(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--m")) db = std::atol(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--reps")) reps = std::atoi(argv[i + 1]);
    else {
      std::fprintf(stderr, "usage: combined_scan [--n 4096] [--c 64] [--m 65] [--reps 20]\n");
      return 2;
    }
  }
  std::vector<std::pair<idx, idx>> sizes = {{32, 33}, {64, 65}, {128, 129}};
  if (da > 0 && db > 0) sizes = {{da, db}};
  for (auto [c, m] : sizes) compare<float>(n, c, m, reps);
  for (auto [c, m] : sizes) compare<double>(n, c, m, reps);
}
