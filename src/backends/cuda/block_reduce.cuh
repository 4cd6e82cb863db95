// Block-wide reductions and scans of the sampling kernels (sampling.cu, sampling_cluster.cu):
// W warps per block, W scratch slots in shared memory given by the caller. Every thread of
// the block must call them (they contain __syncthreads) and gets the block's result.
#pragma once

namespace ks::cuda {

template <int W>
__device__ __forceinline__ unsigned long long block_sum_u64(unsigned long long v, unsigned long long* scratch) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
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

// Inclusive prefix sum over the block in thread order; *total gets the block's sum.
template <int W>
__device__ __forceinline__ unsigned long long block_scan_u64(unsigned long long v, unsigned long long* total,
                                                             unsigned long long* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const unsigned long long x = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += x;
  }
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
