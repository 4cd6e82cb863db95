// ks_sample on CUDA, variant cuda_cluster_local_topk (contract: docs/contracts.md#sample):
// top-k (1 <= top_k <= 1024) then top-p, the same ids as the CPU reference bit for bit, with
// one cluster barrier per row.
//
// A row is split over a cluster of C CTAs (C up to 16), each owning a contiguous range of
// at most 512 L scores (L = 8, 16, 32 or 64 per thread, in registers):
//  1. each CTA reads its range once: validity (NaN, +inf), the max of z = x / T, the
//     finite count, and each finite z's order key;
//  2. each CTA selects its own top-k (the top_k largest keys, equal keys going to lower
//     indices) by radix selection in four rounds of 8 bits over its registers, with no
//     cluster traffic (a histogram per warp: scores crowd into a few bins, and atomics
//     from 16 warps on one bin serialize). The row's top-k is contained in the union of
//     the ranges' top-k: an id beaten by top_k ids of its own range is beaten by top_k ids
//     of the row, in the same (key desc, index asc) order;
//  3. each CTA writes its members (at most top_k, in index order) and its validity, max
//     and finite count into rank 0's shared memory; one cluster barrier;
//  4. rank 0: the row's top-k of the (at most C top_k) candidates by the same selection,
//     then sample_finish_row (sampling_finish.cuh): weights, top-p and the draw, the CPU
//     reference's steps.
// Positions (the Positions comment below: j * 512 + thread by default) number a range's
// scores in index order: the order-dependent steps (the cut among equal keys, the members'
// slots) count a run's flags within a warp, then one block-wide scan over the (run, warp)
// counts.
//
// The row's floor (top_k <= 64; KS_SAMPLE_FLOOR=0 turns it off): after step 1 the row is cut
// into 256 groups of 2C adjacent threads (V / 256 scores each), each CTA publishes its 256 / C
// group maxima in its own shared memory, and after a cluster barrier every CTA reads all 256
// and takes the top_k-th largest, F. At least top_k scores (those maxima) have keys >= F, so
// every member of the row's top-k has a key >= F, and few others do (a score >= F that is not
// one of the top_k maxima must share a group with a larger one). Then step 2 is: each CTA
// sends every key >= F (in index order) when they are at most its slot count (kcap), and its
// own top-k (the radix selection, as without the floor) when there are more, all of which are
// >= F too; rank 0 places the candidates by the ranks' counts and, when at most 512 came, ranks
// each of them by counting the ones before it in (key desc, index asc) order: the members are
// those ranked below top_k. The
// same members as the selection (both are the first top_k of that order), so the same ids.
// Without the floor a selection is a chain of CTA barriers (two to four radix rounds, each a
// histogram, a scan and their barriers: 13,359 SM cycles of a 42,619-cycle row at
// 1 x 128256, be28fdd), and rank 0's second selection another (8,265).
#include <cooperative_groups.h>

#include <climits>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <set>
#include <string>
#include <type_traits>

#include "backends/cuda/common.cuh"
#include "backends/cuda/sampling_common.cuh"
#include "backends/cuda/sampling_finish.cuh"
#include "core/sampling_math.hpp"
#include "ops/args.hpp"

namespace cg = cooperative_groups;

