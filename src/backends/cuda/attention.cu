// paged_attention on CUDA, variant cuda_gqa_cluster (contract: docs/contracts.md,
// paged_attention): decode and prefill read the cache once per KV head instead of once
// per query head, and long contexts are split over a thread-block cluster.
//
// Work unit: (query token t, kv head g) with the G = num_heads / num_kv_heads query
// heads that share g. A cluster of C CTAs splits the unit's keys into C contiguous
// ranges; each CTA walks its range in tiles of 64 keys:
//  - a warp per key reads the K row once (lanes over head_dim) and forms the G scores;
//  - per head, an online softmax over the tile (running max and sum, FP32; dropped keys
//    and -inf scores weigh 0, a NaN score gives a NaN weight, as the CPU's exp);
//  - thread d reads V[key][d] once and updates the G accumulators.
// The C partial states (max, sum, accumulator per head) are merged through distributed
// shared memory: out = sum_c acc_c e^(m_c - M) / sum_c l_c e^(m_c - M). No workspace in
// global memory, so nothing is allocated per call (graph-capturable).
// C: the fewest of 1, 2, 4, 8, 16 that give at least two CTAs per SM, at most one per 256
// keys of the block table's capacity; 8 at most where a cluster of 16 cannot be resident.
#include <cooperative_groups.h>

#include <algorithm>
#include <climits>
#include <map>
#include <mutex>
#include <string>

#include "backends/cuda/attention_params.cuh"
#include "backends/cuda/common.cuh"
#include "ops/args.hpp"

namespace cg = cooperative_groups;

