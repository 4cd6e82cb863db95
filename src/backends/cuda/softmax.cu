// softmax on CUDA (contract: torch.softmax on the fp32 upcast; NaN / +inf / all
// -inf rows give NaN rows).
//
// Two kernels:
//  - row groups (as rms_norm): W warps own a row, values cached in registers;
//    max (with a NaN flag), then sum of exp, then the normalized store.
//  - clusters (sm_90, few wide rows): a thread-block cluster of C CTAs splits one
//    row, each CTA staging its slice in shared memory; partial max / sum travel
//    through distributed shared memory, so the row is read from HBM once with C
//    SMs' bandwidth behind it.
// exp is expf (full precision); the division is IEEE. The reduction order depends
// only on H and the launch configuration derived from H (batch-invariant).
#include <cooperative_groups.h>

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "backends/cuda/common.cuh"
#include "ops/args.hpp"

namespace cg = cooperative_groups;

namespace ks::cuda {

struct SoftmaxParams {
  const void* x;
  void* out;
  int64_t rows, cols;
  int warps_per_row, rows_per_cta;
  int64_t slice;  // cluster path: vectors per CTA
};

constexpr int kSmWMax = 32;

// exp for the contract: expf for fp32 outputs; the hardware exp2 path (__expf,
// relative error ~1e-7, far below 16-bit rounding) for fp16/bf16 outputs.
template <typename T>
__device__ __forceinline__ float sm_exp(float v) {
  if constexpr (sizeof(T) == 2) return __expf(v);
  else return expf(v);
}

// Sum (or max, or) over a row group's warps; every thread gets the same value.
template <int OP>  // 0 sum, 1 max, 2 logical or (as 0/1 floats)
__device__ __forceinline__ float group_reduce(float v, float* red, int group, int warp_in_row, int wpr, int lane) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float u = __shfl_xor_sync(0xffffffffu, v, o);
    v = OP == 0 ? v + u : fmaxf(v, u);
  }
  if (wpr == 1) return v;
  __syncthreads();
  if (lane == 0) red[group * kSmWMax + warp_in_row] = v;
  __syncthreads();
  float r = red[group * kSmWMax];
  for (int i = 1; i < wpr; ++i) r = OP == 0 ? r + red[group * kSmWMax + i] : fmaxf(r, red[group * kSmWMax + i]);
  return r;
}