namespace ks::cuda {
namespace {

namespace smp = ks::sampling;
constexpr int kThreads = 512, kWarps = kThreads / 32, kBins = 256, kMaxC = 16, kMaxL = 64;
// The row's floor: 256 group maxima per row; used for top_k up to 64 (a quarter of them)
constexpr int kFloorGroups = 256, kFloorMaxK = 64;

struct Smem {
  unsigned hist[kWarps][kBins];  // a digit histogram per warp (no atomics across warps)
  unsigned pos_count[kMaxL * kWarps];  // ordered prefix: per (j, warp) counts, then their prefix
  SampleMembers fin;                   // rank 0: the row's members, then the last step
  unsigned long long warp_u64[kWarps];
  float warp_f[kWarps];
  unsigned long long decided[3];
  unsigned sel[2];  // a selection round's digit and the count still needed within it
  unsigned gmax[kFloorGroups];  // the floor: this CTA's 256 / C group maxima, read by every rank
  unsigned floor_key;           // the row's floor F (0: none)
  alignas(16) unsigned ckey[kThreads];  // rank 0: the candidates >= F, in index order, and their ids
  int cidx[kThreads];
  // rank 0: what every rank publishes
  int part_bad[kMaxC];
  float part_zmax[kMaxC];
  unsigned part_finite[kMaxC];
  unsigned part_n[kMaxC];
};

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
// hist[bin] += 1 (the calling warp's own histogram). A plain shared atomic per lane: at
// 10fa6ee, aggregating equal bins first with __match_any_sync cost about 1 us per score
// per thread over the four rounds (1x128256: 30.5 us at 16 scores per thread, 45 at 32).
__device__ __forceinline__ void count_bin(unsigned *hist, unsigned bin) { atomicAdd(&hist[bin], 1u); }

// The digit whose bin, summed over the warps' histograms, is where the count from the top
// first reaches need (>= 1, and <= the histograms' total): sh.sel = {digit, need - the count
// in the digits above it}. Thread t < 256 takes digit 255 - t.
__device__ void select_digit(Smem &sh, unsigned need) {
  const int d = kBins - 1 - int(threadIdx.x);
  unsigned s = 0;
  if (d >= 0)
#pragma unroll
    for (int w = 0; w < kWarps; ++w) s += sh.hist[w][d];
  unsigned long long total;
  const unsigned long long inc = block_scan_u64<kWarps>(s, &total, sh.warp_u64);
  if (s > 0 && inc - s < need && inc >= need) {
    sh.sel[0] = unsigned(d);
    sh.sel[1] = unsigned(need - (inc - s));
  }
  __syncthreads();
}

// Positions. A thread's L scores are L / E runs of E consecutive scores (E = 1: the layout
// before 2026-12-01, now KS_SAMPLE_VEC=0; E = 16 bytes / sizeof(T) by default, so a run is one
// 16-byte load): key j of thread t is at position ((j / E) * 512 + t) * E + j % E of its range. So
// positions run in (run v, warp, lane, e) order, and every order-dependent step (the cut among
// equal keys, the members' slots) counts in that order.
template <int E>
__device__ __forceinline__ int position(int j) {
  return ((j / E) * kThreads + int(threadIdx.x)) * E + j % E;
}
// The E flags of run v (bits v * E .. v * E + E - 1 of flags).
template <int E>
__device__ __forceinline__ unsigned run_bits(uint64_t flags, int v) {
  return unsigned(flags >> (v * E)) & unsigned((1ull << E) - 1ull);
}

// For the flags of the calling thread's positions (bit j for key j, j < L), the number of set
// flags at lower positions of the CTA, for each run v and warp, into sh.pos_count (read by
// for_each_ranked); *total: the CTA's set flags. Every thread calls it.
template <int L, int E>
__device__ void ordered_prefix(uint64_t flags, Smem &sh, unsigned *total) {
  constexpr int NV = L / E;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();  // pos_count's previous contents are consumed
#pragma unroll
  for (int v = 0; v < NV; ++v) {
    unsigned c;
    if constexpr (E == 1)
      c = unsigned(__popc(__ballot_sync(0xffffffffu, run_bits<E>(flags, v))));
    else
      c = __reduce_add_sync(0xffffffffu, unsigned(__popc(run_bits<E>(flags, v))));
    if (lane == 0) sh.pos_count[v * kWarps + warp] = c;
  }
  __syncthreads();
  // exclusive prefix over the NV * kWarps counts in (v, warp) order: P per thread
  constexpr int P = (NV * kWarps + kThreads - 1) / kThreads;
  unsigned cnt[P], s = 0;
#pragma unroll
  for (int e = 0; e < P; ++e) {
    const int q = int(threadIdx.x) * P + e;
    cnt[e] = q < NV * kWarps ? sh.pos_count[q] : 0;
    s += cnt[e];
  }
  unsigned long long all;
  unsigned run = unsigned(block_scan_u64<kWarps>(s, &all, sh.warp_u64)) - s;
#pragma unroll
  for (int e = 0; e < P; ++e) {
    const int q = int(threadIdx.x) * P + e;
    if (q < NV * kWarps) sh.pos_count[q] = run;
    run += cnt[e];
  }
  *total = unsigned(all);
  __syncthreads();
}
// After ordered_prefix on the same flags: f(j, slot) for each set flag j of the calling thread,
// slot = the number of set flags at lower positions of the CTA. Every thread of the CTA calls it
// (warp ballots or scans; f runs under the flag's condition).
template <int L, int E, typename F>
__device__ __forceinline__ void for_each_ranked(uint64_t flags, const Smem &sh, F &&f) {
  constexpr int NV = L / E;
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int v = 0; v < NV; ++v) {
    const unsigned bits = run_bits<E>(flags, v);
    unsigned before;  // set flags of run v in this warp's lower lanes
    if constexpr (E == 1) {
      before = unsigned(__popc(__ballot_sync(0xffffffffu, bits) & ((1u << lane) - 1u)));
    } else {
      const unsigned c = unsigned(__popc(bits));
      unsigned inc = c;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const unsigned y = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= o) inc += y;
      }
      before = inc - c;
    }
    unsigned slot = sh.pos_count[v * kWarps + (threadIdx.x >> 5)] + before;
#pragma unroll
    for (int e = 0; e < E; ++e)
      if ((bits >> e) & 1u) f(v * E + e, slot++);
  }
}

