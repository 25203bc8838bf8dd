// What the CPU backend's property files (test_cpu.cpp, test_cpu_paths.cpp)
// share: their symbols, random shapes, the check of every order against an
// independent loop in double, and [B,N,H,*] copies seen through strides. Two
// files rather than one: the sanitizer build's lina_tests was that one file,
// 74 s with the other core idle; now 48 and 45 s side by side (2026-12-06).
#pragma once

#include <array>
#include <cmath>
#include <vector>
#include <lina/cpu.hpp>
#include <lina/lina.hpp>

#include "support.hpp"

namespace test::cpu_props {

using namespace lina;

inline constexpr auto N = dim<"N">;
inline constexpr auto D = dim<"D">;  // dynamic, so shapes can be random
inline constexpr auto M = dim<"M">;
inline constexpr auto Q = input<"Q">(N, D);
inline constexpr auto K = input<"K">(N, D);
inline constexpr auto V = input<"V">(N, M);

struct shape {
  std::size_t b, h, n, d, m;
};

inline shape random_shape(test::rng& r) {
  shape s{r.in(1, 2), r.in(1, 3), test::length(r), r.in(1, 24), 0};
  do s.m = r.in(1, 24);
  while (s.m == s.d);
  return s;
}

// Evaluate the expression as written, its quadratic and its linear plan, and
// compare them with the independent reference loop (in double).
template <class T, class Map, class Expr>
void check_orders(Expr const& expr, bool causal, bool normalized, std::uint64_t seed) {
  test::rng r{seed};
  double worst = 0;  // largest error / bound seen, reported to show the bound is not slack
  for (int trial = 0; trial < test::trials(12); ++trial) {
    shape s = random_shape(r);
    auto q = tensor<T>::random({s.b, s.h, s.n, s.d}, r.next());
    auto k = tensor<T>::random({s.b, s.h, s.n, s.d}, r.next());
    auto v = tensor<T>::random({s.b, s.h, s.n, s.m}, r.next());
    auto ref = test::reference_attention(q, k, v, [](double x) { return Map::value(x); }, causal, normalized);
    auto as_written = cpu::evaluate(expr, Q = q, K = k, V = v);
    auto quadratic = cpu::evaluate(compile<order::quadratic>(expr), Q = q, K = k, V = v);
    auto linear = cpu::evaluate(compile<order::linear>(expr), Q = q, K = k, V = v);
    auto automatic = cpu::evaluate(compile(expr), Q = q, K = k, V = v);
    // Terms per output: n similarities of d products each, times v. Unnormalised
    // sums scale with their size; normalised ones are averages of v (|v| < 1).
    double scale = normalized ? 1.0 : test::max_abs(ref);
    double bound = test::rounding_bound<T>(static_cast<double>(s.n * s.d), scale);
    CONTEXT(s.b, s.h, s.n, s.d, s.m);
    for (auto const* out : {&as_written, &quadratic, &linear, &automatic}) {
      double err = max_abs_diff(*out, ref);
      CHECK(err <= bound);
      worst = std::max(worst, err / bound);
    }
  }
  MESSAGE("largest error / bound: " << worst);
}

inline double elu1(double x) { return elu_plus_one::value(x); }

// The same numbers stored [B,N,H,*], seen as [B,H,N,*] through strides.
template <class T>
struct bnhd {
  std::vector<T> buf;
  std::array<std::size_t, 4> shape;
  tensor_view<T> view() {
    auto [b, h, n, last] = shape;
    return {buf.data(), {b, h, n, last},
            strides4{std::ptrdiff_t(n * h * last), std::ptrdiff_t(last), std::ptrdiff_t(h * last), 1}};
  }
};
template <class T>
bnhd<T> bnhd_copy(tensor<T> const& t) {
  auto s = t.shape();
  bnhd<T> c{std::vector<T>(t.size()), {s[0], s[1], s[2], s[3]}};
  for (std::size_t i = 0; i < s[0]; ++i)
    for (std::size_t j = 0; j < s[1]; ++j)
      for (std::size_t x = 0; x < s[2]; ++x)
        for (std::size_t y = 0; y < s[3]; ++y) c.buf[((i * s[2] + x) * s[1] + j) * s[3] + y] = t(i, j, x, y);
  return c;
}


}  // namespace test::cpu_props