template <typename T, int VEC, int NV>
__global__ void __launch_bounds__(NV > 0 ? 512 : 1024) softmax_kernel(const SoftmaxParams p) {
  __shared__ float red[kSmWMax * 8];
  const int tpr = p.warps_per_row * 32;
  const int group = threadIdx.x / tpr, lt = threadIdx.x % tpr;
  const int lane = threadIdx.x & 31, wir = lt >> 5;
  const int64_t H = p.cols, hv = H / VEC;
  const T* x = static_cast<const T*>(p.x);  // may alias out (in place)
  T* out = static_cast<T*>(p.out);
  const int64_t step = int64_t(gridDim.x) * p.rows_per_cta;
  for (int64_t base = int64_t(blockIdx.x) * p.rows_per_cta; base < p.rows; base += step) {
    const int64_t row = base + group;
    const bool active = group < p.rows_per_cta && row < p.rows;
    const int64_t off = row * H;
    float mx = -INFINITY, nan = 0.f;
    Vec<T, VEC> xr[NV > 0 ? NV : 1];  // the row, raw (16-byte vectors)
    if constexpr (NV > 0) {
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        const int64_t idx = lt + int64_t(i) * tpr;
        if (active && idx < hv) xr[i] = load_vec<T, VEC>(x + off + idx * VEC);
      }
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        const int64_t idx = lt + int64_t(i) * tpr;
        if (active && idx < hv)
#pragma unroll
          for (int j = 0; j < VEC; ++j) {
            const float f = xr[i].f(j);
            nan = isnan(f) ? 1.f : nan;
            mx = fmaxf(mx, f);
          }
      }
    } else if (active) {
      for (int64_t idx = lt; idx < hv; idx += tpr) {
        const auto xv = load_vec<T, VEC>(x + off + idx * VEC);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const float f = xv.f(j);
          nan = isnan(f) ? 1.f : nan;
          mx = fmaxf(mx, f);
        }
      }
    }
    mx = group_reduce<1>(mx, red, group, wir, p.warps_per_row, lane);
    nan = group_reduce<1>(nan, red, group, wir, p.warps_per_row, lane);
    const bool bad = nan != 0.f || isinf(mx);  // NaN, +inf maximum, or all -inf
    float sum = 0.f;
    if constexpr (NV > 0) {
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        const int64_t idx = lt + int64_t(i) * tpr;
        if (active && !bad && idx < hv)
#pragma unroll
          for (int j = 0; j < VEC; ++j) sum += sm_exp<T>(xr[i].f(j) - mx);
      }
    } else if (active && !bad) {
      for (int64_t idx = lt; idx < hv; idx += tpr) {
        const auto xv = load_vec<T, VEC>(x + off + idx * VEC);
#pragma unroll
        for (int j = 0; j < VEC; ++j) sum += sm_exp<T>(xv.f(j) - mx);
      }
    }
    sum = group_reduce<0>(sum, red, group, wir, p.warps_per_row, lane);
    if (!active) continue;
    const float inv = 1.0f / sum;  // one IEEE division per row; e * inv is within 1 ulp of e / sum
    if constexpr (NV > 0) {
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        const int64_t idx = lt + int64_t(i) * tpr;
        if (idx < hv) {
          Vec<T, VEC> o;
#pragma unroll
          for (int j = 0; j < VEC; ++j) o.set(j, bad ? NAN : sm_exp<T>(xr[i].f(j) - mx) * inv);
          store_vec<T, VEC>(out + off + idx * VEC, o);
        }
      }
    } else {
      for (int64_t idx = lt; idx < hv; idx += tpr) {
        const auto xv = load_vec<T, VEC>(x + off + idx * VEC);
        Vec<T, VEC> o;
#pragma unroll
        for (int j = 0; j < VEC; ++j) o.set(j, bad ? NAN : sm_exp<T>(xv.f(j) - mx) * inv);
        store_vec<T, VEC>(out + off + idx * VEC, o);
      }
    }
  }
}