// The k-th largest (1 <= k <= 256) of the 256 values v held 8 per lane by one warp, with
// multiplicity: the largest c with at least k values >= c, bit by bit from the top. Bits that
// every value shares are the result's too (it is one of the values), so only the bits where the
// values differ take a step (two ballots' worth of counting per value and step).
__device__ __forceinline__ unsigned warp_kth_largest(const unsigned (&v)[8], unsigned k) {
  unsigned o = 0u, a = 0xffffffffu;
#pragma unroll
  for (int u = 0; u < 8; ++u) o |= v[u], a &= v[u];
  o = __reduce_or_sync(0xffffffffu, o);
  a = __reduce_and_sync(0xffffffffu, a);
  unsigned res = a, open = o ^ a;
  while (open) {
    const unsigned bit = 1u << (31 - __clz(open));
    open &= ~bit;
    const unsigned c = res | bit;
    unsigned cnt = 0;
#pragma unroll
    for (int u = 0; u < 8; ++u) cnt += unsigned(__popc(__ballot_sync(0xffffffffu, v[u] >= c)));
    if (cnt >= k) res = c;
  }
  return res;
}

// The top k of the CTA's nonzero keys (key[j] at position<E>(j); count of them CTA-uniform): the k largest, equal keys going to
// lower positions; all of them when count <= k. Returns the calling thread's
// member flags (bit j); *members: their number.
template <int L, int E>
__device__ uint64_t select_top(const unsigned (&key)[L], unsigned count, unsigned k, Smem &sh, unsigned *members) {
  uint64_t flags = 0;
  if (count <= k) {
#pragma unroll
    for (int j = 0; j < L; ++j)
      if (key[j]) flags |= 1ull << j;
    *members = count;
    return flags;
  }
  unsigned prefix = 0, mask = 0, need = k;
  const int warp = threadIdx.x >> 5;
  for (int shift = 24; shift >= 0; shift -= 8) {  // radix selection, 8 bits a round
    // A round whose digit every surviving key shares would select that digit and leave `need`
    // as it is: take it without the round (the same prefix and need, so the same members).
    // bf16 logits at temperature 1: the keys' low 16 bits are equal among keys of one sign, so
    // a selection takes two rounds instead of four.
    {
      unsigned o = 0u, a = 0xffffffffu;
#pragma unroll
      for (int j = 0; j < L; ++j)
        if (key[j] && (key[j] & mask) == prefix) o |= key[j], a &= key[j];
      block_or_and<kWarps>(o, a, sh.warp_u64, &o, &a);
      while (shift >= 0 && (((o ^ a) >> shift) & unsigned(kBins - 1)) == 0) {
        prefix |= o & (unsigned(kBins - 1) << shift);
        mask |= unsigned(kBins - 1) << shift;
        shift -= 8;
      }
      if (shift < 0) break;
    }
    for (int b = threadIdx.x; b < kWarps * kBins; b += kThreads) (&sh.hist[0][0])[b] = 0;
    __syncthreads();
#pragma unroll
    for (int j = 0; j < L; ++j)
      if (key[j] && (key[j] & mask) == prefix) count_bin(sh.hist[warp], (key[j] >> shift) & unsigned(kBins - 1));
    __syncthreads();
    select_digit(sh, need);
    prefix |= sh.sel[0] << shift;
    need = sh.sel[1];
    mask |= unsigned(kBins - 1) << shift;
  }
  // prefix: the k-th largest key; need: how many keys equal to it are members
  // (lowest first)
  uint64_t eq = 0;
#pragma unroll
  for (int j = 0; j < L; ++j) {
    if (key[j] > prefix) flags |= 1ull << j;
    if (key[j] == prefix) eq |= 1ull << j;
  }
  unsigned eq_total;
  ordered_prefix<L, E>(eq, sh, &eq_total);
  for_each_ranked<L, E>(eq, sh, [&](int j, unsigned rank) {
    if (rank < need) flags |= 1ull << j;
  });
  *members = k;
  return flags;
}

