// Decoding of GGUF block formats, one block at a time, in FP32.
// Layouts (little endian):
//   Q4_0 (18 B / 32): f16 d; 16 bytes qs. Element j < 16 is the low nibble of qs[j],
//                     element j + 16 the high nibble. w = d * (q - 8).
//   Q4_1 (20 B / 32): f16 d; f16 m; 16 bytes qs (as Q4_0). w = d * q + m.
//   Q8_0 (34 B / 32): f16 d; 32 int8 qs. w = d * q.
//   F32 / F16 / BF16: one element per "block".
// Rounding: d and m are exact in FP32; d * q (+ m) is evaluated in FP32
// (a fused multiply-add is permitted where the compiler contracts it).
#pragma once

#include <kernscope/kernscope.h>

#include <cstdint>
#include <cstring>

#include "core/half.hpp"

namespace ks::cpu {

inline uint16_t rd_u16(const uint8_t* p) { return uint16_t(p[0] | (p[1] << 8)); }

// Decodes `n_blocks` consecutive blocks of format q starting at src into dst
// (n_blocks * block_size floats).
inline void decode_blocks(ks_qtype_t q, const uint8_t* src, int64_t n_blocks, float* dst) {
  switch (q) {
    case KS_QTYPE_F32:
      std::memcpy(dst, src, size_t(n_blocks) * 4);
      break;
    case KS_QTYPE_F16:
      for (int64_t i = 0; i < n_blocks; ++i) dst[i] = half_to_float(rd_u16(src + 2 * i));
      break;
    case KS_QTYPE_BF16:
      for (int64_t i = 0; i < n_blocks; ++i) dst[i] = bf16_to_float(rd_u16(src + 2 * i));
      break;
    case KS_QTYPE_Q4_0:
      for (int64_t b = 0; b < n_blocks; ++b, src += 18, dst += 32) {
        const float d = half_to_float(rd_u16(src));
        for (int j = 0; j < 16; ++j) {
          dst[j] = d * float(int(src[2 + j] & 0x0F) - 8);
          dst[j + 16] = d * float(int(src[2 + j] >> 4) - 8);
        }
      }
      break;
    case KS_QTYPE_Q4_1:
      for (int64_t b = 0; b < n_blocks; ++b, src += 20, dst += 32) {
        const float d = half_to_float(rd_u16(src));
        const float m = half_to_float(rd_u16(src + 2));
        for (int j = 0; j < 16; ++j) {
          dst[j] = d * float(src[4 + j] & 0x0F) + m;
          dst[j + 16] = d * float(src[4 + j] >> 4) + m;
        }
      }
      break;
    case KS_QTYPE_Q8_0:
      for (int64_t b = 0; b < n_blocks; ++b, src += 34, dst += 32) {
        const float d = half_to_float(rd_u16(src));
        for (int j = 0; j < 32; ++j) dst[j] = d * float(int8_t(src[2 + j]));
      }
      break;
    default:
      break;
  }
}

}  // namespace ks::cpu
