// softmax on CUDA (contract: torch.softmax on the fp32 upcast; NaN / +inf / all
// -inf rows give NaN rows).
//
// Two kernels:
//  - row groups (as rms_norm): W warps own a row, values cached in registers;
//    the maximum (NaN-propagating, so it doubles as the NaN flag), then the sum
//    of exp, then the normalized store.
//  - clusters (sm_90, few wide rows): a thread-block cluster of C CTAs splits one
//    row; every thread keeps its share in registers (all loads issued at once),
//    folds it into a running (max, sum of exp) pair, and the pairs are merged
//    over the warp, the CTA and the cluster (distributed shared memory) in a
//    fixed order: one cluster exchange per row, the row read from HBM once.
// exp is expf for fp32 outputs, __expf for 16-bit ones; the division is one IEEE
// reciprocal per row. The reduction order depends only on H and the launch
// configuration derived from H, the row count and the device.
#include <cooperative_groups.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>
#include <tuple>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "backends/cuda/common.cuh"
#include "ops/args.hpp"
#include "registry/registry.hpp"

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
template <int OP>  // 0 sum, 1 NaN-propagating max
__device__ __forceinline__ float group_reduce(float v, float* red, int group, int warp_in_row, int wpr, int lane) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float u = __shfl_xor_sync(0xffffffffu, v, o);
    v = OP == 0 ? v + u : fmax_nan(v, u);
  }
  if (wpr == 1) return v;
  __syncthreads();
  if (lane == 0) red[group * kSmWMax + warp_in_row] = v;
  __syncthreads();
  float r = red[group * kSmWMax];
  for (int i = 1; i < wpr; ++i) r = OP == 0 ? r + red[group * kSmWMax + i] : fmax_nan(r, red[group * kSmWMax + i]);
  return r;
}

template <typename T, int VEC, int NV>
__global__ void __launch_bounds__(NV > 0 ? 512 : 1024) softmax_kernel(const SoftmaxParams p) {
  __shared__ float red[kSmWMax * 8];
  pdl_begin();
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
    float mx = -INFINITY;
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
        if (active && idx < hv) mx = fmax_nan(mx, vec_max_nan(xr[i]));
      }
    } else if (active) {
      for (int64_t idx = lt; idx < hv; idx += tpr) mx = fmax_nan(mx, vec_max_nan(load_vec<T, VEC>(x + off + idx * VEC)));
    }
    mx = group_reduce<1>(mx, red, group, wir, p.warps_per_row, lane);
    const bool bad = !(fabsf(mx) < INFINITY);  // NaN, +inf maximum, or all -inf
    float sum = 0.f;
    // Cached rows: e = exp(x - max) is computed once, kept in FP32 registers and
    // scaled at the store (the same values as recomputing it: one exp per element
    // instead of two; the exp unit, 16 results per SM per clock, bounded mid-size
    // rows). A bad row's e may be anything: inv is NaN there.
    float e[NV > 0 ? NV : 1][NV > 0 ? VEC : 1];
    if constexpr (NV > 0) {
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        const int64_t idx = lt + int64_t(i) * tpr;
        if (active && idx < hv)
#pragma unroll
          for (int j = 0; j < VEC; ++j) {
            e[i][j] = sm_exp<T>(xr[i].f(j) - mx);
            sum += e[i][j];
          }
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
    // One IEEE division per row (e * inv is within 1 ulp of e / sum). A bad row gets
    // inv = NaN, so every element becomes NaN without a per-element branch.
    const float inv = bad ? NAN : 1.0f / sum;
    if constexpr (NV > 0) {
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        const int64_t idx = lt + int64_t(i) * tpr;
        if (idx < hv) {
          OutVec<T, VEC> o;
#pragma unroll
          for (int j = 0; j < VEC; ++j) o.set(j, e[i][j] * inv);
          store_vec<T, VEC>(out + off + idx * VEC, o);
        }
      }
    } else {
      for (int64_t idx = lt; idx < hv; idx += tpr) {
        const auto xv = load_vec<T, VEC>(x + off + idx * VEC);
        OutVec<T, VEC> o;
#pragma unroll
        for (int j = 0; j < VEC; ++j) o.set(j, sm_exp<T>(xv.f(j) - mx) * inv);
        store_vec<T, VEC>(out + off + idx * VEC, o);
      }
    }
  }
}

