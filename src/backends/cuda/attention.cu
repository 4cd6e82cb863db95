// paged_attention on CUDA, variant cuda_gqa_cluster (contract: docs/contracts.md,
// paged_attention): decode and prefill read the cache once per KV head instead of once
// per query head, and long contexts are split over a thread-block cluster.
//
// Work unit: (query token t, kv head g) with the G = num_heads / num_kv_heads query
// heads that share g. A cluster of C CTAs splits the unit's keys into C contiguous
// ranges. Inside a CTA, LPK lanes hold one key row: lane `sub` owns the E = 16 / sizeof(T)
// elements [sub*E, sub*E + E) of K and V, loaded as one 16-byte vector, and the query's G
// rows for the same elements in registers. So a warp is 32 / LPK independent key streams;
// each stream walks keys stream, stream + NS, ... (NS streams per CTA) U at a time. The
// loads are cp.async copies into a two-stage shared-memory ring: while a step is computed,
// the next step's 2U rows are in flight, and the block-table entries of the step after are
// prefetched into registers. A lane reads back only the 16-byte pieces it copied itself,
// so a per-thread wait (cp.async.wait_group) orders them and no barrier is needed. Per
// stream and head an online softmax in FP32 (running max m, sum l, accumulator acc; one
// rescale per U keys; each e^(s - max) as the SFU's ex2.approx of (s - max) log2 e); the score is the FP32 dot reduced over the
// LPK lanes by shuffles. Dropped keys (unmapped blocks) weigh 0; a -inf score weighs 0;
// a NaN score gives a NaN weight, as the CPU's exp. The states then merge: streams of a
// warp by shuffles, warps through shared memory, the C CTAs of the cluster through
// distributed shared memory: out = sum_c acc_c e^(m_c - M) / sum_c l_c e^(m_c - M).
// No workspace in global memory, so nothing is allocated per call (graph-capturable).
// C: the fewest of 1, 2, 4, 8, 16 that give two CTAs per SM, at most one per 64 keys of
// the block table's capacity; 8 at most where a cluster of 16 cannot be resident. Of the C
// CTAs only the first Ce = min(C, ceil(len / keys per step)) take keys (len: the unit's
// live context length), so a graph captured for the capacity stays cheap at short lengths.
// can_implement: head_dim a multiple of E and at most 32 E, G <= 8, 16-byte aligned
// tensors; other calls go to cuda_cta_per_head.
#include <cooperative_groups.h>

#include <algorithm>
#include <array>
#include <climits>
#include <cstdlib>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "backends/cuda/attention_params.cuh"
#include "backends/cuda/common.cuh"
#include "backends/cuda/rope_common.cuh"
#include "ops/args.hpp"

namespace cg = cooperative_groups;

namespace ks::cuda {
namespace {

// Timeline (a build with -DKS_ATTN_TIMELINE=ON only, for locating the time; never in a release
// build): lane 0 of every warp of cuda_mma_cluster stores %globaltimer (ns) at points of its
// CTA's work into ks_attn_tl[(blockIdx.x * 16 + warp) * 16 + event] (blocks below 512); every
// launch overwrites its slots, so after a run of calls the buffer holds the last launch's.
// ks_debug_attention_timeline copies it out and clears it (bench_ops, KS_ATTN_TIMELINE=1).
// Events: 0 entry, 1 after griddepcontrol.wait, 2 the warp's first tile landed, 3 its key loop
// done, 4 the CTA's warps all done, 5 the state written (finish_unit), 6 exit; finish_unit: 8
// after its first barrier, 9 the warps' factors made; the split's last-CTA merge: 10 the count
// taken (atomic), 11 the states loaded, 12 the factors made, 13 the outputs stored; a cluster's
// merge (finish_unit; 11-13 and 15 = 2 in cuda_mma_cluster's kOneTrip form only): 10 before its
// first cluster barrier, 11 after it, 12 the outputs made, 13 after its last cluster barrier; 15:
// 1 where this CTA merged the unit's split states, 2 where it took part in a cluster's merge. A
// barrier's wait is deferred to the warp's next memory instruction (BAR.SYNC.DEFER_BLOCKING):
// each stamp first reads shared memory (a volatile load), so that it is taken after the wait.
#if defined(KS_ATTN_TIMELINE)
constexpr int kTlBlocks = 512, kTlWarps = 16, kTlEvents = 16;
__device__ unsigned long long ks_attn_tl[kTlBlocks * kTlWarps * kTlEvents];
[[maybe_unused]] __device__ __forceinline__ void tl_mark(int ev, unsigned long long v = 0) {
  if ((threadIdx.x & 31) == 0 && blockIdx.x < kTlBlocks) {
    __shared__ unsigned tl_dummy;
    unsigned long long t = v;
    unsigned d;
    if (ev != 15)
      asm volatile("ld.volatile.shared.u32 %1, [%2];\n\tmov.u64 %0, %%globaltimer;"
                   : "=l"(t), "=r"(d) : "r"(unsigned(__cvta_generic_to_shared(&tl_dummy))) : "memory");
    ks_attn_tl[(blockIdx.x * kTlWarps + (threadIdx.x >> 5)) * kTlEvents + ev] = t;
  }
}
// the stamp after lane 0's x is computed (x stored to shared memory first: its store waits for it)
[[maybe_unused]] __device__ __forceinline__ void tl_mark_after(int ev, float x) {
  if ((threadIdx.x & 31) == 0 && blockIdx.x < kTlBlocks) {
    __shared__ unsigned tl_sink;
    unsigned long long t;
    unsigned d;
    const unsigned a = unsigned(__cvta_generic_to_shared(&tl_sink));
    asm volatile("st.volatile.shared.f32 [%2], %3;\n\tld.volatile.shared.u32 %1, [%2];\n\tmov.u64 %0, %%globaltimer;"
                 : "=l"(t), "=r"(d) : "r"(a), "f"(x) : "memory");
    ks_attn_tl[(blockIdx.x * kTlWarps + (threadIdx.x >> 5)) * kTlEvents + ev] = t;
  }
}
#define KS_TL(...) tl_mark(__VA_ARGS__)
#define KS_TL_AFTER(ev, x) tl_mark_after(ev, x)
#else
#define KS_TL(...) ((void)0)
#define KS_TL_AFTER(ev, x) ((void)0)
#endif

constexpr int kGqaThreads = 256, kGqaWarps = kGqaThreads / 32, kGqaUnroll = 4, kGqaMaxGroup = 8, kGqaStages = 2;
// the cp.async ring: [stage][key u][K | V][thread] 16-byte pieces (conflict-free: a thread's
// pieces are consecutive across threads)
constexpr int64_t kGqaRingBytes = int64_t(kGqaStages) * kGqaUnroll * 2 * kGqaThreads * 16;
constexpr int64_t kGqaSmemLimit = 200 * 1024;

// The per-(token, kv head) softmax states in shared memory, at `base` (after cuda_gqa_cluster's
// cp.async ring; over cuda_mma_cluster's ring once its key loop is done), floats unless noted:
// the CTA's merged state m[G], l[G], acc[G][D] and its any-key flag (read by the other CTAs of
// the cluster), then each of the W warps' states wm[W][G], wl[W][G], wacc[W][G][D].
struct GqaSmem {
  float *m, *l, *acc, *wm, *wl, *wacc;
  int* any;
  __device__ GqaSmem(unsigned char* base, int W, int G, int D) {
    float* f = reinterpret_cast<float*>(base);
    m = f;
    l = m + G;
    acc = l + G;
    wm = acc + G * D;
    wl = wm + W * G;
    wacc = wl + W * G;
    any = reinterpret_cast<int*>(wacc + W * G * D);
  }
};

// One split's softmax state in cuda_mma_cluster's workspace and in finish_unit's pushed area:
// m[G], l[G], acc[G][D] (not yet divided by l), then the any-key flag (1.f / 0.f):
// split_state_floats(G, D) floats each; in the workspace the states of unit u at
// (u * splits + split) * split_state_stride(G, D).
__host__ __device__ constexpr int64_t split_state_floats(int64_t G, int64_t D) { return G * (D + 2) + 1; }
// Their stride in cuda_mma_cluster's workspace (p.ws): split_state_floats rounded up to 4, so
// that every state starts at a multiple of 16 bytes from p.ws (itself cudaMallocAsync's, 256-byte
// aligned; combine_unit checks): the unit's last split CTA copies a unit's states into shared
// memory 16 bytes at a time (the 0-3 padding floats after each state are copied, never written
// nor used).
__host__ __device__ constexpr int64_t split_state_stride(int64_t G, int64_t D) {
  return (split_state_floats(G, D) + 3) / 4 * 4;
}

// The bytes of GqaSmem's states for W warps, G heads of D elements.
constexpr size_t gqa_state_bytes(int W, int G, int64_t D) {
  return size_t(G * (2 + D) * (1 + W)) * sizeof(float) + sizeof(int);
}
[[maybe_unused]] size_t gqa_smem_bytes(int G, int64_t D) { return size_t(kGqaRingBytes) + gqa_state_bytes(kGqaWarps, G, D); }
// finish_unit's pushed area in rank 0 (every CTA's dynamic shared memory has it: one size per
// launch): C states of split_state_floats(G, D) floats, after gqa_smem_bytes rounded up to 16
constexpr size_t gqa_push_offset(size_t base) { return (base + 15) / 16 * 16; }
[[maybe_unused]] size_t gqa_push_bytes(int C, int G, int64_t D) {
  return size_t(16) + size_t(C) * size_t(split_state_floats(G, D)) * sizeof(float);
}

// 2^x by the SFU (ex2.approx.ftz: relative error about 2^-22; results below 2^-126 flush to
// 0, weights that small change no FP32 sum they join); 2^-inf = 0, NaN stays NaN.
[[maybe_unused]] __device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// The factor that brings a partial softmax state with running max m to the merged max M:
// e^(m - M), and 0 for a part that saw no finite score (m = -inf; also when M = -inf). Every
// merge (streams of a warp, warps of a CTA, CTAs of a cluster) weighs its parts with it.
[[maybe_unused]] __device__ __forceinline__ float merge_factor(float m, float M) {
  return m == -INFINITY ? 0.f : expf(m - M);
}

// One output element from its merged state (sum of weights L, weighted sum a): no key at
// all (all dropped, or len 0) gives 0; keys whose scores are all -inf give NaN.
// (used by the sm_90 cluster kernels only: unreferenced in the compute_80 PTX)
[[maybe_unused]] __device__ __forceinline__ float attention_output(float L, float a, int any, int64_t len) {
  const float y = L == 0.f ? (any ? __int_as_float(0x7fffffff) : 0.f) : a / L;
  return len > 0 ? y : 0.f;
}

// cuda_mma_cluster's split: the merge of a unit's split states (the unit's last split CTA, or
// attention_combine_kernel under KS_ATTN_LAST_COMBINE=0); defined below.
template <typename T, bool kL2>
__device__ void combine_unit(const AttnParams &p, int64_t unit, float *comb, int64_t known_len = -1);

// The end of a (token, kv head) unit, shared by both cluster kernels: every warp has stored its
// state (wm, wl, wacc of GqaSmem at raw + states_off; W warps, G heads of D elements) and the
// CTA's threads (NT) merge them, weighting each by merge_factor. A unit whose keys one CTA took
// (Ce == 1) writes its output here; otherwise the Ce CTAs that took keys exchange their states
// through distributed shared memory, and each of the cluster's C ranks writes a share of the
// unit's G x D outputs (rank r: the blocks of NT elements at r * NT + k * C * NT; kOneTrip: the
// r-th of C contiguous chunks; push: rank 0 all of them, below): out = sum_c acc_c e^(m_c - M) /
// sum_c l_c e^(m_c - M). kOneTrip needs W == NT / 32 (its warp loop is unrolled over NT / 32;
// cuda_mma_cluster's one call passes NW and 32 * NW). any_local: this
// thread saw a mapped key; len: the unit's context length (0: a zero row).
// (Cluster: cg::cluster_group, a type the compute_80 pass does not have)
// ws_state (cuda_mma_cluster's split, clusters of one CTA): with Ce > 1 the CTA's state goes
// there (split_state layout) for the unit's last split CTA (or attention_combine_kernel) to
// merge, instead of to the cluster.
// push_off > 0 (cuda_gqa_cluster, AttnParams::push_off; Ce > 1): the exchange takes one cluster
// barrier instead of two. The first Ce CTAs store their states (split_state layout, slot = rank)
// into rank 0's shared memory at raw + push_off, one barrier (release / acquire), then rank 0
// alone reads them locally and writes every output element with the same formula in the same
// order, so the same bits; the other CTAs leave, as nothing reads their memory. The kernel made a
// relaxed arrive at its start (every CTA of the cluster, having computed the same Ce > 1); the
// wait here, before the first remote store, completes it ("rank 0 has started").
// kOneTrip (cuda_mma_cluster): the cluster merge loads every state before its arithmetic (one
// distributed-shared-memory round trip) and arrives at its last barrier before the output's
// store; without it (cuda_gqa_cluster, its SASS as before): the loads of each state follow the
// previous state's arithmetic in the SASS, a round trip per state.
template <typename T, int NT, typename Cluster, bool kOneTrip = false>
__device__ void finish_unit(Cluster& cluster, unsigned char* raw, size_t states_off, int W, int G, int D,
                            int any_local, int Ce, int64_t len, T* out_t, float* ws_state, int push_off = 0) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const int C = int(cluster.num_blocks()), rank = int(cluster.block_rank());
  GqaSmem sm(raw + states_off, W, G, D);
  const int any_cta = __syncthreads_or(any_local);
  KS_TL(8);
  const int64_t sf = split_state_floats(G, D);
  const bool push = Ce > 1 && push_off > 0;
  if (push) {
    cluster_wait();  // every CTA of the cluster has started
    ws_state = rank < Ce ? cluster.map_shared_rank(reinterpret_cast<float*>(raw + push_off), 0) + rank * sf : nullptr;
  }
  // the warps into the CTA's state. Each head's max M over the warps (into sm.m: the CTA's
  // state's slot, written there below anyway where the cluster reads it), then each warp's factor
  // e^(mw - M) once per (warp, head), in place of its mw; then every element sums its warps in
  // warp order. (Each element computed M and its W factors itself before 2026-12-02: W
  // dependent expf chains per element, 2.3-2.6 us of a batch-1 split CTA's end in the timeline
  // build on the H200. Same values, same sums, same bits.)
  for (int g = threadIdx.x; g < G; g += NT) {
    float M = -INFINITY;
    for (int w = 0; w < W; ++w) M = fmaxf(M, sm.wm[w * G + g]);
    sm.m[g] = M;
  }
  __syncthreads();
  for (int k = threadIdx.x; k < W * G; k += NT) sm.wm[k] = merge_factor(sm.wm[k], sm.m[k % G]);
  __syncthreads();
  KS_TL(9);
  for (int i = threadIdx.x; i < G * D; i += NT) {
    const int g = i / D;
    float L = 0.f, a = 0.f;
    auto add_warp = [&](int w) {
      const float f = sm.wm[w * G + g];
      L += sm.wl[w * G + g] * f;
      a += sm.wacc[w * G * D + i] * f;
    };
    if constexpr (kOneTrip) {  // (W == NT / 32 there: unrolled, the loads together)
#pragma unroll
      for (int w = 0; w < NT / 32; ++w) add_warp(w);
    } else {
      for (int w = 0; w < W; ++w) add_warp(w);
    }
    if (Ce == 1) {  // the CTA's state is the unit's: its output, with no cluster exchange (the merge's
      // values; only a zero's sign may differ: the merge's fma(a, 1, +0) makes -0 +0)
      out_t[i] = Dt<T>::from_f(attention_output(L, a, any_cta, len));
    } else if (ws_state) {
      ws_state[2 * G + i] = a;
      if (i % D == 0) ws_state[g] = sm.m[g], ws_state[G + g] = L;
    } else if (!push) {
      sm.acc[i] = a;
      if (i % D == 0) sm.l[g] = L;  // (sm.m[g] holds M already)
    }
  }
  // Ce is the same in every CTA of the cluster (the unit's length), so all of them skip the
  // cluster barriers together; the other ranks returned before their key loops.
  if (Ce == 1) return;
  if (ws_state && threadIdx.x == 0) ws_state[G * (D + 2)] = any_cta ? 1.f : 0.f;
  if (push) {
    cluster_arrive();  // release: the pushed states
    cluster_wait();    // acquire: rank 0 sees all of them
    if (rank != 0) return;
  } else if (ws_state) {
    return;
  } else {
    if (threadIdx.x == 0) *sm.any = any_cta;
    KS_TL(10);
    cluster.sync();  // every CTA's partial state is complete and visible to the cluster
  }
  // state c's parts: rank 0's pushed slot c, or rank c's GqaSmem read through distributed
  // shared memory
  const float* pushed = reinterpret_cast<const float*>(raw + push_off);
  auto remote = [&](int c) { return GqaSmem(cluster.map_shared_rank(raw, c) + states_off, W, G, D); };
  constexpr int kMaxC = 16;
  const int first = push ? 0 : rank * NT, stride = push ? NT : C * NT;
  if constexpr (kOneTrip) {
    // (cuda_mma_cluster; never push) One round trip: every state's m, any, l and accumulator
    // loads are issued before any is used, then the max, then the sums in rank order. The
    // release arrive comes right after the last remote value is used and before the first
    // element's store, so that its memory barrier waits for no store where a thread has one
    // element (per <= NT: every anchor shape; a whole cluster.sync after the stores made its
    // MEMBAR wait for them: 2026-12-02's SASS); the wait, for the other ranks' reads of this
    // CTA's shared memory, then overlaps the store.
    KS_TL(11);
    auto merged = [&](int i) {
      const int g = i / D;
      float mc[kMaxC], lc[kMaxC], ac[kMaxC];
      int anyc[kMaxC];  // (or-ed after the loads: an or beside each load waited for it, 2026-12-02 SASS)
#pragma unroll
      for (int c = 0; c < kMaxC; ++c) {
        mc[c] = -INFINITY, lc[c] = ac[c] = 0.f, anyc[c] = 0;
        if (c < Ce) {  // (rank c's words at this CTA's offsets: ld.shared::cluster)
          mc[c] = __uint_as_float(ld_cluster_b32(&sm.m[g], unsigned(c)));
          lc[c] = __uint_as_float(ld_cluster_b32(&sm.l[g], unsigned(c)));
          ac[c] = __uint_as_float(ld_cluster_b32(&sm.acc[i], unsigned(c)));
          anyc[c] = int(ld_cluster_b32(sm.any, unsigned(c)));
        }
      }
      float M = -INFINITY;
      int any = 0;
#pragma unroll
      for (int c = 0; c < kMaxC; ++c) M = fmaxf(M, mc[c]), any |= anyc[c];
      float L = 0.f, a = 0.f;
      if (M != -INFINITY) {
#pragma unroll
        for (int c = 0; c < kMaxC; ++c) {
          if (c < Ce) {
            const float f = merge_factor(mc[c], M);
            L += lc[c] * f;
            a += ac[c] * f;
          }
        }
      }
      return attention_output(L, a, any, len);
    };
    // rank r merges the r-th of C contiguous chunks of the G x D outputs (up to 2026-12-02 it took
    // elements r * NT + k * C * NT: at G * D <= NT rank 0 alone, whose loads of every state's
    // parts took 1.2-2.3 us in the timeline while the other ranks waited at the last barrier)
    const int per = (G * D + C - 1) / C, hi = min(G * D, (rank + 1) * per);
    const int i0 = rank * per + int(threadIdx.x);
    // (more than one element per thread, per > NT: those after the first stored before the
    // barrier.) One copy of merged's code: the merge runs once per launch, from a cold
    // instruction cache (1889 instructions from the first cluster barrier to the exit with
    // merged inlined twice, 2026-12-02)
    float y0 = 0.f;
#pragma unroll 1
    for (int i = i0; i < hi; i += NT) {
      const float y = merged(i);
      if (i == i0) y0 = y;
      else out_t[i] = Dt<T>::from_f(y);
    }
    KS_TL_AFTER(12, y0);
    cluster_arrive();  // release: this CTA's reads of the others' shared memory are done
    if (i0 < hi) out_t[i0] = Dt<T>::from_f(y0);
    cluster_wait();  // no CTA leaves while another may still read its shared memory
    KS_TL(13);
    KS_TL(15, 2ull);
    return;
  } else {  // (an else: in the one-trip instantiations this loop is not compiled, not unreachable)
    for (int i = first + int(threadIdx.x); i < G * D; i += stride) {
      const int g = i / D;
      float mc[kMaxC];
      int any = 0;
#pragma unroll
      for (int c = 0; c < kMaxC; ++c) {
        mc[c] = -INFINITY;
        if (c < Ce) {
          mc[c] = push ? pushed[c * sf + g] : remote(c).m[g];
          any |= push ? pushed[c * sf + int64_t(G) * (D + 2)] != 0.f : *remote(c).any;
        }
      }
      float M = -INFINITY;
#pragma unroll
      for (int c = 0; c < kMaxC; ++c) M = fmaxf(M, mc[c]);
      float L = 0.f, a = 0.f;
      if (M != -INFINITY) {
#pragma unroll
        for (int c = 0; c < kMaxC; ++c) {
          if (c < Ce) {
            const float f = merge_factor(mc[c], M);
            L += (push ? pushed[c * sf + G + g] : remote(c).l[g]) * f;
            a += (push ? pushed[c * sf + 2 * G + i] : remote(c).acc[i]) * f;
          }
        }
      }
      out_t[i] = Dt<T>::from_f(attention_output(L, a, any, len));
    }
    if (!push) cluster.sync();  // no CTA leaves while another may still read its shared memory
  }
#endif
}

// ceil(n / d) for 0 <= n < 2^31 and 1 <= d < 2^31 (a unit's keys: len is capped at 2^30 by
// cluster_attention_limits) in 32-bit arithmetic: the 64-bit division is a called routine of
// ~70 instructions, and these sit on the chain from the context length to the first copies.
__device__ __forceinline__ uint32_t ceil_div_u32(int64_t n, int64_t d) {
  const uint32_t a = uint32_t(n), b = uint32_t(d);
  return a / b + (a % b != 0u);
}
// the token of unit (token, kv head) = t * num_kv_heads + kv head; unit < 2^31 (a grid's CTA
// index, cluster_attention_limits), so 32-bit as ceil_div_u32
__device__ __forceinline__ int64_t unit_token(int64_t unit, int64_t num_kv_heads) {
  return int64_t(uint32_t(unit) / uint32_t(num_kv_heads));
}
// Ce, the CTAs of a unit's cluster of C that take keys: the first ceil(len / keys) of them (at
// least one; keys: keys_per_cta or KS_ATTN_MIN_KEYS, whichever is larger), or all C with
// KS_ATTN_LIVE_SPLIT=0. It depends on the unit's length and C only, so every CTA of the cluster
// computes the same value.
__device__ __forceinline__ int live_ctas(const AttnParams& p, int C, int64_t len, int64_t keys_per_cta) {
  const int64_t keys = max(keys_per_cta, int64_t(p.min_keys_per_cta));
  return p.live_split ? min(C, max(1, int(ceil_div_u32(len, keys)))) : C;
}

// A CTA's keys [begin, end) of its unit's range.
struct KeyRange {
  int begin, end;
};
// cuda_gqa_cluster's split: CTA `rank` of the Ce that take keys gets the rank-th of Ce equal
// pieces of the unit's len keys (empty for rank >= Ce).
[[maybe_unused]] __device__ __forceinline__ KeyRange gqa_keys(int64_t len, int Ce, int rank) {
  const int per = int(ceil_div_u32(len, Ce));
  const int begin = rank < Ce ? int(min(len, int64_t(rank) * per)) : int(len);
  return {begin, int(min(len, int64_t(begin) + per))};
}

// Warming L2 before the wait. Under programmatic dependent launch a kernel starts while its
// predecessor runs, and what it does before griddepcontrol.wait overlaps that kernel. The K and
// V rows a decode step's attention reads were written by earlier steps, so both cluster kernels
// ask L2 for the first p.prefetch_keys keys of the CTA's range there: prefetch.global.L2 of each
// 128-byte line of those keys' K and V rows of kv head kvh. It is a hint only - nothing it reads
// reaches the kernel's arithmetic - so it may use a length and block-table entries that the
// predecessor is still writing: the kernel reads them again after the wait, an entry outside
// [0, num_blocks) is skipped (no line outside the caches' pages; the first line of a row may start
// before it), its own reads go through L2 alone (no L1 line the kernel's later loads could hit),
// and the kernel's loads get from L2, the point of coherence, whatever the predecessor wrote. Off by default: measured on the
// H200 (87eb81b, 128 keys per CTA) it slowed SmolLM2's decode (1649 tokens/s against 1659 without
// after a 64-token prompt, 1437 against 1491 after 512) and moved the bf16 anchors by -5% (b32
// 32/8 heads T1024 40.3 us against 38.5) to +3% (b1 32/8 T8192 19.4 against 20.0);
// KS_ATTN_PREFETCH_KEYS=N turns it on for experiments.
template <typename T>
__device__ __forceinline__ void warm_keys_l2(const AttnParams& p, int64_t seq, int64_t kvh, KeyRange keys) {
  const int n = min(keys.end - keys.begin, p.prefetch_keys);
  if (n <= 0) return;
  const int64_t D = p.head_dim;
  const int row_bytes = int(D) * int(sizeof(T));
  const int lines = (row_bytes + 127) / 128 + 1;  // the most lines a row may touch
  const int32_t* bt = p.block_tables + seq * p.max_blocks_per_seq;
  const int bs = int(p.block_size);
  for (int i = int(threadIdx.x); i < n * 2 * lines; i += int(blockDim.x)) {
    const int line = i % lines, kv = (i / lines) & 1, pos = keys.begin + i / (2 * lines);
    const int b = block_of(p.bs_mul, p.bs_shift, pos);
    const int32_t blk = __ldcg(bt + b);  // (through L2 alone: token_context's l2_only)
    if (blk < 0 || blk >= p.num_blocks) continue;
    const int64_t elem = (int64_t(blk) * bs + (pos - b * bs)) * p.num_kv_heads * D + kvh * D;
    const char* row = static_cast<const char*>(kv ? p.v_cache : p.k_cache) + elem * int64_t(sizeof(T));
    const char* at = reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(row) & ~uintptr_t(127)) + line * 128;
    if (at < row + row_bytes) prefetch_l2(at);
  }
}


