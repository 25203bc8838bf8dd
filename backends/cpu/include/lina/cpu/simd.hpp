// Fixed-width vectors for the CPU backend's register-blocked kernels. GCC and
// Clang keep arrays of their vector types in registers where they do not keep
// plain arrays (measured: the scan's state tile went to the stack), so the
// kernels name their vectors through this header. Elsewhere a vector is one
// scalar, and the kernels are plain loops. Defining LINA_SIMD_BYTES (0, 16,
// 32 or 64) overrides the width, e.g. to test the scalar loops.
#pragma once

#include <cstring>
#include <type_traits>
#include <utility>
#if defined(__FMA__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "lina/detail/madd.hpp"

namespace lina::cpu::simd {

#if defined(__GNUC__) || defined(__clang__)
#if defined(LINA_SIMD_BYTES)
inline constexpr int bytes = LINA_SIMD_BYTES;
inline constexpr int registers = 32;
#elif defined(__AVX512F__)
inline constexpr int bytes = 64;
inline constexpr int registers = 32;
#elif defined(__AVX__)
inline constexpr int bytes = 32;
inline constexpr int registers = 16;
#elif defined(__aarch64__)
inline constexpr int bytes = 16;
inline constexpr int registers = 32;
#elif defined(__SSE2__) || defined(__ARM_NEON)
inline constexpr int bytes = 16;
inline constexpr int registers = 16;
#else
inline constexpr int bytes = 0;
inline constexpr int registers = 16;
#endif
#else
inline constexpr int bytes = 0;  // no vector types: one scalar per "vector"
inline constexpr int registers = 16;
#endif

template <class T, int Bytes = bytes>
struct vector_of {
  using type = T;
  static constexpr int lanes = 1;
};
#if defined(__GNUC__) || defined(__clang__)
template <>
struct vector_of<float, 64> {
  typedef float type __attribute__((vector_size(64)));
  static constexpr int lanes = 16;
};
template <>
struct vector_of<double, 64> {
  typedef double type __attribute__((vector_size(64)));
  static constexpr int lanes = 8;
};
template <>
struct vector_of<float, 32> {
  typedef float type __attribute__((vector_size(32)));
  static constexpr int lanes = 8;
};
template <>
struct vector_of<double, 32> {
  typedef double type __attribute__((vector_size(32)));
  static constexpr int lanes = 4;
};
template <>
struct vector_of<float, 16> {
  typedef float type __attribute__((vector_size(16)));
  static constexpr int lanes = 4;
};
template <>
struct vector_of<double, 16> {
  typedef double type __attribute__((vector_size(16)));
  static constexpr int lanes = 2;
};
#endif

// Unaligned loads and stores (memcpy compiles to one vector move).
template <class V, class T>
inline V load(T const* p) {
  V v;
  std::memcpy(&v, p, sizeof(V));
  return v;
}
template <class V, class T>
inline void store(T* p, V const& v) {
  std::memcpy(p, &v, sizeof(V));
}
// Every lane x (x - 0 is x for every x, -0 included, so it folds away; x + 0 would not).
template <class V, class T>
inline V broadcast(T x) {
  return x - V{};
}

// a·b + c lane by lane, under detail::madd's rule: fused where the target has an
// FMA instruction (the intrinsic, so that the compiler's tuning cannot unfuse
// it), else rounded twice.
template <class V>
inline V madd(V a, V b, V c) {
  if constexpr (std::is_floating_point_v<V>) {
    return lina::detail::madd(a, b, c);
  } else {
#if defined(__FMA__) && (defined(__GNUC__) || defined(__clang__))
    if constexpr (std::is_same_v<V, vector_of<float, 32>::type>) return _mm256_fmadd_ps(a, b, c);
    if constexpr (std::is_same_v<V, vector_of<double, 32>::type>) return _mm256_fmadd_pd(a, b, c);
    if constexpr (std::is_same_v<V, vector_of<float, 16>::type>) return _mm_fmadd_ps(a, b, c);
    if constexpr (std::is_same_v<V, vector_of<double, 16>::type>) return _mm_fmadd_pd(a, b, c);
#endif
#if defined(__AVX512F__) && (defined(__GNUC__) || defined(__clang__))
    if constexpr (std::is_same_v<V, vector_of<float, 64>::type>) return _mm512_fmadd_ps(a, b, c);
    if constexpr (std::is_same_v<V, vector_of<double, 64>::type>) return _mm512_fmadd_pd(a, b, c);
#endif
    // a vector without an intrinsic here (another target, or LINA_SIMD_BYTES): lane by lane
    for (int l = 0; l < static_cast<int>(sizeof(V) / sizeof(a[0])); ++l) c[l] = lina::detail::madd(a[l], b[l], c[l]);
    return c;
  }
}

// Sum of a vector's lanes, in a fixed order (halves added pairwise).
template <class Vec, class T>
inline T lane_sum(Vec const& v) {
  constexpr int L = static_cast<int>(sizeof(Vec) / sizeof(T));
  using half = vector_of<T, static_cast<int>(sizeof(Vec)) / 2>;
  if constexpr (L > 1 && half::lanes == L / 2) {
    // halves added as vectors, in registers (the same order as lane by lane below)
    typename half::type lo, hi;
    std::memcpy(&lo, &v, sizeof(lo));
    std::memcpy(&hi, reinterpret_cast<char const*>(&v) + sizeof(lo), sizeof(hi));
    return lane_sum<typename half::type, T>(lo + hi);
  } else {
    T t[L];
    std::memcpy(t, &v, sizeof(Vec));
    for (int w = L / 2; w >= 1; w /= 2)
      for (int l = 0; l < w; ++l) t[l] += t[l + w];
    return t[0];
  }
}

// out[p] += the sum of u[p]'s lanes, for P vectors at once: a transposing
// tree of shuffles (each level adds the halves of two vectors' segments into
// one vector) costs P - 1 + log2(L / P) adds where P separate lane sums cost
// P log2(L). Where P > L (or no vector type) the lanes are summed one vector
// at a time. The order of the additions is fixed.
namespace detail {
template <int L, int S, bool Hi, int I>
constexpr int halves_index() {  // lane I of (a, b): segment I / (S/2) from a, then b; its low or high half
  constexpr int half = S / 2, seg = I / half, per = L / S;  // segments per source vector
  constexpr int src = seg < per ? 0 : L;
  return src + (seg % per) * S + I % half + (Hi ? half : 0);
}
template <class V, int L, int S, std::size_t... I>
inline V add_halves(V const& a, V const& b, std::index_sequence<I...>) {
  return __builtin_shufflevector(a, b, halves_index<L, S, false, static_cast<int>(I)>()...) +
         __builtin_shufflevector(a, b, halves_index<L, S, true, static_cast<int>(I)>()...);
}
template <class V, int L, int S, std::size_t... I>
inline V fold_segments(V const& v, std::index_sequence<I...>) {  // lane (k, e) += lane (k, e + S/2)
  return v + __builtin_shufflevector(v, v, static_cast<int>(I / S * S + (I % S + S / 2) % S)...);
}
// P vectors with segments of S lanes -> P/2 vectors with segments of S/2, down to one.
template <int P, int S, int L, class V>
inline void pair_levels(V* w) {
  if constexpr (P > 1) {
#pragma GCC unroll 16
    for (int k = 0; k < P / 2; ++k) w[k] = add_halves<V, L, S>(w[2 * k], w[2 * k + 1], std::make_index_sequence<L>{});
    pair_levels<P / 2, S / 2, L>(w);
  }
}
// Each segment of S lanes summed into its first lane.
template <int S, int L, class V>
inline V fold_levels(V const& v) {
  if constexpr (S > 1)
    return fold_levels<S / 2, L>(fold_segments<V, L, S>(v, std::make_index_sequence<L>{}));
  else
    return v;
}
}  // namespace detail
template <int P, class V, class T>
inline void add_lane_sums(V const (&u)[P], T* out) {
  constexpr int L = static_cast<int>(sizeof(V) / sizeof(T));
  if constexpr (L > 1 && P <= L && (P & (P - 1)) == 0 && (L & (L - 1)) == 0) {
    V w[P];  // (in registers only where these loops are unrolled: GCC does so alone at -O3, by pragma at -O2)
#pragma GCC unroll 16
    for (int p = 0; p < P; ++p) w[p] = u[p];
    detail::pair_levels<P, L, L>(w);  // one vector: P segments of L / P lanes
    V v = detail::fold_levels<L / P, L>(w[0]);
    T t[L];
    std::memcpy(t, &v, sizeof(V));
#pragma GCC unroll 16
    for (int p = 0; p < P; ++p) out[p] += t[p * (L / P)];
  } else {
#pragma GCC unroll 16
    for (int p = 0; p < P; ++p) out[p] += lane_sum<V, T>(u[p]);
  }
}

}  // namespace lina::cpu::simd