#endif

// Trace (KS_SAMPLE_TRACE=1, bf16 calls only; for locating the time, not for production): a
// barrier and a clock64() reading after each phase, and thread 0 of row 0's rank 0 prints
// the SM cycles each phase took, once per launch (nothing when row 0 has no distribution).
template <typename T, int L, bool Trace = false, bool Vec = false>
__global__ void __launch_bounds__(kThreads) sample_local_kernel(const SampleParams p, int kcap, int use_floor) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int E = Vec ? int(16 / sizeof(T)) : 1;  // scores per run (the Positions comment)
  static_assert(L % E == 0, "whole runs");
  extern __shared__ unsigned cand[];  // [C * kcap] keys, then [C * kcap] indices (rank 0's)
  __shared__ Smem sh;
  cluster_arrive_relaxed();  // "this CTA has started"; waited for before the first remote write
  pdl_begin();
  long long tr[9] = {};
  auto mark = [&](int i) {
    if constexpr (Trace) {
      __syncthreads();
      tr[i] = clock64();
    }
  };
  mark(0);
  cg::cluster_group cluster = cg::this_cluster();
  const int C = int(cluster.num_blocks()), rank = int(cluster.block_rank());
  const int64_t r = blockIdx.x / C, V = p.vocab;
  const int64_t per = (V + C - 1) / C, i0 = min(V, int64_t(rank) * per), i1 = min(V, i0 + per);
  const int n_loc = int(i1 - i0);
  const T *row = static_cast<const T *>(p.logits) + r * V;
  const float t = p.temperature;
  const unsigned k = unsigned(p.top_k);
  // 1. the range, once. The loads go out kLoadBatch at a time before any of their scores is
  // made: written as one loop, each load waited for the one before it (the division's slow path
  // is a call, which the compiler does not move loads across), so a thread's L scores took L
  // memory round trips (at 69d45c2's 1x128256, 9003 of 52908 cycles; at 64x128256, L = 64,
  // 55356 of 158545). The same values.
  // With runs of E > 1, a batch is 4 runs of 16-byte loads (where the range's start is 16-byte
  // aligned and the run lies inside the range; else the run's scores one by one, -inf past the
  // range's end: z = -inf / t = -inf, so no key, not finite, not bad, and no branch per score).
  constexpr int kLoadBatch = E == 1 ? (L < 16 ? L : 16) : (L < 4 * E ? L : 4 * E);
  const bool vec_ok = E > 1 && (reinterpret_cast<uintptr_t>(row + i0) & 15u) == 0;
  unsigned key[L];
  int bad = 0;
  unsigned finite = 0;
  float zmax = -INFINITY;