// rotary_embedding_kv_append fused into cuda_gqa_cluster (rotary_embedding_kv_append_paged_attention):
// the rotation's and the append's tensors beside AttnParams (whose q and caches are theirs).
struct AttnRope {
  void* q;        // [T, H, D] contiguous (AttnParams::q), rotated in place at the end
  void* k;        // token t, kv head g at k + t k_ts + g k_hs (elements), rotated in place at the end
  const void* v;  // [T, KVH, D] contiguous
  void* k_cache;  // AttnParams' caches, written at slot_mapping[t]
  void* v_cache;
  const void* pos;
  const void* slots;
  int64_t k_ts, k_hs, num_slots;
  int rotary_half;
  int keep_off;  // the byte offset in dynamic shared memory of the rotated q and k pieces kept for the end
  bool neox, pos64, slots64;
};
// The bytes of that area: q's G heads and k's head of D elements.
constexpr size_t rope_keep_bytes(int G, int64_t D, size_t elem) { return size_t(G + 1) * size_t(D) * elem; }

// The body of cuda_gqa_cluster's kernel; ROPE (rope, inv given): the fused form, which differs
// in three places. (1) Each lane rotates its pieces of q and of the token's new key itself
// (rounded to T, as the composed call stores them) and holds the new key's and value's pieces;
// rank 0's stream 0 writes them to the cache row of slot_mapping[t]. (2) A key whose cache slot
// is slot_mapping[t] takes those pieces instead of a copy from the cache: after the composed
// call's append that row holds exactly them, and no CTA waits for the write. (3) After the
// cluster's last barrier (every CTA of the unit has read q and k) rank 0's stream 0 stores its
// rotated pieces of q's G heads and of k in place. So the output is the two calls'
// bit for bit when no token reads a slot that another token of the launch appends.
template <typename T, int LPK, int GM, bool ROPE>
__device__ __forceinline__ void gqa_unit(const AttnParams& p, const AttnRope* rope, const float* inv) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int E = 16 / int(sizeof(T));  // elements per lane: one 16-byte load
  constexpr int SPW = 32 / LPK;            // key streams per warp
  constexpr int NS = kGqaWarps * SPW;      // key streams per CTA
  constexpr int U = kGqaUnroll;
  using V = Vec<T, E>;
  extern __shared__ __align__(16) unsigned char gqa_raw[];
  cg::cluster_group cluster = cg::this_cluster();
  const int C = int(cluster.num_blocks()), rank = int(cluster.block_rank());
  const int G = p.group;
  const int D = int(p.head_dim);
  GqaSmem sm(gqa_raw + kGqaRingBytes, kGqaWarps, G, D);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int sub = lane % LPK, stream = warp * SPW + lane / LPK;
  const bool owns = sub * E < D;  // lanes past head_dim hold zeros
  const int64_t unit = blockIdx.x / C;  // (token, kv head)
  const int64_t t = unit_token(unit, p.num_kv_heads), kvh = unit - t * p.num_kv_heads;
  if (p.prefetch_keys > 0) {  // before the wait: warm_keys_l2
    const TokenContext now = token_context(p, t, /*l2_only=*/true);
    warm_keys_l2<T>(p, now.seq, kvh, gqa_keys(now.len, live_ctas(p, C, now.len, NS * U), rank));
  }
  // prewait_fresh > 0 (paged_attention_after_append's fresh_keys; one CTA per unit, not the fused
  // kernel): the caller promises that the kernel before this one writes neither seq_ids,
  // context_lens, block_tables nor any cache row this token reads below len - prewait_fresh.
  // The context, the first prewait_steps steps' block-table entries and their copies of the
  // older keys then go out before griddepcontrol.wait (through L2 alone); q and the fresh keys
  // after it. With the q/k/v + RoPE kernel's early trigger, they overlap its tail.
  const bool pre = !ROPE && p.prewait_fresh > 0;
  if (!pre) pdl_begin();
  float q[GM][E], acc[GM][E], m[GM], l[GM];
  auto load_q = [&] {
    const T* qbase = static_cast<const T*>(p.q) + (t * p.num_heads + kvh * G) * D + sub * E;
#pragma unroll
    for (int g = 0; g < GM; ++g) {
      V v{};
      if (g < G && owns) v = load_vec<T, E>(qbase + int64_t(g) * D);
#pragma unroll
      for (int e = 0; e < E; ++e) q[g][e] = v.f(e), acc[g][e] = 0.f;
      m[g] = -INFINITY;
      l[g] = 0.f;
    }
  };
  // q's pieces first: they do not depend on the context length, so their loads overlap
  // token_context's instead of following it (one round trip less before the first keys)
  if constexpr (!ROPE)
    if (!pre) load_q();
  const auto [seq, len] = token_context(p, t, pre);  // len < 2^30 (cluster_attention_limits)
  // The CTAs that get keys: Ce <= C, at least one whole step (NS * U keys) each (or
  // KS_ATTN_MIN_KEYS). C was sized
  // at launch from the block table's capacity (a graph replays it at every length); a short
  // live context then goes to a few CTAs, and the cluster merge reads only their states.
  // Ce depends on this unit's length alone, not on the batch, when C >= ceil(len / (NS U)).
  const int Ce = live_ctas(p, C, len, NS * U);
  if (Ce == 1 && rank > 0) return;  // rank 0 alone: no cluster exchange (below)
  if (Ce > 1 && p.push_off > 0) cluster_arrive_relaxed();  // "started": finish_unit waits for it
  // this CTA's keys: [j_begin, j_end) (empty for rank >= Ce)
  const KeyRange mine_keys = gqa_keys(len, Ce, rank);
  const int j_begin = mine_keys.begin, j_end = mine_keys.end;
  // ROPE: the token's position, its append slot, and this lane's pieces of its new key and value.
  // Every load comes first (the position, the slot, the lane's pieces of q's heads, of k and of
  // v, and for NeoX pairs their partners), then the first step's block-table entries and K / V
  // copies are issued, and only then the sincosf (one per pair index of the lane: q's heads and
  // k share the angles) and the rotations (rope_rotate's), which the first step's arithmetic
  // waits for anyway: a sincosf's slow path is a call that loads are not moved across, so loads
  // after it would wait for it. A key of the first step at the token's own slot is marked
  // pending and filled once the new key is made.
  int64_t new_slot = -1;
  uint4 k_new = make_uint4(0, 0, 0, 0), v_new = make_uint4(0, 0, 0, 0);
  bool rope_ready = !ROPE;  // k_new / v_new made
  unsigned pending = 0;     // keys u of stage 0 at the token's slot, waiting for them
  // rows 0..G-1: q's heads, row GM: k, as stored (a feature past rotary_dim keeps its bits, NaN
  // payloads included, as in the two calls); y: the NeoX partners as floats
  T x[ROPE ? GM + 1 : 1][E];
  float y[ROPE ? GM + 1 : 1][E];
  V vv{};
  int64_t pi = 0;  // the token's position
  if constexpr (ROPE) {
    pi = rope->pos64 ? static_cast<const int64_t*>(rope->pos)[t] : static_cast<const int32_t*>(rope->pos)[t];
    new_slot = rope->slots64 ? static_cast<const int64_t*>(rope->slots)[t] : static_cast<const int32_t*>(rope->slots)[t];
    const int half = rope->rotary_half, d0 = sub * E;
    const bool neox = rope->neox;
    const T* qrow = static_cast<const T*>(p.q) + (t * p.num_heads + kvh * G) * D;
    const T* krow = static_cast<const T*>(rope->k) + t * rope->k_ts + kvh * rope->k_hs;
    if (owns) {
#pragma unroll
      for (int g = 0; g <= GM; ++g) {
        if (g < GM && g >= G) continue;
        const T* row = g < GM ? qrow + int64_t(g) * D : krow;
#pragma unroll
        for (int e = 0; e < E; ++e) {
          const int d = d0 + e;
          x[g][e] = row[d];
          y[g][e] = neox && d < 2 * half ? Dt<T>::to_f(row[d < half ? d + half : d - half]) : 0.f;
        }
      }
      vv = load_vec<T, E>(static_cast<const T*>(rope->v) + (t * p.num_kv_heads + kvh) * D + d0);
    }
  }
  const int32_t* bt = p.block_tables + seq * p.max_blocks_per_seq;
  const int bs = int(p.block_size);
  // pos / block_size without a division (block_of; exact for pos < 2^31)
  const uint32_t bs_mul = p.bs_mul;
  const int bs_shift = p.bs_shift;
  auto div_bs = [&](int pos) { return block_of(bs_mul, bs_shift, pos); };
  constexpr float kLog2e = 1.4426950408889634f;
  const T* kc = static_cast<const T*>(p.k_cache) + kvh * D + sub * E;
  const T* vc = static_cast<const T*>(p.v_cache) + kvh * D + sub * E;
  const int64_t row_stride = p.num_kv_heads * D;
  int any_local = 0;
  uint4* ring = reinterpret_cast<uint4*>(gqa_raw);  // [stage][u][K|V][thread]
  auto piece = [&](int stage, int k, int kv) { return ring + ((stage * U + k) * 2 + kv) * kGqaThreads + threadIdx.x; };
  // the block-table entries of step `j0` (keys past j_end: -1)
  // (l2_only: before griddepcontrol.wait, through L2 alone)
  auto fetch_blocks = [&](int j0, int32_t (&blk)[U], bool l2_only = false) {
#pragma unroll
    for (int k = 0; k < U; ++k) {
      const int pos = j0 + stream + k * NS;
      const int32_t* e = bt + div_bs(pos);
      blk[k] = pos < j_end ? (l2_only ? __ldcg(e) : *e) : -1;
    }
  };
  // copies step j0's K and V pieces of the keys at positions in [from, to) into `stage` (a key
  // outside is left to another call: each slot gets one copy or zero fill); returns the mask of
  // its mapped keys among them. commit: close the group.
  auto issue = [&](int stage, int j0, const int32_t (&blk)[U], int from = 0, int to = INT_MAX, bool commit = true) {
    unsigned valid = 0;
#pragma unroll
    for (int k = 0; k < U; ++k) {
      const int pos = j0 + stream + k * NS;
      if (pos < from || pos >= to) continue;
      const bool ok = pos < j_end && blk[k] >= 0 && blk[k] < p.num_blocks;
      const long long slot = ok ? (long long)blk[k] * bs + (pos - div_bs(pos) * bs) : 0;
      valid |= unsigned(ok) << k;
      if (ROPE && ok && slot == new_slot) {  // the token's own new row: its pieces, not the cache's
        if (rope_ready) {
          *piece(stage, k, 0) = k_new;
          *piece(stage, k, 1) = v_new;
        } else {
          pending |= 1u << k;  // (stage 0: the first step's, filled once they are made)
        }
      } else {
        cp_async16(piece(stage, k, 0), kc + slot * row_stride, ok && owns);
        cp_async16(piece(stage, k, 1), vc + slot * row_stride, ok && owns);
      }
    }
    if (commit) cp_async_commit();
    return valid;
  };
  int32_t blk[U];
  fetch_blocks(j_begin, blk, pre);
  unsigned valid_cur = 0;
  // pre: the first two steps' older keys (both ring stages; p.prewait_steps = 1: the first's
  // alone), then the wait, q and the fresh keys' copies, all one group; the loop then issues
  // nothing at its first step (valid_pre1: step 1's mask)
  bool step1_issued = false;
  unsigned valid_pre1 = 0;
  if (pre) {
    const int fresh = int(max(len - int64_t(p.prewait_fresh), int64_t(0)));
    const int j1 = j_begin + NS * U;
    step1_issued = p.prewait_steps > 1 && j1 < j_end;
    int32_t blk1[U];
    if (step1_issued) fetch_blocks(j1, blk1, true);
    if (j_begin < j_end) valid_cur = issue(0, j_begin, blk, 0, fresh, false);
    if (step1_issued) valid_pre1 = issue(1, j1, blk1, 0, fresh, false);
    pdl_begin();
    load_q();
    if (j_begin < j_end) valid_cur |= issue(0, j_begin, blk, fresh, INT_MAX, false);
    if (step1_issued) valid_pre1 |= issue(1, j1, blk1, fresh, INT_MAX, false);
    cp_async_commit();
  } else {
    valid_cur = j_begin < j_end ? issue(0, j_begin, blk) : 0u;
  }
  if (!step1_issued) fetch_blocks(j_begin + NS * U, blk);
  if constexpr (ROPE) {
    const int half = rope->rotary_half, d0 = sub * E;
    const bool neox = rope->neox;
    const float angle_pos = float(pi);  // fp32(position), as rope_append_kernel's
    float cs[E], sn[E];
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const int d = d0 + e, i = neox ? (d < half ? d : d - half) : d >> 1;
      cs[e] = 1.f, sn[e] = 0.f;
      if (!neox && (e & 1)) {
        cs[e] = cs[e - 1], sn[e] = sn[e - 1];  // the pair's angle, made for its first element
      } else if (owns && d < 2 * half) {
        sincosf(angle_pos * inv[i], &sn[e], &cs[e]);
      }
    }
    // feature d0 + e of row g after the rotation, rounded to T (rope_rotate's r0 for the pair's
    // first element, r1 for its second; unchanged past rotary_dim)
    auto rotated = [&](int g, int e) {
      const int d = d0 + e;
      if (d >= 2 * half) return x[g][e];
      const float self = Dt<T>::to_f(x[g][e]), other = neox ? y[g][e] : Dt<T>::to_f(x[g][e ^ 1]);
      const bool first = neox ? d < half : (e & 1) == 0;
      float r0, r1;
      if (first)
        rope_rotate(self, other, cs[e], sn[e], r0, r1);
      else
        rope_rotate(other, self, cs[e], sn[e], r0, r1);
      return Dt<T>::from_f(first ? r0 : r1);
    };
    if (owns) {
      T kt[E];
#pragma unroll
      for (int e = 0; e < E; ++e) kt[e] = rotated(GM, e);
      memcpy(&k_new, kt, 16);
      memcpy(&v_new, &vv, 16);
    }
    rope_ready = true;
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (pending >> u & 1u) {
        *piece(0, u, 0) = k_new;
        *piece(0, u, 1) = v_new;
      }
    if (rank == 0 && stream == 0 && owns && new_slot >= 0 && new_slot < rope->num_slots) {
      const int64_t off = new_slot * p.num_kv_heads * D + kvh * D + d0;
      *reinterpret_cast<uint4*>(static_cast<T*>(rope->k_cache) + off) = k_new;
      *reinterpret_cast<uint4*>(static_cast<T*>(rope->v_cache) + off) = v_new;
    }
    // rank 0's stream 0 keeps its rotated pieces of q and k for the in-place stores at the end
    T* keep = reinterpret_cast<T*>(gqa_raw + rope->keep_off);
    const bool keeper = rank == 0 && stream == 0 && owns;
