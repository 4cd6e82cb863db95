// rms_norm and fused_add_rms_norm on CUDA (contracts in docs/contracts.md).
//
// A "row group" of W warps owns one row; a CTA holds R row groups (W * R * 32
// threads). Each thread keeps NV vectors of VEC elements in registers, so a row
// is read from memory once; rows wider than the register budget (NV = 0) take
// two passes, the second served mostly by L2. Sums of squares are FP32: per
// thread in index order, then a warp butterfly, then the row group's warps.
// That order depends only on (H, W, NV, VEC), which the launcher derives from H
// and pointer alignment alone, so a row's result never depends on the row count.
// VEC = 16 / sizeof(T) when every pointer is 16-byte aligned and H % VEC == 0,
// else 1 (scalar path: offset views, odd widths). Indexing is int64.
#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "backends/cuda/common.cuh"
#include "ops/args.hpp"

namespace ks::cuda {

struct NormParams {
  const void* x;
  const void* residual;  // fused only (in/out)
  const void* weight;
  void* out;             // rms_norm: out; fused: x (in place)
  void* res_out;         // fused: residual
  int64_t rows, hidden;
  float eps;
  int warps_per_row, rows_per_cta;
};

template <int W_MAX>
__device__ __forceinline__ float row_group_sum(float v, float* red, int group, int warp_in_row, int warps_per_row,
                                               int lane) {
  v = warp_sum(v);
  if (warps_per_row == 1) return v;
  __syncthreads();
  if (lane == 0) red[group * W_MAX + warp_in_row] = v;
  __syncthreads();
  float s = 0.f;
  for (int i = 0; i < warps_per_row; ++i) s += red[group * W_MAX + i];  // same order in every thread
  return s;
}

constexpr int kWMax = 32;

// FUSED = false: out = rms_norm(x). FUSED = true: s = x + residual; residual = s; x = rms_norm(s).
// PRELOAD_W: load the weights together with the row (one memory round trip
// instead of two: pays when few rows are in flight; costs registers otherwise).
// Register budget: cached kernels without preloaded weights (the large-grid ones) are
// capped at 48 registers per thread (rms_norm) or 64 (fused_add_rms_norm, which holds
// the residual too): the most rows in flight per SM that ptxas reaches without
// spilling for NV <= 4 (checked with -Xptxas -v; 256-thread row groups: 5 or 4 per
// SM instead of 3 or 2). Decode-size grids (preloaded weights) and NV = 8 may use
// up to 128: latency, not occupancy, bounds them.
template <typename T, int VEC, int NV, bool FUSED, bool PRELOAD_W>
__global__ void __launch_bounds__(NV > 0 ? 512 : 1024) __maxnreg__(NV > 0 && NV <= 4 && !PRELOAD_W ? (FUSED ? 64 : 48) : 128)
    norm_kernel(const NormParams p) {
  __shared__ float red[kWMax * 8];
  pdl_begin();
  const int tpr = p.warps_per_row * 32;
  const int group = threadIdx.x / tpr, lt = threadIdx.x % tpr;
  const int lane = threadIdx.x & 31, warp_in_row = lt >> 5;
  const int64_t H = p.hidden, hv = H / VEC;
  const T* x = static_cast<const T*>(p.x);  // may alias out (in place): no __restrict__
  const T* r = static_cast<const T*>(p.residual);
  const T* __restrict__ w = static_cast<const T*>(p.weight);
  T* out = static_cast<T*>(p.out);
  T* rout = static_cast<T*>(p.res_out);
  const int64_t step = int64_t(gridDim.x) * p.rows_per_cta;
  for (int64_t base = int64_t(blockIdx.x) * p.rows_per_cta; base < p.rows; base += step) {
    const int64_t row = base + group;
    const bool active = group < p.rows_per_cta && row < p.rows;
    const int64_t off = row * H;
    float ss = 0.f;
    if constexpr (NV > 0) {
      // The row stays in registers as raw 16-byte vectors (half the registers of
      // FP32 copies, so more rows are in flight per SM); s = x (+ residual) is
      // recomputed from them in the second phase, bit-identically. In-row offsets
      // are 32-bit (a cached row has at most 8 * 512 vectors) from per-row bases:
      // fewer live registers, more rows in flight. (No division here: a 64-bit
      // divide before the first load cost decode sizes ~0.1 us.)
      const int hv32 = active ? int(hv) : 0;
      const T* xrow = x + off + lt * VEC;
      const T* rrow = FUSED ? r + off + lt * VEC : nullptr;
      const T* wrow = w + lt * VEC;
      const int stride = tpr * VEC;
      Vec<T, VEC> xv[NV], rv[NV], wv[NV];
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        if (lt + i * tpr < hv32) {
          if constexpr (PRELOAD_W) wv[i] = load_vec<T, VEC>(wrow + i * stride);
          xv[i] = load_vec<T, VEC>(xrow + i * stride);
          if constexpr (FUSED) rv[i] = load_vec<T, VEC>(rrow + i * stride);
        }
      }
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        if (lt + i * tpr < hv32) {
          OutVec<T, VEC> so;
#pragma unroll
          for (int j = 0; j < VEC; ++j) {
            const float v = FUSED ? xv[i].f(j) + rv[i].f(j) : xv[i].f(j);
            ss += v * v;
            if constexpr (FUSED) so.set(j, v);
          }
          if constexpr (FUSED) store_vec<T, VEC>(rout + off + lt * VEC + i * stride, so);
        }
      }
      const float total = row_group_sum<kWMax>(ss, red, group, warp_in_row, p.warps_per_row, lane);
      const float scale = 1.0f / sqrtf(total / float(H) + p.eps);
      if constexpr (!PRELOAD_W) {  // large grids: registers are rows in flight (decode: latency)
#pragma unroll
        for (int i = 0; i < NV; ++i) {
          opaque(xv[i]);
          if constexpr (FUSED) opaque(rv[i]);
        }
      }
      T* orow = out + off + lt * VEC;
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        if (lt + i * tpr < hv32) {
          if constexpr (!PRELOAD_W) wv[i] = load_vec<T, VEC>(wrow + i * stride);
          OutVec<T, VEC> o;
#pragma unroll
          for (int j = 0; j < VEC; ++j) {
            const float v = FUSED ? xv[i].f(j) + rv[i].f(j) : xv[i].f(j);
            o.set(j, v * scale * wv[i].f(j));
          }
          store_vec<T, VEC>(orow + i * stride, o);
        }
      }
    } else {
      // Two passes; residual is written only in the second so pass 2 re-reads the inputs.
      if (active)
        for (int64_t idx = lt; idx < hv; idx += tpr) {
          const auto xv = load_vec<T, VEC>(x + off + idx * VEC);
          Vec<T, VEC> rv;
          if constexpr (FUSED) rv = load_vec<T, VEC>(r + off + idx * VEC);
#pragma unroll
          for (int j = 0; j < VEC; ++j) {
            const float v = FUSED ? xv.f(j) + rv.f(j) : xv.f(j);
            ss += v * v;
          }
        }
      const float total = row_group_sum<kWMax>(ss, red, group, warp_in_row, p.warps_per_row, lane);
      const float scale = 1.0f / sqrtf(total / float(H) + p.eps);
      if (active)
        for (int64_t idx = lt; idx < hv; idx += tpr) {
          const auto xv = load_vec<T, VEC>(x + off + idx * VEC);
          Vec<T, VEC> rv;
          if constexpr (FUSED) rv = load_vec<T, VEC>(r + off + idx * VEC);
          const auto wv = load_vec<T, VEC>(w + idx * VEC);
          OutVec<T, VEC> o, so;
#pragma unroll
          for (int j = 0; j < VEC; ++j) {
            const float v = FUSED ? xv.f(j) + rv.f(j) : xv.f(j);
            if constexpr (FUSED) so.set(j, v);
            o.set(j, v * scale * wv.f(j));
          }
          if constexpr (FUSED) store_vec<T, VEC>(rout + off + idx * VEC, so);
          store_vec<T, VEC>(out + off + idx * VEC, o);
        }
    }
  }
}

