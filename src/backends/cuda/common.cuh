// Shared primitives for the CUDA backend: dtype traits, 16-byte vector IO,
// warp / block reductions, launch checking and configuration records.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>  // CUtensorMap, PFN_cuTensorMapEncodeTiled (no libcuda link: the encoder comes
                            // from cudaGetDriverEntryPointByVersion)

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <map>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>

#include "backends/cuda/launch_rules.hpp"
#include "core/common.hpp"

namespace ks::cuda {

// ---- dtype traits --------------------------------------------------------
template <typename T>
struct Dt;
template <>
struct Dt<float> {
  static __device__ __forceinline__ float to_f(float v) { return v; }
  static __device__ __forceinline__ float from_f(float v) { return v; }
};
template <>
struct Dt<__half> {
  static __device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
  static __device__ __forceinline__ __half from_f(float v) { return __float2half_rn(v); }
};
template <>
struct Dt<__nv_bfloat16> {
  static __device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
  static __device__ __forceinline__ __nv_bfloat16 from_f(float v) { return __float2bfloat16_rn(v); }
};

// The float value of fp16 bits (GGUF block scales are fp16 in little-endian bytes).
__device__ __forceinline__ float h2f_bits(uint16_t b) { return __half2float(__ushort_as_half(b)); }

// VEC elements of T moved as one access (16 bytes when VEC = 16 / sizeof(T)); read
// only (results go through OutVec). 16-bit elements are kept packed in pairs, one
// 32-bit word per pair, and unpacked where they are used: held as an array of
// 16-bit class objects, each element took a register of its own (measured with
// ptxas -v: bf16 fused_add_rms_norm 109 registers per thread), halving the rows in
// flight per SM.
template <typename T, int VEC, bool PACKED = (sizeof(T) == 2 && VEC % 2 == 0)>
struct alignas(sizeof(T) * VEC) Vec {
  T v[VEC];
  __device__ __forceinline__ float f(int i) const { return Dt<T>::to_f(v[i]); }
};
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Vec<T, VEC, true> {
  unsigned w[VEC / 2];
  __device__ __forceinline__ float f(int i) const {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {  // bf16 -> fp32 is a 16-bit shift
      return __uint_as_float((i & 1) ? (w[i >> 1] & 0xffff0000u) : (w[i >> 1] << 16));
    } else {
      __half2 h;
      memcpy(&h, &w[i >> 1], 4);
      return (i & 1) ? __high2float(h) : __low2float(h);
    }
  }
};

// Loads and stores go through plain integer vector types, so every access is one
// 16-byte (8-, 4-byte) instruction: a struct of 16-bit class types copied member-wise
// was emitted as eight 2-byte stores, fetching four times the sectors it needed.
template <int BYTES>
struct RawVec;
template <>
struct RawVec<16> {
  using type = uint4;
};
template <>
struct RawVec<8> {
  using type = uint2;
};
template <>
struct RawVec<4> {
  using type = unsigned;
};
template <>
struct RawVec<2> {
  using type = unsigned short;
};

template <typename T, int VEC, bool PACKED = (sizeof(T) == 2 && VEC % 2 == 0)>
__device__ __forceinline__ Vec<T, VEC, PACKED> load_vec(const T* p) {
  using R = typename RawVec<int(sizeof(Vec<T, VEC, PACKED>))>::type;
  const R r = *reinterpret_cast<const R*>(p);
  Vec<T, VEC, PACKED> v;
  memcpy(&v, &r, sizeof(v));
  return v;
}
template <typename T, int VEC>
__device__ __forceinline__ void store_vec(T* p, const Vec<T, VEC>& v) {
  using R = typename RawVec<int(sizeof(Vec<T, VEC>))>::type;
  R r;
  memcpy(&r, &v, sizeof(r));
  *reinterpret_cast<R*>(p) = r;
}

// An output vector built element by element in FP32 and stored with one rounding
// per element: 16-bit pairs are converted together (cvt.rn.{bf16x2,f16x2}.f32,
// the same round-to-nearest-even as one at a time) into 32-bit words, so the store
// is a single 16-byte instruction. (Setting the 16-bit elements of a Vec one by one
// made the compiler emit 2-byte stores: four times the memory sectors.)
template <typename T, int VEC>
struct OutVec {
  float f[VEC];
  __device__ __forceinline__ void set(int i, float x) { f[i] = x; }
};
template <typename T>
__device__ __forceinline__ unsigned pack2(float a, float b) {
  unsigned u;
  if constexpr (std::is_same_v<T, __half>) {
    const __half2 h = __floats2half2_rn(a, b);
    memcpy(&u, &h, 4);
  } else {
    const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    memcpy(&u, &h, 4);
  }
  return u;
}
// One 16-byte global store (st.global.v4.b32). Written as PTX because NVVM split
// plain uint4 / float4 stores into four 4-byte stores whenever the address came
// from 64-bit index arithmetic, and ptxas cannot re-merge them without knowing the
// alignment. p is a 16-byte aligned global address (the launchers check).
__device__ __forceinline__ void st_global_16(void* p, unsigned a, unsigned b, unsigned c, unsigned d) {
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
}
template <typename T, int VEC>
__device__ __forceinline__ void store_vec(T* p, const OutVec<T, VEC>& o) {
  if constexpr (std::is_same_v<T, float> && VEC == 4) {
    st_global_16(p, __float_as_uint(o.f[0]), __float_as_uint(o.f[1]), __float_as_uint(o.f[2]), __float_as_uint(o.f[3]));
  } else if constexpr (sizeof(T) == 2 && VEC == 8) {
    st_global_16(p, pack2<T>(o.f[0], o.f[1]), pack2<T>(o.f[2], o.f[3]), pack2<T>(o.f[4], o.f[5]),
                 pack2<T>(o.f[6], o.f[7]));
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) p[j] = Dt<T>::from_f(o.f[j]);
  }
}

