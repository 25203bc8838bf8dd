// What one suffix scan for both ∂K and ∂V would save over the two the derived
// backward runs today (the CPU issue asks for one): a measurement of a
// prototype, not a kernel of the library.
//
// The two scans read one running sum, S_i = Σ_{j≥i} φ(q_j) t_jᵀ (C x M+1):
// ∂V's rows are φ(k_i)ᵀ S_i (a contraction over S's rows, the scan kernel's
// natural form) and ∂φ(K)'s rows are S_i [v_i|1] (over its columns), which the
// backward gets from a second scan over the transposed sum. One scan would
// update S once and produce both: per state element and row 3 multiply-adds
// instead of 4, but the second contraction runs along the SIMD lanes, so each
// row's 8 sums of a register tile need a transposing reduction (AVX-512
// shuffles here).
//
//   combined_scan [--n 4096] [--c 64] [--m 64]    (C a multiple of 8, M of 32; float, one thread)
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <lina/cpu/kernels.hpp>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
// GCC 12's _mm512_shuffle_f32x4 passes an undefined mask operand it never reads
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

using namespace lina::cpu;
using idx = lina::cpu::index;

namespace {

#ifdef __AVX512F__
using vec = simd::vector_of<float>::type;
constexpr int L = 16, P = 8, V = 2;

// The sums of 8 vectors, lane l of the result = the sum of u[lane_of(p)]'s lanes.
inline __m512 reduce8(__m512 const u[8]) {
  // 128-bit blocks: (u0 lo+hi 256 | u1 lo+hi 256), then blocks of u0..u3 and u4..u7
  auto half = [](__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  };
  __m512 t0 = half(u[0], u[1]), t1 = half(u[2], u[3]), t2 = half(u[4], u[5]), t3 = half(u[6], u[7]);
  __m512 r0 = _mm512_add_ps(_mm512_shuffle_f32x4(t0, t1, 0x88), _mm512_shuffle_f32x4(t0, t1, 0xDD));
  __m512 r1 = _mm512_add_ps(_mm512_shuffle_f32x4(t2, t3, 0x88), _mm512_shuffle_f32x4(t2, t3, 0xDD));
  __m512 q = _mm512_add_ps(_mm512_unpacklo_ps(r0, r1), _mm512_unpackhi_ps(r0, r1));
  return _mm512_add_ps(_mm512_shuffle_ps(q, q, 0x4E), q);
}
constexpr int lane_of(int p) { return p < 4 ? 4 * p : 4 * (p - 4) + 1; }

// One register tile of the combined scan over n rows (reverse order given by
// negative strides): s += b_i c_iᵀ; o_i += a_iᵀ s; o2_i += s x_i.
void tile(float* __restrict s, idx lds, float const* a, float const* b, idx ldab, float const* c, float const* x,
          idx ldc, float* o, idx ldo, float* o2, idx ldo2, idx n) {
  vec acc[P][V];
  for (int p = 0; p < P; ++p)
    for (int v = 0; v < V; ++v) acc[p][v] = simd::load<vec>(s + p * lds + v * L);
  for (idx i = 0; i < n; ++i) {
    vec cv[V], ov[V], xv[V];
    for (int v = 0; v < V; ++v) {
      cv[v] = simd::load<vec>(c + i * ldc + v * L);
      xv[v] = simd::load<vec>(x + i * ldc + v * L);
      ov[v] = simd::load<vec>(o + i * ldo + v * L);
    }
    __m512 u[P];
    for (int p = 0; p < P; ++p) {
      vec bp = simd::broadcast<vec>(b[i * ldab + p]), ap = simd::broadcast<vec>(a[i * ldab + p]);
      vec t{};
      for (int v = 0; v < V; ++v) {
        acc[p][v] += bp * cv[v];
        ov[v] += ap * acc[p][v];
        t += acc[p][v] * xv[v];
      }
      u[p] = reinterpret_cast<__m512 const&>(t);
    }
    for (int v = 0; v < V; ++v) simd::store(o + i * ldo + v * L, ov[v]);
    alignas(64) float r[16];
    _mm512_store_ps(r, reduce8(u));
    for (int p = 0; p < P; ++p) o2[i * ldo2 + p] += r[lane_of(p)];
  }
  for (int p = 0; p < P; ++p)
    for (int v = 0; v < V; ++v) simd::store(s + p * lds + v * L, acc[p][v]);
}

// The combined suffix scan over n rows: chunks of 64 from the bottom, every tile per chunk.
void combined(std::vector<float> const& a, std::vector<float> const& b, std::vector<float> const& c,
              std::vector<float> const& x, std::vector<float>& o, std::vector<float>& o2, idx n, idx da, idx db) {
  std::vector<float> s(static_cast<std::size_t>(da * db));
  std::fill(o.begin(), o.end(), 0.f);
  std::fill(o2.begin(), o2.end(), 0.f);
  for (idx hi = n; hi > 0; hi -= std::min<idx>(64, hi)) {
    idx rows = std::min<idx>(64, hi), last = hi - 1;
    for (idx q0 = 0; q0 < db; q0 += V * L)
      for (idx p0 = 0; p0 < da; p0 += P)
        tile(&s[p0 * db + q0], db, &a[last * da + p0], &b[last * da + p0], -da, &c[last * db + q0],
             &x[last * db + q0], -db, &o[last * db + q0], -db, &o2[last * da + p0], -da, rows);
  }
}
#endif

}  // namespace

