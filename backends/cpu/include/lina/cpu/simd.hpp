// Fixed-width vectors for the CPU backend's register-blocked kernels. GCC and
// Clang keep arrays of their vector types in registers where they do not keep
// plain arrays (measured: the scan's state tile went to the stack), so the
// kernels name their vectors through this header. Elsewhere a vector is one
// scalar, and the kernels are plain loops. Defining LINA_SIMD_BYTES (0, 16,
// 32 or 64) overrides the width, e.g. to test the scalar loops.
#pragma once

#include <cstring>

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

}  // namespace lina::cpu::simd