// Hides a cached vector's value from the optimizer (an empty asm that "may change"
// each 32-bit word). Applied to the raw row between two passes, it stops the compiler
// from keeping the first pass's FP32 conversions alive across the reduction
// (common-subexpression elimination): the second pass converts the raw words again,
// which costs a few ALU instructions but holds the row in half the registers, so
// more rows are in flight per SM (bf16 rms_norm: 74 -> fewer registers per thread).
template <typename T, int VEC>
__device__ __forceinline__ void opaque(Vec<T, VEC>& v) {
  static_assert(sizeof(Vec<T, VEC>) % 4 == 0 || sizeof(Vec<T, VEC>) < 4, "word-sized vectors");
  if constexpr (sizeof(Vec<T, VEC>) >= 4) {
    unsigned w[sizeof(Vec<T, VEC>) / 4];
    memcpy(w, &v, sizeof(w));
#pragma unroll
    for (unsigned& u : w) asm volatile("" : "+r"(u));
    memcpy(&v, w, sizeof(w));
  } else {
    unsigned short h;
    memcpy(&h, &v, 2);
    asm volatile("" : "+h"(h));
    memcpy(&v, &h, 2);
  }
}

// ---- reductions ----------------------------------------------------------
// The online softmax's sums in the per-thread-column fallback kernels (cuda_cta_per_head,
// varlen_attention), in three levels so that long contexts stay within the contract's summation
// bound (docs/contracts.md): a tile's terms summed in order (the caller: `tile`), at most
// kAttnFoldTiles tiles in the running sum `run`, then `run` folded into `outer` (a running sum
// of n / (tile * kAttnFoldTiles) folds: 2^30 keys in tiles of 64 stay under 8 sqrt(n) ulps, where
// one running sum over the keys was ~n / 2 worst case). Both are rescaled by the tile's factor
// corr = e^(old max - new max). The value is outer + run.
constexpr int kAttnFoldTiles = 64;
__device__ __forceinline__ void attn_cascade_add(float& run, float& outer, float corr, float tile, bool fold) {
  run = run * corr + tile;
  outer *= corr;
  if (fold) {
    outer += run;
    run = 0.f;
  }
}
// Whether the tile of `tile` keys that starts at key first_key (a multiple of tile) is the last of
// its kAttnFoldTiles: attn_cascade_add folds after it.
__device__ __forceinline__ bool attn_fold_after(int64_t first_key, int tile) {
  return (first_key / tile + 1) % kAttnFoldTiles == 0;
}
// The fallback kernels' lazy softmax base (as cuda_mma_cluster's): the exponentials' base moves
// to the running maximum only where a tile's maximum passes it by more than kAttnBaseMargin, so
// every weight e^(s - base) is at most e^8, and a context whose scores keep rising is rescaled
// once per 8 of rise instead of once per tile (each rescale rounds corr = e^(old - new) and both
// sums' products once more: at 2M keys whose scores rose 2^-12 a tile, 64% of the contract's
// bound in an emulation of the per-tile form); where the base stays, corr is 1 and exact. A NaN
// tile maximum leaves the base (fmaxf ignores it; the NaN scores' weights are NaN).
constexpr float kAttnBaseMargin = 8.f;
__device__ __forceinline__ float attn_next_base(float base, float tile_max) {
  return base == -INFINITY || tile_max > base + kAttnBaseMargin ? fmaxf(base, tile_max) : base;
}
// the factor that takes sums at base `base` to base `next` (1 where it stays, and while every
// score so far is -inf or NaN)
__device__ __forceinline__ float attn_base_corr(float base, float next) {
  return next == base ? 1.f : expf(base - next);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// max that propagates NaN (max.NaN.f32 on sm_80+): the softmax row maximum doubles as its NaN flag.
__device__ __forceinline__ float fmax_nan(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return (a != a || b != b) ? __int_as_float(0x7fffffff) : fmaxf(a, b);
#endif
}
__device__ __forceinline__ float warp_max_nan(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmax_nan(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Largest element of a vector as float, NaN if any element is NaN. 16-bit pairs
// are compared packed (exact: the maximum of 16-bit values is one of them).
template <typename T, int VEC>
__device__ __forceinline__ float vec_max_nan(const Vec<T, VEC>& v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (sizeof(T) == 2 && VEC % 2 == 0) {
    using T2 = std::conditional_t<std::is_same_v<T, __half>, __half2, __nv_bfloat162>;
    T2 h[VEC / 2];
    memcpy(h, &v, sizeof(h));
    T2 m = h[0];
#pragma unroll
    for (int k = 1; k < VEC / 2; ++k) m = __hmax2_nan(m, h[k]);
    return fmax_nan(Dt<T>::to_f(m.x), Dt<T>::to_f(m.y));
  } else
#endif
  {
    float m = v.f(0);
#pragma unroll
    for (int j = 1; j < VEC; ++j) m = fmax_nan(m, v.f(j));
    return m;
  }
}

// ---- programmatic dependent launch (sm_90) ---------------------------------
// The two halves of pdl_begin, also for kernels that place them apart: pdl_wait() waits for the
// grids this one depends on (no trigger); pdl_trigger() lets the next kernel launch, whatever the
// grid's size (cuda_a8_resident: at entry, where its CTAs take at most half of an SM, so the next call's
// CTAs copy their weights while this one's finish).
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Every kernel starts with pdl_begin(): it waits until the grids it depends on
// in the stream have completed and their writes are visible (a no-op when the
// launch had no programmatic dependency). A kernel launched with the PDL
// attribute reads nothing early - except quant_matmul's packed weights, which its
// kernels stage before calling this (the contract makes weights read-only inputs
// that the preceding kernel must not write), decode attention's L2 warming when
// KS_ATTN_PREFETCH_KEYS turns it on (warm_keys_l2: hints only, through L2), and its older keys
// under paged_attention_after_append's promise (AttnParams::prewait_fresh) - so what it gains
// otherwise is its launch (CTA setup, argument fetch) overlapping the previous kernel's tail. Stream order is
// kept for any predecessor, kernscope's or not. Grids of at most one CTA per SM
// (decode sizes) then let the next kernel be scheduled at once; larger grids
// trigger it implicitly as their CTAs exit, so the next kernel's CTAs do not take
// SM slots early and land unevenly (measured: early triggers slowed mid-size
// gemv and silu_and_mul by up to 20% on the H200). early_trigger = false keeps a grid of
// any size from triggering (the next kernel starts as this one's CTAs exit): the q/k/v +
// RoPE epilogue kernel under KS_QMM_ROPE_EARLY_TRIGGER=0 (RopeEpi::early_trigger).
// (Triggering whatever the grid's size, for the decode step's gate|up grid of 384 CTAs, measured
// slower and was removed: 1912 against 1933 tokens/s at batch 1, 692b01a, docs/cuda.md.)
__device__ __forceinline__ void pdl_begin(bool early_trigger = true) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  pdl_wait();
  unsigned nsm;
  asm("mov.u32 %0, %%nsmid;" : "=r"(nsm));
  if (early_trigger && gridDim.x * gridDim.y * gridDim.z <= nsm) pdl_trigger();
#endif
}

// A hint that the 128-byte line holding `addr` will be read soon: L2 fetches it from DRAM (a
// no-op for the program's values; the address must lie in an allocation).
__device__ __forceinline__ void prefetch_l2(const void* addr) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(addr));
}