#pragma unroll
    for (int g = 0; g < GM; ++g) {
      T qt[E];
#pragma unroll
      for (int e = 0; e < E; ++e) {
        qt[e] = g < G && owns ? rotated(g, e) : Dt<T>::from_f(0.f);
        q[g][e] = Dt<T>::to_f(qt[e]);
        acc[g][e] = 0.f;
      }
      if (keeper && g < G) memcpy(keep + g * D + d0, qt, 16);
      m[g] = -INFINITY;
      l[g] = 0.f;
    }
    if (keeper) memcpy(keep + G * D + d0, &k_new, 16);
  }
  int stage = 0;
  for (int j0 = j_begin; j0 < j_end; j0 += NS * U, stage ^= 1) {
    // the next step's copies go out before this step's arithmetic
    unsigned valid_next = 0;
    if (step1_issued && j0 == j_begin) valid_next = valid_pre1, cp_async_commit();  // (issued before the wait)
    else if (j0 + NS * U < j_end) valid_next = issue(stage ^ 1, j0 + NS * U, blk);
    else cp_async_commit();  // an empty group keeps the wait count uniform
    fetch_blocks(j0 + 2 * NS * U, blk);
    cp_async_wait<1>();  // this thread's pieces of the current step have landed
    any_local |= valid_cur != 0;
    V kv[U], vv[U];
#pragma unroll
    for (int k = 0; k < U; ++k) {
      kv[k] = *reinterpret_cast<const V*>(piece(stage, k, 0));
      vv[k] = *reinterpret_cast<const V*>(piece(stage, k, 1));
    }
    // every head slot up to GM (q = 0 past G; their states are never stored): one basic
    // block, so each K / V element is unpacked once for all heads and nothing spills
    float sc[U][GM];
#pragma unroll
    for (int k = 0; k < U; ++k)
#pragma unroll
      for (int g = 0; g < GM; ++g) {
        float d = 0.f;
#pragma unroll
        for (int e = 0; e < E; ++e) d = fmaf(q[g][e], kv[k].f(e), d);
#pragma unroll
        for (int o = LPK / 2; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
        sc[k][g] = (valid_cur >> k & 1u) ? d * p.scale : -INFINITY;  // a dropped key weighs 0
      }
#pragma unroll
    for (int g = 0; g < GM; ++g) {
      float mx = -INFINITY;
#pragma unroll
      for (int k = 0; k < U; ++k) mx = fmaxf(mx, sc[k][g]);  // NaN ignored here, kept by exp below
      const float nm = fmaxf(m[g], mx);
      // nothing seen yet (every score -inf): subtract 0, so exp2(-inf - 0) = 0 and no -inf - -inf
      const float base = nm == -INFINITY ? 0.f : nm;
      const float corr = fast_exp2((m[g] - base) * kLog2e);
      float pk[U], s = 0.f;
#pragma unroll
      for (int k = 0; k < U; ++k) {
        pk[k] = fast_exp2((sc[k][g] - base) * kLog2e);  // -inf score: 0; NaN score: NaN, as exp
        s += pk[k];
      }
      l[g] = l[g] * corr + s;
      m[g] = nm;
#pragma unroll
      for (int e = 0; e < E; ++e) {
        float a = acc[g][e] * corr;
#pragma unroll
        for (int k = 0; k < U; ++k) a = fmaf(pk[k], vv[k].f(e), a);
        acc[g][e] = a;
      }
    }
    valid_cur = valid_next;
  }
  cp_async_wait<0>();
  // the warp's streams into one state (lanes differing in the bits above LPK)
#pragma unroll
  for (int o = LPK; o < 32; o <<= 1)
#pragma unroll
    for (int g = 0; g < GM; ++g) {
      const float mo = __shfl_xor_sync(0xffffffffu, m[g], o), lo = __shfl_xor_sync(0xffffffffu, l[g], o);
      const float M = fmaxf(m[g], mo), f = merge_factor(m[g], M), fo = merge_factor(mo, M);
      l[g] = l[g] * f + lo * fo;
#pragma unroll
      for (int e = 0; e < E; ++e) acc[g][e] = acc[g][e] * f + __shfl_xor_sync(0xffffffffu, acc[g][e], o) * fo;
      m[g] = M;
    }
  if (lane < LPK) {
#pragma unroll
    for (int g = 0; g < GM; ++g) {
      if (g >= G) break;
      if (lane == 0) sm.wm[warp * G + g] = m[g], sm.wl[warp * G + g] = l[g];
      if (owns)
#pragma unroll
        for (int e = 0; e < E; ++e) sm.wacc[(warp * G + g) * D + sub * E + e] = acc[g][e];
    }
  }
  T* out_t = static_cast<T*>(p.out) + (t * p.num_heads + kvh * G) * D;
  finish_unit<T, kGqaThreads>(cluster, gqa_raw, kGqaRingBytes, kGqaWarps, G, D, any_local, Ce, len, out_t, nullptr,
                              p.push_off);
  if constexpr (ROPE) {
    // q's G heads and k's head rotated in place, after every CTA of the unit has read them
    // (finish_unit's last cluster barrier; with Ce = 1 the other ranks read nothing): rank 0's
    // stream 0 stores the pieces it kept (its own stores: no barrier)
    if (rank != 0 || stream != 0 || !owns) return;
    const T* keep = reinterpret_cast<const T*>(gqa_raw + rope->keep_off);
    T* qh = static_cast<T*>(rope->q) + (t * p.num_heads + kvh * G) * D + sub * E;
    for (int g = 0; g < G; ++g)
      *reinterpret_cast<uint4*>(qh + int64_t(g) * D) = *reinterpret_cast<const uint4*>(keep + g * D + sub * E);
    T kt[E];
    memcpy(kt, keep + G * D + sub * E, 16);
    T* kh = static_cast<T*>(rope->k) + t * rope->k_ts + kvh * rope->k_hs + sub * E;
#pragma unroll
    for (int e = 0; e < E; ++e) kh[e] = kt[e];
  }
#endif
}

template <typename T, int LPK, int GM>
__global__ void __launch_bounds__(kGqaThreads, GM <= 4 ? 2 : 1) paged_attention_gqa_kernel(const __grid_constant__ AttnParams p) {
  gqa_unit<T, LPK, GM, false>(p, nullptr, nullptr);
}

// rotary_embedding_kv_append_paged_attention's fused kernel (the table by value, read in place)
template <typename T, int LPK, int GM>
__global__ void __launch_bounds__(kGqaThreads, GM <= 4 ? 2 : 1)
    paged_attention_gqa_rope_kernel(const __grid_constant__ AttnParams p, const __grid_constant__ AttnRope rope,
                                    const __grid_constant__ RopeTable tab) {
  gqa_unit<T, LPK, GM, true>(p, &rope, tab.inv);
}

// The fewest of 1, 2, 4, ..., max_cluster CTAs per (token, kv head) unit that give min_ctas CTAs
// in all, at most one per keys_per_cta keys of the block table's capacity.
int choose_cluster(const ops::PagedAttentionArgs& a, int max_cluster, int64_t min_ctas, int64_t keys_per_cta) {
  const int64_t units = a.num_tokens * a.num_kv_heads;
  const int64_t capacity = a.max_blocks_per_seq * a.block_size;
  int c = 1;
  while (2 * c <= max_cluster && units * c < min_ctas && capacity >= 2 * c * keys_per_cta) c *= 2;
  return c;
}

// cuda_gqa_cluster's keys of block-table capacity per cluster CTA at most: 64, or
// KS_ATTN_CAPACITY_KEYS=N (experiments; read once). See launch_gqa.
int64_t gqa_capacity_keys() {
  static const int64_t keys = std::clamp<long long>(env_number("KS_ATTN_CAPACITY_KEYS", 64), 1, 1 << 20);
  return keys;
}