// Cluster path (sm_90): blockIdx.x / C = row, rank within the cluster = slice.
// Each CTA stages its slice of the row in shared memory (so registers stay few
// and several CTAs fit per SM), reduces max / NaN flag and the sum of exp over
// the cluster through distributed shared memory, and writes from shared memory.
constexpr int kClusterThreads = 256;
template <typename T, int VEC>
__global__ void __launch_bounds__(kClusterThreads) softmax_cluster_kernel(const SoftmaxParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(16) unsigned char stage_raw[];
  Vec<T, VEC>* stage = reinterpret_cast<Vec<T, VEC>*>(stage_raw);
  __shared__ float red[kClusterThreads / 32];
  __shared__ float part[2];
  __shared__ float glob[3];
  cg::cluster_group cluster = cg::this_cluster();
  const int csize = int(cluster.num_blocks()), rank = int(cluster.block_rank());
  const int64_t row = blockIdx.x / csize;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  const int64_t H = p.cols, hv = H / VEC;
  const int64_t v0 = rank * p.slice, n = max(int64_t(0), min(hv, v0 + p.slice) - v0);
  const T* x = static_cast<const T*>(p.x) + row * H + v0 * VEC;
  T* out = static_cast<T*>(p.out) + row * H + v0 * VEC;
  float mx = -INFINITY, nan = 0.f;
  constexpr int U = 4;  // loads in flight per thread
  for (int64_t base = threadIdx.x; base < n; base += int64_t(U) * blockDim.x) {
    Vec<T, VEC> v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t i = base + int64_t(u) * blockDim.x;
      if (i < n) v[u] = load_vec<T, VEC>(x + i * VEC);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t i = base + int64_t(u) * blockDim.x;
      if (i < n) {
        stage[i] = v[u];
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const float f = v[u].f(j);
          nan = isnan(f) ? 1.f : nan;
          mx = fmaxf(mx, f);
        }
      }
    }
  }
  mx = warp_max(mx);
  nan = warp_max(nan);
  if (lane == 0) red[warp] = mx;
  __syncthreads();
  if (threadIdx.x == 0) {
    float m = red[0];
    for (int i = 1; i < nw; ++i) m = fmaxf(m, red[i]);
    part[0] = m;
  }
  __syncthreads();
  if (lane == 0) red[warp] = nan;
  __syncthreads();
  if (threadIdx.x == 0) {
    float f = red[0];
    for (int i = 1; i < nw; ++i) f = fmaxf(f, red[i]);
    part[1] = f;
  }
  cluster.sync();
  // One warp gathers the cluster's partials over DSMEM (lane r reads rank r).
  if (warp == 0) {
    float m = -INFINITY, f = 0.f;
    if (lane < csize) {
      const float* rp = cluster.map_shared_rank(part, lane);
      m = rp[0];
      f = rp[1];
    }
    m = warp_max(m);
    f = warp_max(f);
    if (lane == 0) { glob[0] = m; glob[1] = f; }
  }
  cluster.sync();  // part[] read everywhere before reuse; glob[] visible in the CTA
  const float gm = glob[0];
  const bool bad = glob[1] != 0.f || isinf(gm);
  float sum = 0.f;
  if (!bad)
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      const Vec<T, VEC> v = stage[i];
#pragma unroll
      for (int j = 0; j < VEC; ++j) sum += sm_exp<T>(v.f(j) - gm);
    }
  sum = warp_sum(sum);
  if (lane == 0) red[warp] = sum;
  __syncthreads();
  if (threadIdx.x == 0) {
    float t = 0.f;
    for (int i = 0; i < nw; ++i) t += red[i];
    part[0] = t;
  }
  cluster.sync();
  if (warp == 0) {
    float v = lane < csize ? cluster.map_shared_rank(part, lane)[0] : 0.f;
    v = warp_sum(v);  // a fixed butterfly: the same total in every CTA
    if (lane == 0) glob[2] = v;
  }
  __syncthreads();
  const float inv = 1.0f / glob[2];
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const Vec<T, VEC> v = stage[i];
    Vec<T, VEC> o;
#pragma unroll
    for (int j = 0; j < VEC; ++j) o.set(j, bad ? NAN : sm_exp<T>(v.f(j) - gm) * inv);
    store_vec<T, VEC>(out + i * VEC, o);
  }
  cluster.sync();  // keep part[] alive until every CTA of the cluster has read it
#endif
}

