// a·b + c with one rounding wherever the target has a fused multiply-add, and
// with two where it has none: the rule cpu::simd::madd follows for vectors.
// Kernels whose results must agree to the bit (a map applied row by row and the
// same sums as one product) say madd explicitly on both sides rather than leave
// `acc += a * b` to the compiler: GCC's contraction follows its tuning (for AMD
// Zen it leaves a lone chain of accumulations unfused), so the same expression
// was fused in one loop and not in another on the same machine.
#pragma once

#include <cmath>

namespace lina::detail {

inline float madd(float a, float b, float c) {
#if defined(__FP_FAST_FMAF)
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}
inline double madd(double a, double b, double c) {
#if defined(__FP_FAST_FMA)
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}

}  // namespace lina::detail
