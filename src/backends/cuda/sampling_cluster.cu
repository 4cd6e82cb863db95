// ks_sample on CUDA, variant cuda_cluster_topk (contract: docs/contracts.md#sample): top-k
// (1 <= top_k <= 1024) then top-p, the same ids as the CPU reference bit for bit.
//
// A row is split over a cluster of C CTAs (C up to 16), each owning a contiguous range:
//  1. one pass: validity (NaN, +inf), the max of z = x / T, the finite count, and a
//     histogram of the top 12 bits of each finite z's order key; the C CTAs' values meet
//     through distributed shared memory;
//  2. top-k when the row has more than top_k finite scores: the k-th largest order key by
//     radix selection in three rounds (12, 12 and 8 bits). Each round merges the C
//     histograms, each rank summing its own slice of bins; the rank whose slice holds the
//     k-th finds the digit with a block-wide suffix scan. Then the cut among equal keys
//     (lower indices first) by counts per rank and an ordered scan on the rank holding it;
//  3. every member (at most top_k) is appended to rank 0's shared memory;
//  4. rank 0 alone: the members in index order (ranks by counting), then
//     sample_finish_row (sampling_finish.cuh): the fixed-point weights, top-p and the
//     Philox draw, exactly the CPU reference's steps (core/sampling_math.hpp).
// Every decision is on integers; exp and the division are the CPU's operation sequence.
// Calls with top_k = 0 or > 1024 go to cuda_cta_per_row.
#include <cooperative_groups.h>

#include <climits>
#include <cstdint>
#include <string>

#include "backends/cuda/sampling_common.cuh"
#include "backends/cuda/sampling_finish.cuh"
#include "backends/cuda/common.cuh"
#include "core/sampling_math.hpp"
#include "ops/args.hpp"

namespace cg = cooperative_groups;