// ---- cluster path (sm_90) ----------------------------------------------------
// Running softmax statistics of a set of elements: m = max (NaN-propagating),
// s = sum of exp(x - m). merge() is commutative (so a butterfly leaves every lane
// with bit-identical results) and keeps s = 0 when m is -inf (nothing finite yet)
// or not finite at all (the row is all NaN then, s is unused).
struct MaxSum {
  float m, s;
};
__device__ __forceinline__ MaxSum merge(MaxSum a, MaxSum b) {
  const float m = fmax_nan(a.m, b.m);
  if (!(fabsf(m) < INFINITY)) return {m, 0.f};
  return {m, a.s * expf(a.m - m) + b.s * expf(b.m - m)};
}
__device__ __forceinline__ MaxSum warp_merge(MaxSum v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
    v = merge(v, {__shfl_xor_sync(0xffffffffu, v.m, o), __shfl_xor_sync(0xffffffffu, v.s, o)});
  return v;
}

// blockIdx.x / C = row, rank in the cluster = slice of p.slice vectors; thread t
// holds vectors t, t + T, ..., t + (NV - 1) T of the slice in registers. NV > 8
// variants run 128 or 256 threads (up to 128 registers each), so a few
// wide rows can be held on chip in a single wave. NV = 0 stages the slice in
// dynamic shared memory instead (few registers, so more CTAs fit; an experiment
// behind KS_SOFTMAX_SMEM=1 until measured), folding each vector into the running
// statistics as it arrives.
// Register cap: 16-bit NV = 8 variants get 56 (no spills, checked with -Xptxas -v)
// instead of 64, so nine 128-thread CTAs fit per SM: at 64 x 128256 the occupancy API
// reported 58 co-resident clusters of 16 at 64 registers (two waves for 64 rows).
constexpr int kClusterMaxThreads = 512;
template <typename T, int VEC, int NV>
__global__ void __launch_bounds__(NV > 8 ? 256 : kClusterMaxThreads, 2)
    __maxnreg__(NV == 8 && sizeof(T) == 2 ? 56 : NV > 8 ? 128 : 64) softmax_cluster_kernel(const SoftmaxParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  __shared__ MaxSum red[kClusterMaxThreads / 32];
  __shared__ MaxSum part;  // this CTA's statistics, read by the whole cluster
  __shared__ MaxSum glob;  // the row's
  extern __shared__ __align__(16) unsigned char stage_raw[];  // NV = 0: the slice
  Vec<T, VEC>* stage = reinterpret_cast<Vec<T, VEC>*>(stage_raw);
  pdl_begin();
  cg::cluster_group cluster = cg::this_cluster();
  const int csize = int(cluster.num_blocks()), rank = int(cluster.block_rank());
  const int64_t row = blockIdx.x / csize;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5, nt = blockDim.x;
  const int64_t H = p.cols, hv = H / VEC;
  const int64_t v0 = rank * p.slice, n = max(int64_t(0), min(hv, v0 + p.slice) - v0);
  const T* x = static_cast<const T*>(p.x) + row * H + v0 * VEC;  // may alias out (in place)
  T* out = static_cast<T*>(p.out) + row * H + v0 * VEC;
  Vec<T, VEC> xr[NV > 0 ? NV : 1];
  MaxSum st{-INFINITY, 0.f};
  if constexpr (NV > 0) {
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int64_t idx = threadIdx.x + int64_t(i) * nt;
      if (idx < n) xr[i] = load_vec<T, VEC>(x + idx * VEC);
    }
#pragma unroll
    for (int i = 0; i < NV; ++i)
      if (threadIdx.x + int64_t(i) * nt < n) st.m = fmax_nan(st.m, vec_max_nan(xr[i]));
    // exp is recomputed at the store: keeping e = exp(x - thread max) in registers
    // (one exp per element, as the row-group kernel does) was measured slower here
    // (H200: 64 x 32000 bf16 7.1 -> 7.5 us; the extra registers cost co-resident clusters)
    if (fabsf(st.m) < INFINITY) {
#pragma unroll
      for (int i = 0; i < NV; ++i)
        if (threadIdx.x + int64_t(i) * nt < n)
#pragma unroll
          for (int j = 0; j < VEC; ++j) st.s += sm_exp<T>(xr[i].f(j) - st.m);
    }
  } else {
    constexpr int U = 4;  // vectors in flight per thread
    for (int64_t base = threadIdx.x; base < n; base += int64_t(U) * nt) {
      Vec<T, VEC> v[U];
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (base + int64_t(u) * nt < n) v[u] = load_vec<T, VEC>(x + (base + int64_t(u) * nt) * VEC);
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t idx = base + int64_t(u) * nt;
        if (idx >= n) continue;
        stage[idx] = v[u];
        const float vm = vec_max_nan(v[u]);
        if (!(vm <= st.m)) {  // a new maximum (or NaN): rescale the running sum
          st.s = fabsf(st.m) < INFINITY && fabsf(vm) < INFINITY ? st.s * expf(st.m - vm) : 0.f;
          st.m = fmax_nan(st.m, vm);
        }
        if (fabsf(st.m) < INFINITY)
#pragma unroll
          for (int j = 0; j < VEC; ++j) st.s += sm_exp<T>(v[u].f(j) - st.m);
      }
    }
  }
  st = warp_merge(st);
  if (lane == 0) red[warp] = st;
  __syncthreads();
  if (warp == 0) {
    MaxSum v = lane < nw ? red[lane] : MaxSum{-INFINITY, 0.f};
    v = warp_merge(v);
    if (lane == 0) part = v;
  }
  cluster_arrive();  // release: part is visible to the cluster
  cluster_wait();
  if (warp == 0) {
    MaxSum v{-INFINITY, 0.f};
    if (lane < csize) v = *cluster.map_shared_rank(&part, lane);
    v = warp_merge(v);  // the same fixed butterfly in every CTA: one result per row
    if (lane == 0) glob = v;
  }
  __syncthreads();
  cluster_arrive();  // done reading the other CTAs' part; waited for before exit
  const float gm = glob.m;
  const bool bad = !(fabsf(gm) < INFINITY);  // NaN, +inf maximum, or all -inf
  const float inv = bad ? NAN : 1.0f / glob.s;  // NaN row: every exp(x - gm) * NaN is NaN
  if constexpr (NV > 0) {
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int64_t idx = threadIdx.x + int64_t(i) * nt;
      if (idx < n) {
        OutVec<T, VEC> o;
#pragma unroll
        for (int j = 0; j < VEC; ++j) o.set(j, sm_exp<T>(xr[i].f(j) - gm) * inv);
        store_vec<T, VEC>(out + idx * VEC, o);
      }
    }
  } else {
    for (int64_t idx = threadIdx.x; idx < n; idx += nt) {
      const Vec<T, VEC> v = stage[idx];
      OutVec<T, VEC> o;
#pragma unroll
      for (int j = 0; j < VEC; ++j) o.set(j, sm_exp<T>(v.f(j) - gm) * inv);
      store_vec<T, VEC>(out + idx * VEC, o);
    }
  }
  cluster_wait();  // no CTA leaves while another may still read its shared memory