namespace ks::cuda {
namespace {

constexpr int kGqaThreads = 128, kKeyTile = 64;
[[maybe_unused]] constexpr int kGqaWarps = kGqaThreads / 32;  // (device code only: unused in the host pass)
constexpr int64_t kGqaSmemLimit = 48 * 1024;


// Dynamic shared memory layout (floats unless noted): q[G][D], acc[G][D], w[G][tile],
// m[G], l[G], corr[G], then slot[tile] (int64) and the CTA's any-key flag.
struct GqaSmem {
  float *q, *acc, *w, *m, *l, *corr;
  long long* slot;
  int* any;
  __device__ GqaSmem(unsigned char* base, int G, int64_t D) {
    float* f = reinterpret_cast<float*>(base);
    q = f;
    acc = q + G * D;
    w = acc + G * D;
    m = w + G * kKeyTile;
    l = m + G;
    corr = l + G;
    uintptr_t p = reinterpret_cast<uintptr_t>(corr + G);
    p = (p + 7) & ~uintptr_t(7);
    slot = reinterpret_cast<long long*>(p);
    any = reinterpret_cast<int*>(slot + kKeyTile);
  }
};

size_t gqa_smem_bytes(int G, int64_t D) {
  size_t b = size_t(2 * G * D + G * kKeyTile + 3 * G) * sizeof(float);
  b = (b + 7) & ~size_t(7);
  return b + kKeyTile * sizeof(long long) + sizeof(int);
}

template <typename T>
__global__ void __launch_bounds__(kGqaThreads) paged_attention_gqa_kernel(const AttnParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(16) unsigned char gqa_raw[];
  pdl_begin();
  cg::cluster_group cluster = cg::this_cluster();
  const int C = int(cluster.num_blocks()), rank = int(cluster.block_rank());
  const int G = p.group;
  const int64_t D = p.head_dim;
  GqaSmem sm(gqa_raw, G, D);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t unit = blockIdx.x / C;  // (token, kv head)
  const int64_t t = unit / p.num_kv_heads, kvh = unit % p.num_kv_heads;
  const int64_t seq = p.seq_ids ? int64_t(p.seq_ids[t]) : t;
  int64_t len = p.context_lens[t];
  if (seq < 0 || seq >= p.num_seqs || len < 0) len = 0;
  len = min(len, p.max_blocks_per_seq * p.block_size);
  // this CTA's keys: [j_begin, j_end), whole tiles except at the end
  const int64_t per = ((len + C - 1) / C + kKeyTile - 1) / kKeyTile * kKeyTile;
  const int64_t j_begin = min(len, int64_t(rank) * per), j_end = min(len, j_begin + per);
  const T* qbase = static_cast<const T*>(p.q) + (t * p.num_heads + kvh * G) * D;
  for (int64_t i = threadIdx.x; i < int64_t(G) * D; i += blockDim.x) {
    sm.q[i] = Dt<T>::to_f(qbase[i]);
    sm.acc[i] = 0.f;
  }
  for (int g = threadIdx.x; g < G; g += blockDim.x) sm.m[g] = -INFINITY, sm.l[g] = 0.f;
  if (threadIdx.x == 0) *sm.any = 0;
  int any_local = 0;
  const T* kc = static_cast<const T*>(p.k_cache);
  const T* vc = static_cast<const T*>(p.v_cache);
  for (int64_t j0 = j_begin; j0 < j_end; j0 += kKeyTile) {
    const int nt = int(min(int64_t(kKeyTile), j_end - j0));
    __syncthreads();  // q / the previous tile's weights and slots are consumed
    for (int j = threadIdx.x; j < nt; j += blockDim.x) {
      const int64_t pos = j0 + j;
      const int64_t blk = p.block_tables[seq * p.max_blocks_per_seq + pos / p.block_size];
      sm.slot[j] = (blk >= 0 && blk < p.num_blocks) ? (blk * p.block_size + pos % p.block_size) : -1;
      any_local |= sm.slot[j] >= 0;
    }
    __syncthreads();
    // scores: a warp per key, the K row read once for the G heads
    for (int j = warp; j < nt; j += kGqaWarps) {
      const long long slot = sm.slot[j];
      const T* kr = slot >= 0 ? kc + (slot * p.num_kv_heads + kvh) * D : nullptr;
      for (int g = 0; g < G; ++g) {
        float dot = 0.f;
        if (kr)
          for (int64_t d = lane; d < D; d += 32) dot += sm.q[g * D + d] * Dt<T>::to_f(kr[d]);
        dot = warp_sum(dot);
        if (lane == 0) sm.w[g * kKeyTile + j] = slot >= 0 ? dot * p.scale : -INFINITY;
      }
    }
    __syncthreads();
    // online softmax per head: warp w owns heads w, w + 4, ...
    for (int g = warp; g < G; g += kGqaWarps) {
      float* wg = sm.w + g * kKeyTile;
      float mx = -INFINITY;
      for (int j = lane; j < nt; j += 32) mx = fmaxf(mx, wg[j]);  // NaN ignored here, kept by exp below
      mx = warp_max(mx);
      const float old = sm.m[g], nm = fmaxf(old, mx);
      const float corr = nm == -INFINITY ? 1.f : expf(old - nm);
      float s = 0.f;
      for (int j = lane; j < nt; j += 32) {
        const float sc = wg[j];
        const float e = (sm.slot[j] < 0 || sc == -INFINITY) ? 0.f : expf(sc - nm);
        wg[j] = e;
        s += e;
      }
      s = warp_sum(s);
      if (lane == 0) {
        sm.l[g] = sm.l[g] * corr + s;
        sm.m[g] = nm;
        sm.corr[g] = corr;
      }
    }
    __syncthreads();
    // V: thread d reads V[key][d] once for the G accumulators
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
      for (int g = 0; g < G; ++g) sm.acc[g * D + d] *= sm.corr[g];
      for (int j = 0; j < nt; ++j) {
        const long long slot = sm.slot[j];
        if (slot < 0) continue;
        const float v = Dt<T>::to_f(vc[(slot * p.num_kv_heads + kvh) * D + d]);
        for (int g = 0; g < G; ++g) sm.acc[g * D + d] += sm.w[g * kKeyTile + j] * v;
      }
    }
  }
  if (__syncthreads_or(any_local) && threadIdx.x == 0) *sm.any = 1;
  cluster.sync();  // every CTA's partial state is complete and visible to the cluster
  // merge: rank r writes the output elements r, r + C, ... of the unit's G x D outputs
  T* out = static_cast<T*>(p.out) + (t * p.num_heads + kvh * G) * D;
  for (int64_t i = int64_t(rank) * blockDim.x + threadIdx.x; i < int64_t(G) * D; i += int64_t(C) * blockDim.x) {
    const int g = int(i / D);
    float M = -INFINITY;
    int any = 0;
    for (int c = 0; c < C; ++c) {
      GqaSmem r(cluster.map_shared_rank(gqa_raw, c), G, D);
      M = fmaxf(M, r.m[g]);
      any |= *r.any;
    }
    float L = 0.f, a = 0.f;
    if (M != -INFINITY) {
      for (int c = 0; c < C; ++c) {
        GqaSmem r(cluster.map_shared_rank(gqa_raw, c), G, D);
        const float f = r.m[g] == -INFINITY ? 0.f : expf(r.m[g] - M);
        L += r.l[g] * f;
        a += r.acc[i] * f;
      }
    }
    // no key at all (all dropped, or len 0): a zero row; keys whose scores are all -inf: NaN
    const float y = L == 0.f ? (any ? __int_as_float(0x7fffffff) : 0.f) : a / L;
    out[i] = Dt<T>::from_f(len > 0 ? y : 0.f);
  }
  cluster.sync();  // no CTA leaves while another may still read its shared memory
#endif
}

int choose_cluster(const ops::PagedAttentionArgs& a, int sm_count, int max_cluster) {
  const int64_t units = a.num_tokens * a.num_kv_heads;
  const int64_t capacity = a.max_blocks_per_seq * a.block_size;
  int c = 1;
  while (2 * c <= max_cluster && units * c < 2 * int64_t(sm_count) && capacity >= int64_t(2 * c) * 256) c *= 2;
  return c;
}

// Per kernel instantiation and per device (each device loads its own copy of the module,
// and the attribute belongs to one kernel): allow clusters of 16, then ask whether a
// cluster of 16 CTAs (128 threads, the largest shared-memory footprint, 48 KB) can be
// resident at all (it needs 16 SMs of one GPC; a MIG slice may have fewer). Returns the
// largest cluster size to use, 16 or 8. Done once per (T, device); a per-thread cache
// keeps the lock off the launch path.
template <typename T>
int max_cluster_for(int dev) {
  thread_local int cached_dev = -1, cached_max = 8;
  if (dev == cached_dev) return cached_max;
  static std::mutex mu;
  static std::map<int, int> known;
  std::lock_guard<std::mutex> lock(mu);
  auto it = known.find(dev);
  if (it == known.end()) {
    auto kern = paged_attention_gqa_kernel<T>;
    check_cuda(cudaFuncSetAttribute(kern, cudaFuncAttributeNonPortableClusterSizeAllowed, 1), "paged_attention",
               "allow a non-portable cluster size");
    const int n = co_resident_clusters(reinterpret_cast<const void*>(kern), 16, kGqaThreads, size_t(kGqaSmemLimit));
    it = known.emplace(dev, n > 0 ? 16 : 8).first;
  }
  cached_dev = dev;
  cached_max = it->second;
  return cached_max;
}

}  // namespace

