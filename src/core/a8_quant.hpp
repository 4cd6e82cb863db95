// quant_matmul_a8's arithmetic (docs/contracts.md#quant_matmul_a8), one definition for the CPU
// reference and the CUDA kernels, so that every backend quantizes x to the same codes and forms
// every block's value with the same FP32 operations.
//
// x is quantized per block of 32 values (the weights' block size), as in llama.cpp's Q8_1
// activations (W4A8 / W8A8):
//   a = max |x_i|; the block is "bad" if any x_i is NaN or +-inf;
//   bad:               d = NaN, q_i = 0            (every output of the row is NaN)
//   a / 127 < FLT_MIN: d = 0,   q_i = 0            (a < 1.5e-36, including an all-zero block)
//   else:              d = a / 127, q_i = rint(x_i * (127 / a)) in [-127, 127] (ties to even)
// (every operation one FP32 rounding, to nearest even). Then, with S = sum c_i q_i and Q = sum q_i
// exact in int32 (c_i the weight's stored code: the nibble 0..15 for Q4_0 and Q4_1, the signed
// byte for Q8_0), one block's value is
//   Q8_0: (dw * d) * S       Q4_0: (dw * d) * (S - 8 Q)       Q4_1: fma(dw * d, S, mw * (d * Q))
// with dw, mw the block's fp16 scale and minimum; S and Q convert to FP32 exactly (|S| < 2^20).
// A row's block values are summed in FP32 in one fixed order (a8_row_sum), so every backend gives
// the same bits (a NaN's sign and payload aside).
#pragma once

#include <kernscope/kernscope.h>

#include <cfloat>
#include <cmath>
#include <cstdint>

#include "core/half.hpp"

namespace ks {

// The scale of one block of x: d (NaN for a bad block, 0 for a negligible one) and the factor
// that takes x to codes (0 where every code is 0).
struct A8Scale {
  float d, inv;
};

// amax: max |x_i| over the block's finite values; bad: the block holds a NaN or an infinity.
KS_HD A8Scale a8_scale(float amax, bool bad) {
  if (bad) return {NAN, 0.f};
  const float d = amax / 127.f;
  if (!(d >= FLT_MIN)) return {0.f, 0.f};
  return {d, 127.f / amax};
}

// One value's code: x * inv rounded to nearest even, in [-127, 127] (x finite).
KS_HD int a8_code(float x, float inv) {
  const float t = rintf(x * inv);
  return int(fminf(fmaxf(t, -127.f), 127.f));
}

// d * Q, the block's sum of x as quantized (Q4_1's minimum term).
KS_HD float a8_dq(float d, int Qs) { return d * float(Qs); }

// One block's value from its exact integer sums: S = sum c_i q_i, Qs = sum q_i (Q4_0 only), dq =
// a8_dq(d, Qs) (Q4_1 only); dw, mw the weight block's scale and minimum (mw: Q4_1 only), d the x
// block's scale.
template <ks_qtype_t Q>
KS_HD float a8_block_value(float dw, float mw, float d, float dq, int S, int Qs) {
  if constexpr (Q == KS_QTYPE_Q4_1) {
    return fmaf(dw * d, float(S), mw * dq);
  } else if constexpr (Q == KS_QTYPE_Q4_0) {
    return (dw * d) * float(S - 8 * Qs);
  } else {
    return (dw * d) * float(S);
  }
}

// A row's sum of its nb block values v, in the order every backend uses (the CUDA kernels' warp
// order): lane sums s_l = ((0 + v_l) + v_{l+32}) + ... for l < 32 (0 where l >= nb), then a
// butterfly: for o = 16, 8, 4, 2, 1, s_l = s_l + s_{l xor o}; the sum is s_0.
inline float a8_row_sum(const float* v, int64_t nb) {
  float s[32];
  for (int l = 0; l < 32; ++l) {
    s[l] = 0.f;
    for (int64_t b = l; b < nb; b += 32) s[l] += v[b];
  }
  for (int o = 16; o > 0; o >>= 1) {
    float t[32];
    for (int l = 0; l < 32; ++l) t[l] = s[l] + s[l ^ o];
    for (int l = 0; l < 32; ++l) s[l] = t[l];
  }
  return s[0];
}

}  // namespace ks