#endif
}

namespace {

struct SmConfig {
  int vec, nv, warps_per_row, rows_per_cta, grid, cluster, threads;
  int64_t slice;
  int max_clusters;  // co-resident clusters (cluster path), from the occupancy API
};


template <typename T, int VEC, int NV>
void* cluster_kernel_ptr() {
  return reinterpret_cast<void*>(softmax_cluster_kernel<T, VEC, NV>);
}
void* cluster_kernel(int es, int nv) {
  switch (es * 16 + nv) {
    case 4 * 16 + 2: return cluster_kernel_ptr<float, 4, 2>();
    case 4 * 16 + 4: return cluster_kernel_ptr<float, 4, 4>();
    case 4 * 16 + 6: return cluster_kernel_ptr<float, 4, 6>();
    case 4 * 16 + 8: return cluster_kernel_ptr<float, 4, 8>();
    case 4 * 16 + 12: return cluster_kernel_ptr<float, 4, 12>();
    case 4 * 16 + 16: return cluster_kernel_ptr<float, 4, 16>();
    case 4 * 16 + 0: return cluster_kernel_ptr<float, 4, 0>();
    default: break;
  }
  // fp16 and bf16 kernels have the same resources; bf16's stands for both
  switch (nv) {
    case 0: return cluster_kernel_ptr<__nv_bfloat16, 8, 0>();
    case 2: return cluster_kernel_ptr<__nv_bfloat16, 8, 2>();
    case 4: return cluster_kernel_ptr<__nv_bfloat16, 8, 4>();
    case 6: return cluster_kernel_ptr<__nv_bfloat16, 8, 6>();
    case 8: return cluster_kernel_ptr<__nv_bfloat16, 8, 8>();
    case 12: return cluster_kernel_ptr<__nv_bfloat16, 8, 12>();
    default: return cluster_kernel_ptr<__nv_bfloat16, 8, 16>();
  }
}

// How many clusters of (C CTAs x threads) fit on the device at once
// (cudaOccupancyMaxActiveClusters), cached per device / element size / NV / C / threads.
// NV = 0 (shared-memory staging, `smem` bytes per CTA) is queried every time.
int query_active_clusters(void* kern, int c, int threads, size_t smem) {
  if (c > 8)
    check_cuda(cudaFuncSetAttribute(kern, cudaFuncAttributeNonPortableClusterSizeAllowed, 1), "softmax",
               "allow a non-portable cluster size");
  if (smem > 48 * 1024)
    check_cuda(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)), "softmax",
               "raise dynamic shared memory");
  return co_resident_clusters(kern, c, threads, smem);  // 0: not launchable so (never chosen)
}
int max_active_clusters(int device, int es, int nv, int c, int threads, size_t smem = 0) {
  if (nv == 0) {  // staging: keyed by the slice size too (a map, on the >= 4-wave path only)
    static std::mutex mu;
    static std::map<std::tuple<int, int, int, int, size_t>, int> cache;
    const auto key = std::make_tuple(device, es, c, threads, smem);
    std::lock_guard<std::mutex> lock(mu);
    auto it = cache.find(key);
    if (it == cache.end()) it = cache.emplace(key, query_active_clusters(cluster_kernel(es, 0), c, threads, smem)).first;
    return it->second;
  }
  constexpr int kDev = 16;
  static std::atomic<int> cache[kDev][2][6][4][3];
  const int di = device % kDev, ei = es == 4 ? 1 : 0, ni = nv <= 8 ? nv / 2 - 1 : nv == 12 ? 4 : 5;
  const int ci = c == 2 ? 0 : c == 4 ? 1 : c == 8 ? 2 : 3, ti = threads == 512 ? 2 : threads == 256 ? 1 : 0;
  std::atomic<int>& slot = cache[di][ei][ni][ci][ti];
  const int known = slot.load(std::memory_order_relaxed);
  if (known > 0) return known - 1;
  const int n = query_active_clusters(cluster_kernel(es, nv), c, threads, 0);
  slot.store(n + 1, std::memory_order_relaxed);
  return n;
}