// cuda_gqa_cluster runs one CTA per (token, kv head) unit, no cluster, for block tables of at
// most 256 keys (KS_ATTN_ONE_CTA_KEYS=N: N keys, 0: never; read once). By the capacity alone, as
// the cluster rule, so a row's split does not depend on the batch, and a graph captured for a
// table replays the same launch at every length. Why (H200, SmolLM2 decode, same calls): a
// cluster's launch costs more than one CTA's few steps of 64 keys at short lengths - 1768 tokens/s
// against 1679 with one CTA for the 256/512-key tables (6c20047), 1817 against 1714 (ba41314),
// and at 8 / 16 / 32 sequences +4% / +14% / +15% (ba41314) - but one CTA's steps are serial:
// 240-368 live keys in one CTA lost (1536 against 1632, ba41314), 512-640 lost more (1256 against
// 1598 with the 4-stage ring below, e113b95), and 200-256 lost too (1627 against 1665, 54d78ee).
// The bound is still 256 (at most 4 steps): paged_attention_after_append's early reads serve one
// CTA only, and tables of 128 keys lost after 64-token prompts (1799 against 1809);
// llama.hpp's tables (headroom 1) give contexts up to 256 that table.
// As shipped (cf200dc): 1802 against 1704 with the rules before, 8 / 16 / 32 sequences +5% / +14% / +16%.
// A 4-stage ring for the one-CTA units (three steps in flight) was slower still (1785 against
// 1820; e113b95): the steps are not waiting on memory.
int64_t gqa_one_cta_keys() {
  static const int64_t keys = std::clamp<long long>(env_number("KS_ATTN_ONE_CTA_KEYS", 256), 0, 1 << 20);
  return keys;
}

// cuda_gqa_cluster's own kernel launches its clusters (C > 1) without PDL (the fused RoPE kernel,
// off in the model, keeps PDL), so they are not placed beside a
// kernel that lets its dependents launch early (the q/k/v + RoPE kernel of a decode step, since
// 2026-12-01): SmolLM2 on the H200 after a 512-token prompt (the 641-key table's clusters),
// a2bbdd8, same call: with that trigger 1435 tokens/s with PDL against 1481 without (1516 before
// either); without the trigger, 1515 against 1516 (PDL gains nothing there). One CTA per unit
// keeps PDL: it is what lets paged_attention_after_append read the older keys early.
// KS_ATTN_CLUSTER_PDL=1 (read once; comparisons): clusters with PDL, as before; =wide (an
// experiment, not yet measured): with PDL where the grid exceeds one CTA per SM (batched decode
// after 512-token prompts lost 2.5-3.4% at 8 sequences without it; a batch-1 grid is 24 CTAs).
bool gqa_cluster_pdl(int64_t grid, int sm_count) {
  static const int mode = env_is("KS_ATTN_CLUSTER_PDL", "1") ? 1 : env_is("KS_ATTN_CLUSTER_PDL", "wide") ? 2 : 0;
  return mode == 1 || (mode == 2 && grid > sm_count);
}

// Steps of keys whose copies paged_attention_after_append's one-CTA units issue before
// griddepcontrol.wait: 2 (the ring's two stages), or KS_ATTN_PREWAIT_STEPS=1 (read once;
// comparisons).
int gqa_prewait_steps() {
  static const int steps = env_is("KS_ATTN_PREWAIT_STEPS", "1") ? 1 : 2;
  return steps;
}

// The kernel parameters of both cluster variants, with the environment switches
// KS_ATTN_LIVE_SPLIT (0: every CTA of a cluster takes keys), KS_ATTN_MIN_KEYS=N (at least N
// keys per CTA) and KS_ATTN_PREFETCH_KEYS=N (warm_keys_l2's keys per CTA; default 0, none), for
// experiments; read once.
AttnParams cluster_attn_params(const ops::PagedAttentionArgs& a) {
  AttnParams p = attn_params(a);
  static const bool live_split = !env_is("KS_ATTN_LIVE_SPLIT", "0");
  static const int min_keys = int(std::clamp<long long>(env_number("KS_ATTN_MIN_KEYS", 0), 0, INT_MAX));
  static const int prefetch_keys = int(std::clamp<long long>(env_number("KS_ATTN_PREFETCH_KEYS", 0), 0, 1 << 20));
  p.live_split = live_split ? 1 : 0;
  p.min_keys_per_cta = min_keys;
  p.prefetch_keys = prefetch_keys;
  return p;
}

// What both cluster variants require beyond their own shapes: 16-byte aligned q, out and caches,
// 32-bit key positions, and a grid of units * 16 CTAs at most within 2^31 - 1; "" when met.
std::string cluster_attention_limits(const ops::PagedAttentionArgs& a) {
  for (const detail::View* t : {&a.q, &a.out, &a.k_cache, &a.v_cache})
    if (!aligned16(t->data)) return "q, out, k_cache and v_cache must be 16-byte aligned";
  if (a.max_blocks_per_seq * a.block_size > int64_t(INT32_MAX / 2))
    return "max_blocks_per_seq * block_size exceeds 2^30 key positions (32-bit key indices)";
  // one CTA per (token, kv head) at least, on grid.x (at most 2^31 - 1 CTAs)
  if (a.num_tokens * a.num_kv_heads * 16 > int64_t(INT32_MAX))
    return "num_tokens * num_kv_heads * 16 exceeds the grid's 2^31 - 1 CTAs";
  return "";
}

// KS_ATTN_PUSH_MERGE=0 (read once; for comparisons): cuda_gqa_cluster's cluster merge through two
// barriers and remote reads, as before the pushed merge
bool gqa_push_merge() {
  static const bool on = !env_is("KS_ATTN_PUSH_MERGE", "0");
  return on;
}

// The largest cluster size for this instantiation on dev, 16 or 8 (cluster16_or_8: per kernel
// and device, since each device loads its own copy of the module), asked with 256 threads and
// the instantiation's largest shared memory.
template <typename T, int LPK, int GM, bool ROPE>
int max_cluster_for(int dev) {
  // the most this instantiation can need: GM heads of LPK * E elements, and the pushed states of
  // a cluster of 16 (gqa_push_bytes)
  // (at most kGqaSmemLimit: the launcher pushes only where the whole fits in it)
  const int64_t D = int64_t(LPK) * (16 / int64_t(sizeof(T)));
  const size_t base = gqa_smem_bytes(GM, D);
  // (KS_ATTN_PUSH_MERGE=0: without the pushed states, as before the pushed merge, so the cluster
  // sizes chosen are the old ones too)
  const size_t most =
      gqa_push_merge()
          ? std::max(base, std::min(gqa_push_offset(base) + gqa_push_bytes(16, GM, D), size_t(kGqaSmemLimit)))
          : base;
  if constexpr (ROPE)  // (the kept pieces after it all)
    return cluster16_or_8<paged_attention_gqa_rope_kernel<T, LPK, GM>>(
        dev, kGqaThreads, gqa_push_offset(most) + rope_keep_bytes(GM, D, sizeof(T)), "paged_attention");
  else
    return cluster16_or_8<paged_attention_gqa_kernel<T, LPK, GM>>(dev, kGqaThreads, most, "paged_attention");
}

int elems_per_lane(detail::DType dt) { return dt == detail::DType::F32 ? 4 : 8; }


}  // namespace

std::string paged_attention_gqa_can_implement(const void* args) {
  const auto& a = *static_cast<const ops::PagedAttentionArgs*>(args);
  const int64_t G = a.num_heads / a.num_kv_heads, E = elems_per_lane(a.q.dtype);
  if (G > kGqaMaxGroup) return "more than 8 query heads per kv head";
  if (a.head_dim % E != 0 || a.head_dim > 32 * E)
    return "head_dim must be a multiple of " + std::to_string(E) + " and at most " + std::to_string(32 * E) +
           " (16-byte rows of K and V per lane group)";
  if (const std::string why = cluster_attention_limits(a); !why.empty()) return why;
  if (int64_t(gqa_smem_bytes(int(G), a.head_dim)) > kGqaSmemLimit)
    return "the query heads of a kv head times head_dim exceed 200 KB of shared memory";
  return "";
}

// Compute capability 9.0 and code built for it: the kernel's body exists only for sm_90+
// (#if __CUDA_ARCH__ >= 900); a newer GPU that JIT-compiles an older PTX (80-virtual) would
// run an empty kernel and leave the output unwritten (DeviceProps::sm90_code, cached).
bool paged_attention_gqa_supported(int device) { return device_props(device).sm90_code; }

namespace {
// cuda_gqa_cluster's launch; rope (and tab) given: the fused kernel of
// rotary_embedding_kv_append_paged_attention (op: the name its errors carry)
void launch_gqa(const char* op, const ops::PagedAttentionArgs& a, ks_stream_t stream, const AttnRope* rope,
                const RopeTable* tab) {
  const int dev = a.q.device.device_id;
  DeviceGuard g(dev, op);
  const DeviceProps& dp = device_props(dev);
  const int G = int(a.num_heads / a.num_kv_heads);
  AttnParams p = cluster_attn_params(a);
  const size_t base_smem = gqa_smem_bytes(G, a.head_dim);
  size_t smem = base_smem;
  const auto s = static_cast<cudaStream_t>(stream);
  const int E = elems_per_lane(a.q.dtype);
  const int lanes = int((a.head_dim + E - 1) / E);
  const int LPK = lanes <= 4 ? 4 : lanes <= 8 ? 8 : lanes <= 16 ? 16 : 32;
  const int GM = G <= 1 ? 1 : G <= 2 ? 2 : G <= 4 ? 4 : 8;
  int C = 1;
  int64_t grid = 0;
  // The kernels of the three dtypes have the same type, so a generic lambda with a static
  // once_flag gave them one flag between them (and one for all devices): only the first
  // dtype launched got the non-portable attribute, and a cluster of 16 of another dtype
  // (or on another device) failed to launch. The attribute is set per kernel and device.
  auto go = [&](auto tag, auto lpk, auto gm) {
    using T = decltype(tag);
    constexpr int kL = decltype(lpk)::value, kG = decltype(gm)::value;
    // two CTAs per SM, a CTA per 64 keys of the table's capacity at most (KS_ATTN_CAPACITY_KEYS=N:
    // per N keys, for experiments). The live split gives each CTA one step of keys (64 for fp32
    // heads of 64), so a context filling its table can use every CTA of its cluster; with one per
    // 128 keys (before 2026-12-01) the cluster capped it at half the table: on the H200 (87eb81b,
    // SmolLM2, 641-token cache) decode after a 512-token prompt 1519 tokens/s against 1436, 576 of
    // 656 keys 7.75 us against 8.65, shorter contexts unchanged.
    const int most = rope ? max_cluster_for<T, kL, kG, true>(dev) : max_cluster_for<T, kL, kG, false>(dev);
    const bool one_cta = a.max_blocks_per_seq * a.block_size <= gqa_one_cta_keys();
    C = one_cta ? 1 : choose_cluster(a, most, 2 * int64_t(dp.sm_count), gqa_capacity_keys());
    grid = a.num_tokens * a.num_kv_heads * C;
    // paged_attention_after_append's promise: the older keys read before griddepcontrol.wait,
    // by one CTA per unit only (clusters launch without PDL, and read so they measured slower:
    // 1481 against 1510 tokens/s at a2bbdd8, SmolLM2 after a 512-token prompt). C == 1 also
    // where choose_cluster gives 1: tables under 128 keys, or batches of ~2 units per SM or more.
    p.prewait_fresh = !rope && C == 1 && a.fresh_keys > 0 ? int(std::min<int64_t>(a.fresh_keys, INT32_MAX)) : 0;
    p.prewait_steps = gqa_prewait_steps();
    // the pushed states' area, when a cluster merges (finish_unit, push_off) and it fits
    if (C > 1 && gqa_push_merge() &&
        int64_t(gqa_push_offset(base_smem) + gqa_push_bytes(C, G, a.head_dim)) <= kGqaSmemLimit) {
      p.push_off = int(gqa_push_offset(base_smem));
      smem = size_t(p.push_off) + gqa_push_bytes(C, G, a.head_dim);
    }
    if (rope) {
      AttnRope r = *rope;
      r.keep_off = int(gqa_push_offset(smem));
      smem = size_t(r.keep_off) + rope_keep_bytes(G, a.head_dim, sizeof(T));
      launch_kernel(op, paged_attention_gqa_rope_kernel<T, kL, kG>, dim3(unsigned(grid)), dim3(kGqaThreads), smem, s,
                    C, dp.pdl, p, r, *tab);
    } else
      launch_kernel(op, paged_attention_gqa_kernel<T, kL, kG>, dim3(unsigned(grid)), dim3(kGqaThreads), smem, s, C,
                    dp.pdl && (C == 1 || gqa_cluster_pdl(grid, dp.sm_count)), p);
  };
  auto by_group = [&](auto tag, auto lpk) {
    switch (GM) {
      case 1: go(tag, lpk, std::integral_constant<int, 1>{}); break;
      case 2: go(tag, lpk, std::integral_constant<int, 2>{}); break;
      case 4: go(tag, lpk, std::integral_constant<int, 4>{}); break;
      default: go(tag, lpk, std::integral_constant<int, 8>{}); break;
    }
  };
  auto by_lanes = [&](auto tag) {
    switch (LPK) {
      case 4: by_group(tag, std::integral_constant<int, 4>{}); break;
      case 8: by_group(tag, std::integral_constant<int, 8>{}); break;
      case 16: by_group(tag, std::integral_constant<int, 16>{}); break;
      default: by_group(tag, std::integral_constant<int, 32>{}); break;
    }
  };
  with_float_type(a.q.dtype, by_lanes);
  check_launch(op);
  record_launch(op,
                "variant=cuda_gqa_cluster cluster=%lld group=%lld lanes_per_key=%lld push_merge=%lld grid=%lld rope=%lld "
                "prewait=%lld",
                {C, G, LPK, p.push_off > 0 ? 1 : 0, grid, rope ? 1 : 0, rope ? 0 : p.prewait_fresh});
}
}  // namespace

void paged_attention_gqa_cuda(const void* args, ks_stream_t stream) {
  launch_gqa("paged_attention", *static_cast<const ops::PagedAttentionArgs*>(args), stream, nullptr, nullptr);
}

// rotary_embedding_kv_append_paged_attention, variant cuda_gqa_cluster: cuda_gqa_cluster's
// conditions, plus the table's limit and a 16-byte aligned v.
std::string rope_append_attention_gqa_can_implement(const void* args) {
  const auto& a = *static_cast<const ops::RopeKvAppendAttentionArgs*>(args);
  if (a.rkv.rope.rotary_dim / 2 > kRopeParamHalf) return "rotary_dim > 1024 (the inverse frequencies travel as a parameter)";
  if (a.rkv.kv.num_tokens != a.attn.num_tokens) return "slot_mapping has fewer entries than q has tokens (the kernel appends a row per token)";
  if (!aligned16(a.rkv.kv.v.data)) return "v must be 16-byte aligned";
  const int G = int(a.attn.num_heads / a.attn.num_kv_heads);
  if (G <= kGqaMaxGroup && int64_t(gqa_push_offset(gqa_smem_bytes(G, a.attn.head_dim)) +
                                   rope_keep_bytes(G, a.attn.head_dim, detail::dtype_bytes(a.attn.q.dtype))) >
                               kGqaSmemLimit)
    return "the attention's shared memory and the kept q and k pieces exceed 200 KB";
  return paged_attention_gqa_can_implement(&a.attn);
}

void rope_append_attention_gqa_cuda(const void* args, ks_stream_t stream) {
  const auto& a = *static_cast<const ops::RopeKvAppendAttentionArgs*>(args);
  const ops::RotaryArgs& r = a.rkv.rope;
  const ops::KvCacheAppendArgs& kv = a.rkv.kv;
  AttnRope rope{r.q.data,
                r.k.data,
                kv.v.data,
                kv.k_cache.data,
                kv.v_cache.data,
                r.positions.data,
                kv.slot_mapping.data,
                r.k_token_stride,
                r.k_head_stride,
                kv.num_slots,
                int(r.rotary_dim / 2),
                0,
                r.neox,
                r.positions.dtype == detail::DType::I64,
                kv.slot_mapping.dtype == detail::DType::I64};
  RopeTable tab{};
  cpu::rope_inv_freq(r.rotary_dim, r.theta, tab.inv);
  launch_gqa("rotary_embedding_kv_append_paged_attention", a.attn, stream, &rope, &tab);
}

}  // namespace ks::cuda

