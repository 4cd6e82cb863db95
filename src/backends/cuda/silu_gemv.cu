// silu_and_mul and gemv on CUDA (contracts in docs/contracts.md).
//
// silu_and_mul: a 2-D grid (column tiles x rows); each thread converts UNROLL
//   vectors of gate and up, computes g * (1 / (1 + exp(-g))) * u in FP32 and
//   stores one rounded vector (fp32: expf and IEEE division; fp16/bf16: __expf
//   and __fdividef, whose error is far below the 16-bit rounding). VEC = 16 / sizeof(T) when x and
//   out are 16-byte aligned and D % VEC == 0, else 1.
// gemv: one warp per output row (WARPS rows per CTA). Lanes stride the row with
//   16-byte loads, UNROLL loads in flight, FP32 partial sums reduced by a warp
//   butterfly. x is read through L1/L2 (it is shared by every row).
#include <algorithm>
#include <cstdio>

#include "backends/cuda/common.cuh"
#include "ops/args.hpp"

namespace ks::cuda {

template <typename T, int VEC, int UNROLL>
__global__ void __launch_bounds__(256) silu_and_mul_kernel(const T* __restrict__ x, T* __restrict__ out, int64_t rows,
                                                           int64_t d) {
  pdl_begin();
  const int64_t dv = d / VEC;
  for (int64_t row = blockIdx.y; row < rows; row += gridDim.y) {
    const T* g = x + row * 2 * d;
    const T* u = g + d;
    T* o = out + row * d;
    const int64_t first = (int64_t(blockIdx.x) * blockDim.x * UNROLL) + threadIdx.x;
    Vec<T, VEC> gv[UNROLL], uv[UNROLL];
#pragma unroll
    for (int k = 0; k < UNROLL; ++k) {
      const int64_t i = first + int64_t(k) * blockDim.x;
      if (i < dv) {
        gv[k] = load_vec<T, VEC>(g + i * VEC);
        uv[k] = load_vec<T, VEC>(u + i * VEC);
      }
    }
#pragma unroll
    for (int k = 0; k < UNROLL; ++k) {
      const int64_t i = first + int64_t(k) * blockDim.x;
      if (i < dv) {
        OutVec<T, VEC> r;
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          r.set(j, silu_times<T>(gv[k].f(j), uv[k].f(j)));  // (common.cuh)
        }
        store_vec<T, VEC>(o + i * VEC, r);
      }
    }
  }
}

template <typename T, int VEC>
void launch_silu(const ops::SiluAndMulArgs& a, cudaStream_t s, int* unroll_out, int* gx_out) {
  const int64_t dv = a.d / VEC;
  constexpr int kThreads = 256;
  // Unroll only when the grid still covers every SM twice: small calls are
  // latency-bound and want as many CTAs issuing loads at once as possible.
  const DeviceProps& dp = device_props(a.x.device.device_id);
  const int sm = dp.sm_count;
  const int64_t vectors = dv * a.rows;
  const int unroll = vectors >= int64_t(8) * sm * kThreads ? 4 : vectors >= int64_t(4) * sm * kThreads ? 2 : 1;
  const int64_t gx = (dv + kThreads * unroll - 1) / (kThreads * unroll);
  const dim3 grid(unsigned(gx), unsigned(std::min<int64_t>(a.rows, 65535)));
  const T* x = static_cast<const T*>(a.x.data);
  T* o = static_cast<T*>(a.out.data);
  auto kern = unroll == 4 ? silu_and_mul_kernel<T, VEC, 4> : unroll == 2 ? silu_and_mul_kernel<T, VEC, 2>
                                                                        : silu_and_mul_kernel<T, VEC, 1>;
  launch_kernel("silu_and_mul", kern, grid, dim3(kThreads), 0, s, 1, dp.pdl, x, o, a.rows, a.d);
  *unroll_out = unroll;
  *gx_out = int(gx);
}

template <typename T>
int silu_t(const ops::SiluAndMulArgs& a, cudaStream_t s, int* unroll, int* gx) {
  constexpr int V = 16 / sizeof(T);
  const bool vec_ok = aligned16(a.x.data) && aligned16(a.out.data) && a.d % V == 0;
  if (vec_ok) {
    launch_silu<T, V>(a, s, unroll, gx);
    return V;
  }
  launch_silu<T, 1>(a, s, unroll, gx);
  return 1;
}