namespace ks::cuda {
namespace {

namespace smp = ks::sampling;
constexpr int kThreads = 512, kWarpsPerCta = kThreads / 32, kMaxK = kSampleMaxTopK, kBins = 4096;

struct Smem {
  unsigned hist[kBins];  // this CTA's digit histogram (read by the other ranks while merging)
  union {
    unsigned merged[kBins];  // this rank's slice of the merged histogram
    SampleMembers fin;       // rank 0: the members in index order, then the last step
  } u;
  int cand[kMaxK];  // rank 0: member indices, appended by every rank in any order
  unsigned long long warp_u64[kWarpsPerCta];
  float warp_f[kWarpsPerCta];
  // published for the cluster
  int bad;
  float zmax;
  unsigned long long finite, range_total, eq;
  unsigned cand_count;
  unsigned long long decided[3];  // the deciding rank's digit / remaining need / cut index
};

// (sm_90 only, as the kernel: an older target's pass compiles the kernel empty and would warn
// that these are never referenced)
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
__device__ __forceinline__ unsigned long long block_sum(unsigned long long v, Smem& sh) {
  return block_sum_u64<kWarpsPerCta>(v, sh.warp_u64);
}
__device__ __forceinline__ float block_max(float v, Smem& sh) { return block_max_f<kWarpsPerCta>(v, sh.warp_f); }
// inclusive scan in thread order; *total: the block's sum
__device__ __forceinline__ unsigned long long block_scan(unsigned long long v, unsigned long long* total, Smem& sh) {
  return block_scan_u64<kWarpsPerCta>(v, total, sh.warp_u64);
}
// hist[bin] += 1 for the calling lanes, one shared atomic per distinct bin per warp
__device__ __forceinline__ void count_bin(unsigned* hist, unsigned bin) {
  const unsigned peers = __match_any_sync(__activemask(), bin);
  if ((threadIdx.x & 31) == unsigned(__ffs(peers) - 1)) atomicAdd(&hist[bin], unsigned(__popc(peers)));
}
#endif

template <typename T>
__global__ void __launch_bounds__(kThreads) sample_cluster_kernel(const SampleParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  __shared__ Smem sh;
  pdl_begin();
  cg::cluster_group cluster = cg::this_cluster();
  const int C = int(cluster.num_blocks()), rank = int(cluster.block_rank());
  const float t = p.temperature;
  const int64_t V = p.vocab;
  const int64_t per = (V + C - 1) / C, i0 = min(V, int64_t(rank) * per), i1 = min(V, i0 + per);
  for (int64_t r = blockIdx.x / C; r < p.rows; r += gridDim.x / C) {
    const T* row = static_cast<const T*>(p.logits) + r * V;
    // 1. validity, max z, finite count, top-12-bit key histogram
    for (int b = threadIdx.x; b < kBins; b += kThreads) sh.hist[b] = 0;
    if (threadIdx.x == 0) sh.cand_count = 0;
    __syncthreads();
    int bad = 0;
    float zmax = -INFINITY;
    unsigned long long finite = 0;
    for (int64_t i = i0 + threadIdx.x; i < i1; i += kThreads) {
      const float x = Dt<T>::to_f(row[i]);
      const float z = scaled_logit(x, t);
      bad |= (x != x) || z == INFINITY;
      if (z > -INFINITY) {
        ++finite;
        zmax = fmaxf(zmax, z);
        count_bin(sh.hist, smp::order_key(z) >> 20);
      }
    }
    bad = __syncthreads_or(bad);
    zmax = block_max(zmax, sh);
    finite = block_sum(finite, sh);
    if (threadIdx.x == 0) sh.bad = bad, sh.zmax = zmax, sh.finite = finite;
    cluster.sync();
    int bad_all = 0;
    float zmax_all = -INFINITY;
    unsigned long long finite_all = 0;
    for (int c = 0; c < C; ++c) {
      const Smem* o = cluster.map_shared_rank(&sh, c);
      bad_all |= o->bad;
      zmax_all = fmaxf(zmax_all, o->zmax);
      finite_all += o->finite;
    }
    if (bad_all || finite_all == 0) {
      if (rank == 0 && threadIdx.x == 0) {
        p.out[r] = 0;
        if (p.valid) p.valid[r] = 0;
      }
      cluster.sync();  // every rank has read the others' values before they change
      continue;
    }
    // 2. top-k: the k-th largest key (kkey) and the cut among keys equal to it
    const bool use_k = finite_all > static_cast<unsigned long long>(p.top_k);
    unsigned kkey = 0;
    long long cut = V;
    if (use_k) {
      unsigned prefix = 0, mask = 0;
      unsigned long long need = static_cast<unsigned long long>(p.top_k);
      for (int round = 0; round < 3; ++round) {
        const int shift = round == 0 ? 20 : round == 1 ? 8 : 0;
        const int nbins = round == 2 ? 256 : kBins;
        if (round > 0) {
          cluster.sync();  // the previous round's histograms and decision are read everywhere
          for (int b = threadIdx.x; b < nbins; b += kThreads) sh.hist[b] = 0;
          __syncthreads();
          for (int64_t i = i0 + threadIdx.x; i < i1; i += kThreads) {
            const float z = sample_z(row, i, t);
            if (!(z > -INFINITY)) continue;
            const unsigned key = smp::order_key(z);
            if ((key & mask) == prefix) count_bin(sh.hist, (key >> shift) & unsigned(nbins - 1));
          }
          __syncthreads();
          cluster.sync();  // every histogram is complete
        } else {
          cluster.sync();  // (round 0's histograms were completed before the first cluster sync)
        }
        // this rank's slice of the merged histogram, and its total
        const int b0 = rank * nbins / C, b1 = (rank + 1) * nbins / C;
        unsigned long long part = 0;
        for (int b = b0 + threadIdx.x; b < b1; b += kThreads) {
          unsigned s = 0;
          for (int c = 0; c < C; ++c) s += cluster.map_shared_rank(sh.hist, c)[b];
          sh.u.merged[b] = s;
          part += s;
        }
        part = block_sum(part, sh);
        if (threadIdx.x == 0) sh.range_total = part;
        cluster.sync();
        // the rank whose slice holds the need-th largest (slices of higher ranks hold larger digits)
        unsigned long long above = 0;
        int R = 0;
        for (int c = C - 1; c >= 0; --c) {
          const unsigned long long tot = cluster.map_shared_rank(&sh, c)->range_total;
          if (above + tot >= need) {
            R = c;
            break;
          }
          above += tot;
        }
        if (rank == R) {
          // suffix scan over the slice from its top: thread k takes the k-th bin from the top
          // (slices hold at most kBins / C bins; kThreads may be fewer: a loop of chunks)
          const unsigned long long need_here = need - above;
          unsigned long long carry = 0;
          bool found = false;
          for (int top = b1 - 1; top >= b0 && !found; top -= kThreads) {
            const int b = top - int(threadIdx.x);
            const unsigned long long v = b >= b0 ? sh.u.merged[b] : 0;
            unsigned long long total;
            const unsigned long long inc = block_scan(v, &total, sh);
            // the bin where the running count from the top first reaches need_here
            if (b >= b0 && v > 0 && carry + inc >= need_here && carry + inc - v < need_here) {
              sh.decided[0] = unsigned(b);
              sh.decided[1] = need_here - (carry + inc - v);
            }
            carry += total;
            found = carry >= need_here;
            __syncthreads();
          }
        }
        cluster.sync();  // rank R's decision is written
        const Smem* d = cluster.map_shared_rank(&sh, R);
        prefix |= unsigned(d->decided[0]) << shift;
        need = d->decided[1];
        mask |= unsigned(nbins - 1) << shift;
      }
      kkey = prefix;
      // the need-th key equal to kkey in index order: counts per rank, then one ordered scan
      unsigned long long eq = 0;
      for (int64_t i = i0 + threadIdx.x; i < i1; i += kThreads) {
        const float z = sample_z(row, i, t);
        eq += (z > -INFINITY && smp::order_key(z) == kkey) ? 1 : 0;
      }
      eq = block_sum(eq, sh);
      if (threadIdx.x == 0) sh.eq = eq;
      cluster.sync();
      unsigned long long before = 0;
      int Q = C - 1;
      for (int c = 0; c < C; ++c) {
        const unsigned long long e = cluster.map_shared_rank(&sh, c)->eq;
        if (before + e >= need) {
          Q = c;
          break;
        }
        before += e;
      }
      if (rank == Q) {
        const unsigned long long nth = need - before;
        unsigned long long carry = 0;
        for (int64_t base = i0; base < i1; base += kThreads) {
          const int64_t i = base + threadIdx.x;
          unsigned long long f = 0;
          if (i < i1) {
            const float z = sample_z(row, i, t);
            f = (z > -INFINITY && smp::order_key(z) == kkey) ? 1 : 0;
          }
          unsigned long long total;
          const unsigned long long inc = block_scan(f, &total, sh);
          if (f && carry + inc == nth) sh.decided[2] = static_cast<unsigned long long>(i);
          carry += total;
          if (carry >= nth) break;  // uniform: carry and total are the same in every thread
        }
      }
      cluster.sync();
      cut = static_cast<long long>(cluster.map_shared_rank(&sh, Q)->decided[2]);
    }
    // 3. members -> rank 0
    {
      Smem* r0 = cluster.map_shared_rank(&sh, 0);
      for (int64_t i = i0 + threadIdx.x; i < i1; i += kThreads) {
        const float z = sample_z(row, i, t);
        if (!(z > -INFINITY)) continue;
        if (use_k) {
          const unsigned key = smp::order_key(z);
          if (!(key > kkey || (key == kkey && i <= cut))) continue;
        }
        const unsigned slot = atomicAdd(&r0->cand_count, 1u);
        if (slot < unsigned(kMaxK)) r0->cand[slot] = int(i);
      }
    }
    cluster.sync();  // every member is in rank 0's shared memory; nothing remote is read after this
    if (rank != 0) continue;
    // 4. rank 0: the CPU reference's steps on the (at most top_k) members
    const int n = int(min(sh.cand_count, unsigned(kMaxK)));
    for (int e = threadIdx.x; e < n; e += kThreads) {  // index order by counting
      const int id = sh.cand[e];
      int pos = 0;
      for (int j = 0; j < n; ++j) pos += sh.cand[j] < id;
      sh.u.fin.idx[pos] = id;
    }
    __syncthreads();
    sample_finish_row<kWarpsPerCta>(p, r, row, zmax_all, n, sh.u.fin, sh.warp_u64, sh.decided);
  }
#endif
}

// 16 when a cluster of 16 can be resident on the device, else 8 (cluster16_or_8)
template <typename T>
int max_cluster(int dev) {
  return cluster16_or_8<sample_cluster_kernel<T>>(dev, kThreads, 0, "sample");
}

}  // namespace

std::string sample_cluster_can_implement(const void* args) {
  const auto& a = *static_cast<const ops::SampleArgs*>(args);
  if (a.top_k < 1 || a.top_k > kMaxK) return "top_k must be in 1..1024 (other calls: cuda_cta_per_row)";
  if (a.vocab > int64_t(INT32_MAX)) return "vocab exceeds 2^31 - 1";
  if (!device_props(a.logits.device.device_id).sm90_code) return "thread-block clusters need compute capability 9.0";
  return "";
}

void sample_cluster_cuda(const void* args, ks_stream_t stream) {
  const auto& a = *static_cast<const ops::SampleArgs*>(args);
  const int dev = a.logits.device.device_id;
  DeviceGuard g(dev, "sample");
  const DeviceProps& dp = device_props(dev);
  const SampleParams p = sample_params(a);
  const auto s = static_cast<cudaStream_t>(stream);
  int C = 1;
  int64_t grid = 0;
  auto go = [&](auto tag) {
    using T = decltype(tag);
    const int most = max_cluster<T>(dev);
    // the most CTAs per row while the rows fill at most 2 CTAs per SM, each CTA >= 4096 elements
    while (2 * C <= most && a.rows * 2 * C <= 2 * int64_t(dp.sm_count) && a.vocab >= int64_t(2 * C) * 4096) C *= 2;
    grid = std::min<int64_t>(a.rows, std::max<int64_t>(1, int64_t(dp.sm_count) * 2 / C)) * C;
    launch_kernel("sample", sample_cluster_kernel<T>, dim3(unsigned(grid)), dim3(kThreads), 0, s, C, dp.pdl, p);
  };
  with_float_type(a.logits.dtype, go);
  check_launch("sample");
  record_launch("sample", "cluster_topk threads=%lld cluster=%lld grid=%lld", {kThreads, C, grid});
}

}  // namespace ks::cuda