// ---- thread-block cluster barrier halves (sm_90) ---------------------------------
// Every thread of every CTA of the cluster arrives, then waits; arrive and wait alternate.
// release / acquire order the shared-memory accesses (local and distributed) around them;
// the relaxed arrive orders nothing (e.g. only "every CTA of the cluster has started").
__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }

// A 4-byte load from the shared memory of CTA `rank` of the cluster, at the offset that `local`
// (this CTA's shared memory) has in this CTA: mapa to a shared::cluster address, then
// ld.shared::cluster (sm_90; the caller orders it after the writer's release by a cluster
// barrier). A generic load through cluster.map_shared_rank's pointer reads the same word.
__device__ __forceinline__ unsigned ld_cluster_b32(const void* local, unsigned rank) {
  unsigned a, v;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(a) : "r"(unsigned(__cvta_generic_to_shared(local))), "r"(rank));
  asm volatile("ld.shared::cluster.b32 %0, [%1];" : "=r"(v) : "r"(a) : "memory");
  return v;
}

// ---- asynchronous copies to shared memory (cp.async, sm_80+) ------------------
// Copies the first n (0..16) bytes at gmem to smem as one 16-byte copy, zero-filling the
// rest; nothing past gmem + n is read. Both addresses 16-byte aligned. Without sm_80 code
// the copy is done at once by the thread (commit and wait are then no-ops).
__device__ __forceinline__ void cp_async_bytes(void* smem, const void* gmem, int n) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned dst = unsigned(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(n) : "memory");
#else
  unsigned char* d = static_cast<unsigned char*>(smem);
  const unsigned char* g = static_cast<const unsigned char*>(gmem);
  for (int i = 0; i < 16; ++i) d[i] = i < n ? g[i] : 0;