// ---- paged_attention, variant cuda_mma_cluster (bf16 / fp16) ----------------------------
// The work unit and the cluster split of cuda_gqa_cluster (a cluster of C CTAs per (token, kv
// head), the first Ce of them taking keys, merged by finish_unit), with the dot products on
// the tensor cores (mma.sync m16n8k16, FP32 accumulation) and each warp streaming its own keys:
//  - a CTA's 4 warps take its range's tiles of 16 keys in turn (warp w: tiles w, w + 4, ...);
//    each warp copies its tiles' K and V rows with cp.async into its own ring of kStages
//    stages (rows unpadded, 16-byte chunks XOR-swizzled by the row: see McShape) and
//    waits only for its own copies (cp.async.wait_group, then __syncwarp): no CTA barrier in
//    the key loop;
//  - S = Q K^T: A = the G query rows of the kv head (rows G..15 zero) in registers, B = the
//    tile's K rows by ldmatrix; s = scale * S in FP32 (the contract's order); unmapped keys
//    and keys past the range get weight 0 (score -inf), as in cuda_gqa_cluster;
//  - the online softmax in FP32 per row (the 4 lanes of a quad hold a row: max by two
//    shuffles), each e^(s - max) as ex2.approx of (s - max) log2 e, as cuda_gqa_cluster;
//  - O += P V: each FP32 weight p is carried as three bf16 (fp16) numbers hi + mid + lo
//    (hi = round(p), mid = round(p - hi), lo = round(p - hi - mid); each difference exact), so
//    hi + mid + lo is p to within 2^-24 |p| (bf16: the exponent range of FP32; fp16: weights
//    under 2^-14 lose their pieces' subnormal bits, at most 2^-25 absolute) and each piece's
//    product with V is exact - the FP32 weights of the contract, not bf16-rounded ones. (The
//    tensor cores' FP32 accumulation of those products need not round like IEEE additions.)
// Products of bf16 / fp16 inputs are exact; the tensor cores' FP32 sums may round differently
// from a sequential FP32 sum (the contract fixes no order).
// With G <= 4 the three pieces share one MMA (PK, at the kernel); the softmax base moves only
// when a score passes it by kMcSlack. Few units over long contexts: each unit's keys are split
// beyond one cluster over `splits` CTAs whose states meet in a workspace private to the call
// (split_workspace), merged by the unit's last split CTA to finish (or, under
// KS_ATTN_LAST_COMBINE=0, by attention_combine_kernel; the same code and bits).
// can_implement: bf16 / fp16, head_dim a multiple of 8 up to 128 (padded to 32, 64 or 128
// with zeros), at most 16 query heads per kv head, 16-byte aligned tensors, fewer than 2^31
// cache slots, compute capability 9.0.
// cuda_mma_tma: the same kernel, units, split and arithmetic, with each warp's K / V tiles
// brought by the TMA unit instead of per-lane cp.async copies: lane 0 issues two tensor copies
// per 16-key tile (cp.async.bulk.tensor through a CUtensorMap of each cache, built per call on
// the host) completing on the stage's mbarrier, the rows landing with the 128-byte swizzle (no
// padding; the layout cuda_mma_cluster's copies make too), so the key loop loses the
// copies' address arithmetic, shuffles and 16 copy instructions per lane and tile. An
// unmapped block's tile is read at a row past the map (the TMA unit fills zeros); V rows past
// the range in the last tile are zeroed after landing (0 x NaN would be NaN). Same bits as
// cuda_mma_cluster. can_implement: that of cuda_mma_cluster with head_dim 64 or 128,
// block_size a multiple of 16, a non-empty cache, and a driver with cuTensorMapEncodeTiled.
namespace ks::cuda {
namespace {

constexpr int kMcKeys = 16, kMcMaxGroup = 16;
// cuda_mma_cluster's split: part `part` of the Ce that take keys gets whole tiles of kMcKeys,
// ceil(len / Ce) rounded up to a tile, the last part's range ending at len (empty past Ce).
// ([[maybe_unused]] on the key-range helpers: their callers are sm_90 code, so the compute_80
// pass would warn, #177-D)
[[maybe_unused]] __device__ __forceinline__ KeyRange mma_keys(int64_t len, int Ce, int part) {
  const int64_t per = (int64_t(ceil_div_u32(len, Ce)) + kMcKeys - 1) / kMcKeys * kMcKeys;
  const int begin = int(min(len, int64_t(part) * per));
  return {begin, part < Ce ? int(min(len, int64_t(begin) + per)) : begin};
}
// the split beyond a cluster pays off where a cluster CTA would read at least this much K and V
constexpr int64_t kSplitMinBytes = 256 * 1024;
// how far (natural-log units) a score may pass the exponentials' base before the base moves
// (device code of sm_90 only: unreferenced in the compute_80 pass)
[[maybe_unused]] constexpr float kMcSlack = 8.f;

// head_dim padded: 32, 64 or 128; NW warps per CTA (4 or 8); TM: tiles by the TMA unit
// (cuda_mma_tma: DP 64 or 128 = head_dim)
template <int DP, int NW, bool TM = false>
struct McShape {
  // one K or V row, unpadded: each 128-byte line a warp copies lands in one 128-byte aligned
  // line of shared memory, its 16-byte chunks XOR-swizzled by the row (ldmatrix's 8 row
  // addresses hit distinct banks). Rows padded by 16 bytes instead (before 2026-12-01) made
  // every line straddle two, and the copies then asked L2 for 1.5x the sectors and streamed at
  // 4.2 TB/s where unpadded ones reach 4.5 (bench/kv_read_probe.cu on the H200, 4d26046). Head
  // dim 64 / 128: the TMA unit's 128-byte swizzle (rows of 128 elements in two 64-element
  // halves; cuda_mma_tma's tiles land so), 32: 64-byte rows, chunk c of row r at c ^ (r / 2).
  static constexpr int kRowBytes = DP * 2;
  // per warp (TM at head_dim 64: 6 stages of 4 KB, 24 KB per warp as at 128)
  static constexpr int kStages = DP >= 128 ? 3 : TM ? 6 : 4;
  static constexpr int kStageBytes = 2 * kMcKeys * kRowBytes;       // 16 K rows, then 16 V rows
  static constexpr int kRingBytes = NW * kStages * kStageBytes;
  // the ring starts on a 128-byte boundary (TM: 1024, the swizzle's period for the TMA unit;
  // then followed by the NW x kStages mbarriers)
  static constexpr int kAlign = TM ? 1024 : 128;
  static constexpr int kExtra = kAlign + (TM ? NW * kStages * 8 : 0);
};

// The byte offset of 16-byte chunk c (elements 8 c ..) of row r (0..15) in a tile of McShape's
// 16 K (or V) rows: the swizzles keep chunk c of 8 neighbouring rows in distinct banks (ldmatrix)
template <int DP>
__device__ __forceinline__ int mc_chunk(int r, int c) {
  if constexpr (DP == 32) return r * 64 + (((c ^ (r >> 1)) & 3) << 4);
  else return (c >> 3) * (kMcKeys * 128) + r * 128 + (((c & 7) ^ (r & 7)) << 4);
}

// The shared memory of one CTA: the warps' rings, over which the states of finish_unit are laid
// once every warp has left its key loop.
template <int DP, int NW, bool TM = false>
constexpr size_t mc_smem_bytes(int G, int64_t D) {
  using Sh = McShape<DP, NW, TM>;
  return std::max(size_t(Sh::kRingBytes + Sh::kExtra), gqa_state_bytes(NW, G, D));
}

// The K and V caches as cuda_mma_tma's tensor maps (kernel parameter; unused by cuda_mma_cluster)
struct McMaps {
  CUtensorMap k, v;
};


// a and b as a packed pair of T (low half: a), and the pair's values back in ra, rb
template <typename T>
__device__ __forceinline__ uint32_t mc_pack(float a, float b, float& ra, float& rb) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
    ra = __low2float(v);
    rb = __high2float(v);
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __half2 v = __floats2half2_rn(a, b);
    ra = __low2float(v);
    rb = __high2float(v);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
}

// (a, b) as hi + mid + lo in three packed pairs of T (see the header)
template <typename T>
__device__ __forceinline__ void split3(float a, float b, uint32_t& hi, uint32_t& mid, uint32_t& lo) {
  float ha, hb, ma, mb, la, lb;
  hi = mc_pack<T>(a, b, ha, hb);
  const float ra = a - ha, rb = b - hb;  // exact
  mid = mc_pack<T>(ra, rb, ma, mb);
  lo = mc_pack<T>(ra - ma, rb - mb, la, lb);
}

// PK (packed pieces, G <= 4): P's three pieces share one MMA. The A operand of P V has 16 rows
// and G <= 4 of them hold a head, so rows g, g + 8 and g + 4 carry head g's hi, mid and lo
// pieces; one m16n8k16 per 8 columns of V instead of three, and the pieces' sums are added
// once at the end ((hi + mid) + lo in FP32). Lanes 16..31 (rows 4..7 of S are zero) take
// rows 0..3's scores by a shuffle, so every replica's softmax is the same instructions on the
// same values (bit for bit); only row qr's softmax runs (row qr + 8 is the same head's mid).
// LC: the instantiation for the split's last-CTA merge (p.ws_count set, the default; the merge below the key loop,
// which inlined into every instantiation raised the key loop's registers, e.g. 96-105 -> 116-127
// at head_dim 32).
// TM: the tiles by the TMA unit through `maps` (cuda_mma_tma; see the header).
template <typename T, int DP, int NW, bool PK, bool LC = false, bool TM = false, bool PW = false>
__global__ void __launch_bounds__(32 * NW) paged_attention_mma_kernel(const AttnParams p, const __grid_constant__ McMaps maps) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  static_assert(!TM || DP == 64 || DP == 128, "cuda_mma_tma: head_dim 64 or 128");
  static_assert(!(PW && TM), "the early reads are cp.async copies");
  KS_TL(0);
  using Sh = McShape<DP, NW, TM>;
  constexpr int NH = PK ? 1 : 2;  // softmax rows per lane: qr (and qr + 8 unpacked)
  constexpr int CH = DP / 8;       // 16-byte chunks of a padded row
  constexpr int RP = 32 / CH;      // rows one copy pass of the warp covers
  constexpr int NK = DP / 16;      // k-steps of Q K^T
  constexpr int NJ = DP / 16;      // pairs of 8-column tiles of P V
  constexpr int S = Sh::kStages;
  extern __shared__ __align__(16) unsigned char mc_raw[];
  cg::cluster_group cluster = cg::this_cluster();
  const int C = int(cluster.num_blocks()), rank = int(cluster.block_rank());
  const int G = p.group;
  const int D = int(p.head_dim);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  // A unit's keys go to `parts` CTAs: the C of its cluster, or (split, C = 1) its p.splits CTAs
  const int parts = p.splits > 1 ? p.splits : C;
  const int64_t unit = blockIdx.x / parts;  // (token, kv head)
  const int part = p.splits > 1 ? int(blockIdx.x % parts) : rank;
  const int64_t t = unit_token(unit, p.num_kv_heads), kvh = unit - t * p.num_kv_heads;
  // Ce: as cuda_gqa_cluster (two tiles per warp at least, or KS_ATTN_MIN_KEYS)
  const int64_t keys_per_cta = p.splits > 1 ? p.split_keys : 2 * NW * kMcKeys;
  if (p.prefetch_keys > 0) {  // before the wait: warm_keys_l2
    const TokenContext now = token_context(p, t, /*l2_only=*/true);
    warm_keys_l2<T>(p, now.seq, kvh, mma_keys(now.len, live_ctas(p, parts, now.len, keys_per_cta), part));
  }
  // pre (PW: an instantiation of its own, launched for paged_attention_after_append's
  // fresh_keys = p.prewait_fresh > 0; not the TMA tiles): the caller promises that the kernel
  // before this one writes neither seq_ids, context_lens, block_tables nor any cache row this
  // token reads below len - prewait_fresh. The context, the
  // first S tiles' block-table entries and the first S - 1 tiles' copies of the older keys then go
  // out before griddepcontrol.wait (through L2 alone), so that their round trips overlap that
  // kernel; q and the fresh keys' copies after it. Otherwise everything after the wait.
  constexpr bool pre = PW;
  if (!pre) {
    pdl_begin();
    KS_TL(1);
  }
  // A fragments of Q (rows: the kv head's query heads; columns past D and rows past G zero),
  // loaded right after the wait: they do not depend on the context length, so their loads
  // overlap token_context's (or, pre, the early copies') instead of following them
  const int qr = lane >> 2, qc = (lane & 3) * 2;
  uint32_t qa[NK][4];
  auto load_q = [&] {
    const T* qb = static_cast<const T*>(p.q) + (t * p.num_heads + kvh * G) * D;
    auto pair = [&](int row, int col) -> uint32_t {
      return row < G && col < D ? *reinterpret_cast<const uint32_t*>(qb + int64_t(row) * D + col) : 0u;
    };
#pragma unroll
    for (int ks = 0; ks < NK; ++ks) {
      qa[ks][0] = pair(qr, ks * 16 + qc);
      qa[ks][1] = pair(qr + 8, ks * 16 + qc);
      qa[ks][2] = pair(qr, ks * 16 + qc + 8);
      qa[ks][3] = pair(qr + 8, ks * 16 + qc + 8);
    }
  };
  if (!pre) load_q();
  const auto [seq, len] = token_context(p, t, /*l2_only=*/pre);  // len <= INT32_MAX / 2 (can_implement)
  // a split CTA without keys has no cluster to wait for, and the combine reads only the first
  // Ce states
  const int Ce = live_ctas(p, parts, len, keys_per_cta);
  if ((Ce == 1 || p.splits > 1) && part >= Ce) return;
  const KeyRange mine_keys = mma_keys(len, Ce, part);
  const int j_begin = mine_keys.begin, j_end = mine_keys.end;
  const int ntiles = (j_end - j_begin + kMcKeys - 1) / kMcKeys;
  const int mine = ntiles > warp ? (ntiles - warp + NW - 1) / NW : 0;  // this warp's tiles
  auto tile_key = [&](int i) { return (warp + i * NW) * kMcKeys; };      // its tile i's first key, from j_begin