namespace {

struct SmConfig {
  int vec, nv, warps_per_row, rows_per_cta, grid, cluster, threads;
  int64_t slice;
};

SmConfig choose(int64_t rows, int64_t H, int es, bool vec_ok, const DeviceProps& dp) {
  SmConfig c{};
  c.vec = vec_ok ? 16 / es : 1;
  const int64_t hv = (H + c.vec - 1) / c.vec;
  // Few wide rows: split each row over a thread-block cluster so every SM has
  // bytes in flight. Cluster size: the smallest of 2, 4, 8 that gives >= 2 CTAs
  // per SM and a shared-memory slice of at most 48 KB (4 CTAs per SM); if even 8
  // leaves a bigger slice, 8 with the bigger slice.
  if (dp.major >= 9 && c.vec > 1 && rows < 4 * int64_t(dp.sm_count) && H * es >= 64 * 1024) {
    int cl = 2;
    while (cl < 8 && (rows * cl < 2 * int64_t(dp.sm_count) || (hv + cl - 1) / cl * 16 > 48 * 1024)) cl *= 2;
    c.slice = (hv + cl - 1) / cl;
    if (c.slice * 16 <= 200 * 1024) {
      c.cluster = cl;
      c.threads = kClusterThreads;
      c.nv = 0;
      c.grid = int(rows * cl);
      return c;
    }
  }
  c.cluster = 1;
  const RowGroupConfig g = row_group_config(rows, hv, c.vec == 1, dp.sm_count);
  c.nv = g.nv;
  c.warps_per_row = g.warps_per_row;
  c.rows_per_cta = g.rows_per_cta;
  c.threads = g.threads;
  c.grid = g.grid;
  return c;
}

template <typename T, int VEC, int NV>
void launch_one(const SmConfig& c, const SoftmaxParams& p, cudaStream_t s) {
  if (c.cluster > 1) {
    const size_t smem = size_t(c.slice) * sizeof(Vec<T, VEC>);
    auto kern = softmax_cluster_kernel<T, VEC>;
    if (smem > 48 * 1024)
      check_cuda(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)), "softmax",
                 "raise dynamic shared memory");
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(c.grid);
    cfg.blockDim = dim3(c.threads);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = s;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = c.cluster;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    check_cuda(cudaLaunchKernelEx(&cfg, kern, p), "softmax", "cluster launch");
  } else {
    softmax_kernel<T, VEC, NV><<<c.grid, c.threads, 0, s>>>(p);
  }
}

template <typename T, int VEC>
void launch_vec(const SmConfig& c, const SoftmaxParams& p, cudaStream_t s) {
  switch (c.nv) {
    case 1: launch_one<T, VEC, 1>(c, p, s); break;
    case 2: launch_one<T, VEC, 2>(c, p, s); break;
    case 4: launch_one<T, VEC, 4>(c, p, s); break;
    case 8:
      if constexpr (VEC > 1) {
        launch_one<T, VEC, 8>(c, p, s);
        break;
      }
      [[fallthrough]];
    default: launch_one<T, VEC, 0>(c, p, s); break;
  }
}

template <typename T>
void launch_t(const SmConfig& c, const SoftmaxParams& p, cudaStream_t s) {
  if (c.vec > 1)
    launch_vec<T, 16 / sizeof(T)>(c, p, s);
  else
    launch_vec<T, 1>(c, p, s);
}

}  // namespace

void softmax_cuda(const void* args, ks_stream_t stream) {
  const auto& a = *static_cast<const ops::SoftmaxArgs*>(args);
  DeviceGuard g(a.x.device.device_id, "softmax");
  const int es = detail::dtype_bytes(a.x.dtype);
  const bool vec_ok = aligned16(a.x.data) && aligned16(a.out.data) && (a.cols * es) % 16 == 0;
  const SmConfig c = choose(a.rows, a.cols, es, vec_ok, device_props(a.x.device.device_id));
  SoftmaxParams p{a.x.data, a.out.data, a.rows, a.cols, c.warps_per_row, c.rows_per_cta, c.slice};
  const auto s = static_cast<cudaStream_t>(stream);
  switch (a.x.dtype) {
    case detail::DType::F32: launch_t<float>(c, p, s); break;
    case detail::DType::F16: launch_t<__half>(c, p, s); break;
    default: launch_t<__nv_bfloat16>(c, p, s); break;
  }
  check_launch("softmax");
  if (c.cluster > 1)
    record_launch("softmax", "cluster=%lld threads=%lld vec=%lld smem_slice=%lldB grid=%lld",
                  {c.cluster, c.threads, c.vec, (long long)(c.slice * 16), c.grid});
  else
    record_launch("softmax", "vec=%lld nv=%lld warps_per_row=%lld rows_per_cta=%lld grid=%lld",
                  {c.vec, c.nv, c.warps_per_row, c.rows_per_cta, c.grid});
}

}  // namespace ks::cuda