int main(int argc, char** argv) {
#ifndef __AVX512F__
  (void)argc;
  (void)argv;
  std::printf("combined_scan: the prototype needs AVX-512\n");
#else
  idx n = 4096, da = 64, db = 64;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--n")) n = std::atol(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--c")) da = std::atol(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--m")) db = std::atol(argv[i + 1]);
  }
  if (da % P || db % (V * L) || n <= 0) {
    std::fprintf(stderr, "usage: combined_scan [--n 4096] [--c 64] [--m 64]  (C a multiple of 8, M of 32)\n");
    return 2;
  }
  auto sz = [](idx r, idx cl) { return static_cast<std::size_t>(r * cl); };
  std::vector<float> a(sz(n, da)), b(sz(n, da)), c(sz(n, db)), x(sz(n, db));
  unsigned r = 1;
  for (auto* v : {&a, &b, &c, &x})
    for (auto& e : *v) {
      r = r * 1664525u + 1013904223u;
      e = static_cast<float>((r >> 8) * 0x1.0p-24 - 0.5);
    }
  auto mk = [](std::vector<float>& v, idx rows, idx cols) { return view<float>(v.data(), rows, cols, cols, 1); };
  std::vector<float> o_two(sz(n, db)), o2_two(sz(n, da)), o(sz(n, db)), o2(sz(n, da));
  std::vector<float> scratch(1 << 20);
  using clock = std::chrono::steady_clock;
  double two = 1e300, one = 1e300;
  for (int rep = 0; rep < 20; ++rep) {
    auto t0 = clock::now();
    std::vector<float> s1(sz(da, db)), s2(sz(db, da));
    matrix<float> out = mk(o_two, n, db), out2 = mk(o2_two, n, da);
    kernels::scan_contract(mk(a, n, da), mk(b, n, da), mk(c, n, db), out, s1.data(), true, scratch.data());
    kernels::scan_contract(mk(x, n, db), mk(c, n, db), mk(b, n, da), out2, s2.data(), true, scratch.data());
    auto t1 = clock::now();
    combined(a, b, c, x, o, o2, n, da, db);
    auto t2 = clock::now();
    two = std::min(two, std::chrono::duration<double, std::milli>(t1 - t0).count());
    one = std::min(one, std::chrono::duration<double, std::milli>(t2 - t1).count());
  }
  double diff = 0, scale = 0;
  for (std::size_t i = 0; i < o.size(); ++i) diff = std::max(diff, double(std::abs(o[i] - o_two[i]))), scale = std::max(scale, double(std::abs(o_two[i])));
  for (std::size_t i = 0; i < o2.size(); ++i) diff = std::max(diff, double(std::abs(o2[i] - o2_two[i]))), scale = std::max(scale, double(std::abs(o2_two[i])));
  std::printf("N = %td, C = %td, M = %td, float, one thread, best of 20: two suffix scans %.3f ms, one combined "
              "%.3f ms: %.2fx (largest difference %.1e of the largest output)\n",
              n, da, db, two, one, two / one, diff / scale);
  return diff <= 1e-4 * scale ? 0 : 1;
#endif
}
