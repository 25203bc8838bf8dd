// lina::detail::exp, the vectorisable exp behind elu+1: within 2 ulp of the
// correctly rounded value over the whole range (against long double), exact
// at the special values, and NaN in, NaN out.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
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