// path: which registry variant asks (cuda_cluster: the cluster path or cluster = 0 when no
// configuration fits; cuda_rowgroup: the row-group path only).
enum class Path { Cluster, RowGroup };
SmConfig choose(int64_t rows, int64_t H, int es, bool vec_ok, int device, const DeviceProps& dp, Path path) {
  SmConfig c{};
  c.vec = vec_ok ? 16 / es : 1;
  const int64_t hv = (H + c.vec - 1) / c.vec;
  // Few wide rows: a cluster per row, so the row's bytes are spread over several
  // SMs. Among C in {2, 4, 8, 16}, 256 or 512 threads and NV in {2, 4, 6, 8, 12, 16}
  // vectors per thread (the fewest that hold the row; NV > 8 with 256 threads),
  // take the fewest waves of co-resident clusters (occupancy API): every wave pays
  // the whole load -> cluster exchange -> store latency chain (measured: 64 x 128256
  // bf16 in two waves of NV = 4 took as long as one wave of twice the bytes would).
  // Ties: the smallest NV (more threads in flight), then the smallest C.
  // (deterministic mode: never, since the cluster path's order depends on the row count: the
  // registry skips cuda_cluster, which is not batch-invariant)
  if (path == Path::Cluster) {
    c.cluster = 0;
    if (!(dp.sm90_code && c.vec > 1 && rows < 4 * int64_t(dp.sm_count) && H * es >= 16 * 1024)) return c;
    static const int forced = [] {  // KS_SOFTMAX_CLUSTER=2|4|8|16: a tuning knob for experiments
      const char* e = std::getenv("KS_SOFTMAX_CLUSTER");
      return e ? std::atoi(e) : 0;
    }();
    // KS_SOFTMAX_SMEM=0: never stage in shared memory; 1: always (where it fits); unset:
    // the measured rule in choose_cluster. Read per call (only on this wide-row path) so
    // a test or benchmark can switch it.
    const char* smem_env = std::getenv("KS_SOFTMAX_SMEM");
    const int smem_mode = !smem_env ? 1 : smem_env[0] == '0' ? 0 : smem_env[0] == '1' ? 2 : 1;
    static const bool debug = [] {  // KS_DEBUG_CONFIG=1: print every cluster candidate to stderr
      const char* e = std::getenv("KS_DEBUG_CONFIG");
      return e && e[0] == '1';
    }();
    // The registry's can_implement and the launch both ask for the same call's configuration
    // (and a model asks for the same shapes over and over): the last answer is kept per thread.
    struct Memo {
      int64_t rows = -1, hv = -1;
      int es = 0, device = -1, smem_mode = -1;
      ClusterChoice k{};
    };
    thread_local Memo memo;
    if (!(memo.rows == rows && memo.hv == hv && memo.es == es && memo.device == device && memo.smem_mode == smem_mode)) {
      memo.k = choose_cluster(
          rows, hv, forced, smem_mode,
          [&](int nv, int cl, int th, int64_t smem) { return max_active_clusters(device, es, nv, cl, th, size_t(smem)); },
          [&](int cl, int th, int nv, int64_t smem, int n, int64_t waves) {
            if (debug)
              std::fprintf(stderr,
                           "kernscope softmax %lldx%lld es=%d: C=%d threads=%d NV=%d smem=%lld co-resident clusters=%d "
                           "waves=%lld\n",
                           (long long)rows, (long long)H, es, cl, th, nv, (long long)smem, n, (long long)waves);
          });
      memo.rows = rows, memo.hv = hv, memo.es = es, memo.device = device, memo.smem_mode = smem_mode;
    }
    const ClusterChoice& k = memo.k;
    c.cluster = k.cluster;
    c.threads = k.threads;
    c.nv = k.nv;
    c.max_clusters = k.active;
    if (c.cluster > 0) {
      c.slice = k.slice;
      c.grid = int(rows * c.cluster);
    }
    return c;  // cluster = 0: no configuration fits (can_implement says so)
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
void launch_cluster(const SmConfig& c, const SoftmaxParams& p, cudaStream_t s, bool pdl) {
  auto kern = softmax_cluster_kernel<T, VEC, NV>;
  if (c.cluster > 8)
    check_cuda(cudaFuncSetAttribute(kern, cudaFuncAttributeNonPortableClusterSizeAllowed, 1), "softmax",
               "allow a non-portable cluster size");
  const size_t smem = NV == 0 ? size_t(c.slice) * 16 : 0;
  if (smem > 48 * 1024)
    check_cuda(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)), "softmax",
               "raise dynamic shared memory");
  launch_kernel("softmax", kern, dim3(c.grid), dim3(c.threads), smem, s, c.cluster, pdl, p);
}