#pragma unroll
  for (int j0 = 0; j0 < L; j0 += kLoadBatch) {
    T raw[kLoadBatch];
    if constexpr (E == 1) {
#pragma unroll
      for (int u = 0; u < kLoadBatch; ++u) {
        const int q = position<E>(j0 + u);
        raw[u] = q < n_loc ? row[i0 + q] : Dt<T>::from_f(0.f);
      }
    } else {
#pragma unroll
      for (int w = 0; w < kLoadBatch / E; ++w) {
        const int q = position<E>(j0 + w * E);  // the run's first position
        if (vec_ok && q + E <= n_loc) {
          const uint4 v4 = *reinterpret_cast<const uint4 *>(row + i0 + q);
          memcpy(&raw[w * E], &v4, sizeof(v4));
        } else {
#pragma unroll
          for (int e = 0; e < E; ++e) raw[w * E + e] = q + e < n_loc ? row[i0 + q + e] : Dt<T>::from_f(-INFINITY);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kLoadBatch; ++u) {
      const int j = j0 + u, q = position<E>(j);
      key[j] = 0;  // below every finite z's key (>= 0x00800000)
      if (E > 1 || q < n_loc) {
        const float x = Dt<T>::to_f(raw[u]);
        const float z = scaled_logit(x, t);  // x / t as the CPU divides
        bad |= (x != x) || z == INFINITY;
        if (z > -INFINITY) {
          ++finite;
          zmax = fmaxf(zmax, z);
          key[j] = smp::order_key(z);
        }
      }
    }
  }
  bad = __syncthreads_or(bad);
  zmax = block_max_f<kWarps>(zmax, sh.warp_f);
  finite = unsigned(block_sum_u64<kWarps>(finite, sh.warp_u64));
  // The row's floor F: the top_k-th largest of the row's 256 group maxima (the file's comment)
  unsigned F = 0;
  if (use_floor) {  // (cluster-uniform: top_k and C)
    const int G = 2 * C, per_rank = kFloorGroups / C;  // threads per group, groups per CTA
    unsigned m = 0;
#pragma unroll
    for (int j = 0; j < L; ++j) m = max(m, key[j]);
    for (int o = 1; o < G; o <<= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
    if ((int(threadIdx.x) & (G - 1)) == 0) sh.gmax[int(threadIdx.x) / G] = m;
    cluster_wait();    // every CTA of the cluster has started
    cluster_arrive();  // (release: the group maxima)
    cluster_wait();
    if (threadIdx.x < 32) {
      unsigned v[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        const int gi = u * 32 + int(threadIdx.x);
        v[u] = *cluster.map_shared_rank(&sh.gmax[gi % per_rank], gi / per_rank);
      }
      const unsigned f = warp_kth_largest(v, k);
      if (threadIdx.x == 0) sh.floor_key = f;
    }
    __syncthreads();
    F = sh.floor_key;
  }
  mark(1);
  // 2. this range's members, in index order: with the floor, every key >= F where they fit the
  // slots, else (and without the floor) the range's top-k
  unsigned n_mem = 0, placed;
  uint64_t mem = 0;
  bool ordered = false;  // ordered_prefix already ran on mem
  if (!bad && use_floor) {
#pragma unroll
    for (int j = 0; j < L; ++j)
      if (key[j] && key[j] >= F) mem |= 1ull << j;
    ordered_prefix<L, E>(mem, sh, &placed);
    if (placed <= unsigned(kcap)) {
      n_mem = placed;
      ordered = true;
    }
  }
  if (!bad && !ordered) mem = select_top<L, E>(key, finite, k, sh, &n_mem);
  if (bad) mem = 0;
  mark(2);
  if (!ordered) ordered_prefix<L, E>(mem, sh, &placed);
  mark(3);
  // 3. into rank 0's shared memory
  if (!use_floor) cluster_wait();  // every CTA of the cluster has started (the floor waited)
  unsigned *r0_key = cluster.map_shared_rank(cand, 0);
  int *r0_idx = reinterpret_cast<int *>(r0_key + C * kcap);
  const int base = rank * kcap;
  for_each_ranked<L, E>(mem, sh, [&](int j, unsigned slot) {
    r0_key[base + int(slot)] = key[j];
    r0_idx[base + int(slot)] = int(i0 + position<E>(j));
  });
  if (threadIdx.x == 0) {
    Smem *r0 = cluster.map_shared_rank(&sh, 0);
    r0->part_bad[rank] = bad;
    r0->part_zmax[rank] = zmax;
    r0->part_finite[rank] = finite;
    r0->part_n[rank] = bad ? 0 : n_mem;
  }
  cluster_arrive();
  cluster_wait();  // every rank's candidates are in rank 0; the other ranks are done
  if (rank != 0) return;
  mark(4);
  // 4. rank 0: the row's top-k of the candidates (slot rank * kcap + s: index order), then the
  // last step
  int bad_all = 0;
  float zmax_all = -INFINITY;
  unsigned long long finite_all = 0;
  for (int c = 0; c < C; ++c) {
    bad_all |= sh.part_bad[c];
    zmax_all = fmaxf(zmax_all, sh.part_zmax[c]);
    finite_all += sh.part_finite[c];
  }
  if (bad_all || finite_all == 0) {
    if (threadIdx.x == 0) {
      p.out[r] = 0;
      if (p.valid) p.valid[r] = 0;
    }
    return;
  }
  const int *idx = reinterpret_cast<const int *>(cand + C * kcap);
  const int slots = C * kcap;
  unsigned n = 0;
  // With the floor every candidate is >= F (a range sends its own top-k only when more than
  // kcap = top_k of its keys are >= F; where kcap < top_k, kcap is the range's length and
  // nothing overflows), so candidate s of rank c is the (n_0 + .. + n_{c-1} + s)-th in index
  // order. Where more than top_k and at most 512 of them came, they go straight into ckey /
  // cidx (no scan) and are ranked by counting; else rank 0's radix selection below.
  unsigned n_cand = 0;  // (with the floor) the candidates every rank sent
  if (use_floor)
    for (int c = 0; c < C; ++c) n_cand += sh.part_n[c];
  if (use_floor && n_cand > k && n_cand <= unsigned(kThreads)) {
    for (int g = int(threadIdx.x); g < slots; g += kThreads) {
      const int c = g / kcap, sl = g - c * kcap;
      if (sl < int(sh.part_n[c])) {
        unsigned at = unsigned(sl);
        for (int c2 = 0; c2 < c; ++c2) at += sh.part_n[c2];
        sh.ckey[at] = cand[g], sh.cidx[at] = idx[g];
      }
    }
    mark(5);
    // Candidate i's rank: the candidates before it in (key desc, index asc) order, four keys
    // per shared-memory load (the tail padded with 0, below every candidate's key). Members:
    // rank < top_k, placed by a scan in index order.
    const int n4 = (int(n_cand) + 3) / 4;
    if (int(threadIdx.x) >= int(n_cand) && int(threadIdx.x) < 4 * n4) sh.ckey[threadIdx.x] = 0u;
    __syncthreads();
    const int i = int(threadIdx.x);
    unsigned before = 0;
    if (i < int(n_cand)) {
      const unsigned me = sh.ckey[i];
      const uint4 *ck4 = reinterpret_cast<const uint4 *>(sh.ckey);
#pragma unroll 4
      for (int h4 = 0; h4 < n4; ++h4) {
        const uint4 o = ck4[h4];
        const int h = 4 * h4;
        before += unsigned(o.x > me || (o.x == me && h < i)) + unsigned(o.y > me || (o.y == me && h + 1 < i)) +
                  unsigned(o.z > me || (o.z == me && h + 2 < i)) + unsigned(o.w > me || (o.w == me && h + 3 < i));
      }
    }
    mark(6);
    const bool member = i < int(n_cand) && before < k;
    unsigned long long n_all;
    const unsigned long long slot = block_scan_u64<kWarps>(member ? 1ull : 0ull, &n_all, sh.warp_u64);
    if (member) sh.fin.idx[slot - 1] = sh.cidx[i], sh.fin.w[slot - 1] = sh.ckey[i];
    n = k;
  } else {
    // rank 0's top-k by the radix selection over its registers (key j at position<E>(j) =
    // rank * kcap + slot: index order)
    unsigned n_reg = 0;
#pragma unroll
    for (int j = 0; j < L; ++j) {
      const int g = position<E>(j);
      key[j] = 0;
      if (g < slots) {
        const int c = g / kcap;
        if (g - c * kcap < int(sh.part_n[c]) && cand[g] >= F) key[j] = cand[g], ++n_reg;
      }
    }
    n_cand = unsigned(block_sum_u64<kWarps>(n_reg, sh.warp_u64));
    mark(5);
    // (a row with at most top_k finite scores: every range sent all of its own, all members)
    const uint64_t top = select_top<L, E>(key, n_cand, k, sh, &n);
    mark(6);
    ordered_prefix<L, E>(top, sh, &placed);
    for_each_ranked<L, E>(top, sh, [&](int j, unsigned slot) {
      sh.fin.idx[slot] = idx[position<E>(j)];
      sh.fin.w[slot] = key[j];
    });
  }
  __syncthreads();
  mark(7);
  // (the members' keys in sh.fin.w: the last step does not read the logits again)
  sample_finish_row<kWarps>(p, r, row, zmax_all, int(n), sh.fin, sh.warp_u64, sh.decided, true);
  mark(8);
  if constexpr (Trace)
    if (blockIdx.x == 0 && threadIdx.x == 0)
      printf("sample trace L=%d C=%d floor=%d vec=%d (SM cycles, row 0 rank 0): load+floor %lld select %lld order %lld "
             "write+barrier %lld candidates %lld select %lld order %lld finish %lld total %lld\n",
             L, C, use_floor, int(Vec), tr[1] - tr[0], tr[2] - tr[1], tr[3] - tr[2], tr[4] - tr[3], tr[5] - tr[4], tr[6] - tr[5],
             tr[7] - tr[6], tr[8] - tr[7], tr[8] - tr[0]);
#endif
}

constexpr int kLs[] = {8, 16, 32, 64};
constexpr size_t kSmemLimit = size_t(kMaxC) * kSampleMaxTopK * 8;  // the largest candidate area: 128 KB

// Once per device and instantiation: clusters of 16 (non-portable) allowed, and
// the dynamic shared memory limit raised to the largest candidate area.
template <typename T, int L, bool Trace, bool Vec>
void prepare(int dev) {
  static std::mutex mu;
  static std::set<int> done;
  std::lock_guard<std::mutex> lock(mu);
  if (done.count(dev)) return;
  auto kern = sample_local_kernel<T, L, Trace, Vec>;
  check_cuda(cudaFuncSetAttribute(kern, cudaFuncAttributeNonPortableClusterSizeAllowed, 1), "sample",
             "allow a non-portable cluster size");
  check_cuda(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSmemLimit)), "sample",
             "raise the dynamic shared memory limit");
  done.insert(dev);
}

