// Shared by the sampling kernels (sampling.cu, sampling_cluster.cu): their kernel parameters,
// and block-wide reductions and scans for W warps per block with W scratch slots in shared
// memory given by the caller. Every thread of the block must call the reductions (they
// contain __syncthreads) and gets the block's result.
#pragma once

#include <cstdint>

#include "backends/cuda/common.cuh"
#include "ops/args.hpp"

namespace ks::cuda {

struct SampleParams {
  const void* logits;
  int64_t* out;
  uint8_t* valid;
  const int64_t* seed_offset;
  float temperature;
  int64_t top_k;
  double top_p;
  int64_t rows, vocab;
  // sample_finish_row: one warp finishes a row of at most 64 members (1, the default), or the whole
  // CTA (0: KS_SAMPLE_FINISH_WARP=0, for comparisons); the same ids either way
  int finish_warp;
};

// KS_SAMPLE_FINISH_WARP=0 (read once): every row's last step by the whole CTA, for comparisons
inline bool sample_finish_warp() {
  static const bool on = !env_is("KS_SAMPLE_FINISH_WARP", "0");
  return on;
}

inline SampleParams sample_params(const ops::SampleArgs& a) {
  return SampleParams{a.logits.data,
                      static_cast<int64_t*>(a.out.data),
                      a.has_valid ? static_cast<uint8_t*>(a.valid.data) : nullptr,
                      static_cast<const int64_t*>(a.seed_offset.data),
                      a.temperature,
                      a.top_k,
                      a.top_p,
                      a.rows,
                      a.vocab,
                      sample_finish_warp() ? 1 : 0};
}

// Warp-wide sums and inclusive scans of exact 64-bit integers (the order of the additions does
// not change them); the block-wide forms below start with them.
__device__ __forceinline__ unsigned long long warp_sum_u64(unsigned long long v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ unsigned long long warp_inclusive_scan_u64(unsigned long long v) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const unsigned long long y = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += y;
  }
  return v;
}

template <int W>
__device__ __forceinline__ unsigned long long block_sum_u64(unsigned long long v, unsigned long long* scratch) {
  v = warp_sum_u64(v);
  __syncthreads();  // the scratch's previous contents are consumed
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
  __syncthreads();
  unsigned long long s = 0;
  for (int w = 0; w < W; ++w) s += scratch[w];
  return s;
}

template <int W>
__device__ __forceinline__ float block_max_f(float v, float* scratch) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
  __syncthreads();
  float m = scratch[0];
  for (int w = 1; w < W; ++w) m = fmaxf(m, scratch[w]);
  return m;
}

// z = x / t, the CPU's IEEE division (no fast-math), or x itself when t is 1: the same value
// (x / 1 == x for every float, -0, infinities and subnormals included; a NaN x invalidates its row
// whatever z is) without the division's instruction sequence, for every score of a row.
__device__ __forceinline__ float scaled_logit(float x, float t) { return t == 1.0f ? x : x / t; }

// The OR and the AND of v over the block (sm_80+: warp reductions, then the W warps' pairs).
template <int W>
__device__ __forceinline__ void block_or_and(unsigned v_or, unsigned v_and, unsigned long long* scratch,
                                             unsigned* out_or, unsigned* out_and) {
  const unsigned o = __reduce_or_sync(0xffffffffu, v_or), a = __reduce_and_sync(0xffffffffu, v_and);
  __syncthreads();  // the scratch's previous contents are consumed
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = (static_cast<unsigned long long>(o) << 32) | a;
  __syncthreads();
  unsigned ro = 0, ra = 0xffffffffu;
  for (int w = 0; w < W; ++w) {
    ro |= unsigned(scratch[w] >> 32);
    ra &= unsigned(scratch[w]);
  }
  *out_or = ro;
  *out_and = ra;
}

// Inclusive prefix sum over the block in thread order; *total gets the block's sum.
template <int W>
__device__ __forceinline__ unsigned long long block_scan_u64(unsigned long long v, unsigned long long* total,
                                                             unsigned long long* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_inclusive_scan_u64(v);
  __syncthreads();
  if (lane == 31) scratch[warp] = v;
  __syncthreads();
  unsigned long long before = 0, all = 0;
  for (int w = 0; w < W; ++w) {
    if (w < warp) before += scratch[w];
    all += scratch[w];
  }
  *total = all;
  return before + v;
}

}  // namespace ks::cuda
