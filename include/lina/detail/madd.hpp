// a·b + c with one rounding wherever the target has a fused multiply-add for
// T, and with two elsewhere: the rule cpu::simd::madd follows for vectors.
// Kernels whose results must agree to the bit (a map applied row by row and the
// same sums as one product) say madd explicitly on both sides rather than leave
// `acc += a * b` to the compiler: GCC's contraction follows its tuning (for AMD
// Zen it leaves a lone chain of accumulations unfused), so the same expression
// was fused in one loop and not in another on the same machine.
#pragma once

#include <cmath>
#include <type_traits>

namespace lina::detail {

template <class T>
inline T madd(T a, T b, T c) {
#if defined(__FP_FAST_FMAF)
  if constexpr (std::is_same_v<T, float>) return std::fma(a, b, c);
#endif
#if defined(__FP_FAST_FMA)
  if constexpr (std::is_same_v<T, double>) return std::fma(a, b, c);
#endif
  return a * b + c;
}

}  // namespace lina::detail