std::string paged_attention_gqa_can_implement(const void* args) {
  const auto& a = *static_cast<const ops::PagedAttentionArgs*>(args);
  const int G = int(a.num_heads / a.num_kv_heads);
  if (int64_t(gqa_smem_bytes(G, a.head_dim)) > kGqaSmemLimit)
    return "the query heads of a kv head times head_dim exceed 48 KB of shared memory";
  // one CTA per (token, kv head) at least, on grid.x (at most 2^31 - 1 CTAs)
  if (a.num_tokens * a.num_kv_heads > int64_t(INT32_MAX))
    return "num_tokens * num_kv_heads exceeds the grid's 2^31 - 1 CTAs";
  return "";
}

// Compute capability 9.0 and code built for it: the kernel's body exists only for sm_90+
// (#if __CUDA_ARCH__ >= 900); a newer GPU that JIT-compiles an older PTX (80-virtual) would
// run an empty kernel and leave the output unwritten (DeviceProps::sm90_code, cached).
bool paged_attention_gqa_supported(int device) { return device_props(device).sm90_code; }

void paged_attention_gqa_cuda(const void* args, ks_stream_t stream) {
  const auto& a = *static_cast<const ops::PagedAttentionArgs*>(args);
  const int dev = a.q.device.device_id;
  DeviceGuard g(dev, "paged_attention");
  const DeviceProps& dp = device_props(dev);
  const int G = int(a.num_heads / a.num_kv_heads);
  const AttnParams p = attn_params(a);
  const size_t smem = gqa_smem_bytes(G, a.head_dim);
  const auto s = static_cast<cudaStream_t>(stream);
  int C = 1;
  int64_t grid = 0;
  // The kernels of the three dtypes have the same type, so a generic lambda with a static
  // once_flag gave them one flag between them (and one for all devices): only the first
  // dtype launched got the non-portable attribute, and a cluster of 16 of another dtype
  // (or on another device) failed to launch. The attribute is now set per kernel and device.
  auto go = [&](auto tag) {
    using T = decltype(tag);
    C = choose_cluster(a, dp.sm_count, max_cluster_for<T>(dev));
    grid = a.num_tokens * a.num_kv_heads * C;
    launch_kernel("paged_attention", paged_attention_gqa_kernel<T>, dim3(unsigned(grid)), dim3(kGqaThreads), smem, s,
                  C, dp.pdl, p);
  };
  switch (a.q.dtype) {
    case detail::DType::F32: go(float{}); break;
    case detail::DType::F16: go(__half{}); break;
    default: go(__nv_bfloat16{}); break;
  }
  check_launch("paged_attention");
  record_launch("paged_attention", "variant=cuda_gqa_cluster cluster=%lld group=%lld key_tile=%lld grid=%lld",
                {C, G, kKeyTile, grid});
}

}  // namespace ks::cuda