// 16 when a cluster of 16 of the heaviest instantiation (L = 64, the largest candidate area)
// can be resident on the device (16 SMs of one GPC), else 8 (cluster16_or_8).
int max_cluster(int dev) {
  return cluster16_or_8<sample_local_kernel<float, kMaxL>>(dev, kThreads, kSmemLimit, "sample");
}

// Runs of 16 bytes (the Positions comment), unless KS_SAMPLE_VEC=0 (scalar loads, for comparisons).
bool vec_runs() { return !env_is("KS_SAMPLE_VEC", "0"); }

struct Plan {
  int C = 1, L = 0, kcap = 0;
  size_t smem = 0;
  std::string why;
};

// The cluster size C and scores per thread L for a call: C at least what makes
// a range fit 512 x 64 scores; then doubled up to max_c while the rows' CTAs
// fit one per SM and each range keeps >= 2048 scores, and (scalar loads only)
// while ranges need 64 per thread and the rows' CTAs stay within 4 per SM (KS_SAMPLE_CLUSTER=C: that
// power of two instead, if a range fits it; for experiments). L: the fewest
// that hold a range and rank 0's C x kcap candidates.
Plan plan_for(const ops::SampleArgs &a, int sm_count, int max_c, bool vec) {
  Plan pl;
  const int64_t V = a.vocab, most = int64_t(kThreads) * kMaxL;
  auto fits = [&](int c) { return (V + c - 1) / c <= most; };
  int C = 1;
  while (C < max_c && !fits(C)) C *= 2;
  if (!fits(C)) {
    pl.why = "vocab exceeds " + std::to_string(max_c) + " x 32768 scores (other calls: cuda_cluster_topk)";
    return pl;
  }
  while (2 * C <= max_c && a.rows * 2 * C <= int64_t(sm_count) && V / (2 * C) >= 2048) C *= 2;
  // Scalar loads (KS_SAMPLE_VEC=0) only: 64 scores per thread only where 32 would take more than
  // 4 CTAs per SM. At 64 x 128256 (bf16, top-k 50, top-p 0.9; 1483d8d) C = 8, L = 32 took 67.7 us
  // against 85.2 at C = 4, L = 64 (and 94.8 at C = 16); at 256 x 151936 C = 16, L = 32 took 550
  // against 481 at C = 8. With runs of 16 bytes (the default; 1a2d0da) 64 scores per thread load
  // as 8 runs and the fewest CTAs win: 64 x 128256 at C = 4 (L = 64) 38.5 us against 49.6 at C = 8
  // (L = 32) and 52.9 at C = 16; 256 x 151936 at C = 8 (L = 64) 243 against 395 at C = 16.
  if (!vec)
    while (2 * C <= max_c && (V + C - 1) / C > int64_t(kThreads) * 32 && a.rows * 2 * C <= 4 * int64_t(sm_count))
      C *= 2;
  const long long forced = env_number("KS_SAMPLE_CLUSTER", 0);
  if ((forced == 1 || forced == 2 || forced == 4 || forced == 8 || forced == 16) && forced <= max_c &&
      fits(int(forced)))
    C = int(forced);
  const int64_t per = (V + C - 1) / C;
  pl.C = C;
  pl.kcap = int(std::min<int64_t>(a.top_k, per));
  const int64_t need = std::max<int64_t>(per, int64_t(C) * pl.kcap);  // a range, and rank 0's candidates
  for (int L : kLs)
    if (int64_t(kThreads) * L >= need) {
      pl.L = L;
      break;
    }
  pl.smem = size_t(C) * size_t(pl.kcap) * 8;
  // (against the largest cluster, so can_implement, which plans without asking the device,
  // and the launch agree whatever C turns out to be)
  if (a.rows > int64_t(INT_MAX) / kMaxC) pl.why = "rows exceed (2^31 - 1) / 16 (the grid's CTAs at 16 per row)";
  return pl;
}

}  // namespace

