// IEEE binary16 and bfloat16 <-> binary32 conversions, round-to-nearest-even.
// Portable bit manipulation; usable from host and CUDA device code.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define KS_HD __host__ __device__ __forceinline__
#else
#define KS_HD inline
#endif

namespace ks {

KS_HD float bits_to_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
KS_HD uint32_t f32_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// binary16 -> binary32 (exact).
KS_HD float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t man = h & 0x3FFu;
  if (exp == 0x1F) return bits_to_f32(sign | 0x7F800000u | (man << 13));  // inf / nan
  if (exp == 0) {
    if (man == 0) return bits_to_f32(sign);
    // subnormal: value = man * 2^-24
    float v = float(man) * 5.9604644775390625e-08f;
    return sign ? -v : v;
  }
  return bits_to_f32(sign | ((exp + 112u) << 23) | (man << 13));
}

// binary32 -> binary16, round to nearest even; overflow -> inf; NaN stays NaN.
KS_HD uint16_t float_to_half(float f) {
  const uint32_t x = f32_to_bits(f);
  const uint16_t sign = uint16_t((x >> 16) & 0x8000u);
  const uint32_t ax = x & 0x7FFFFFFFu;
  if (ax >= 0x7F800000u) {  // inf or nan
    return uint16_t(sign | 0x7C00u | (ax > 0x7F800000u ? 0x200u | ((ax >> 13) & 0x3FFu) : 0u));
  }
  if (ax >= 0x477FF000u) return uint16_t(sign | 0x7C00u);  // rounds to >= 65520 -> inf
  if (ax < 0x38800000u) {                                  // below 2^-14: subnormal or zero
    if (ax < 0x33000000u) return sign;                     // < 2^-25 rounds to 0
    const uint32_t e = ax >> 23;
    const uint32_t m = (ax & 0x7FFFFFu) | 0x800000u;
    const uint32_t shift = 126u - e;  // 14..24 (value = m * 2^(e-150), unit 2^-24)
    uint32_t q = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (q & 1u))) ++q;
    return uint16_t(sign | q);
  }
  uint32_t r = ax - 0x38000000u;  // rebias exponent 127 -> 15
  const uint32_t rem = r & 0x1FFFu;
  r >>= 13;
  if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) ++r;
  return uint16_t(sign | r);
}

KS_HD float bf16_to_float(uint16_t b) { return bits_to_f32(uint32_t(b) << 16); }

// binary32 -> bfloat16, round to nearest even; NaN stays a quiet NaN.
KS_HD uint16_t float_to_bf16(float f) {
  uint32_t x = f32_to_bits(f);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t((x >> 16) | 0x40u);
  x += 0x7FFFu + ((x >> 16) & 1u);
  return uint16_t(x >> 16);
}

}  // namespace ks
