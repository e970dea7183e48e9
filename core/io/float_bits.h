// IEEE binary16 and bfloat16 conversions on the host, round to nearest even.
#pragma once

#include <cstdint>
#include <cstring>

namespace loom {

inline uint32_t floatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float bitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline float halfToFloat(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1f)  // Inf or NaN
    return bitsFloat(sign | 0x7f800000u | (mantissa << 13));
  if (exponent == 0) {
    if (mantissa == 0) return bitsFloat(sign);
    // Subnormal half: normalise into a float.
    int shift = 0;
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      ++shift;
    }
    mantissa &= 0x3ffu;
    return bitsFloat(sign | uint32_t(127 - 15 + 1 - shift) << 23 | mantissa << 13);
  }
  return bitsFloat(sign | (exponent + 127 - 15) << 23 | mantissa << 13);
}

inline uint16_t floatToHalf(float f) {
  const uint32_t u = floatBits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t absBits = u & 0x7fffffffu;
  if (absBits >= 0x7f800000u)  // Inf or NaN (keep NaN quiet)
    return uint16_t(sign | 0x7c00u | (absBits > 0x7f800000u ? 0x200u : 0));
  if (absBits >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // overflow
  if (absBits < 0x38800000u) {  // result is subnormal or zero
    if (absBits < 0x33000000u) return uint16_t(sign);
    const uint32_t exponent = absBits >> 23;
    const uint32_t mantissa = (absBits & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - exponent;  // value = mantissa * 2^(exponent - 150) = result * 2^-24
    uint32_t result = mantissa >> shift;
    const uint32_t rest = mantissa & ((1u << shift) - 1);
    const uint32_t half = 1u << (shift - 1);
    if (rest > half || (rest == half && (result & 1u))) ++result;
    return uint16_t(sign | result);
  }
  uint32_t result = ((absBits >> 13) - ((127 - 15) << 10)) & 0xffffu;
  const uint32_t rest = absBits & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (result & 1u))) ++result;
  return uint16_t(sign | result);
}

inline float bf16ToFloat(uint16_t b) { return bitsFloat(uint32_t(b) << 16); }

inline uint16_t floatToBf16(float f) {
  const uint32_t u = floatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);  // quiet NaN
  const uint32_t roundingBias = 0x7fffu + ((u >> 16) & 1u);
  return uint16_t((u + roundingBias) >> 16);
}

}  // namespace loom