#endif
}
// 16 bytes when fill, else 16 zero bytes (nothing read).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool fill) {
  cp_async_bytes(smem, gmem, fill ? 16 : 0);
}
__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}
// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

// Weight staging (SW): a CTA's weight rows are one contiguous range of bytes. The CTA copies
// them to shared memory with 16-byte cp.async copies issued *before* it waits on the kernel
// it depends on (pdl_begin): no kernel of a step writes weights, so they may be read early,
// and the DRAM latency of the weights then overlaps the previous kernel. The range's unaligned
// head (< 16 bytes) is read by plain loads and its tail by a zero-filling partial copy, so no
// byte outside the rows is read. The rows keep their address modulo 16 in shared memory, so
// the word loads of decode_q_block and a8_block stay aligned. Thread t of the `nt` copying threads (the CTA,
// or a warp's lanes) takes the pieces t, t + nt, ...; each commits one cp.async group. Returns
// where row n0 starts in `dst`.
__device__ __forceinline__ const uint8_t* stage_weight_rows(unsigned char* dst, const uint8_t* w, int64_t row_bytes,
                                                           int64_t n0, int64_t rows, unsigned t, unsigned nt) {
  const uintptr_t beg = reinterpret_cast<uintptr_t>(w + n0 * row_bytes), end = beg + uintptr_t(rows * row_bytes);
  const uintptr_t a0 = beg & ~uintptr_t(15), a1 = (beg + 15) & ~uintptr_t(15);
  unsigned char* row0 = dst + (beg - a0);
  if (t < a1 - beg && beg + t < end) row0[t] = w[n0 * row_bytes + t];
  for (uintptr_t a = a1 + 16 * uintptr_t(t); a < end; a += 16 * uintptr_t(nt)) {
    const uintptr_t left = end - a;
    cp_async_bytes(dst + (a - a0), reinterpret_cast<const void*>(a), left < 16 ? int(left) : 16);
  }
  cp_async_commit();
  return row0;
}
// Bytes of shared memory a CTA of `rows` weight rows needs to stage them: the rows, up to 15
// bytes of head misalignment, and the tail's last 16-byte piece (its zero fill) - within the
// 16 added bytes because every block format's row bytes (18, 20, 34 per block) are even and a
// CTA stages 8 x cols_per_warp rows, a multiple of 16 bytes.
__host__ __device__ constexpr int64_t staged_weight_bytes(int64_t rows, int64_t row_bytes) {
  return rows * row_bytes + 16;
}

// ---- bulk copies (TMA, cp.async.bulk) completing on an mbarrier (sm_90) ---------------
// A shared-memory barrier whose phase completes when `count` arrivals and, where an arrival
// declared bytes (expect_tx), every byte of the bulk copies counted against it have landed.
// Waiters spin on the phase's parity. The bodies exist for sm_90 only: the kernels that use
// them are declined on other devices (their can_implement asks for sm_90 code).
__device__ __forceinline__ void mbar_init(uint64_t* bar, unsigned count) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(unsigned(__cvta_generic_to_shared(bar))), "r"(count)
               : "memory");
#endif
}
// Makes initialized barriers visible to the async proxy (the bulk copies' completions).
__device__ __forceinline__ void mbar_init_fence() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}
// One arrival that also declares `bytes` more to come by bulk copies (release semantics).
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, unsigned bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("{\n .reg .b64 st;\n mbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}"
               ::"r"(unsigned(__cvta_generic_to_shared(bar))), "r"(bytes) : "memory");
#endif
}
// One plain arrival (release semantics: this thread's earlier accesses happen before the phase).
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("{\n .reg .b64 st;\n mbarrier.arrive.shared::cta.b64 st, [%0];\n}"
               ::"r"(unsigned(__cvta_generic_to_shared(bar))) : "memory");
