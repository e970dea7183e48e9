// float16 and bfloat16 on the host: bit patterns to float exactly, float to
// bit patterns rounding to nearest even as the GPU's cvt.rn does. The one
// copy: .npy I/O (core/io), the host tile API (host.h) and loom's emulator of
// the CUDA tiles (emu.h, runtime/emu) all convert with it, so each does
// exactly what the device does. Header-only and self-contained: it is
// embedded beside the tile headers for the programs compiled at run time.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace loom::half {

inline float halfToFloat(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu, bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | (mantissa << 13);  // inf, NaN
  } else if (exponent == 0 && mantissa == 0) {
    bits = sign;
  } else if (exponent == 0) {  // subnormal: normalise
    int shift = 0;
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      ++shift;
    }
    bits = sign | uint32_t(113 - shift) << 23 | (mantissa & 0x3ffu) << 13;
  } else {
    bits = sign | (exponent + 112) << 23 | mantissa << 13;
  }
  float f;
  __builtin_memcpy(&f, &bits, 4);
  return f;
}

// Round to nearest even, overflow to infinity, subnormals kept (cvt.rn.f16.f32).
inline uint16_t floatToHalf(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  const uint32_t magnitude = u & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return uint16_t(sign | 0x7e00u);  // NaN: canonical quiet NaN
  if (magnitude >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds to or past 65520: infinity
  if (magnitude < 0x38800000u) {  // below the smallest normal half (2^-14): subnormal or zero
    if (magnitude < 0x33000000u) return sign;  // below half the smallest subnormal (2^-25): zero
    const uint32_t exponent = magnitude >> 23, mantissa = (magnitude & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - exponent;  // 14 + (113 - exponent) - 1
    uint32_t result = mantissa >> shift;
    const uint32_t remainder = mantissa & ((1u << shift) - 1), halfway = 1u << (shift - 1);
    if (remainder > halfway || (remainder == halfway && (result & 1u))) ++result;
    return uint16_t(sign | result);
  }
  uint32_t result = ((magnitude >> 13) - (112u << 10));
  const uint32_t remainder = magnitude & 0x1fffu;
  if (remainder > 0x1000u || (remainder == 0x1000u && (result & 1u))) ++result;
  return uint16_t(sign | result);
}

inline float bfloat16ToFloat(uint16_t b) {
  const uint32_t bits = uint32_t(b) << 16;
  float f;
  __builtin_memcpy(&f, &bits, 4);
  return f;
}

// Round to nearest even (cvt.rn.bf16.f32); NaN stays a quiet NaN.
inline uint16_t floatToBfloat16(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// RoPE as public training code tables it (KernelSpec.rope_table_dtype; the
// generator, the host tile API and the reference all take it from here):
// pair j's inverse frequency 1 / theta^((2j) / d) and the angle
// float32(position) * inv_freq, each in float32 arithmetic, then a table
// entry (a cosine or sine) rounded to the table's dtype: `table` 1 float32,
// 2 bfloat16.
inline float ropeTableInvFreq(double theta, int j, int d) {
  const float exponent = float(2 * j) / float(d);
  return 1.0f / std::pow(float(theta), exponent);
}
inline float ropeTableAngle(int64_t position, float invFreq) {
  const volatile float product = float(position) * invFreq;  // rounded to float32, never fused or widened
  return product;
}
inline double ropeTableRound(double x, int table) {
  return table == 2 ? double(bfloat16ToFloat(floatToBfloat16(float(x)))) : double(float(x));
}

}  // namespace loom::half
