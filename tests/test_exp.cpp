// lina::detail::exp, the vectorisable exp behind elu+1 and softmax: within
// 2 ulp of the correctly rounded value over the whole range (against long
// double), exact at the special values, and NaN in, NaN out; exp_min0, elu+1's,
// the same bits below 0.
#include <doctest/doctest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <lina/detail/exp.hpp>

#include "support.hpp"

namespace {
template <class T>
double worst_ulps(double lo, double hi, int samples, std::uint64_t seed) {
  test::rng r{seed};
  double worst = 0;
  for (int i = 0; i < samples; ++i) {
    T x = static_cast<T>(lo + (hi - lo) * static_cast<double>(r.next() >> 11) * 0x1.0p-53);
    long double ref = std::exp(static_cast<long double>(x));
    T y = lina::detail::exp(x);
    if (ref > static_cast<long double>(std::numeric_limits<T>::max())) {
      CHECK(std::isinf(y));
      continue;
    }
    T rounded = static_cast<T>(ref);
    long double ulp = rounded < std::numeric_limits<T>::min()
                          ? static_cast<long double>(std::numeric_limits<T>::denorm_min())
                          : static_cast<long double>(std::nextafter(rounded, std::numeric_limits<T>::infinity()) - rounded);
    worst = std::max(worst, static_cast<double>(std::fabs(static_cast<long double>(y) - ref) / ulp));
  }
  return worst;
}
}  // namespace

TEST_CASE_TEMPLATE("detail::exp is within 2 ulp of exp everywhere", T, float, double) {
  double range = sizeof(T) == 4 ? 110 : 760;
  double wide = worst_ulps<T>(-range, range, 200000, 1);
  double near_zero = worst_ulps<T>(-2, 2, 200000, 2);  // where elu+1 spends its time
  MESSAGE("largest error: " << wide << " ulp over ±" << range << ", " << near_zero << " ulp on [-2, 2]");
  CHECK(wide <= 2);
  CHECK(near_zero <= 2);
}

TEST_CASE_TEMPLATE("detail::exp at the special values", T, float, double) {
  T const inf = std::numeric_limits<T>::infinity();
  CHECK(lina::detail::exp(T(0)) == T(1));
  CHECK(lina::detail::exp(inf) == inf);
  CHECK(lina::detail::exp(-inf) == T(0));
  CHECK(std::isnan(lina::detail::exp(std::numeric_limits<T>::quiet_NaN())));
  CHECK(lina::detail::exp(T(1000)) == inf);
  CHECK(lina::detail::exp(T(-1000)) == T(0));
  // the subnormal range: within an ulp of the library's (denorm_min steps)
  T x = sizeof(T) == 4 ? T(-100) : T(-740);
  CHECK(std::abs(lina::detail::exp(x) - std::exp(x)) <= std::numeric_limits<T>::denorm_min());
}

// exp_min0, elu+1's exp: on (-inf, 0] the very bits of detail::exp (so within
// its 2 ulp), 1 above 0, NaN for NaN. The floats from -104 (where exp reaches
// 0) to 0 are 1.1 billion values: one in 401 of them, evenly spread, is tried,
// and one in 7 of [-104, -87], where the results are subnormal; the doubles
// from -746 as many.
TEST_CASE_TEMPLATE("detail::exp_min0 is exp(min(x, 0)), bit for bit", T, float, double) {
  using U = std::conditional_t<sizeof(T) == 4, std::uint32_t, std::uint64_t>;
  auto same_bits = [](T a, T b) { return std::bit_cast<U>(a) == std::bit_cast<U>(b); };
  std::size_t differ = 0, tried = 0;
  auto sweep = [&](T from, T to, U step) {  // from `from` < 0 up to `to` (excluded), by `step` values
    for (U b = std::bit_cast<U>(from); b > std::bit_cast<U>(to) && b <= std::bit_cast<U>(from); b -= step) {
      T x = std::bit_cast<T>(b);
      differ += !same_bits(lina::detail::exp_min0(x), lina::detail::exp(x));
      ++tried;
    }
  };
  if constexpr (sizeof(T) == 4) {
    sweep(T(-104), T(-0.0), 401);
    sweep(T(-104), T(-87), 7);
  } else {
    sweep(T(-746), T(-0.0), U{1} << 41);
    sweep(T(-746), T(-708), U{1} << 30);
  }
  test::rng r{3};
  double const range = sizeof(T) == 4 ? 110 : 760;
  for (int i = 0; i < 200000; ++i) {
    T x = static_cast<T>(-range * static_cast<double>(r.next() >> 11) * 0x1.0p-53);
    differ += !same_bits(lina::detail::exp_min0(x), lina::detail::exp(x));
    ++tried;
  }
  MESSAGE(tried << " values tried");
  CHECK(tried > 1000000);
  CHECK(differ == 0);
  T const inf = std::numeric_limits<T>::infinity();
  CHECK(lina::detail::exp_min0(T(0)) == T(1));
  CHECK(lina::detail::exp_min0(T(-0.0)) == T(1));
  CHECK(lina::detail::exp_min0(T(3)) == T(1));
  CHECK(lina::detail::exp_min0(inf) == T(1));
  CHECK(lina::detail::exp_min0(-inf) == T(0));
  CHECK(lina::detail::exp_min0(T(-1000)) == T(0));
  CHECK(lina::detail::exp_min0(-std::numeric_limits<T>::min()) == T(1));
  CHECK(std::isnan(lina::detail::exp_min0(std::numeric_limits<T>::quiet_NaN())));
  CHECK(std::isnan(lina::detail::exp_min0(-std::numeric_limits<T>::quiet_NaN())));
}