  const int32_t* bt = p.block_tables + seq * p.max_blocks_per_seq;
  const int bs = int(p.block_size);
  const uint32_t bs_mul = p.bs_mul;
  const int bs_shift = p.bs_shift;
  // this lane's 16-byte chunk of every row it copies (chunk ch; ch * 8 < D or zero-filled)
  const int ch = lane % CH;
  const bool ch_in = ch * 8 < D;
  const T* kc = static_cast<const T*>(p.k_cache) + kvh * D + ch * 8;
  const T* vc = static_cast<const T*>(p.v_cache) + kvh * D + ch * 8;
  const uint32_t row_stride = uint32_t(p.num_kv_heads * D);  // < 2^31 (can_implement)
  constexpr unsigned kAl = Sh::kAlign;
  const unsigned pad = (kAl - (unsigned(__cvta_generic_to_shared(mc_raw)) & (kAl - 1u))) & (kAl - 1u);
  unsigned char* ring = mc_raw + pad + warp * (S * Sh::kStageBytes);
  uint64_t* bars = nullptr;  // TM: this warp's S stage barriers
  if constexpr (TM) {
    bars = reinterpret_cast<uint64_t*>(mc_raw + pad + Sh::kRingBytes) + warp * S;
    if (lane == 0) {
#pragma unroll
      for (int st = 0; st < S; ++st) mbar_init(bars + st, 1);
      mbar_init_fence();
    }
    __syncwarp();
  }
  // TM: the row index past the maps (an unmapped block's tile: the TMA unit fills zeros)
  const int rows_end = int(p.num_blocks) * int(p.block_size);
  // Key (lane & 15) of this warp's tile i: its block-table entry (-1 past the range) and its
  // offset in the block. The entry is only loaded here, a tile before its copies are issued;
  // slot_of, at the issue, reads it, so the load's latency hides behind a tile of work (when
  // the entry was checked here, every tile waited for it: ncu at 05fa748 put half of the warps'
  // stalls on global loads).
  // (TM: the tile's first key, for every lane: a tile lies in one block, block_size % 16 == 0)
  auto fetch = [&](int i, int32_t& blk, int& off, bool l2_only = false) {
    const int pos = j_begin + tile_key(i) + (TM ? 0 : (lane & 15));
    blk = -1;
    off = 0;
    if (pos < j_end) {
      const int b = block_of(bs_mul, bs_shift, pos);  // pos / block_size
      blk = l2_only ? __ldcg(bt + b) : bt[b];
      off = pos - b * bs;
    }
  };
  // the cache slot of a fetched key, or -1 for a key past the range or unmapped (32-bit: the
  // cache holds fewer than 2^31 slots, can_implement)
  auto slot_of = [&](int32_t blk, int off) -> int {
    return blk >= 0 && blk < p.num_blocks ? blk * bs + off : -1;
  };
  // copies the tile of these slots into stage `stage`; returns its mask of mapped keys. With
  // `first` (the tile's first key position) and [from, to): only the rows of keys at positions
  // in [from, to) (the rest are left to another call: each row gets one copy or zero fill).
  // commit: close the group.
  auto issue = [&](int stage, int slot, int first = 0, int from = 0, int to = INT_MAX, bool commit = true) -> unsigned {
    const unsigned valid = __ballot_sync(0xffffffffu, slot >= 0) & 0xffffu;  // lanes 0..15 (16..31 the same)
    unsigned char* st = ring + stage * Sh::kStageBytes;
#pragma unroll
    for (int k = 0; k < kMcKeys / RP; ++k) {
      const int row = lane / CH + k * RP;
      const uint64_t off = uint64_t(uint32_t(max(__shfl_sync(0xffffffffu, slot, row), 0))) * row_stride;
      const bool fill = (valid >> row & 1u) && ch_in;
      if (first + row >= from && first + row < to) {
        cp_async16(st + mc_chunk<DP>(row, ch), kc + off, fill);
        cp_async16(st + kMcKeys * Sh::kRowBytes + mc_chunk<DP>(row, ch), vc + off, fill);
      }
    }
    if (commit) cp_async_commit();
    return valid;
  };
  // TM: tile i (block entry blk, offset off) into stage `stage` by lane 0's two tensor copies,
  // each 16 rows (keys) of kv head kvh with both halves of head_dim (box {64, 16, DP / 64, 1} of
  // the map {64 elements, cache rows, halves, kv heads}); returns its mask of mapped keys in the
  // range (a prefix: only the range's last tile is partial)
  auto issue_tma = [&](int stage, int i, int32_t blk, int off) -> unsigned {
    const bool mapped = blk >= 0 && blk < p.num_blocks;
    const int n = j_end - (j_begin + tile_key(i));  // >= 1 for a tile of the range
    if (lane == 0) {
      unsigned char* st = ring + stage * Sh::kStageBytes;
      const int row = mapped ? blk * bs + off : rows_end;
      mbar_arrive_expect_tx(bars + stage, unsigned(Sh::kStageBytes));
      tma_load_4d(st, &maps.k, 0, row, 0, int(kvh), bars + stage);
      tma_load_4d(st + kMcKeys * Sh::kRowBytes, &maps.v, 0, row, 0, int(kvh), bars + stage);
    }
    return !mapped ? 0u : n >= kMcKeys ? 0xffffu : (1u << n) - 1u;
  };
  auto issue_tile = [&](int stage, int i, int32_t blk, int off) -> unsigned {
    if constexpr (TM) return issue_tma(stage, i, blk, off);
    else return issue(stage, slot_of(blk, off));
  };
  // 16-byte chunk c of row r in a tile (McShape's swizzled rows)
  auto at = [&](const unsigned char* tile, int r, int c) -> const unsigned char* { return tile + mc_chunk<DP>(r, c); };
  // stage s's mask of mapped keys in bits 16 s .. (TM: bit s, whether its block is mapped: the
  // mask is then the range's prefix, and the ring may have more than 4 stages)
  uint64_t masks = 0;
  auto put_mask = [&](int stage, unsigned m) {
    if constexpr (TM) masks = (masks & ~(uint64_t(1) << stage)) | (uint64_t(m != 0u) << stage);
    else masks = (masks & ~(uint64_t(0xffffu) << (16 * stage))) | (uint64_t(m) << (16 * stage));
  };
  auto get_mask = [&](int i) -> unsigned {
    if constexpr (TM) {
      const int n = j_end - (j_begin + tile_key(i));
      return !(masks >> (i % S) & 1u) ? 0u : n >= kMcKeys ? 0xffffu : (1u << n) - 1u;
    } else {
      return unsigned(masks >> (16 * (i % S))) & 0xffffu;
    }
  };
  int32_t pre_blk[S];
  int pre_off[S];
#pragma unroll
  for (int i = 0; i < S; ++i) {  // the first S tiles' entries, all loads in flight at once
    pre_blk[i] = -1;
    pre_off[i] = 0;
    if (i < mine) fetch(i, pre_blk[i], pre_off[i], pre);
  }
  if constexpr (pre) {
    // before the wait, the first S - 1 tiles' rows of older keys (positions below fresh), in
    // open groups; after it, q, then each tile's fresh rows and the tile's group closed (group 0
    // then also holds every early copy: waiting for it waits for them too, issued first)
    const int fresh = int(max(len - int64_t(p.prewait_fresh), int64_t(0)));
#pragma unroll
    for (int i = 0; i < S - 1; ++i)
      if (i < mine) put_mask(i, issue(i, slot_of(pre_blk[i], pre_off[i]), j_begin + tile_key(i), 0, fresh, false));
    pdl_begin();
    KS_TL(1);
    load_q();
#pragma unroll
    for (int i = 0; i < S - 1; ++i) {
      if (i < mine) issue(i, slot_of(pre_blk[i], pre_off[i]), j_begin + tile_key(i), fresh, INT_MAX, false);
      cp_async_commit();
    }
  } else {
#pragma unroll
    for (int i = 0; i < S - 1; ++i) {
      if (i < mine) put_mask(i, issue_tile(i, i, pre_blk[i], pre_off[i]));
      else if constexpr (!TM) cp_async_commit();  // empty groups keep the wait count uniform
    }
  }
  int32_t next_blk = pre_blk[S - 1];  // tile S - 1's, ahead of its copies
  int next_off = pre_off[S - 1];
  constexpr float kLog2e = 1.4426950408889634f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};  // rows qr and qr + 8
  float acc[2 * NJ][4];
#pragma unroll
  for (int n = 0; n < 2 * NJ; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
  int any_local = 0;
  // ldmatrix row addresses: K (keys on B's columns) and V (keys on B's rows, transposed)
  const int krow = (lane & 7) + ((lane >> 4) & 1) * 8, kchunk = (lane >> 3) & 1;
  const int vrow = (lane & 7) + ((lane >> 3) & 1) * 8, vchunk = lane >> 4;
  for (int i = 0; i < mine; ++i) {
    const int nx = i + S - 1;
    if (nx < mine) {
      put_mask(nx % S, issue_tile(nx % S, nx, next_blk, next_off));
      if (nx + 1 < mine) fetch(nx + 1, next_blk, next_off);
    } else if constexpr (!TM) {
      cp_async_commit();
    }
    const unsigned valid = get_mask(i);
    if constexpr (TM) {
      mbar_wait(bars + i % S, unsigned(i / S) & 1u);  // the tile's bytes have landed
      if (valid != 0u && valid != 0xffffu) {
        // the range's last tile, partly past it: V rows past the range (whatever the cache
        // holds there, NaN too) to zero, as the cp.async path's zero-filled copies
        unsigned char* vz = ring + (i % S) * Sh::kStageBytes + kMcKeys * Sh::kRowBytes;
        const int n = __popc(valid);
        for (int e = lane; e < (kMcKeys - n) * (DP / 8); e += 32) {
          const int r = n + e / (DP / 8), c = e % (DP / 8);
          *reinterpret_cast<uint4*>(vz + (c >> 3) * (kMcKeys * 128) + r * 128 + (c & 7) * 16) = make_uint4(0u, 0u, 0u, 0u);
        }
        // (the partial tile is the warp's last: no bulk copy lands in this stage after these
        // stores; the fence keeps that true should the ring's order change)
        fence_proxy_async_smem();
        __syncwarp();
      }
    } else {
      cp_async_wait<S - 1>();
      __syncwarp();  // every lane's copies of tile i have landed
    }
    if (i == 0) KS_TL(2);
    any_local |= valid != 0u;
    const unsigned char* kt = ring + (i % S) * Sh::kStageBytes;
    const unsigned char* vt = kt + kMcKeys * Sh::kRowBytes;
    float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};  // keys 0..7, 8..15
#pragma unroll
    for (int ks = 0; ks < NK; ++ks) {
      uint32_t b[4];
      ldmatrix_x4<false>(b, at(kt, krow, 2 * ks + kchunk));
      mma_16816<T>(s[0], qa[ks], b[0], b[1]);
      mma_16816<T>(s[1], qa[ks], b[2], b[3]);
    }
    // s[n][e]: row qr (e < 2) or qr + 8, key n * 8 + qc + (e & 1)
    if constexpr (PK) {  // lanes 16..31: rows 0..3's scores (lanes 0..15 read their own)
#pragma unroll
      for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int e = 0; e < 2; ++e) s[n][e] = __shfl_sync(0xffffffffu, s[n][e], lane & 15);
    }
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int e = 0; e < 2 * NH; ++e)
        s[n][e] = (valid >> (n * 8 + qc + (e & 1)) & 1u) ? s[n][e] * p.scale : -INFINITY;  // unmapped: weight 0
#pragma unroll
    for (int h = 0; h < NH; ++h) {
      float mx = fmaxf(fmaxf(s[0][2 * h], s[0][2 * h + 1]), fmaxf(s[1][2 * h], s[1][2 * h + 1]));  // NaN ignored here
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      // The exponentials' base m moves only when a score passes it by more than kMcSlack, so
      // most tiles skip the accumulators' rescale (a warp-uniform vote): weights stay below
      // e^kMcSlack, and the states' merges take m as the base it is, not as the maximum.
      if (__any_sync(0xffffffffu, mx > m[h] + kMcSlack)) {
        const float nm = fmaxf(m[h], mx);
        // m = -inf (nothing finite yet): 0, acc and l are 0; nm = -inf too: 1, no -inf - -inf
        const float corr = nm == -INFINITY ? 1.f : fast_exp2((m[h] - nm) * kLog2e);
        l[h] *= corr;
        m[h] = nm;
        if constexpr (PK) {  // both halves of the accumulators are head qr's (or its replica's)
#pragma unroll
          for (int n = 0; n < 2 * NJ; ++n) acc[n][0] *= corr, acc[n][1] *= corr, acc[n][2] *= corr, acc[n][3] *= corr;
        } else {
#pragma unroll
          for (int n = 0; n < 2 * NJ; ++n) acc[n][2 * h] *= corr, acc[n][2 * h + 1] *= corr;
        }
      }
      const float base = m[h] == -INFINITY ? 0.f : m[h];  // nothing finite yet: exp2(-inf) = 0
      float sum = 0.f;
#pragma unroll
      for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int e = 2 * h; e < 2 * h + 2; ++e) {
          s[n][e] = fast_exp2((s[n][e] - base) * kLog2e);  // -inf: 0; NaN stays NaN, as exp
          sum += s[n][e];
        }
      l[h] += sum;
    }
    if constexpr (PK) {
      // rows qr < 4: hi (A regs 0, 2) and mid (rows qr + 8: regs 1, 3); rows 4..7: lo of head
      // qr - 4 (regs 0, 2), rows 12..15 zero
      uint32_t hi0, mid0, lo0, hi1, mid1, lo1, pa[4];
      split3<T>(s[0][0], s[0][1], hi0, mid0, lo0);
      split3<T>(s[1][0], s[1][1], hi1, mid1, lo1);
      const bool upper = lane >= 16;
      pa[0] = upper ? lo0 : hi0;
      pa[1] = upper ? 0u : mid0;
      pa[2] = upper ? lo1 : hi1;
      pa[3] = upper ? 0u : mid1;
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
        uint32_t b[4];
        ldmatrix_x4<true>(b, at(vt, vrow, 2 * j + vchunk));
        mma_16816<T>(acc[2 * j], pa, b[0], b[1]);
        mma_16816<T>(acc[2 * j + 1], pa, b[2], b[3]);
      }
    } else {
      // P's A fragments (rows qr, qr + 8; keys qc.., 8 + qc..), three pieces each
      uint32_t pa[3][4];
      split3<T>(s[0][0], s[0][1], pa[0][0], pa[1][0], pa[2][0]);
      split3<T>(s[0][2], s[0][3], pa[0][1], pa[1][1], pa[2][1]);
      split3<T>(s[1][0], s[1][1], pa[0][2], pa[1][2], pa[2][2]);
      split3<T>(s[1][2], s[1][3], pa[0][3], pa[1][3], pa[2][3]);
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
        uint32_t b[4];
        ldmatrix_x4<true>(b, at(vt, vrow, 2 * j + vchunk));
#pragma unroll
        for (int piece = 0; piece < 3; ++piece) {
          mma_16816<T>(acc[2 * j], pa[piece], b[0], b[1]);
          mma_16816<T>(acc[2 * j + 1], pa[piece], b[2], b[3]);
        }
      }
    }
    __syncwarp();  // the stage is read before the next iteration's copies overwrite it
  }
  if constexpr (TM) {
    // every copy issued was waited for; the barriers end here (the states finish_unit and
    // combine_unit lay over the ring stay below them, but their bytes are plain memory again)
    if (lane == 0)
#pragma unroll
      for (int st = 0; st < S; ++st) mbar_inval(bars + st);
  } else {
    cp_async_wait<0>();
  }
  KS_TL(3);
  // a row's sum over its quad
#pragma unroll
  for (int h = 0; h < NH; ++h) {
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
  }
  if constexpr (PK) {  // head qr's sums: (hi + mid) + lo (lane + 16's rows qr + 4)
#pragma unroll
    for (int n = 0; n < 2 * NJ; ++n)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float lo = __shfl_xor_sync(0xffffffffu, acc[n][e], 16);
        acc[n][e] = (acc[n][e] + acc[n][e + 2]) + lo;
      }
  }
  __syncthreads();  // every warp is done with the rings: the states go over them
  KS_TL(4);
  GqaSmem sm(mc_raw, NW, G, D);
#pragma unroll
  for (int h = 0; h < NH; ++h) {
    const int g = qr + 8 * h;
    if (g >= G) continue;
    if ((lane & 3) == 0) sm.wm[warp * G + g] = m[h], sm.wl[warp * G + g] = l[h];
#pragma unroll
    for (int n = 0; n < 2 * NJ; ++n) {
      const int d = n * 8 + qc;
      if (d < D) {  // D is a multiple of 8: both columns or neither
        sm.wacc[(warp * G + g) * D + d] = acc[n][2 * h];
        sm.wacc[(warp * G + g) * D + d + 1] = acc[n][2 * h + 1];
      }
    }
  }
  T* out_t = static_cast<T*>(p.out) + (t * p.num_heads + kvh * G) * D;
  float* ws_state = p.splits > 1 ? p.ws + (unit * p.splits + part) * split_state_stride(G, D) : nullptr;
  // (kOneTrip: the cluster merge's loads in one round trip, its last arrive before the store)
  finish_unit<T, 32 * NW, decltype(cluster), true>(cluster, mc_raw, 0, NW, G, D, any_local, Ce, len, out_t, ws_state);
  KS_TL(5);
  if constexpr (LC) {
    if (ws_state && Ce > 1) {
      // The default (p.ws_count set; not under KS_ATTN_LAST_COMBINE=0): the unit's last split CTA to get here merges the
      // Ce states (the combine kernel's code and order, so the same bits). The barrier orders
      // every thread's state stores before thread 0's count, an acq_rel atomic at GPU scope
      // whose release is cumulative over them (one fence for the CTA, not one per thread: 0.1-0.2
      // µs at batch 1's splits, 2026-12-02); in the last CTA its acquire, then the barrier, orders
      // every thread's loads of the others' states after their counts. The increment wraps
      // (atom.inc) back to 0 at the last arrival, so the count is 0 again for the next call or
      // replay.
      __shared__ int last;
      __syncthreads();
      if (threadIdx.x == 0) {
        unsigned old;
        asm volatile("atom.acq_rel.gpu.global.inc.u32 %0, [%1], %2;"
                     : "=r"(old) : "l"(p.ws_count + unit), "r"(unsigned(Ce - 1)) : "memory");
        last = old == unsigned(Ce - 1);
      }
      __syncthreads();
      KS_TL(10);
      if (last) combine_unit<T, true>(p, unit, reinterpret_cast<float*>(mc_raw), len);  // (the rings are free)
      KS_TL(15, (unsigned long long)last);
    }
  }
  KS_TL(6);
#endif
}