std::string sample_local_can_implement(const void *args) {
  const auto &a = *static_cast<const ops::SampleArgs *>(args);
  if (a.top_k < 1 || a.top_k > kSampleMaxTopK) return "top_k must be in 1..1024 (other calls: cuda_cta_per_row)";
  const int dev = a.logits.device.device_id;
  const DeviceProps &dp = device_props(dev);
  if (!dp.sm90_code) return "thread-block clusters need compute capability 9.0";
  if (a.vocab <= int64_t(kThreads) * kMaxL * 8) return plan_for(a, dp.sm_count, 8, vec_runs()).why;  // (no device query)
  return plan_for(a, dp.sm_count, max_cluster(dev), vec_runs()).why;
}

void sample_local_cuda(const void *args, ks_stream_t stream) {
  const auto &a = *static_cast<const ops::SampleArgs *>(args);
  const int dev = a.logits.device.device_id;
  DeviceGuard g(dev, "sample");
  const DeviceProps &dp = device_props(dev);
  const bool vec = vec_runs();
  const Plan pl = plan_for(a, dp.sm_count, max_cluster(dev), vec);
  if (!pl.why.empty()) detail::fail(KS_ERROR_INTERNAL, "sample",
                                    pl.why);  // (can_implement refused it)
  const SampleParams p = sample_params(a);
  const auto s = static_cast<cudaStream_t>(stream);
  const bool trace = env_is("KS_SAMPLE_TRACE", "1");
  const int use_floor = a.top_k <= kFloorMaxK && !env_is("KS_SAMPLE_FLOOR", "0") ? 1 : 0;
  auto go = [&](auto tag, auto lt) {
    using T = decltype(tag);
    constexpr int L = decltype(lt)::value;
    // the kernel, or its traced instantiation (bf16 only), with runs of 1 or of 16 bytes
    auto launch = [&](auto traced, auto vectored) {
      constexpr bool Trace = decltype(traced)::value, Vec = decltype(vectored)::value;
      prepare<T, L, Trace, Vec>(dev);
      launch_kernel("sample", sample_local_kernel<T, L, Trace, Vec>, dim3(unsigned(a.rows * pl.C)), dim3(kThreads),
                    pl.smem, s, pl.C, dp.pdl, p, pl.kcap, use_floor);
    };
    auto launch_vec = [&](auto traced) {
      if (vec) return launch(traced, std::true_type{});
      launch(traced, std::false_type{});
    };
    if constexpr (std::is_same_v<T, __nv_bfloat16>)
      if (trace) return launch_vec(std::true_type{});
    launch_vec(std::false_type{});
  };
  with_float_type(a.logits.dtype, [&](auto tag) {
    switch (pl.L) {
      case 8:
        go(tag, std::integral_constant<int, 8>{});
        break;
      case 16:
        go(tag, std::integral_constant<int, 16>{});
        break;
      case 32:
        go(tag, std::integral_constant<int, 32>{});
        break;
      default:
        go(tag, std::integral_constant<int, 64>{});
        break;
    }
  });
  check_launch("sample");
  record_launch("sample", "cluster_local_topk threads=%lld cluster=%lld L=%lld grid=%lld floor=%lld vec=%lld",
                {kThreads, pl.C, pl.L, a.rows * pl.C, use_floor, vec ? 1 : 0});
}

}  // namespace ks::cuda
