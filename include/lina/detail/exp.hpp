// exp(x) for float and double in straight-line code that compilers vectorise
// (std::exp is a scalar library call, and without -ffast-math GCC will not
// replace it by a vector one; it dominated elu+1 attention, ~60% of a forward).
//
// x = k ln2 + r, |r| <= ln2/2 (k rounded to nearest, ln2 split in two parts so
// k ln2 is exact), e^r by its Taylor polynomial (degree 7 for float, 13 for
// double: truncation below half an ulp on that interval), then scaled by 2^k
// in two steps so that results down to the subnormals and up to overflow come
// out right. Within 2 ulp of the correctly rounded exp (tests/test_exp.cpp);
// exp(NaN) = NaN, exp(+inf) = inf, exp(-inf) = 0. exp_min0, below, is the same
// function on (-inf, 0] in fewer operations.
#pragma once

#include <bit>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>

namespace lina::detail {

template <class T>
struct exp_constants;
template <>
struct exp_constants<float> {
  using bits = std::int32_t;
  static constexpr int mantissa = 23, bias = 127, degree = 7;
  static constexpr float lo = -104.0f, hi = 89.0f;  // e^lo < min subnormal / 2, e^hi > max
  static constexpr float inv_ln2 = 1.44269504088896341f;
  static constexpr float ln2_hi = 0.693145751953125f;  // 12 bits: k ln2_hi is exact for |k| < 2^11
  static constexpr float ln2_lo = 1.428606765330187045e-06f;
  static constexpr float shifter = 0x1.8p23f;  // adding it rounds to an integer
};
template <>
struct exp_constants<double> {
  using bits = std::int64_t;
  static constexpr int mantissa = 52, bias = 1023, degree = 13;
  static constexpr double lo = -746.0, hi = 710.0;
  static constexpr double inv_ln2 = 1.4426950408889634074;
  static constexpr double ln2_hi = 0.693147180369123816490;  // 32 bits
  static constexpr double ln2_lo = 1.90821492927058770002e-10;
  static constexpr double shifter = 0x1.8p52;
};

// 1/i! for i = 0 .. degree, the Taylor coefficients of e^r.
template <class T>
inline constexpr auto exp_coefficients = [] {
  constexpr int n = exp_constants<T>::degree;
  struct table {
    T c[n + 1];
  } t{};
  double f = 1;
  for (int i = 0; i <= n; ++i) {
    if (i > 0) f *= i;
    t.c[i] = static_cast<T>(1.0 / f);
  }
  return t;
}();

// Horner form, unrolled here: GCC unrolls a loop of constant length before it
// vectorises only at -O3, and at -O2 the loop kept every exp scalar.
template <class T, std::size_t... I>
inline T exp_poly(T r, std::index_sequence<I...>) {
  constexpr int n = exp_constants<T>::degree;
  T p = exp_coefficients<T>.c[n];
  ((p = p * r + exp_coefficients<T>.c[n - 1 - static_cast<int>(I)]), ...);
  return p;
}
template <class T>
inline T exp_poly(T r) {
  return exp_poly(r, std::make_index_sequence<exp_constants<T>::degree>{});
}

template <class T>
inline T exp(T x) {
  static_assert(std::is_floating_point_v<T> && (sizeof(T) == 4 || sizeof(T) == 8), "lina::detail::exp: float or double");
  using C = exp_constants<T>;
  using I = typename C::bits;
  T xc = x < C::lo ? C::lo : (x > C::hi ? C::hi : (x == x ? x : T(0)));  // NaN: returned below
  T kf = (xc * C::inv_ln2 + C::shifter) - C::shifter;
  T r = (xc - kf * C::ln2_hi) - kf * C::ln2_lo;
  T p = exp_poly(r);
  I k = static_cast<I>(kf);
  I k1 = k >> 1, k2 = k - k1;  // 2^k = 2^k1 2^k2, each a normal number
  T s1 = std::bit_cast<T>(static_cast<I>((k1 + C::bias) << C::mantissa));
  T s2 = std::bit_cast<T>(static_cast<I>((k2 + C::bias) << C::mantissa));
  T y = p * s1 * s2;
  return x == x ? y : x;
}

// e^min(x, 0): elu+1's exp (its positive inputs take the other branch), in
// fewer instructions: a loop of it over floats, vectorised by GCC 12 at -O3
// for AVX-512, spends 25 per 16 values besides the load and store, where
// exp's spends 39 (mask operations included). On (-inf, 0] it is exp(x)
// bit for bit: the results lie in [0, 1], so 2^k scales in one step, by
// 2^(k + 64) (exact: a normal number for every k down to lo's) and then by
// 2^-64, which rounds once as exp's second step does; k is read from the bits
// of the sum that rounded it rather than converted; and a NaN needs no test,
// since the clamps keep it and it spreads through the arithmetic.
template <class T>
inline T exp_min0(T x) {
  static_assert(std::is_floating_point_v<T> && (sizeof(T) == 4 || sizeof(T) == 8), "lina::detail::exp_min0: float or double");
  using C = exp_constants<T>;
  using U = std::make_unsigned_t<typename C::bits>;
  constexpr int shift = 64;  // k + shift + bias >= 1 for every k from lo's (float -150, double -1076) to 0
  constexpr T unshift = std::bit_cast<T>(static_cast<U>(U(C::bias - shift) << C::mantissa));  // 2^-shift
  T xc = x < C::lo ? C::lo : (x > T(0) ? T(0) : x);  // (a NaN fails both tests and stays)
  T t = xc * C::inv_ln2 + C::shifter;  // its low mantissa bits hold k
  T kf = t - C::shifter;
  T r = (xc - kf * C::ln2_hi) - kf * C::ln2_lo;
  T p = exp_poly(r);
  // (bits(t) + bias + shift) << mantissa: t's exponent and the shifter's own
  // mantissa bit move out of the word, leaving 2^(k + shift)'s bits.
  T s = std::bit_cast<T>(static_cast<U>((std::bit_cast<U>(t) + U(C::bias + shift)) << C::mantissa));
  return p * s * unshift;
}

}  // namespace lina::detail