template <typename T, int VEC>
void launch_vec(const SmConfig& c, const SoftmaxParams& p, cudaStream_t s, bool pdl) {
  if (c.cluster > 1) {
    if constexpr (VEC > 1) {
      switch (c.nv) {
        case 0: launch_cluster<T, VEC, 0>(c, p, s, pdl); break;
        case 2: launch_cluster<T, VEC, 2>(c, p, s, pdl); break;
        case 4: launch_cluster<T, VEC, 4>(c, p, s, pdl); break;
        case 6: launch_cluster<T, VEC, 6>(c, p, s, pdl); break;
        case 8: launch_cluster<T, VEC, 8>(c, p, s, pdl); break;
        case 12: launch_cluster<T, VEC, 12>(c, p, s, pdl); break;
        default: launch_cluster<T, VEC, 16>(c, p, s, pdl); break;
      }
    }
    return;
  }
  const dim3 grid(c.grid), block(c.threads);
  switch (c.nv) {
    case 1: launch_kernel("softmax", softmax_kernel<T, VEC, 1>, grid, block, 0, s, 1, pdl, p); break;
    case 2: launch_kernel("softmax", softmax_kernel<T, VEC, 2>, grid, block, 0, s, 1, pdl, p); break;
    case 4: launch_kernel("softmax", softmax_kernel<T, VEC, 4>, grid, block, 0, s, 1, pdl, p); break;
    case 8:
      if constexpr (VEC > 1) {
        launch_kernel("softmax", softmax_kernel<T, VEC, 8>, grid, block, 0, s, 1, pdl, p);
        break;
      }
      [[fallthrough]];
    default: launch_kernel("softmax", softmax_kernel<T, VEC, 0>, grid, block, 0, s, 1, pdl, p); break;
  }
}