// The end of cuda_mma_cluster's split: a CTA per (token, kv head) unit merges the states the
// first Ce of the unit's p.splits CTAs left in p.ws, in split order, with the cluster merge's
// formula (finish_unit): out = sum_s acc_s e^(m_s - M) / sum_s l_s e^(m_s - M) (L = a = 0 when
// every m_s is -inf). A unit whose keys one CTA took (Ce == 1) was written by that CTA and is
// skipped (both kernels count Ce by live_ctas with p.split_keys).
// Latency, not work, sets its time (a few hundred floats per unit, read from L2): so the first
// batch of each thread's first output accumulators is loaded before anything else (they do not
// depend on the factors), every split's m and l go into shared memory, each head's M is a max
// (order-free) by a warp's butterfly, the Ce x G factors are made in parallel, and each output
// element sums its Ce accumulators in split order, kB at a time, the next batch loaded while
// one is summed, beside its head's L (in split order). The sums and their order
// are those of the serial form before 2026-12-01 (same bits).
// Dynamic shared memory: 2 * splits * G floats.
// Unit `unit`'s merge by the CTA that calls it (any block size >= G; every thread calls it):
// comb holds 2 * splits * G floats. kL2: the states are read through L2 only (ld.global.cg),
// for the unit's last split CTA (the default merge), which reads what other CTAs wrote during
// this kernel (after its count's acquire; the staged copies below are cp.async.cg, L2 only too).
// There, where the CTA's dynamic shared memory holds the unit's Ce states and their Ce x G
// factors, they are first staged in it (one round trip) and merged from there in the same order
// (same bits). known_len: the unit's context length,
// where the caller has it.
template <typename T, bool kL2>
__device__ void combine_unit(const AttnParams &p, int64_t unit, float *comb, int64_t known_len) {
  constexpr int kB = 16;  // accumulators per batch and output element (two batches in flight)
  __shared__ float head_m[kMcMaxGroup];
  const int64_t t = unit_token(unit, p.num_kv_heads), kvh = unit - t * p.num_kv_heads;
  // (known_len: the unit's last split CTA has it; not read again, a round trip saved)
  const int64_t len = known_len >= 0 ? known_len : token_context(p, t).len;
  const int Ce = live_ctas(p, p.splits, len, p.split_keys);
  if (Ce == 1) return;
  const int G = p.group, D = int(p.head_dim);
  const int64_t sf = split_state_stride(G, D);
  const float* st = p.ws + unit * p.splits * sf;
  T* out_t = static_cast<T*>(p.out) + (t * p.num_heads + kvh * G) * D;
  // each head's M into head_m, m_of(c, g) split c's m of head g: a warp's lanes fold the splits,
  // then a butterfly (a max is the same in any order; up to 2026-12-02 one thread per head
  // walked the Ce splits); then a barrier
  auto head_maxima = [&](auto m_of) {
    const int lane = int(threadIdx.x) & 31, nwarps = int(blockDim.x) >> 5;
    for (int g = int(threadIdx.x) >> 5; g < G; g += nwarps) {
      float M = -INFINITY;
      for (int c = lane; c < Ce; c += 32) M = fmaxf(M, m_of(c, g));
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
      if (lane == 0) head_m[g] = M;
    }
    __syncthreads();
  };
  unsigned smem_bytes;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(smem_bytes));
  if (kL2 && int64_t(Ce) * (sf + G) * int64_t(sizeof(float)) <= int64_t(smem_bytes) &&
      (reinterpret_cast<uintptr_t>(st) & 15u) == 0) {
    // The unit's last split CTA (kL2), where its dynamic shared memory holds the Ce states and
    // their factors (batch 1's splits: 33-35 KB of 116+): every state in by 16-byte cp.async
    // copies through L2 (the states' stride is a multiple of 4 floats, p.ws and comb 16-byte
    // aligned), all in flight at once (one round trip), then the merge below from shared memory:
    // the same values, sums and order. (The form below loads each output element's accumulators
    // in batches of kB after the factors: at 2026-12-02's timeline a round trip per element and
    // batch, 2.5 us of the merge at 32 / 8 heads of 128; 4-byte copies until the second
    // 2026-12-02 call.)
    float* sst = comb;                    // Ce * sf floats: the states
    float* f = comb + int64_t(Ce) * sf;  // Ce * G: the factors
    const int n = int(int64_t(Ce) * sf);
    for (int k = 4 * int(threadIdx.x); k < n; k += 4 * int(blockDim.x)) cp_async16(sst + k, st + k, true);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    int any_local = 0;
    for (int c = threadIdx.x; c < Ce; c += blockDim.x) any_local |= sst[c * sf + int64_t(G) * (D + 2)] != 0.f;
    const int any = __syncthreads_or(any_local);
    if constexpr (kL2) KS_TL(11);
    head_maxima([&](int c, int g) { return sst[c * sf + g]; });
    for (int k = threadIdx.x; k < Ce * G; k += blockDim.x) {
      const int c = k / G, g = k % G;
      const float M = head_m[g];
      f[k] = M == -INFINITY ? 0.f : merge_factor(sst[c * sf + g], M);
    }
    __syncthreads();
    if constexpr (kL2) KS_TL(12);
    for (int i = threadIdx.x; i < G * D; i += blockDim.x) {
      const int g = i / D;
      float a = 0.f, L = 0.f;
      for (int c = 0; c < Ce; ++c) {
        const float fc = f[c * G + g];
        L += sst[c * sf + G + g] * fc;
        a += sst[c * sf + 2 * G + i] * fc;
      }
      const bool empty = head_m[g] == -INFINITY;
      out_t[i] = Dt<T>::from_f(attention_output(empty ? 0.f : L, empty ? 0.f : a, any, len));
    }
    if constexpr (kL2) KS_TL(13);
    return;
  }
  auto ld = [&](int64_t i) { return kL2 ? __ldcg(st + i) : st[i]; };
  // split c's accumulator of output element i, 0 past Ce
  auto acc = [&](int c, int i) { return c < Ce ? ld(c * sf + 2 * G + i) : 0.f; };
  float v[kB];  // the batch being summed
  if (int(threadIdx.x) < G * D)
#pragma unroll
    for (int j = 0; j < kB; ++j) v[j] = acc(j, int(threadIdx.x));
  float *fm = comb, *fl = comb + Ce * G;
  int any_local = 0;
  for (int k = threadIdx.x; k < Ce * G; k += blockDim.x) {
    const int c = k / G, g = k % G;
    fm[k] = ld(c * sf + g);
    fl[k] = ld(c * sf + G + g);
  }
  for (int c = threadIdx.x; c < Ce; c += blockDim.x) any_local |= ld(c * sf + int64_t(G) * (D + 2)) != 0.f;
  const int any = __syncthreads_or(any_local);
  if constexpr (kL2) KS_TL(11);
  head_maxima([&](int c, int g) { return fm[c * G + g]; });
  for (int k = threadIdx.x; k < Ce * G; k += blockDim.x) {
    const float M = head_m[k % G];
    fm[k] = M == -INFINITY ? 0.f : merge_factor(fm[k], M);
  }
  __syncthreads();
  if constexpr (kL2) KS_TL(12);
  for (int i = threadIdx.x; i < G * D; i += blockDim.x) {
    const int g = i / D;
    if (i != int(threadIdx.x))  // (the first element's first batch is loaded)
#pragma unroll
      for (int j = 0; j < kB; ++j) v[j] = acc(j, i);
    // the head's L (split order, as before) beside the element's sum: two independent chains
    // (one thread per head summed L before 2026-12-02, a barrier before the outputs)
    float a = 0.f, L = 0.f;
    for (int c0 = 0; c0 < Ce; c0 += kB) {
      float w[kB];  // the next batch, in flight while this one is summed
#pragma unroll
      for (int j = 0; j < kB; ++j) w[j] = c0 + kB < Ce ? acc(c0 + kB + j, i) : 0.f;
#pragma unroll
      for (int j = 0; j < kB; ++j)
        if (c0 + j < Ce) {
          const float f = fm[(c0 + j) * G + g];
          L += fl[(c0 + j) * G + g] * f;
          a += v[j] * f;
        }
#pragma unroll
      for (int j = 0; j < kB; ++j) v[j] = w[j];
    }
    const bool empty = head_m[g] == -INFINITY;
    out_t[i] = Dt<T>::from_f(attention_output(empty ? 0.f : L, empty ? 0.f : a, any, len));
  }
  if constexpr (kL2) KS_TL(13);
}

template <typename T>
__global__ void __launch_bounds__(256) attention_combine_kernel(const AttnParams p) {
  extern __shared__ float comb[];  // f[Ce][G] (m, then the factors), l[Ce][G]
  pdl_begin();
  combine_unit<T, false>(p, blockIdx.x, comb);
}

int padded_head_dim(int64_t d) { return d <= 32 ? 32 : d <= 64 ? 64 : 128; }

// ---- the split's workspace ------------------------------------------------------------
// Outside stream capture: stream-ordered, cudaMallocAsync on the caller's stream and
// cudaFreeAsync after the combine. Under capture: a buffer owned by the graph being captured
// (a CUDA user object, released with the graph and its executables once their launches are
// done), so the graph gets no memory nodes: those would forbid cloning it, instantiating it
// more than once and nesting it as a child graph, and would sit between the kernels, where
// programmatic dependent launch cannot overlap them. Each captured call owns its own buffer and
// launches of one executable are serialized; but a clone or a second instantiation of the graph
// shares the buffer (the kernels' parameters carry its address), so such executables must not run
// at the same time (their split states would mix, and their counters). A user
// object's destructor may not call CUDA: it queues the buffer, and a later call outside capture
// frees it with cudaFreeAsync on a side stream.
// (device, buffer) of destroyed graphs, under a lock; never destroyed, since a graph may be
// destroyed (and its destructor run) after this file's static objects at exit
struct ReleasedWorkspaces {
  std::mutex mu;
  std::vector<std::pair<int, void*>> list;
};
ReleasedWorkspaces& released_workspaces() {
  static auto* r = new ReleasedWorkspaces;
  return *r;
}

void release_graph_workspace(void* owner) {
  auto* w = static_cast<std::pair<int, void*>*>(owner);
  ReleasedWorkspaces& r = released_workspaces();
  {
    std::lock_guard<std::mutex> lock(r.mu);
    r.list.push_back(*w);
  }
  delete w;
}

// A non-blocking stream per device for the graph workspaces' allocation and release.
cudaStream_t workspace_stream(int dev) {
  return once_per_device<cudaStream_t>(dev, [](int) {
    cudaStream_t st = nullptr;
    check_cuda(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), "paged_attention", "cudaStreamCreateWithFlags");
    return st;
  });
}

// bytes of workspace for one call on stream s of device dev (the caller holds a DeviceGuard),
// its bytes from zero_from on set to 0 (before the call's kernels: on s, or at capture time);
// *stream_ordered: the caller frees it with cudaFreeAsync on s after its last kernel. nullptr
// when the memory is not there (the caller then keeps to the cluster); other errors throw.
float* split_workspace(int dev, cudaStream_t s, size_t bytes, size_t zero_from, bool* stream_ordered) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  cudaGraph_t graph = nullptr;
  check_cuda(cudaStreamGetCaptureInfo(s, &status, nullptr, &graph), "paged_attention", "cudaStreamGetCaptureInfo");
  void* p = nullptr;
  // the bytes from zero_from on set to 0 on stream z; on failure the buffer is freed there
  auto zero_tail = [&](cudaStream_t z) {
    const cudaError_t e = zero_from < bytes ? cudaMemsetAsync(static_cast<char*>(p) + zero_from, 0, bytes - zero_from, z)
                                            : cudaSuccess;
    if (e != cudaSuccess) (void)cudaFreeAsync(p, z);  // (the memset's error is the one reported)
    return e;
  };
  if (status != cudaStreamCaptureStatusActive) {
    std::vector<void*> done;
    {
      ReleasedWorkspaces& r = released_workspaces();
      std::lock_guard<std::mutex> lock(r.mu);
      for (size_t i = 0; i < r.list.size();)
        if (r.list[i].first == dev) {
          done.push_back(r.list[i].second);
          r.list[i] = r.list.back();
          r.list.pop_back();
        } else {
          ++i;
        }
    }
    for (void* d : done) check_cuda(cudaFreeAsync(d, workspace_stream(dev)), "paged_attention", "cudaFreeAsync (graph workspace)");
    const cudaError_t e = cudaMallocAsync(&p, bytes, s);
    if (e == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();  // an answer here: the caller takes the cluster path
      return nullptr;
    }
    check_cuda(e, "paged_attention", "cudaMallocAsync (split workspace)");
    check_cuda(zero_tail(s), "paged_attention", "cudaMemsetAsync (split counters)");
    *stream_ordered = true;
    return static_cast<float*>(p);
  }
  // under capture: allocate on the side stream (relaxed mode lets this thread wait for it)
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  check_cuda(cudaThreadExchangeStreamCaptureMode(&mode), "paged_attention", "cudaThreadExchangeStreamCaptureMode");
  const cudaStream_t side = workspace_stream(dev);
  cudaError_t e = cudaMallocAsync(&p, bytes, side);
  if (e == cudaSuccess) {
    const cudaError_t z = zero_tail(side);
    if (z != cudaSuccess) {
      (void)cudaThreadExchangeStreamCaptureMode(&mode);  // the caller's mode back
      check_cuda(z, "paged_attention", "cudaMemsetAsync (graph workspace counters)");
    }
  }
  if (e == cudaSuccess) e = cudaStreamSynchronize(side);
  (void)cudaThreadExchangeStreamCaptureMode(&mode);  // the caller's mode back
  if (e == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    return nullptr;
  }
  check_cuda(e, "paged_attention", "cudaMallocAsync (graph workspace)");
  auto* owner = new std::pair<int, void*>(dev, p);
  cudaUserObject_t obj = nullptr;
  e = cudaUserObjectCreate(&obj, owner, release_graph_workspace, 1, cudaUserObjectNoDestructorSync);
  if (e != cudaSuccess) {
    delete owner;
    (void)cudaFreeAsync(p, side);
    check_cuda(e, "paged_attention", "cudaUserObjectCreate");
  }
  // the graph takes the only reference: the buffer lives as long as the graph and its executables
  check_cuda(cudaGraphRetainUserObject(graph, obj, 1, cudaGraphUserObjectMove), "paged_attention",
             "cudaGraphRetainUserObject");
  *stream_ordered = false;
  return static_cast<float*>(p);
}

}  // namespace

