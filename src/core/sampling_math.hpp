// Arithmetic of ks_sample shared by every backend, written so that the CPU and the
// CUDA code compute bit-identical results (docs/contracts.md#sample):
//  - sample_exp: an FP32 exp from one fixed sequence of IEEE operations (multiply-adds
//    are explicit fmaf, never left to the compiler's contraction), within 2 ulp of exp;
//  - fixed-point weights w = round(2^40 * e) as int64, so every sum is an exact integer
//    and no summation order can change a decision;
//  - Philox4x32-10 (Salmon et al., SC'11), a counter-based generator: the draw of a row
//    depends only on (seed, offset, row);
//  - an order-preserving unsigned key of an FP32 value (for radix selection).
#pragma once

#include <cmath>
#include <cstdint>

#include "core/half.hpp"  // KS_HD, bits_to_f32 / f32_to_bits

namespace ks::sampling {

constexpr int kWeightBits = 40;  // fixed-point fraction bits of the weights

// exp(x) for x <= 0 (the sampler only needs e^(z - max)); 0 below -104 (where the FP32
// result would be denormal or zero), 1 at 0. x = n ln2 + r with |r| <= ln2/2 (two-part
// ln2), e^r by a degree-7 Taylor polynomial (Horner with fmaf), times 2^n exactly.
KS_HD float sample_exp(float x) {
  if (!(x > -104.0f)) return 0.0f;  // also NaN -> 0 (callers exclude NaN rows first)
  if (x >= 0.0f) return 1.0f;
  const float n = rintf(x * 1.44269504088896341f);
  float r = fmaf(-n, 0.693145751953125f, x);  // ln2 high part (exact in the product)
  r = fmaf(-n, 1.42860682030941723212e-6f, r);  // ln2 low part
  float p = 1.98412698412698413e-4f;           // 1/7!
  p = fmaf(p, r, 1.38888888888888889e-3f);     // 1/6!
  p = fmaf(p, r, 8.33333333333333333e-3f);     // 1/5!
  p = fmaf(p, r, 4.16666666666666667e-2f);     // 1/4!
  p = fmaf(p, r, 1.66666666666666667e-1f);     // 1/3!
  p = fmaf(p, r, 0.5f);
  p = fmaf(p, r, 1.0f);
  p = fmaf(p, r, 1.0f);
  // 2^n for n in [-150, 0]: two exact steps keep normal scale factors
  const int ni = int(n);
  const int n1 = ni / 2, n2 = ni - n1;
  const float s1 = ks::bits_to_f32(uint32_t(127 + n1) << 23), s2 = ks::bits_to_f32(uint32_t(127 + n2) << 23);
  return (p * s1) * s2;
}

// w = round(2^40 * e) for e in [0, 1] (exact in FP64, round half to even).
KS_HD int64_t to_weight(float e) {
#if defined(__CUDA_ARCH__)
  return __double2ll_rn(double(e) * 1099511627776.0);
#else
  return std::llrint(double(e) * 1099511627776.0);
#endif
}

// floor(u * w / 2^24) for u < 2^24 and w < 2^63, exactly.
KS_HD uint64_t scale_draw(uint32_t u, uint64_t w) {
  const uint64_t lo = (w & 0xFFFFFFull) * u;  // < 2^48
  const uint64_t hi = (w >> 24) * u;          // < 2^63
  return hi + (lo >> 24);
}

// Philox4x32-10: counter (c0..c3), key (k0, k1) -> four 32-bit outputs; returns the first.
KS_HD uint32_t philox_first(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0, uint32_t k1) {
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = uint64_t(0xD2511F53u) * c0, p1 = uint64_t(0xCD9E8D57u) * c2;
    const uint32_t hi0 = uint32_t(p0 >> 32), lo0 = uint32_t(p0), hi1 = uint32_t(p1 >> 32), lo1 = uint32_t(p1);
    const uint32_t n0 = hi1 ^ c1 ^ k0, n1 = lo1, n2 = hi0 ^ c3 ^ k1, n3 = lo0;
    c0 = n0, c1 = n1, c2 = n2, c3 = n3;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return c0;
}

// The row's 24-bit uniform draw: Philox4x32-10 with key = seed, counter = (offset, row).
KS_HD uint32_t row_draw(uint64_t seed, uint64_t offset, uint64_t row) {
  return philox_first(uint32_t(offset), uint32_t(offset >> 32), uint32_t(row), uint32_t(row >> 32), uint32_t(seed),
                      uint32_t(seed >> 32)) >>
         8;
}

// Order-preserving key: a < b (as floats, no NaN) iff key(a) < key(b); -0 == +0.
KS_HD uint32_t order_key(float f) {
  if (f == 0.0f) f = 0.0f;
  const uint32_t u = ks::f32_to_bits(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// The float whose order_key is key (for keys order_key gives): f itself, except that -0 comes
// back as +0 (order_key does not tell them apart). A NaN's key gives a NaN.
KS_HD float from_order_key(uint32_t key) {
  return ks::bits_to_f32((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

}  // namespace ks::sampling