void silu_and_mul_cuda(const void* args, ks_stream_t stream) {
  const auto& a = *static_cast<const ops::SiluAndMulArgs*>(args);
  DeviceGuard g(a.x.device.device_id, "silu_and_mul");
  const auto s = static_cast<cudaStream_t>(stream);
  int vec = 1, unroll = 1, gx = 0;
  with_float_type(a.x.dtype, [&](auto tag) { vec = silu_t<decltype(tag)>(a, s, &unroll, &gx); });
  check_launch("silu_and_mul");
  record_launch("silu_and_mul", "vec=%lld unroll=%lld threads=256 grid=%lldx%lld",
                {vec, unroll, gx, (long long)std::min<int64_t>(a.rows, 65535)});
}

// ---- gemv -----------------------------------------------------------------
template <typename T, int VEC, int UNROLL>
__global__ void __launch_bounds__(256) gemv_kernel(const T* __restrict__ w, const T* __restrict__ x, T* __restrict__ out,
                                                   int64_t n, int64_t h) {
  pdl_begin();
  const int lane = threadIdx.x & 31;
  const int64_t row = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (row >= n) return;
  const T* wr = w + row * h;
  const int64_t hv = h / VEC;
  float acc[UNROLL];
#pragma unroll
  for (int k = 0; k < UNROLL; ++k) acc[k] = 0.f;
  int64_t i = lane;
  for (; i + int64_t(UNROLL - 1) * 32 < hv; i += 32 * UNROLL) {
    // Unpacked 16-bit vectors (Vec<..., false>): the packed layout measured ~0.1 us
    // slower at decode sizes (512 x 1024) and saved no registers here.
    Vec<T, VEC, false> wv[UNROLL], xv[UNROLL];
#pragma unroll
    for (int k = 0; k < UNROLL; ++k) {
      wv[k] = load_vec<T, VEC, false>(wr + (i + k * 32) * VEC);
      xv[k] = load_vec<T, VEC, false>(x + (i + k * 32) * VEC);
    }
#pragma unroll
    for (int k = 0; k < UNROLL; ++k)
#pragma unroll
      for (int j = 0; j < VEC; ++j) acc[k] += wv[k].f(j) * xv[k].f(j);
  }
  for (; i < hv; i += 32) {
    const auto wv = load_vec<T, VEC, false>(wr + i * VEC);
    const auto xv = load_vec<T, VEC, false>(x + i * VEC);
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc[0] += wv.f(j) * xv.f(j);
  }
  float s = 0.f;
#pragma unroll
  for (int k = 0; k < UNROLL; ++k) s += acc[k];
  s = warp_sum(s);
  if (lane == 0) out[row] = Dt<T>::from_f(s);
}

template <typename T>
int gemv_t(const ops::GemvArgs& a, cudaStream_t s, int* warps_out) {
  constexpr int V = 16 / sizeof(T);
  const bool vec_ok = aligned16(a.x.data) && aligned16(a.weight.data) && a.h % V == 0;
  const DeviceProps& dp = device_props(a.x.device.device_id);
  const int sm = dp.sm_count;
  // 8 warps per CTA, fewer when that would leave SMs idle.
  int warps = 8;
  while (warps > 2 && (a.n + warps - 1) / warps < 2 * sm) warps /= 2;
  const dim3 grid(unsigned((a.n + warps - 1) / warps)), block(32 * warps);
  const T* w = static_cast<const T*>(a.weight.data);
  const T* x = static_cast<const T*>(a.x.data);
  T* o = static_cast<T*>(a.out.data);
  *warps_out = warps;
  if (vec_ok) {
    launch_kernel("gemv", gemv_kernel<T, V, 4>, grid, block, 0, s, 1, dp.pdl, w, x, o, a.n, a.h);
    return V;
  }
  launch_kernel("gemv", gemv_kernel<T, 1, 8>, grid, block, 0, s, 1, dp.pdl, w, x, o, a.n, a.h);
  return 1;
}

void gemv_cuda(const void* args, ks_stream_t stream) {
  const auto& a = *static_cast<const ops::GemvArgs*>(args);
  DeviceGuard g(a.x.device.device_id, "gemv");
  const auto s = static_cast<cudaStream_t>(stream);
  int vec = 1, warps = 0;
  with_float_type(a.x.dtype, [&](auto tag) { vec = gemv_t<decltype(tag)>(a, s, &warps); });
  check_launch("gemv");
  record_launch("gemv", "vec=%lld warp_per_row warps_per_cta=%lld unroll=%lld", {vec, warps, vec > 1 ? 4 : 8});
}

}  // namespace ks::cuda