// ---- varlen_attention (packed sequences, no cache) ------------------------------------
// A CTA per (query row, head), grid-stride: the row's sequence by binary search over
// cu_seqlens_q (device offsets are clamped to [0, total], so bad offsets stay memory-safe),
// then the visible keys in tiles of 64: a warp per key for the FP32 score, an online FP32
// softmax, thread d accumulating V. The same arithmetic as cuda_cta_per_head's.
namespace ks::cuda {
namespace {

struct VarlenParams {
  void* out;
  const void* q;
  const void* k;
  const void* v;
  const int32_t* cu_q;
  const int32_t* cu_k;
  float scale;
  bool causal;
  int64_t total_q, total_k, num_heads, num_kv_heads, head_dim, num_seqs;
};

constexpr int kVarThreads = 128, kVarTile = 64;

template <typename T>
__global__ void __launch_bounds__(kVarThreads) varlen_attention_kernel(const VarlenParams p) {
  extern __shared__ float var_sh[];  // q (D floats), acc (D floats)
  __shared__ float w[kVarTile];
  __shared__ float red[kVarThreads / 32];
  pdl_begin();
  const int64_t D = p.head_dim;
  float* qv = var_sh;
  float* acc = var_sh + D;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = kVarThreads / 32;
  const int64_t G = p.num_heads / p.num_kv_heads;
  auto off = [&](const int32_t* cu, int64_t i, int64_t total) { return min(max(int64_t(cu[i]), int64_t(0)), total); };
  for (int64_t rh = blockIdx.x; rh < p.total_q * p.num_heads; rh += gridDim.x) {
    const int64_t row = rh / p.num_heads, h = rh % p.num_heads, kvh = h / G;
    // the sequence s with cu_q[s] <= row < cu_q[s + 1] (the last such s when empty ones repeat)
    int64_t lo = 0, hi = p.num_seqs;  // invariant: answer in [lo, hi)
    while (hi - lo > 1) {
      const int64_t mid = (lo + hi) / 2;
      if (off(p.cu_q, mid, p.total_q) <= row) lo = mid; else hi = mid;
    }
    const int64_t s = lo;
    const int64_t q0 = p.num_seqs > 0 ? off(p.cu_q, s, p.total_q) : 0, q1 = p.num_seqs > 0 ? off(p.cu_q, s + 1, p.total_q) : 0;
    const int64_t k0 = p.num_seqs > 0 ? off(p.cu_k, s, p.total_k) : 0;
    const int64_t k1 = p.num_seqs > 0 ? max(k0, off(p.cu_k, s + 1, p.total_k)) : 0;
    const bool in_seq = row >= q0 && row < q1;
    const int64_t lq = q1 - q0, lk = k1 - k0, i = row - q0;
    int64_t vis = in_seq ? (p.causal ? min(lk, max(int64_t(0), i + lk - lq + 1)) : lk) : 0;
    const T* qr = static_cast<const T*>(p.q) + rh * D;
    T* out = static_cast<T*>(p.out) + rh * D;
    __syncthreads();  // the previous row's q / acc are no longer read
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
      qv[d] = Dt<T>::to_f(qr[d]);
      acc[d] = 0.f;
    }
    float run_max = -INFINITY, run_sum = 0.f;
    for (int64_t j0 = 0; j0 < vis; j0 += kVarTile) {
      const int nt = int(min(int64_t(kVarTile), vis - j0));
      __syncthreads();
      for (int j = warp; j < nt; j += nw) {
        const T* kr = static_cast<const T*>(p.k) + ((k0 + j0 + j) * p.num_kv_heads + kvh) * D;
        float dot = 0.f;
        for (int64_t d = lane; d < D; d += 32) dot += qv[d] * Dt<T>::to_f(kr[d]);
        dot = warp_sum(dot);
        if (lane == 0) w[j] = dot * p.scale;
      }
      __syncthreads();
      float m = -INFINITY;
      for (int j = threadIdx.x; j < nt; j += blockDim.x) m = fmaxf(m, w[j]);
      m = warp_max(m);
      if (lane == 0) red[warp] = m;
      __syncthreads();
      m = red[0];
      for (int k = 1; k < nw; ++k) m = fmaxf(m, red[k]);
      const float nm = fmaxf(run_max, m);
      const float corr = nm == -INFINITY ? 1.f : expf(run_max - nm);
      __syncthreads();
      float sum = 0.f;
      for (int j = threadIdx.x; j < nt; j += blockDim.x) {
        const float e = w[j] == -INFINITY ? 0.f : expf(w[j] - nm);
        w[j] = e;
        sum += e;
      }
      sum = warp_sum(sum);
      if (lane == 0) red[warp] = sum;
      __syncthreads();
      float tile = 0.f;
      for (int k = 0; k < nw; ++k) tile += red[k];
      run_sum = run_sum * corr + tile;
      run_max = nm;
      for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
        float a = acc[d] * corr;
        for (int j = 0; j < nt; ++j)
          a += w[j] * Dt<T>::to_f(static_cast<const T*>(p.v)[((k0 + j0 + j) * p.num_kv_heads + kvh) * D + d]);
        acc[d] = a;
      }
    }
    __syncthreads();
    // no visible key: a zero row; keys whose scores are all -inf: NaN (exp(-inf - -inf)), as the CPU
    const float inv = run_sum == 0.f ? (vis > 0 ? __int_as_float(0x7fffffff) : 0.f) : 1.f / run_sum;
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x) out[d] = Dt<T>::from_f(vis > 0 ? acc[d] * inv : 0.f);
  }
}

}  // namespace