#endif
}
// Spins until the barrier's phase of this parity has completed (acquire semantics).
__device__ __forceinline__ void mbar_wait(uint64_t* bar, unsigned parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "{\n .reg .pred done;\n wait_%=:\n mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      " @!done bra wait_%=;\n}" ::"r"(unsigned(__cvta_generic_to_shared(bar))), "r"(parity) : "memory");
#endif
}
// bytes (a multiple of 16; both addresses 16-byte aligned) from global to this CTA's shared
// memory by the TMA unit, counted against bar's expected bytes.
__device__ __forceinline__ void bulk_copy_g2s(void* smem, const void* gmem, unsigned bytes, uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(unsigned(__cvta_generic_to_shared(smem))), "l"(gmem), "r"(bytes),
               "r"(unsigned(__cvta_generic_to_shared(bar))) : "memory");
#endif
}
// The box of a 4-D tensor map at coordinates {c0, c1, c2, c3} (innermost first) to this CTA's
// shared memory by the TMA unit (with the map's swizzle; zeros for elements past the map),
// counted against bar's expected bytes.
__device__ __forceinline__ void tma_load_4d(void* smem, const CUtensorMap* map, int c0, int c1, int c2, int c3, uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];"
      ::"r"(unsigned(__cvta_generic_to_shared(smem))), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2),
      "r"(c3), "r"(unsigned(__cvta_generic_to_shared(bar))) : "memory");
#endif
}
// Ends a barrier's life (every phase it was armed for completed) before its bytes are used as
// plain shared memory.
__device__ __forceinline__ void mbar_inval(uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.inval.shared::cta.b64 [%0];" ::"r"(unsigned(__cvta_generic_to_shared(bar))) : "memory");
#endif
}
// Orders this thread's earlier generic shared-memory writes before its later bulk copies.
__device__ __forceinline__ void fence_proxy_async_smem() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}
// The producer of a ring of whole weight rows (cuda_bulk_stream, cuda_a8_bulk_stream), run by one
// thread: stage i (rows [r0 + i rps, min(r1, r0 + (i + 1) rps)) of the [N, RB]-byte matrix w)
// goes to slot i mod S (slot_bytes apart from ring) by one bulk copy of its byte range widened to
// 16-byte boundaries (so a row keeps its address modulo 16 in the slot), completing on full[slot];
// the matrix's bytes past its last 16-byte boundary come by plain stores. A slot is refilled once
// its empty barrier's phase (every consumer thread's arrival) has completed. early: the copies
// start before the previous kernel has finished (weights are read-only inputs); else after
// griddepcontrol.wait.
__device__ __forceinline__ void bulk_rows_produce(const uint8_t* w, int64_t N, int64_t RB, int64_t r0, int64_t r1,
                                                  int rps, int S, int nst, unsigned char* ring, int slot_bytes,
                                                  uint64_t* full, uint64_t* empty, bool early, int chunk) {
  if (!early) pdl_begin();
  const int64_t end16 = (N * RB) & ~int64_t(15);  // bulk copies stop at the last 16-byte boundary
  for (int i = 0; i < nst; ++i) {
    const int s = i % S;
    if (i >= S) mbar_wait(&empty[s], unsigned(i / S - 1) & 1u);  // stage i - S has been consumed
    const int64_t a = r0 + int64_t(i) * rps, e = min(r1, a + rps);
    const int64_t g0 = (a * RB) & ~int64_t(15), g1 = min((e * RB + 15) & ~int64_t(15), end16);
    unsigned char* dst = ring + int64_t(s) * slot_bytes;
    for (int64_t b = max(g0, g1); b < e * RB; ++b) dst[b - g0] = w[b];  // the matrix's tail
    fence_proxy_async_smem();
    mbar_arrive_expect_tx(&full[s], unsigned(max(g1 - g0, int64_t(0))));
    // one bulk copy, or copies of `chunk` bytes (a multiple of 16) where chunk > 0
    for (int64_t c = g0; c < g1; c += chunk > 0 ? chunk : g1 - g0)
      bulk_copy_g2s(dst + (c - g0), w + c, unsigned(min(g1 - c, chunk > 0 ? int64_t(chunk) : g1 - g0)), &full[s]);
  }
}
// The start both bulk-ring kernels share: the CTA's contiguous rows [r0, r1) of the N (the grid
// splits them evenly), its nst stages of rps rows, the S slot pairs of barriers (full: the
// producer's arrival plus its copies' bytes; empty: every one of the 32 * consumer_warps consumer
// threads), then warp consumer_warps (lane 0) produces the stages. Returns false in that warp,
// whose work is done (it must return: the consumers wait on no CTA barrier after this).
__device__ __forceinline__ bool bulk_ring_begin(const uint8_t* w, int64_t N, int64_t RB, int rps, int S, int slot_bytes,
                                                unsigned char* ring, uint64_t* full, uint64_t* empty, bool early,
                                                int chunk, int consumer_warps, int64_t& r0, int64_t& r1, int& nst) {
  r0 = int64_t(blockIdx.x) * N / gridDim.x;
  r1 = (int64_t(blockIdx.x) + 1) * N / gridDim.x;
  nst = int((r1 - r0 + rps - 1) / rps);
  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], unsigned(32 * consumer_warps));
    }
    mbar_init_fence();
  }
  __syncthreads();
  if (int(threadIdx.x >> 5) != consumer_warps) return true;
  if ((threadIdx.x & 31) == 0) bulk_rows_produce(w, N, RB, r0, r1, rps, S, nst, ring, slot_bytes, full, empty, early, chunk);
  return false;
}
// The bulk rings deal a stage's units of work (row pairs, or groups of rows) to the consumer warps
// in turn across stages, not from warp 0 again in every stage: after `before` units of earlier
// stages, the stage's first unit goes to warp before mod kBulkWarps, so warp w's first is this.
__device__ __forceinline__ int bulk_rotated(int w, int before) {
  return ((w - before) % kBulkWarps + kBulkWarps) % kBulkWarps;
}

