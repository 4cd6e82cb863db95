// Staging x for the tensor-core quant_matmul variants (quant_mma.cu): the three exact bf16
// pieces of an FP32 value, as cuda_mma_stream and cuda_mma_rows feed fp32 x to bf16 MMAs, and
// the division of a small index by a chunk's width without the division sequence. Plain C++
// usable on the host too, so the CPU tests check them (tests/cpp/test_launch_config.cpp).
#pragma once

#include <cstdint>

#include "core/half.hpp"  // KS_HD, f32_to_bits, bits_to_f32

namespace ks::cuda {

// w[i]'s upper 16 bits are piece i's bf16 pattern, its lower 16 bits zero: piece 0 is v rounded
// toward zero (the first 8 of its 24 significant bits; a NaN gives the canonical 0x7FFF, what
// cvt.rz.bf16.f32 gives), piece 1 the next 8 bits of the remainder v - piece 0 (exact in FP32),
// piece 2 the last 8 (exact in bf16). A non-finite v is all in piece 0 (pieces 1 and 2 are +0).
// So the pieces add up to v exactly for every finite v of magnitude 2^-110 or more; below, the
// bits under bf16's smallest subnormal (2^-133) are dropped (truncated toward zero). The same
// values as converting with __float2bfloat16_rz three times (quant_mma.cu before 2026-12-01), by
// integer operations instead of the conversion unit (a quarter of the FP32 rate on sm_90): the
// bf16 pattern of an FP32 value rounded toward zero is its upper half.
KS_HD void bf16_piece_words(float v, uint32_t (&w)[3]) {
  const uint32_t u = f32_to_bits(v);
  const uint32_t w0 = (u & 0x7fffffffu) > 0x7f800000u ? 0x7fff0000u : (u & 0xffff0000u);
  const float r1 = (w0 & 0x7f800000u) != 0x7f800000u ? v - bits_to_f32(w0) : 0.f;
  const uint32_t w1 = f32_to_bits(r1) & 0xffff0000u;
  const float r2 = r1 - bits_to_f32(w1);
  w[0] = w0;
  w[1] = w1;
  w[2] = f32_to_bits(r2) & 0xffff0000u;
}

// n / d for n < 2^16 and 2 <= d < 2^16 as one high multiply (d = 1 would need m = 2^32): with
// m = div_magic(d) = ceil(2^32 / d), floor(n m / 2^32) = floor(n / d) (the error n (m d - 2^32) /
// (d 2^32) < n / 2^32 < 1 / d stays below the distance from n / d to the next integer, at least
// 1 / d; tested for every n < 2^16 at the widths the kernel uses). cuda_mma_rows' staging indices are below 2^16: each element takes
// 16 bytes or more of a CTA's shared memory, at most 227 KB.
KS_HD uint32_t div_magic(uint32_t d) { return 0xffffffffu / d + 1u; }
KS_HD uint32_t div_by_magic(uint32_t n, uint32_t m) { return uint32_t((uint64_t(n) * m) >> 32); }

}  // namespace ks::cuda