namespace {

struct NormConfig {
  int vec, nv, warps_per_row, rows_per_cta, grid;
  bool preload_w;
};

// Shape -> launch configuration (documented in docs/cuda.md).
NormConfig choose(int64_t rows, int64_t H, int es, bool vec_ok, int sm_count) {
  NormConfig c{};
  c.vec = vec_ok ? 16 / es : 1;
  const RowGroupConfig g = row_group_config(rows, (H + c.vec - 1) / c.vec, c.vec == 1, sm_count);
  c.nv = g.nv;
  c.warps_per_row = g.warps_per_row;
  c.rows_per_cta = g.rows_per_cta;
  c.grid = g.grid;
  // KS_NORM_PRELOAD=N moves preload_weights' threshold to N CTAs per SM (experiments).
  static const int64_t preload_ctas_per_sm = [] {
    const long long v = env_number("KS_NORM_PRELOAD", 0);
    return int64_t(v > 0 ? v : 8);
  }();
  c.preload_w = preload_weights((rows + g.rows_per_cta - 1) / g.rows_per_cta, sm_count, preload_ctas_per_sm);
  return c;
}

template <typename T, int VEC, bool FUSED, bool PW>
void launch_nv(const NormConfig& c, const NormParams& p, cudaStream_t s, bool pdl) {
  const dim3 block(32 * c.warps_per_row * c.rows_per_cta), grid(c.grid);
  const char* op = FUSED ? "fused_add_rms_norm" : "rms_norm";
  switch (c.nv) {
    case 1: launch_kernel(op, norm_kernel<T, VEC, 1, FUSED, PW>, grid, block, 0, s, 1, pdl, p); break;
    case 2: launch_kernel(op, norm_kernel<T, VEC, 2, FUSED, PW>, grid, block, 0, s, 1, pdl, p); break;
    case 4: launch_kernel(op, norm_kernel<T, VEC, 4, FUSED, PW>, grid, block, 0, s, 1, pdl, p); break;
    case 8:
      if constexpr (VEC > 1) {
        launch_kernel(op, norm_kernel<T, VEC, 8, FUSED, PW>, grid, block, 0, s, 1, pdl, p);
        break;
      }
      [[fallthrough]];
    default: launch_kernel(op, norm_kernel<T, VEC, 0, FUSED, false>, grid, block, 0, s, 1, pdl, p); break;
  }
}

template <typename T, bool FUSED>
void launch_t(const NormConfig& c, const NormParams& p, cudaStream_t s, bool pdl) {
  constexpr int V = 16 / sizeof(T);
  if (c.vec == V)
    c.preload_w ? launch_nv<T, V, FUSED, true>(c, p, s, pdl) : launch_nv<T, V, FUSED, false>(c, p, s, pdl);
  else
    c.preload_w ? launch_nv<T, 1, FUSED, true>(c, p, s, pdl) : launch_nv<T, 1, FUSED, false>(c, p, s, pdl);
}

template <bool FUSED>
void launch(detail::DType dt, const NormConfig& c, const NormParams& p, cudaStream_t s, bool pdl) {
  with_float_type(dt, [&](auto tag) { launch_t<decltype(tag), FUSED>(c, p, s, pdl); });
}

constexpr const char* kNormFmt = "vec=%lld nv=%lld warps_per_row=%lld rows_per_cta=%lld grid=%lld preload_w=%lld";
void record(const char* op, const NormConfig& c) {
  record_launch(op, kNormFmt, {c.vec, c.nv, c.warps_per_row, c.rows_per_cta, c.grid, c.preload_w ? 1 : 0});
}

}  // namespace