// Barrier `id` (1..15; 0 is __syncthreads'), complete when `threads` threads (a multiple of 32,
// whole warps) have arrived at it: a subset of warps synchronizes without the others.
__device__ __forceinline__ void named_barrier(unsigned id, unsigned threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// ---- tensor maps (host) --------------------------------------------------------
// cuTensorMapEncodeTiled from the driver (nullptr when it lacks it), looked up once
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();  // an answer: the callers decline
      f = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

// ---- tensor cores (mma.sync, sm_80+) -----------------------------------------
// D += A B on the tensor cores, m16n8k16, FP32 accumulation (a: 4 registers of A's pairs, b0 b1:
// B's pairs, d: this lane's 4 accumulators).
// T: __nv_bfloat16 or __half.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  else
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  __trap();  // can_implement declines devices below sm_80
#endif
}
// Four 8x8 matrices of 16-bit elements from shared memory (ldmatrix.x4): lanes 8i..8i+7 give
// the 16-byte row addresses of matrix i, and r[i] receives this lane's pair of matrix i (row
// lane / 4, columns 2 (lane % 4) and + 1; transposed: column lane / 4, rows 2 (lane % 4), + 1).
template <bool Trans>
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem_row) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned a = unsigned(__cvta_generic_to_shared(smem_row));
  if constexpr (Trans)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a) : "memory");
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a) : "memory");
#else
  __trap();
#endif
}

// ---- host side -----------------------------------------------------------
inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Environment switches (for comparisons and experiments): whether the variable holds exactly
// `value` (only the values a switch documents change anything), or its number (strtoll;
// `fallback` when unset).
inline bool env_is(const char* name, const char* value) {
  const char* e = std::getenv(name);
  return e && std::string(e) == value;
}
inline long long env_number(const char* name, long long fallback) {
  const char* e = std::getenv(name);
  return e ? std::strtoll(e, nullptr, 10) : fallback;
}
// The bytes of one bulk copy of a ring's stage: `fallback` (0: one copy per stage), or
// KS_QMM_BULK_CHUNK_KB=n KB for every bulk ring (experiments; 0 again one copy).
inline int bulk_chunk_bytes(int fallback) {
  static const long long kb = env_number("KS_QMM_BULK_CHUNK_KB", -1);
  return kb >= 0 ? int(kb) * 1024 : fallback;
}
// Whether quant_matmul's kernels may read their weights before the dependency wait (weight
// staging, cuda_mma_rows' first blocks, cuda_bulk_stream's producer): KS_QMM_WSTAGE=0 turns
// that off (the same bits; for comparisons, and the contract's way to let the immediately
// preceding kernel write the weights: docs/contracts.md). Read once.
inline bool qmm_stage_weights_enabled() {
  static const bool on = !env_is("KS_QMM_WSTAGE", "0");
  return on;
}
// The most CTAs per SM of a grid whose matmul kernels stage their weights (KS_QMM_WSTAGE_CTAS=n,
// experiments, n in 1..32; default 3, which takes in SmolLM2's gate|up matmul of 3072 rows, 384
// CTAs of 8 rows on 132 SMs: +2.9% batch-1 decode on the H200 at 0736325, docs/perf/model.md; 2
// until then). launch_qmm also keeps it to the CTAs whose shared memory fits an SM at once.
inline int qmm_stage_weights_ctas_per_sm() {
  static const int n = int(std::clamp<long long>(env_number("KS_QMM_WSTAGE_CTAS", 3), 1, 32));
  return n;
}

// silu(g) * u in FP32, as silu_and_mul computes it before rounding to T (16-bit T: the hardware
// exp2 and fast divide, relative error ~1e-7, far below the output's rounding; fp32: expf and
// IEEE division). The one expression of silu_and_mul, its fused matmul forms and cuda_mma_rows'
// SiLU prologue, so they agree bit for bit.
template <typename T>
__device__ __forceinline__ float silu_times(float g, float u) {
  const float sig = sizeof(T) == 2 ? __fdividef(1.0f, 1.0f + __expf(-g)) : 1.0f / (1.0f + expf(-g));
  return __fmul_rn(__fmul_rn(g, sig), u);  // (rounded products: never contracted into a caller's add)
}
// v rounded to T's precision (as a T store would), as a float.
template <typename T>
__device__ __forceinline__ float round_to(float v) {
  return Dt<T>::to_f(Dt<T>::from_f(v));
}