std::string varlen_attention_can_implement(const void* args) {
  const auto& a = *static_cast<const ops::VarlenAttentionArgs*>(args);
  if (a.head_dim > 4096) return "head_dim > 4096 (q and the accumulator are kept in 48 KB of shared memory)";
  return "";
}

void varlen_attention_cuda(const void* args, ks_stream_t stream) {
  const auto& a = *static_cast<const ops::VarlenAttentionArgs*>(args);
  const int dev = a.q.device.device_id;
  DeviceGuard g(dev, "varlen_attention");
  const DeviceProps& dp = device_props(dev);
  const VarlenParams p{a.out.data, a.q.data, a.k.data, a.v.data, static_cast<const int32_t*>(a.cu_q.data),
                       static_cast<const int32_t*>(a.cu_k.data), a.scale, a.causal, a.total_q, a.total_k,
                       a.num_heads, a.num_kv_heads, a.head_dim, a.num_seqs};
  const unsigned grid = unsigned(std::min<int64_t>(a.total_q * a.num_heads, int64_t(dp.sm_count) * 16));
  const size_t smem = size_t(2 * a.head_dim) * sizeof(float);
  const auto s = static_cast<cudaStream_t>(stream);
  switch (a.q.dtype) {
    case detail::DType::F32:
      launch_kernel("varlen_attention", varlen_attention_kernel<float>, dim3(grid), dim3(kVarThreads), smem, s, 1, dp.pdl, p);
      break;
    case detail::DType::F16:
      launch_kernel("varlen_attention", varlen_attention_kernel<__half>, dim3(grid), dim3(kVarThreads), smem, s, 1, dp.pdl, p);
      break;
    default:
      launch_kernel("varlen_attention", varlen_attention_kernel<__nv_bfloat16>, dim3(grid), dim3(kVarThreads), smem, s, 1,
                    dp.pdl, p);
      break;
  }
  check_launch("varlen_attention");
  record_launch("varlen_attention", "cta_per_row_head threads=%lld key_tile=%lld grid=%lld", {kVarThreads, kVarTile, grid});
}

}  // namespace ks::cuda