void rms_norm_cuda(const void* args, ks_stream_t stream) {
  const auto& a = *static_cast<const ops::RmsNormArgs*>(args);
  DeviceGuard g(a.x.device.device_id, "rms_norm");
  const int es = detail::dtype_bytes(a.x.dtype);
  const bool vec_ok = aligned16(a.x.data) && aligned16(a.out.data) && aligned16(a.weight.data) && (a.hidden * es) % 16 == 0;
  const DeviceProps& dp = device_props(a.x.device.device_id);
  const NormConfig c = choose(a.rows, a.hidden, es, vec_ok, dp.sm_count);
  NormParams p{a.x.data, nullptr, a.weight.data, a.out.data, nullptr, a.rows, a.hidden, a.eps, c.warps_per_row,
               c.rows_per_cta};
  launch<false>(a.x.dtype, c, p, static_cast<cudaStream_t>(stream), dp.pdl);
  check_launch("rms_norm");
  record("rms_norm", c);
}

void fused_add_rms_norm_cuda(const void* args, ks_stream_t stream) {
  const auto& a = *static_cast<const ops::FusedAddRmsNormArgs*>(args);
  DeviceGuard g(a.x.device.device_id, "fused_add_rms_norm");
  const int es = detail::dtype_bytes(a.x.dtype);
  const bool vec_ok = aligned16(a.x.data) && aligned16(a.residual.data) && aligned16(a.weight.data) &&
                      (a.hidden * es) % 16 == 0;
  const DeviceProps& dp = device_props(a.x.device.device_id);
  const NormConfig c = choose(a.rows, a.hidden, es, vec_ok, dp.sm_count);
  NormParams p{a.x.data, a.residual.data, a.weight.data, a.x.data, a.residual.data, a.rows, a.hidden, a.eps,
               c.warps_per_row, c.rows_per_cta};
  launch<true>(a.x.dtype, c, p, static_cast<cudaStream_t>(stream), dp.pdl);
  check_launch("fused_add_rms_norm");
  record("fused_add_rms_norm", c);
}

}  // namespace ks::cuda