// Calls f with a value of the element type of dt (float, __half, or __nv_bfloat16 for
// bf16): the one place a launcher turns the validated float dtype into a kernel template
// argument (`using T = decltype(tag);` in f).
template <class F>
void with_float_type(detail::DType dt, F&& f) {
  switch (dt) {
    case detail::DType::F32: f(float{}); break;
    case detail::DType::F16: f(__half{}); break;
    default: f(__nv_bfloat16{}); break;
  }
}

// f(T{}, std::integral_constant<ks_qtype_t, Q>{}) for x's float dtype and a GGUF block format
// with a streaming quant_matmul kernel (Q4_0, Q4_1; any other: Q8_0).
template <class F>
void with_float_type_and_qtype(detail::DType dt, ks_qtype_t q, F&& f) {
  with_float_type(dt, [&](auto tag) {
    if (q == KS_QTYPE_Q4_0)
      f(tag, std::integral_constant<ks_qtype_t, KS_QTYPE_Q4_0>{});
    else if (q == KS_QTYPE_Q4_1)
      f(tag, std::integral_constant<ks_qtype_t, KS_QTYPE_Q4_1>{});
    else
      f(tag, std::integral_constant<ks_qtype_t, KS_QTYPE_Q8_0>{});
  });
}

// Throws a KS_ERROR_CUDA failure naming the op when e != cudaSuccess.
inline void check_cuda(cudaError_t e, const char* op, const char* what) {
  if (e != cudaSuccess)
    detail::fail(e == cudaErrorMemoryAllocation ? KS_ERROR_OUT_OF_MEMORY : KS_ERROR_CUDA, op,
                 std::string(what) + ": " + cudaGetErrorName(e) + ": " + cudaGetErrorString(e));
}
// After a launch: reports launch-configuration errors without synchronizing.
inline void check_launch(const char* op) { check_cuda(cudaGetLastError(), op, "kernel launch"); }

// Makes the tensors' device current for the call and restores the caller's.
class DeviceGuard {
 public:
  DeviceGuard(int device, const char* op) {
    check_cuda(cudaGetDevice(&prev_), op, "cudaGetDevice");
    if (prev_ != device) check_cuda(cudaSetDevice(device), op, "cudaSetDevice");
    cur_ = device;
  }
  ~DeviceGuard() {
    if (prev_ != cur_) cudaSetDevice(prev_);
  }

 private:
  int prev_ = 0, cur_ = 0;
};

struct DeviceProps {
  int sm_count = 0, major = 0, minor = 0;
  int smem_per_sm = 0;  // shared memory per SM in bytes (cudaDevAttrMaxSharedMemoryPerMultiprocessor)
  // The kernels run sm_90 code on this device (not a JIT of the compute_80 PTX, where every
  // `__CUDA_ARCH__ >= 900` section - clusters, griddepcontrol - is compiled out).
  bool sm90_code = false;
  bool pdl = false;  // launch with programmatic dependent launch (sm90_code, unless KS_PDL=0)
};
const DeviceProps& device_props(int device);

// Whether KS_PDL_OFF (a comma list of op names, read once; experiments) names op: its kernels then
// launch without the PDL attribute, so they start only when the previous kernel has finished (e.g.
// KS_PDL_OFF=paged_attention: decode attention's clusters not placed early beside the RoPE kernel).
bool pdl_off_for(const char* op);

// Launches kern<<<grid, block, smem, s>>>(args...) through cudaLaunchKernelEx, as a
// thread-block cluster of `cluster` CTAs when cluster > 1, with the PDL attribute
// when pdl is set (and KS_PDL_OFF does not name op); a launch error throws KS_ERROR_CUDA naming op.
template <typename... P, typename... A>
void launch_kernel(const char* op, void (*kern)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t s,
                   int cluster, bool pdl, A&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cudaLaunchAttribute attr[2];
  unsigned n = 0;
  if (cluster > 1) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n].val.clusterDim.x = unsigned(cluster);
    attr[n].val.clusterDim.y = 1;
    attr[n].val.clusterDim.z = 1;
    ++n;
  }
  if (pdl && !pdl_off_for(op)) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  cfg.attrs = attr;
  cfg.numAttrs = n;
  check_cuda(cudaLaunchKernelEx(&cfg, kern, std::forward<A>(args)...), op, "kernel launch");
}

