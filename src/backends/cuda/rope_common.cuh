// What every CUDA RoPE kernel shares (rope_kv.cu's three, and the q/k/v matmul's RoPE
// epilogue in model_ops.cu): the inverse-frequency table passed by value and the rotation.
#pragma once

#include <cstdint>

namespace ks::cpu {
void rope_inv_freq(int64_t rotary_dim, double theta, float* inv_freq);  // backends/cpu/reference.cpp
}

namespace ks::cuda {

// inv_freq computed on the host by the CPU reference's own function and passed by value
// (2 KB of kernel parameters) for rotary_dim <= 1024, so both backends rotate by the same
// FP32 frequencies (a device pow may round one of them to the neighbouring FP32 value,
// which at positions near 2^31 changes the angle completely).
constexpr int64_t kRopeParamHalf = 512;
struct RopeTable {
  float inv[kRopeParamHalf];
};

// The rotation of one pair, with every product and sum rounded on its own (no FMA
// contraction): every kernel that rotates, whatever code the compiler makes around it,
// gives the same bits, and the same as the CPU reference's unfused FP32 expression.
__device__ __forceinline__ void rope_rotate(float x0, float x1, float c, float s, float& r0, float& r1) {
  r0 = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
  r1 = __fadd_rn(__fmul_rn(x1, c), __fmul_rn(x0, s));
}

}  // namespace ks::cuda
