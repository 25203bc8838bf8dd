// Host conversions between fp32 and the 16-bit element types, rounding to
// nearest even: the emulation's half of what tiles.cuh does on the device
// (cvt.rn.f16.f32, cvt.rn.bf16.f32). Bit patterns, so no compiler support for
// _Float16 or __bf16 is needed.
#pragma once

#include <bit>
#include <cstdint>

namespace lina::cuda {

// bfloat16: the top 16 bits of an fp32 (8 bits of significand).
constexpr std::uint16_t bf16_bits(float x) {
  std::uint32_t u = std::bit_cast<std::uint32_t>(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even; overflow carries into ±inf
  return static_cast<std::uint16_t>(u >> 16);
}
constexpr float from_bf16_bits(std::uint16_t b) { return std::bit_cast<float>(static_cast<std::uint32_t>(b) << 16); }

// IEEE binary16: 5 exponent bits, 11 bits of significand, subnormals below 2^-14.
constexpr std::uint16_t f16_bits(float x) {
  std::uint32_t u = std::bit_cast<std::uint32_t>(x);
  std::uint32_t sign = (u >> 16) & 0x8000u;
  std::uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7e00u);  // NaN
  if (a >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // rounds to ≥ 2^16: inf
  if (a >= 0x38800000u) {  // normal half (≥ 2^-14)
    std::uint32_t r = a - 0x38000000u;  // rebias the exponent: 127 → 15
    r += 0xfffu + ((r >> 13) & 1u);
    return static_cast<std::uint16_t>(sign | (r >> 13));
  }
  if (a < 0x33000000u) return static_cast<std::uint16_t>(sign);  // below half the smallest subnormal: ±0
  // Subnormal half: the value in units of 2^-24, rounded to nearest even.
  std::uint32_t e = a >> 23, m = (a & 0x7fffffu) | 0x800000u;
  std::uint32_t shift = 126 - e;  // m · 2^(e-150) / 2^-24 = m >> (126 - e)
  std::uint32_t q = m >> shift, rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1);
  if (rem > half || (rem == half && (q & 1u))) ++q;
  return static_cast<std::uint16_t>(sign | q);
}
constexpr float from_f16_bits(std::uint16_t h) {
  std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  std::uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | (m << 13));
  if (e != 0) return std::bit_cast<float>(sign | ((e + 112) << 23) | (m << 13));
  if (m == 0) return std::bit_cast<float>(sign);
  // Subnormal: normalise.
  int shift = 0;
  while (!(m & 0x400u)) {
    m <<= 1;
    ++shift;
  }
  return std::bit_cast<float>(sign | (static_cast<std::uint32_t>(113 - shift) << 23) | ((m & 0x3ffu) << 13));
}

}  // namespace lina::cuda