template <typename T>
void launch_t(const SmConfig& c, const SoftmaxParams& p, cudaStream_t s, bool pdl) {
  if (c.vec > 1)
    launch_vec<T, 16 / sizeof(T)>(c, p, s, pdl);
  else
    launch_vec<T, 1>(c, p, s, pdl);
}

}  // namespace

namespace {
bool softmax_vec_ok(const ops::SoftmaxArgs& a) {
  return aligned16(a.x.data) && aligned16(a.out.data) && (a.cols * detail::dtype_bytes(a.x.dtype)) % 16 == 0;
}
void softmax_launch(const ops::SoftmaxArgs& a, ks_stream_t stream, Path path);
}  // namespace

// Variant cuda_cluster: few wide rows, a cluster per row (sm_90, 16-byte aligned rows).
std::string softmax_cluster_can_implement(const void* args) {
  const auto& a = *static_cast<const ops::SoftmaxArgs*>(args);
  const int dev = a.x.device.device_id;
  const DeviceProps& dp = device_props(dev);
  if (!dp.sm90_code) return "thread-block clusters need compute capability 9.0";
  if (!softmax_vec_ok(a)) return "rows must be 16-byte aligned and a multiple of 16 bytes";
  const int es = detail::dtype_bytes(a.x.dtype);
  if (a.rows >= 4 * int64_t(dp.sm_count)) return "4 or more rows per SM: row groups fill the GPU";
  if (a.cols * es < 16 * 1024) return "rows under 16 KB: one CTA reads a row fast enough";
  if (choose(a.rows, a.cols, es, true, dev, dp, Path::Cluster).cluster == 0)
    return "no cluster configuration can be resident for this shape";
  return "";
}
void softmax_cluster_cuda(const void* args, ks_stream_t stream) {
  softmax_launch(*static_cast<const ops::SoftmaxArgs*>(args), stream, Path::Cluster);
}
// Variant cuda_rowgroup: any shape, batch-invariant.
void softmax_cuda(const void* args, ks_stream_t stream) {
  softmax_launch(*static_cast<const ops::SoftmaxArgs*>(args), stream, Path::RowGroup);
}

namespace {
void softmax_launch(const ops::SoftmaxArgs& a, ks_stream_t stream, Path path) {
  const int dev = a.x.device.device_id;
  DeviceGuard g(dev, "softmax");
  const int es = detail::dtype_bytes(a.x.dtype);
  const bool vec_ok = softmax_vec_ok(a);
  const DeviceProps& dp = device_props(dev);
  const SmConfig c = choose(a.rows, a.cols, es, vec_ok, dev, dp, path);
  if (c.cluster == 0) detail::fail(KS_ERROR_BACKEND_UNAVAILABLE, "softmax", "no cluster configuration fits this shape");
  SoftmaxParams p{a.x.data, a.out.data, a.rows, a.cols, c.warps_per_row, c.rows_per_cta, c.slice};
  const auto s = static_cast<cudaStream_t>(stream);
  with_float_type(a.x.dtype, [&](auto tag) { launch_t<decltype(tag)>(c, p, s, dp.pdl); });
  check_launch("softmax");
  if (c.cluster > 1)
    record_launch("softmax", "cluster=%lld threads=%lld vec=%lld nv=%lld grid=%lld max_active_clusters=%lld",
                  {c.cluster, c.threads, c.vec, c.nv, c.grid, c.max_clusters});
  else
    record_launch("softmax", "vec=%lld nv=%lld warps_per_row=%lld rows_per_cta=%lld grid=%lld",
                  {c.vec, c.nv, c.warps_per_row, c.rows_per_cta, c.grid});
}
}  // namespace

}  // namespace ks::cuda