// A [num_blocks, block_size, num_kv_heads, head_dim] cache (bf16 / fp16, contiguous, 16-byte
// aligned) as cuda_mma_tma's map: dimensions {64 elements, cache rows, head_dim / 64 halves, kv
// heads} (strides: a row, 128 bytes, a head), boxes of {64, 16 rows, head_dim / 64, 1}, the
// 128-byte swizzle, zeros past the rows. false when the driver refuses it.
bool encode_cache_map(CUtensorMap* m, const detail::View& cache, int64_t rows, int64_t kvh, int64_t D) {
  const PFN_cuTensorMapEncodeTiled_v12000 enc = tensor_map_encoder();
  if (!enc) return false;
  const cuuint64_t dims[4] = {64, cuuint64_t(rows), cuuint64_t(D / 64), cuuint64_t(kvh)};
  const cuuint64_t strides[3] = {cuuint64_t(kvh * D * 2), 128, cuuint64_t(D * 2)};
  const cuuint32_t box[4] = {64, cuuint32_t(kMcKeys), cuuint32_t(D / 64), 1};
  const cuuint32_t elem[4] = {1, 1, 1, 1};
  const CUtensorMapDataType type =
      cache.dtype == detail::DType::BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  return enc(m, type, 4, const_cast<void*>(cache.data), dims, strides, box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE,
             CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

std::string paged_attention_mma_can_implement(const void* args) {
  const auto& a = *static_cast<const ops::PagedAttentionArgs*>(args);
  if (a.q.dtype != detail::DType::BF16 && a.q.dtype != detail::DType::F16) return "bf16 and fp16 only (tensor cores)";
  if (a.num_heads / a.num_kv_heads > kMcMaxGroup) return "more than 16 query heads per kv head";
  if (a.head_dim % 8 != 0 || a.head_dim > 128) return "head_dim must be a multiple of 8 and at most 128";
  if (a.num_blocks * a.block_size > int64_t(INT32_MAX) || a.num_kv_heads * a.head_dim > int64_t(INT32_MAX))
    return "num_blocks * block_size or num_kv_heads * head_dim exceeds 2^31 - 1 (32-bit slots and row strides)";
  return cluster_attention_limits(a);
}

std::string paged_attention_mma_tma_can_implement(const void* args) {
  const auto& a = *static_cast<const ops::PagedAttentionArgs*>(args);
  if (const std::string why = paged_attention_mma_can_implement(args); !why.empty()) return why;
  if (a.head_dim != 64 && a.head_dim != 128) return "head_dim must be 64 or 128 (tensor maps of 64-element halves)";
  if (a.block_size % kMcKeys != 0) return "block_size must be a multiple of 16 (a 16-key tile in one block)";
  if (a.num_blocks * a.block_size == 0) return "an empty cache (a tensor map needs rows)";
  if (!tensor_map_encoder()) return "the driver has no cuTensorMapEncodeTiled";
  return "";
}

namespace {
// cuda_mma_cluster, or with tma cuda_mma_tma (the same launch rules and kernel, tiles by the TMA unit)
void run_mma(const void* args, ks_stream_t stream, bool tma) {
  const auto& a = *static_cast<const ops::PagedAttentionArgs*>(args);
  const int dev = a.q.device.device_id;
  DeviceGuard g(dev, "paged_attention");
  const DeviceProps& dp = device_props(dev);
  const int G = int(a.num_heads / a.num_kv_heads);
  AttnParams p = cluster_attn_params(a);
  // paged_attention_after_append's promise: the older keys' first tiles are copied before the wait
  // (not with the TMA tiles)
  p.prewait_fresh = !tma && a.fresh_keys > 0 ? int(std::min<int64_t>(a.fresh_keys, INT32_MAX)) : 0;
  const int DP = padded_head_dim(a.head_dim);
  const auto s = static_cast<cudaStream_t>(stream);
  int C = 1;
  int64_t grid = 0, splits = 1;
  int NW = 4, resident = 0;
  // KS_ATTN_SPLIT=0: no split beyond a cluster (for comparisons)
  static const bool split_on = !env_is("KS_ATTN_SPLIT", "0");
  // each unit's last split CTA merges the states (no combine kernel), unless
  // KS_ATTN_LAST_COMBINE=0 (attention_combine_kernel, for comparisons). At ea63df9 (after the
  // merge's latency chain was shortened): b1 9/3 heads of 64, 32K keys 16.99 us against 17.9 with
  // the combine kernel; 32/8 of 128, 8K 18.6 against 20.0, 32K 44.1 against 45.2.
  const bool last_combine = !env_is("KS_ATTN_LAST_COMBINE", "0");
  // the fewest keys per split CTA: 256 (two tiles per warp), or KS_ATTN_SPLIT_KEYS=N (a
  // multiple of 16, for experiments)
  static const int split_keys = int(std::clamp<long long>(env_number("KS_ATTN_SPLIT_KEYS", 256), 16, 1 << 20) / 16 * 16);
  const bool pools = once_per_device<bool>(dev, [](int d) {
    int v = 0;
    return cudaDeviceGetAttribute(&v, cudaDevAttrMemoryPoolsSupported, d) == cudaSuccess && v != 0;
  });
  McMaps maps{};
  if (tma) {
    const int64_t rows = a.num_blocks * a.block_size;
    if (!encode_cache_map(&maps.k, a.k_cache, rows, a.num_kv_heads, a.head_dim) ||
        !encode_cache_map(&maps.v, a.v_cache, rows, a.num_kv_heads, a.head_dim))
      detail::fail(KS_ERROR_CUDA, "paged_attention", "cuda_mma_tma: cuTensorMapEncodeTiled refused the caches' tensor maps");
  }
  auto go = [&](auto tag, auto dpad, auto warps, auto packed, auto tm) {
    using T = decltype(tag);
    constexpr int kDP = decltype(dpad)::value, kNW = decltype(warps)::value;
    constexpr bool kTM = decltype(tm)::value;
    constexpr auto kern = paged_attention_mma_kernel<T, kDP, kNW, decltype(packed)::value, false, kTM>;
    constexpr int kThreads = 32 * kNW;
    float* ws = nullptr;          // the split's workspace
    bool stream_ordered = false;  // ws is freed here after the combine (else a graph owns it)
    // the most shared memory any call of this instantiation needs (16 heads), set once; with 8
    // warps (few units) every launch asks for more than half an SM's shared memory, so that the
    // CTAs of a cluster land on as many SMs (two CTAs of a cluster of 16 on one SM left half the
    // H200's SMs without one at batch 1)
    constexpr size_t kMost = mc_smem_bytes<kDP, kNW, kTM>(kMcMaxGroup, kDP);
    constexpr size_t kSpread = std::max(kMost, size_t(116 * 1024));
    const size_t smem = kNW == 8 ? kSpread : mc_smem_bytes<kDP, kNW, kTM>(G, a.head_dim);
    const int max_c = cluster16_or_8<kern>(dev, kThreads, kNW == 8 ? kSpread : kMost, "paged_attention");
    // S CTAs per unit, each with its own keys, their states merged through a workspace private to
    // this call (split_workspace; without memory for it, the launch as chosen before); lc: the
    // unit's last split CTA merges (a zeroed counter per unit after the states), else
    // attention_combine_kernel
    const int64_t units = a.num_tokens * a.num_kv_heads, capacity = a.max_blocks_per_seq * a.block_size;
    auto take_split = [&](int64_t S, bool lc) {
      if (!split_on || !pools || S <= 1) return;
      const size_t states = size_t(units * S * split_state_stride(G, a.head_dim)) * sizeof(float);
      const size_t ws_bytes = lc ? states + size_t(units) * sizeof(unsigned) : states;
      if (float* w = split_workspace(dev, s, ws_bytes, states, &stream_ordered)) {
        ws = w;
        p.split_keys = split_keys;
        p.splits = int(S);
        p.ws = ws;
        if (lc) p.ws_count = reinterpret_cast<unsigned*>(reinterpret_cast<char*>(w) + states);
        splits = S;
        C = 1;
        resident = 0;
      }
    };
    C = choose_cluster(a, max_c, dp.sm_count, 256);  // a CTA on every SM, at least 256 keys each
    if (kNW == 8) {
      // clusters of 16, 12 and 8 CTAs of one SM each that can be resident at once (a cluster's
      // CTAs share a GPC): the largest size of which every unit gets a cluster at once
      const auto& fit = once_per_device<std::array<int, 3>>(dev, [&](int) {
        return std::array<int, 3>{co_resident_clusters(reinterpret_cast<const void*>(kern), 16, kThreads, kSpread),
                                  co_resident_clusters(reinterpret_cast<const void*>(kern), 12, kThreads, kSpread),
                                  co_resident_clusters(reinterpret_cast<const void*>(kern), 8, kThreads, kSpread)};
      });
      const int sizes[3] = {16, 12, 8};
      for (int k = 0; k < 3; ++k)
        if (sizes[k] <= max_c && units <= fit[size_t(k)] && capacity >= int64_t(sizes[k]) * 256) {
          C = sizes[k];
          resident = fit[size_t(k)];
          break;
        }
      // Split beyond a cluster: a cluster holds at most 16 CTAs (7 such clusters fit on the
      // H200 at one CTA per SM), so with 8 units only 64 SMs read keys. Each unit's keys then
      // go to S CTAs of one SM each (S units <= SMs: one wave), at least split_keys each, when
      // that is more than C; their states meet in a workspace private to this call
      // (split_workspace) and the unit's last split CTA (or attention_combine_kernel) writes the output.
      // Only where the cluster would leave each CTA at least kSplitMinBytes of K and V (by the
      // capacity, as C): the rule, attention_splits, is in launch_rules.hpp (unit-tested on the CPU)
      take_split(attention_splits(units, capacity, dp.sm_count, C, a.head_dim, int64_t(sizeof(T)), split_keys,
                                  kSplitMinBytes),
                 last_combine);
    }
    grid = a.num_tokens * a.num_kv_heads * C * splits;
    // The early reads (their own instantiations, PW) with 8 warps only (few units: batch 1's
    // clusters and splits) and a grid of at most one CTA per SM: a larger grid lets its successor
    // launch only as its CTAs exit (pdl_begin), and at 12f25a9 batch 32 at 1024 keys took 37.50
    // us with them against 36.55 without. The default instantiations carry no trace of them (in
    // the kernel as a runtime flag, at 12f25a9, the batch-1 anchors without the promise ran
    // 0.1-0.2 us slower: 5.77-5.88 against 5.63 us at 9/3 heads, 1024 keys).
    // (and only under programmatic dependent launch, so that prewait=1 in the launch record means
    // that reads did go out early)
    if (kNW != 8 || kTM || grid > dp.sm_count || !dp.pdl || pdl_off_for("paged_attention")) p.prewait_fresh = 0;
    try {
      bool launched = false;
      if constexpr (kNW == 8) {
        // the instantiations of 8 warps only: LC, the split's last CTA merging (where p.ws_count
        // is set; the split is taken with 8 warps only), and PW, the early reads (not with TMA)
        auto launch_as = [&](auto lc, auto pw) {
          constexpr auto k = paged_attention_mma_kernel<T, kDP, kNW, decltype(packed)::value, decltype(lc)::value, kTM,
                                                        decltype(pw)::value>;
          cluster16_or_8<k>(dev, kThreads, kSpread, "paged_attention");  // (its attributes, as kern's)
          launch_kernel("paged_attention", k, dim3(unsigned(grid)), dim3(kThreads), smem, s, C, dp.pdl, p, maps);
          launched = true;
        };
        if constexpr (!kTM)
          if (p.prewait_fresh > 0) {
            if (p.ws_count) launch_as(std::true_type{}, std::true_type{});
            else launch_as(std::false_type{}, std::true_type{});
          }
        if (!launched && p.ws_count) launch_as(std::true_type{}, std::false_type{});
      }
      if (!launched)
        launch_kernel("paged_attention", kern, dim3(unsigned(grid)), dim3(kThreads), smem, s, C, dp.pdl, p, maps);
      if (splits > 1 && !p.ws_count)
        launch_kernel("paged_attention", attention_combine_kernel<T>, dim3(unsigned(a.num_tokens * a.num_kv_heads)),
                      dim3(256), size_t(2 * splits * G) * sizeof(float), s, 1, dp.pdl, p);
    } catch (...) {
      if (stream_ordered) (void)cudaFreeAsync(ws, s);  // the launch error is the one reported
      throw;
    }
    if (stream_ordered) check_cuda(cudaFreeAsync(ws, s), "paged_attention", "cudaFreeAsync (split workspace)");
  };
  // 8 warps per CTA where even clusters of 16 leave SMs without a CTA (few units, e.g. batch
  // 1): twice the keys in flight per SM; else 4 (two CTAs per SM at head_dim 128)
  // (KS_ATTN_MMA_WARPS=4 or 8 forces one, for comparisons)
  static const long long force_warps = env_number("KS_ATTN_MMA_WARPS", 0);
  NW = a.num_tokens * a.num_kv_heads * 16 < int64_t(dp.sm_count) * 2 ? 8 : 4;
  if (force_warps == 4 || force_warps == 8) NW = int(force_warps);
  // P's three pieces in one MMA where at most 4 query heads share a kv head
  const bool packed = G <= 4;
  auto by_tma = [&](auto tag, auto dpad, auto warps, auto pk) {
    if constexpr (decltype(dpad)::value != 32)
      if (tma) return go(tag, dpad, warps, pk, std::true_type{});
    go(tag, dpad, warps, pk, std::false_type{});
  };
  auto by_pack = [&](auto tag, auto dpad, auto warps) {
    if (packed) by_tma(tag, dpad, warps, std::true_type{});
    else by_tma(tag, dpad, warps, std::false_type{});
  };
  auto by_warps = [&](auto tag, auto dpad) {
    if (NW == 8) by_pack(tag, dpad, std::integral_constant<int, 8>{});
    else by_pack(tag, dpad, std::integral_constant<int, 4>{});
  };
  auto by_dim = [&](auto tag) {
    switch (DP) {
      case 32: by_warps(tag, std::integral_constant<int, 32>{}); break;
      case 64: by_warps(tag, std::integral_constant<int, 64>{}); break;
      default: by_warps(tag, std::integral_constant<int, 128>{}); break;
    }
  };
  if (a.q.dtype == detail::DType::BF16) by_dim(__nv_bfloat16{});
  else by_dim(__half{});
  check_launch("paged_attention");
  record_launch("paged_attention",
                tma ? "variant=cuda_mma_tma cluster=%lld splits=%lld group=%lld head_dim_padded=%lld warps=%lld "
                      "packed=%lld grid=%lld resident_clusters=%lld last_combine=%lld prewait=%lld"
                    : "variant=cuda_mma_cluster cluster=%lld splits=%lld group=%lld head_dim_padded=%lld warps=%lld "
                      "packed=%lld grid=%lld resident_clusters=%lld last_combine=%lld prewait=%lld",
                {C, splits, G, DP, NW, packed ? 1 : 0, grid, resident, p.ws_count ? 1 : 0, p.prewait_fresh > 0 ? 1 : 0});
}
}  // namespace

void paged_attention_mma_cuda(const void* args, ks_stream_t stream) { run_mma(args, stream, false); }
void paged_attention_mma_tma_cuda(const void* args, ks_stream_t stream) { run_mma(args, stream, true); }

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
  extern __shared__ float var_sh[];  // q, acc, outer (D floats each: attn_cascade_add's levels)
  __shared__ float w[kVarTile];
  __shared__ float red[kVarThreads / 32];
  pdl_begin();
  const int64_t D = p.head_dim;
  float* qv = var_sh;
  float* acc = var_sh + D;
  float* outer = var_sh + 2 * D;
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
      acc[d] = outer[d] = 0.f;
    }
    float run_max = -INFINITY, run_sum = 0.f, outer_sum = 0.f;
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
      const float nm = attn_next_base(run_max, m);  // (the lazy base: weights up to e^8)
      const float corr = attn_base_corr(run_max, nm);
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
      const bool fold = attn_fold_after(j0, kVarTile);
      attn_cascade_add(run_sum, outer_sum, corr, tile, fold);
      run_max = nm;
      for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
        float a = 0.f;  // the tile's terms
        for (int j = 0; j < nt; ++j)
          a += w[j] * Dt<T>::to_f(static_cast<const T*>(p.v)[((k0 + j0 + j) * p.num_kv_heads + kvh) * D + d]);
        attn_cascade_add(acc[d], outer[d], corr, a, fold);
      }
    }
    __syncthreads();
    // no visible key: a zero row; keys whose scores are all -inf: NaN (exp(-inf - -inf)), as the CPU
    const float total = outer_sum + run_sum;
    const float inv = total == 0.f ? (vis > 0 ? __int_as_float(0x7fffffff) : 0.f) : 1.f / total;
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x)
      out[d] = Dt<T>::from_f(vis > 0 ? (outer[d] + acc[d]) * inv : 0.f);
  }
}

}  // namespace

std::string varlen_attention_can_implement(const void* args) {
  const auto& a = *static_cast<const ops::VarlenAttentionArgs*>(args);
  if (a.head_dim > 4096) return "head_dim > 4096 (q and the accumulator's two levels are kept in 3 x head_dim floats of shared memory)";
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
  const size_t smem = size_t(3 * a.head_dim) * sizeof(float);  // q, acc, outer
  const auto s = static_cast<cudaStream_t>(stream);
  with_float_type(a.q.dtype, [&](auto tag) {
    // 48 KB at head_dim 4096, past the default limit with the static arrays: the opt-in limit
    // (once per device; a device with less refuses the call)
    require_opt_in_smem<varlen_attention_kernel<decltype(tag)>>(a.q.device.device_id, "varlen_attention", smem,
                                                                "head_dim " + std::to_string(a.head_dim));
    launch_kernel("varlen_attention", varlen_attention_kernel<decltype(tag)>, dim3(grid), dim3(kVarThreads), smem, s, 1,
                  dp.pdl, p);
  });
  check_launch("varlen_attention");
  record_launch("varlen_attention", "cta_per_row_head threads=%lld key_tile=%lld grid=%lld", {kVarThreads, kVarTile, grid});
}

}  // namespace ks::cuda

#if defined(KS_ATTN_TIMELINE)
// The timeline build's read-out (see ks_attn_tl): copies up to n of its 512 x 16 x 16 entries
// (ns; 0 = not recorded) into host, then clears them. Returns the entries copied, -1 on a CUDA
// error. Not part of the ABI: only a -DKS_ATTN_TIMELINE=ON build has it.
extern "C" __attribute__((visibility("default"))) long long ks_debug_attention_timeline(unsigned long long* host, size_t n) {
  constexpr size_t kAll = size_t(ks::cuda::kTlBlocks) * ks::cuda::kTlWarps * ks::cuda::kTlEvents;
  const size_t m = n < kAll ? n : kAll;
  void* dev = nullptr;
  if (cudaGetSymbolAddress(&dev, ks::cuda::ks_attn_tl) != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess ||
      cudaMemcpy(host, dev, m * sizeof(unsigned long long), cudaMemcpyDeviceToHost) != cudaSuccess ||
      cudaMemset(dev, 0, kAll * sizeof(unsigned long long)) != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess)
    return -1;
  return (long long)m;
}
#endif