// Clusters of c CTAs x threads (smem bytes of dynamic shared memory each) that can be
// resident at once for kern (cudaOccupancyMaxActiveClusters); 0 when the configuration
// cannot launch (the error is cleared: it is an answer here, not a failure).
inline int co_resident_clusters(const void* kern, int c, int threads, size_t smem) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(unsigned(c));
  cfg.blockDim = dim3(unsigned(threads));
  cfg.dynamicSmemBytes = smem;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = unsigned(c);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  int n = 0;
  if (cudaOccupancyMaxActiveClusters(&n, kern, &cfg) != cudaSuccess) {
    (void)cudaGetLastError();
    n = 0;
  }
  return n;
}

// make(dev), computed once per device under a lock and shared by every thread; each thread
// also keeps its last device's result, so the launch path takes no lock. One cache per
// (V, Make) pair of types, i.e. per call site (a lambda's type is its own). Nothing is cached
// when make throws.
template <typename V, typename Make>
const V& once_per_device(int dev, Make&& make) {
  thread_local int cached_dev = -1;
  thread_local const V* cached = nullptr;
  if (dev == cached_dev) return *cached;
  static std::mutex mu;
  static std::map<int, V> known;
  std::lock_guard<std::mutex> lock(mu);
  auto it = known.find(dev);
  if (it == known.end()) it = known.emplace(dev, make(dev)).first;
  cached = &it->second;
  cached_dev = dev;
  return *cached;
}

// The largest cluster size to launch Kern with on device dev: 16 when a cluster of 16 CTAs of
// `threads` threads and `smem` bytes of dynamic shared memory can be resident (it needs 16
// SMs of one GPC; a MIG slice may have fewer), else 8. Clusters of 16 are non-portable: they
// are allowed for Kern here first, and Kern's dynamic shared memory limit is raised to smem
// when smem > 0 (function attributes are per device: dev is made current for them). Asked once
// per (kernel, device); a per-thread cache keeps the lock off the launch path.
template <auto Kern>
int cluster16_or_8(int dev, int threads, size_t smem, const char* op) {
  return once_per_device<int>(dev, [&](int) {
    DeviceGuard guard(dev, op);
    check_cuda(cudaFuncSetAttribute(Kern, cudaFuncAttributeNonPortableClusterSizeAllowed, 1), op,
               "allow a non-portable cluster size");
    if (smem > 0)
      check_cuda(cudaFuncSetAttribute(Kern, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)), op,
                 "set the dynamic shared memory size");
    return co_resident_clusters(reinterpret_cast<const void*>(Kern), 16, threads, smem) > 0 ? 16 : 8;
  });
}

// Kern's static shared memory in bytes (the same on every device that runs this build's code).
template <auto Kern>
int64_t static_smem_bytes(const char* op) {
  cudaFuncAttributes fa{};
  check_cuda(cudaFuncGetAttributes(&fa, Kern), op, "read the kernel's attributes");
  return int64_t(fa.sharedSizeBytes);
}

// The dynamic shared memory one CTA of Kern may take on device dev: the device's opt-in limit
// less Kern's static shared memory. Kern's limit is raised to that once per (kernel, device),
// with dev made current (function attributes are per device; can_implement runs without a
// DeviceGuard).
template <auto Kern>
int64_t opt_in_smem_limit(int dev, const char* op) {
  return once_per_device<int64_t>(dev, [&](int d) {
    DeviceGuard guard(d, op);
    int optin = 0;
    check_cuda(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, d), op,
               "read the shared memory limit");
    const int limit = optin - int(static_smem_bytes<Kern>(op));
    check_cuda(cudaFuncSetAttribute(Kern, cudaFuncAttributeMaxDynamicSharedMemorySize, limit), op,
               "set the dynamic shared memory size");
    return int64_t(limit);
  });
}
// opt_in_smem_limit, then a refusal naming `what` (KS_ERROR_BACKEND_UNAVAILABLE, before any launch)
// where one CTA's `bytes` of dynamic shared memory pass it on device dev
template <auto Kern>
void require_opt_in_smem(int dev, const char* op, size_t bytes, const std::string& what) {
  const int64_t limit = opt_in_smem_limit<Kern>(dev, op);
  if (int64_t(bytes) > limit)
    detail::fail(KS_ERROR_BACKEND_UNAVAILABLE, op,
                 what + " needs " + std::to_string(bytes) + " bytes of shared memory per CTA; device " +
                     std::to_string(dev) + " allows " + std::to_string(limit));
}

// Last launch configuration per op (ks_last_launch_config, the benchmark's
// `config` column). Recording is cheap (a few integers into a thread-local slot,
// no formatting or allocation on the launch path); the text is made on request.
// fmt takes up to 12 `%lld` conversions, filled from values in order.
void record_launch(const char* op, const char* fmt, std::initializer_list<long long> values);
std::string last_config(const char* op);

}  // namespace ks::cuda
