// The model-path operators on CUDA (contracts in docs/contracts.md): argmax,
// embedding, quant_matmul (GGUF block formats, decode-sized M) and paged_attention.
// First versions, written for correctness with sensible memory access; their
// launch rules are not tuned yet.
//
// Index tensors on the device cannot be range-checked on the host without a
// synchronisation; the kernels stay memory-safe instead: an embedding id outside
// [0, vocab) yields a row of NaN, a block id outside [0, num_blocks) or a
// sequence id outside [0, num_seqs) drops the affected keys (an attention row
// with no key left is a zero row), and context lengths are clamped to the block
// table's capacity.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <string>
#include <type_traits>

#include <cooperative_groups.h>

#include "backends/cuda/attention_params.cuh"
#include "backends/cuda/common.cuh"
#include "backends/cuda/rope_common.cuh"
#include "ops/args.hpp"

namespace cg = cooperative_groups;

namespace ks::cuda {
namespace {

template <typename T>
__device__ __forceinline__ float ld_f(const T* p, int64_t i) {
  return Dt<T>::to_f(p[i]);
}

__device__ __forceinline__ int64_t ld_index(const void* p, bool is64, int64_t i) {
  return is64 ? static_cast<const int64_t*>(p)[i] : int64_t(static_cast<const int32_t*>(p)[i]);
}

// ---- argmax ---------------------------------------------------------------------
// The contract's order (a NaN beats every number and the first NaN wins; otherwise the larger
// value, ties to the smaller index) as one unsigned key per value, compared with the index:
// every NaN takes the largest key, -0 and +0 the same key (they tie), and the float order maps
// to the unsigned order (sign bit set: the bits inverted; clear: the sign bit added). Key 0 is
// below every value's (-inf's key is 0x007FFFFF): an empty share.
__device__ __forceinline__ unsigned order_key(float v) {
  const unsigned b = __float_as_uint(v + 0.f);  // -0 + 0 = +0 (round to nearest); NaN stays NaN
  const unsigned k = b ^ (unsigned(int(b) >> 31) | 0x80000000u);
  return v != v ? 0xFFFFFFFFu : k;
}
struct ArgBest {
  unsigned k;
  int64_t i;
};
__device__ __forceinline__ ArgBest better(ArgBest a, ArgBest b) {
  return a.k > b.k || (a.k == b.k && a.i <= b.i) ? a : b;
}
// The best of a warp's 32 candidates (every lane gets it). Indices below 2^31: the largest key
// by one warp reduction, then the smallest index among the lanes holding it by another;
// otherwise a butterfly of better().
__device__ __forceinline__ ArgBest warp_best(ArgBest b, bool small_index) {
  if (small_index) {
    const unsigned k = __reduce_max_sync(0xffffffffu, b.k);
    const unsigned i = __reduce_min_sync(0xffffffffu, b.k == k ? unsigned(b.i) : 0xFFFFFFFFu);
    return ArgBest{k, int64_t(i)};
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const ArgBest c{__shfl_xor_sync(0xffffffffu, b.k, o), __shfl_xor_sync(0xffffffffu, b.i, o)};
    b = better(b, c);
  }
  return b;
}

// A row is split over a cluster of C CTAs (C = 1 where clusters are not available). Each
// CTA scans its share of the row's 16-byte vectors, four loads per thread in flight
// before any comparison, each value turned into its key; the elements before the first 16-byte
// boundary and after the last whole vector go to rank 0. Warp reductions, then shared memory;
// then every CTA stores its best into rank 0's shared memory (one slot per rank, two sets
// alternating by row, so a CTA a row ahead cannot overwrite what rank 0 has yet to read) and
// one cluster barrier later rank 0 reduces them from its own shared memory. The result does not
// depend on C or on the order of the scan: (key, index) is a total order.
// kArgmaxMaxCluster: the largest cluster (argmax_cluster in launch_rules.hpp picks it)
constexpr int kArgmaxThreads = 512, kArgmaxUnroll = 4, kArgmaxMaxCluster = 16;

template <typename T>
__global__ void __launch_bounds__(kArgmaxThreads) argmax_kernel(const T* __restrict__ x, int64_t* __restrict__ out,
                                                                  int64_t rows, int64_t cols) {
  constexpr int VEC = 16 / int(sizeof(T));
  using V = Vec<T, VEC>;
  __shared__ unsigned sk[kArgmaxThreads / 32];
  __shared__ long long si[kArgmaxThreads / 32];
  __shared__ unsigned cta_k;
  __shared__ long long cta_i;
  // rank 0: every rank's best, by row parity (sm_90 clusters only: unused in the compute_80 PTX)
  [[maybe_unused]] __shared__ unsigned part_k[2][kArgmaxMaxCluster];
  [[maybe_unused]] __shared__ long long part_i[2][kArgmaxMaxCluster];
  int C = 1, rank = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cluster_arrive_relaxed();  // "this CTA has started": waited for before the first remote store
  cg::cluster_group cluster = cg::this_cluster();
  C = int(cluster.num_blocks());
  rank = int(cluster.block_rank());
#endif
  pdl_begin();
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  bool first = true;
#endif
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const bool small_index = cols < (int64_t(1) << 31);  // every index and `cols` fit 31 bits
  for (int64_t r = blockIdx.x / C; r < rows; r += gridDim.x / C) {
    const T* row = x + r * cols;
    // elements [head, head + nvec * VEC) are whole aligned vectors
    const int64_t mis = int64_t((reinterpret_cast<uintptr_t>(row) & 15u) / sizeof(T));
    const int64_t head = min(cols, mis == 0 ? int64_t(0) : int64_t(VEC) - mis);
    const int64_t nvec = (cols - head) / VEC;
    const int64_t per = (nvec + C - 1) / C;
    const int64_t v0 = min(nvec, int64_t(rank) * per), v1 = min(nvec, v0 + per);
    const V* vrow = reinterpret_cast<const V*>(row + head);
    ArgBest b{0u, cols};  // an empty share loses to any element
    for (int64_t v = v0 + threadIdx.x; v < v1; v += int64_t(kArgmaxUnroll) * kArgmaxThreads) {
      V buf[kArgmaxUnroll];
#pragma unroll
      for (int u = 0; u < kArgmaxUnroll; ++u) {
        const int64_t w = v + int64_t(u) * kArgmaxThreads;
        if (w < v1) buf[u] = load_vec<T, VEC>(reinterpret_cast<const T*>(vrow + w));
      }
      // this thread's elements come in increasing index order: a strictly larger key wins, its
      // place in the step kept as u * VEC + e and turned into an index once per step. (A branch
      // per vector, as for the loads: as one predicated block the compiler interleaved each
      // load with the previous vector's comparisons, one DRAM round trip after another.)
      unsigned bk = 0u;
      int bp = 0;
#pragma unroll
      for (int u = 0; u < kArgmaxUnroll; ++u) {
        if (v + int64_t(u) * kArgmaxThreads < v1)
#pragma unroll
          for (int e = 0; e < VEC; ++e) {
            const unsigned k = order_key(buf[u].f(e));
            bp = k > bk ? u * VEC + e : bp;
            bk = k > bk ? k : bk;
          }
      }
      if (bk > b.k) b = ArgBest{bk, head + (v + int64_t(bp / VEC) * kArgmaxThreads) * VEC + bp % VEC};
    }
    if (rank == 0) {  // the unaligned head and the tail (the head's indices precede the vectors')
      const int64_t tail0 = head + nvec * VEC;
      for (int64_t i = threadIdx.x; i < head; i += kArgmaxThreads) b = better(b, ArgBest{order_key(ld_f(row, i)), i});
      for (int64_t i = tail0 + threadIdx.x; i < cols; i += kArgmaxThreads)
        b = better(b, ArgBest{order_key(ld_f(row, i)), i});
    }
    b = warp_best(b, small_index);
    __syncthreads();  // the previous row's partials are read
    if (lane == 0) sk[warp] = b.k, si[warp] = b.i;
    __syncthreads();
    if (warp == 0) {
      ArgBest c = lane < kArgmaxThreads / 32 ? ArgBest{sk[lane], si[lane]} : ArgBest{0u, cols};
      c = warp_best(c, small_index);
      if (lane == 0) cta_k = c.k, cta_i = c.i;
    }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (first) cluster_wait();  // (the start: every CTA of the cluster runs)
    first = false;
    if (C > 1) {
      const int set = int((r / (gridDim.x / C)) & 1);  // this CTA's row count so far, mod 2
      if (threadIdx.x == 0) {  // (warp 0's lane 0 wrote cta_k / cta_i)
        *cluster.map_shared_rank(&part_k[set][rank], 0) = cta_k;
        *cluster.map_shared_rank(&part_i[set][rank], 0) = cta_i;
      }
      cluster_arrive();
      cluster_wait();  // every rank's best is in rank 0's shared memory
      if (rank == 0 && threadIdx.x == 0) {
        ArgBest c{part_k[set][0], part_i[set][0]};
        for (int k = 1; k < C; ++k) c = better(c, ArgBest{part_k[set][k], part_i[set][k]});
        // all -inf: every element ties at -inf's key and index 0 wins; cols > 0 always here
        out[r] = c.i < cols ? c.i : 0;
      }
      continue;
    }
#endif
    if (threadIdx.x == 0) out[r] = cta_i < cols ? cta_i : 0;
  }
}

// ---- embedding --------------------------------------------------------------------
// Decodes element j of a packed row (GGUF block formats, little endian).
__device__ __forceinline__ uint16_t rd16(const uint8_t* p) { return uint16_t(p[0] | (uint16_t(p[1]) << 8)); }

__device__ __forceinline__ float decode_elem(ks_qtype_t q, const uint8_t* row, int64_t j) {
  switch (q) {
    case KS_QTYPE_F32: {
      float f;
      memcpy(&f, row + 4 * j, 4);
      return f;
    }
    case KS_QTYPE_F16: return h2f_bits(rd16(row + 2 * j));
    case KS_QTYPE_BF16: return __uint_as_float(uint32_t(rd16(row + 2 * j)) << 16);
    case KS_QTYPE_Q4_0: {
      const uint8_t* b = row + (j / 32) * 18;
      const int e = int(j % 32);
      const int code = e < 16 ? (b[2 + e] & 0x0F) : (b[2 + e - 16] >> 4);
      return h2f_bits(rd16(b)) * float(code - 8);
    }
    case KS_QTYPE_Q4_1: {
      const uint8_t* b = row + (j / 32) * 20;
      const int e = int(j % 32);
      const int code = e < 16 ? (b[4 + e] & 0x0F) : (b[4 + e - 16] >> 4);
      return h2f_bits(rd16(b)) * float(code) + h2f_bits(rd16(b + 2));
    }
    case KS_QTYPE_Q8_0: {
      const uint8_t* b = row + (j / 32) * 34;
      return h2f_bits(rd16(b)) * float(int8_t(b[2 + j % 32]));
    }
    default: return __int_as_float(0x7fffffff);
  }
}

struct EmbParams {
  void* out;
  const void* ids;
  bool ids64;
  const void* table;
  ks_qtype_t format;
  int64_t num_ids, hidden, vocab, row_bytes;
};

template <typename T>
__global__ void __launch_bounds__(256) embedding_kernel(const EmbParams p) {
  pdl_begin();
  T* out = static_cast<T*>(p.out);
  for (int64_t i = blockIdx.x; i < p.num_ids; i += gridDim.x) {
    const int64_t id = ld_index(p.ids, p.ids64, i);
    T* dst = out + i * p.hidden;
    if (id < 0 || id >= p.vocab) {  // not checkable on the host: a loud NaN row, nothing read
      for (int64_t j = threadIdx.x; j < p.hidden; j += blockDim.x) dst[j] = Dt<T>::from_f(__int_as_float(0x7fffffff));
      continue;
    }
    if (p.format == KS_QTYPE_NONE) {
      const T* src = static_cast<const T*>(p.table) + id * p.hidden;
      for (int64_t j = threadIdx.x; j < p.hidden; j += blockDim.x) dst[j] = src[j];  // bit-exact copy
    } else {
      const uint8_t* src = static_cast<const uint8_t*>(p.table) + id * p.row_bytes;
      for (int64_t j = threadIdx.x; j < p.hidden; j += blockDim.x) dst[j] = Dt<T>::from_f(decode_elem(p.format, src, j));
    }
  }
}

// ---- dequantize -------------------------------------------------------------------
// out[r, j] = decode of element j of packed row r (FP32, rounded once); a thread per output
// element pair of a row strip, grid-stride over rows.
template <typename T>
__global__ void __launch_bounds__(256) dequantize_kernel(T* __restrict__ out, const uint8_t* __restrict__ packed,
                                                         ks_qtype_t q, int64_t rows, int64_t cols, int64_t row_bytes) {
  pdl_begin();
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const uint8_t* src = packed + r * row_bytes;
    for (int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; j < cols; j += int64_t(gridDim.x) * blockDim.x)
      out[r * cols + j] = Dt<T>::from_f(decode_elem(q, src, j));
  }
}

// ---- quant_matmul ----------------------------------------------------------------
// out[m, n] = sum_k x[m, k] * w[n, k], w decoded from its blocks in FP32 on the fly.
// A warp owns an output column n for MQ rows of x at a time; lane l takes blocks
// l, l + 32, ... of the weight row, decodes each block once (32 values) and
// multiplies it with the matching 32 values of every x row of the chunk. MQ = 1 for
// M = 1 (decode: no work for rows that do not exist), else 4. A row's arithmetic is the
// same for either MQ (its own sums, in the same order), so results do not depend on M.
constexpr int kMqMany = 4;

// Byte k of w (a small integer code) minus `bias`, as a float: the byte is put under the
// exponent of 2^23 by one byte permute (the float 2^23 + byte) and 2^23 + bias is subtracted.
// Both are exact, so this is float(byte) - bias bit for bit, without the integer-to-float
// conversion instruction (I2F.S8 runs at a quarter of the FP32 rate on sm_90).
// (The selector is an immediate of the permute: as a C++ argument the compiler kept it in a
// register and re-made it with a move before nearly every permute.)
template <int K>
__device__ __forceinline__ float byte_float(uint32_t w, float bias) {
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(w), "r"(0x4B000000u), "n"(0x7540 + K));
  return __uint_as_float(r) - (8388608.f + bias);
}

// One block of 32 weights decoded in FP32. WIDE: the block is read as 32-bit words (Q4_1,
// 20-byte blocks, 4-byte aligned) or 16-bit halves (Q4_0, Q8_0: 18 and 34 bytes, 2-byte
// aligned) instead of byte by byte: the same values, 4-2x fewer load instructions. PERM (with
// WIDE): the codes become floats by byte_float instead of the conversion instructions - the
// same values, a choice of speed only. Measured on the H200 (6aeca25 against e8565c2, the
// per-warp kernel, every other variant within 1%): faster with bf16 x (up to 9%) and slower
// with fp32 x (the 49152 x 576 head 3-8%, the model's fused norm + q/k/v and SiLU + down
// 4-5%), so the per-warp and staged kernels take it for 16-bit x only; cuda_bulk_stream always.
template <bool WIDE, bool PERM = true>
__device__ __forceinline__ void decode_q_block(ks_qtype_t q, const uint8_t* blk, float* v) {
  if constexpr (WIDE) {
    if (q == KS_QTYPE_Q4_1) {
      const uint32_t* w = reinterpret_cast<const uint32_t*>(blk);
      const uint32_t w0 = w[0];
      const float d = h2f_bits(uint16_t(w0 & 0xFFFFu)), mn = h2f_bits(uint16_t(w0 >> 16));
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint32_t word = w[1 + i];
        if constexpr (PERM) {
          const uint32_t lo = word & 0x0F0F0F0Fu, hi = (word >> 4) & 0x0F0F0F0Fu;
          v[4 * i] = d * byte_float<0>(lo, 0.f) + mn;
          v[4 * i + 1] = d * byte_float<1>(lo, 0.f) + mn;
          v[4 * i + 2] = d * byte_float<2>(lo, 0.f) + mn;
          v[4 * i + 3] = d * byte_float<3>(lo, 0.f) + mn;
          v[4 * i + 16] = d * byte_float<0>(hi, 0.f) + mn;
          v[4 * i + 17] = d * byte_float<1>(hi, 0.f) + mn;
          v[4 * i + 18] = d * byte_float<2>(hi, 0.f) + mn;
          v[4 * i + 19] = d * byte_float<3>(hi, 0.f) + mn;
        } else {
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            const uint32_t c = (word >> (8 * k)) & 0xFFu;
            v[4 * i + k] = d * float(c & 0x0Fu) + mn;
            v[4 * i + k + 16] = d * float(c >> 4) + mn;
          }
        }
      }
      return;
    }
    const uint16_t* h = reinterpret_cast<const uint16_t*>(blk);
    const float d = h2f_bits(h[0]);
    if (q == KS_QTYPE_Q8_0) {
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        if constexpr (PERM) {
          const uint32_t u = uint32_t(h[1 + i]) ^ 0x8080u;  // code + 128 in each byte
          v[2 * i] = d * byte_float<0>(u, 128.f);
          v[2 * i + 1] = d * byte_float<1>(u, 128.f);
        } else {
          const uint16_t hw = h[1 + i];
          v[2 * i] = d * float(int8_t(hw & 0xFFu));
          v[2 * i + 1] = d * float(int8_t(hw >> 8));
        }
      }
    } else {  // Q4_0
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        if constexpr (PERM) {
          const uint32_t hw = h[1 + i], lo = hw & 0x0F0Fu, hi = (hw >> 4) & 0x0F0Fu;
          v[2 * i] = d * byte_float<0>(lo, 8.f);
          v[2 * i + 1] = d * byte_float<1>(lo, 8.f);
          v[2 * i + 16] = d * byte_float<0>(hi, 8.f);
          v[2 * i + 17] = d * byte_float<1>(hi, 8.f);
        } else {
          const uint16_t hw = h[1 + i];
#pragma unroll
          for (int k = 0; k < 2; ++k) {
            const int c = (hw >> (8 * k)) & 0xFF;
            v[2 * i + k] = d * float((c & 0x0F) - 8);
            v[2 * i + k + 16] = d * float((c >> 4) - 8);
          }
        }
      }
    }
  } else {
    const float d = h2f_bits(rd16(blk));
    if (q == KS_QTYPE_Q8_0) {
#pragma unroll
      for (int e = 0; e < 32; ++e) v[e] = d * float(int8_t(blk[2 + e]));
    } else {
      const bool q41 = q == KS_QTYPE_Q4_1;
      const float mn = q41 ? h2f_bits(rd16(blk + 2)) : 0.f;
      const uint8_t* qs = blk + (q41 ? 4 : 2);
#pragma unroll
      for (int e = 0; e < 16; ++e) {
        const int lo = qs[e] & 0x0F, hi = qs[e] >> 4;
        v[e] = q41 ? d * float(lo) + mn : d * float(lo - 8);
        v[e + 16] = q41 ? d * float(hi) + mn : d * float(hi - 8);
      }
    }
  }
}

// The row fed to the dot products ("h"), by prologue:
//  - None:    x itself;
//  - Norm:    round(r * inv_rms * norm_weight) of residual r (rms_norm's expression and rounding);
//  - AddNorm: the same of s = x + residual (FP32, unrounded), residual_out = round(s)
//             (fused_add_rms_norm's values, written by warp 0 of CTA 0);
//  - Silu:    round(g * sigmoid(g) * u) of gate_up (silu_and_mul's expression and rounding).
// inv_rms = 1 / sqrt(sum(s^2) / K + eps): each warp sums its rows' squares itself (lanes over
// 16-byte vectors, then the butterfly), so no block waits on another and a row's sums do not
// depend on M. The dot products are quant_matmul's, so with the prologue None the kernel is it.
enum class Pro { None, Norm, AddNorm, Silu };

struct QmmParams {
  const void* x;        // None: x [M, K]; Norm / AddNorm: residual [M, K]; Silu: gate_up [M, 2K]
  const void* add;      // AddNorm: x [M, K]
  const void* norm_w;   // Norm / AddNorm: [K]
  void* res_out;        // AddNorm: residual_out [M, K]
  const uint8_t* w;     // [N, row_bytes]
  void* out;            // [M, N]
  int64_t M, N, K, row_bytes;
  float eps;
  ks_qtype_t q;
  int cols_per_warp;    // the consecutive output columns each warp owns (1, 2 or 4; by N, K and the block format)
};

// QmmParams' rows as the activations' type T, and the elements between rows of p.x (prologue P).
template <typename T>
struct QmmRows {
  const T* x;   // None: x; Norm / AddNorm: residual; Silu: gate_up
  const T* xa;  // AddNorm: x
  const T* nw;  // Norm / AddNorm: norm_weight
  T* ro;        // AddNorm: residual_out
  T* out;
  int64_t xs;   // Silu: 2K, else K
};
template <typename T, Pro P>
__device__ __forceinline__ QmmRows<T> qmm_rows(const QmmParams& p) {
  return {static_cast<const T*>(p.x), static_cast<const T*>(p.add), static_cast<const T*>(p.norm_w),
          static_cast<T*>(p.res_out), static_cast<T*>(p.out), P == Pro::Silu ? 2 * p.K : p.K};
}

// A block's 32 decoded weights times its 32 staged x values (FP32, 16-byte aligned, as 8
// float4), summed in order from 0: the per-warp kernel's order for one block.
__device__ __forceinline__ float dot32(const float* v, const float4* x) {
  float s = 0.f;
#pragma unroll
  for (int c = 0; c < 8; ++c) {
    const float4 h = x[c];
    s += v[4 * c] * h.x;
    s += v[4 * c + 1] * h.y;
    s += v[4 * c + 2] * h.z;
    s += v[4 * c + 3] * h.w;
  }
  return s;
}

// This thread's share of a row's sum of squares (Norm: of residual r; AddNorm: of s = x + r),
// vectors first, first + step, ... of XV elements; `write` stores round(s) to residual_out as
// it goes (AddNorm). Shared by the per-warp and the staged kernels.
template <typename T, int XV, Pro P>
__device__ __forceinline__ float row_squares(const T* r, const T* xa, T* ro, int64_t row, int64_t nvec, int64_t first,
                                             int64_t step, bool write) {
  float ss = 0.f;
  for (int64_t i = first; i < nvec; i += step) {
    const auto rv = load_vec<T, XV>(r + row + i * XV);
    Vec<T, XV> av;
    if constexpr (P == Pro::AddNorm) av = load_vec<T, XV>(xa + row + i * XV);
    OutVec<T, XV> so;
#pragma unroll
    for (int j = 0; j < XV; ++j) {
      float v = rv.f(j);
      if constexpr (P == Pro::AddNorm) v += av.f(j);
      ss += v * v;
      so.set(j, v);
    }
    if constexpr (P == Pro::AddNorm)
      if (write) store_vec<T, XV>(ro + row + i * XV, so);
  }
  return ss;
}

// One element of the row fed to the dot products: x (or residual, or gate) value xv, the added
// x value a (AddNorm), the norm weight w (Norm, AddNorm), the up value u (Silu).
template <typename T, Pro P>
__device__ __forceinline__ float prologue(float xv, float a, float w, float u, float inv) {
  float h = xv;
  if constexpr (P == Pro::AddNorm) h += a;
  if constexpr (P == Pro::Norm || P == Pro::AddNorm) h = round_to<T>(h * inv * w);
  if constexpr (P == Pro::Silu) h = round_to<T>(silu_times<T>(h, u));  // silu_and_mul's value
  return h;
}

// The inverse RMS of rows m0 .. m0 + MQ - 1 (those below M) of the Norm / AddNorm prologue, each
// summed by the warp (row_squares over its lanes, then the butterfly); `write`: this warp stores
// residual_out's rows as it goes (AddNorm). Rows past M get 0.
template <typename T, int XV, Pro P, int MQ>
__device__ __forceinline__ void warp_inv_rms(const T* r, const T* xa, T* ro, int64_t m0, int64_t M, int64_t K, float eps,
                                             int lane, bool write, float* inv) {
#pragma unroll
  for (int mm = 0; mm < MQ; ++mm) {
    inv[mm] = 0.f;
    if (m0 + mm >= M) break;
    const float ss = row_squares<T, XV, P>(r, xa, ro, (m0 + mm) * K, K / XV, lane, 32, write);
    inv[mm] = 1.0f / sqrtf(warp_sum(ss) / float(K) + eps);  // norm_kernel's expression
  }
}

// s + the E products w[e] * h[e] of one row, added in order from e = 0, where h is the row fed to
// the dot products (prologue P) at elements base .. base + E - 1 of p.x (norm_weight at kw ..,
// the up half K further on): XV elements per load.
template <typename T, int XV, Pro P, int E>
__device__ __forceinline__ float dot_prologue(float s, const float* w, const T* x, const T* xa, const T* nw, int64_t base,
                                              int64_t kw, int64_t K, float inv) {
#pragma unroll
  for (int c = 0; c < E / XV; ++c) {
    const auto xv = load_vec<T, XV>(x + base + c * XV);
    Vec<T, XV> av{}, wv{}, uv{};  // only those of prologue P are loaded
    if constexpr (P == Pro::AddNorm) av = load_vec<T, XV>(xa + base + c * XV);
    if constexpr (P == Pro::Norm || P == Pro::AddNorm) wv = load_vec<T, XV>(nw + kw + c * XV);
    if constexpr (P == Pro::Silu) uv = load_vec<T, XV>(x + base + K + c * XV);
#pragma unroll
    for (int j = 0; j < XV; ++j) {
      float h = xv.f(j);
      if constexpr (P != Pro::None) h = prologue<T, P>(h, av.f(j), wv.f(j), uv.f(j), inv);
      s += w[c * XV + j] * h;
    }
  }
  return s;
}

// WIDE: weight blocks read as words, and the rows' 32 values per block as 16-byte vectors
// (every row pointer 16-byte aligned; K is a multiple of 32, so every block's slice is too).
// NC (p.cols_per_warp): warp w of the CTA owns columns n0 + w * NC + c, c < NC, one after the
// other (each column's sums exactly as with NC = 1). SW: the CTA's weight rows are staged in
// shared memory first (stage_weight_rows); the arithmetic is the same either way.
template <typename T, bool WIDE, int MQ, Pro P, bool SW>
__global__ void __launch_bounds__(256) quant_matmul_kernel(const QmmParams p) {
  extern __shared__ __align__(16) unsigned char qmm_wsm[];  // SW: the CTA's weight rows
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nc = p.cols_per_warp;
  const int64_t cta_cols = int64_t(blockDim.x >> 5) * nc, n0 = int64_t(blockIdx.x) * cta_cols;
  const uint8_t* wcta = p.w + n0 * p.row_bytes;  // row n0 of the weights, wherever they are read from
  if constexpr (SW) {
    wcta = stage_weight_rows(qmm_wsm, p.w, p.row_bytes, n0, min(cta_cols, p.N - n0), threadIdx.x, blockDim.x);
    pdl_begin();
    cp_async_wait<0>();
    __syncthreads();
  } else {
    pdl_begin();
  }
  const int64_t col0 = n0 + int64_t(warp) * nc;  // this warp's first column
  const bool writer = P == Pro::AddNorm && blockIdx.x == 0 && threadIdx.x < 32;  // residual_out
  if (col0 >= p.N && !writer) return;
  const int64_t M = p.M, N = p.N, K = p.K;
  const int64_t nblocks = K / 32, bbytes = q_block_bytes(p.q);
  const auto [x, xa, nw, ro, out, xs] = qmm_rows<T, P>(p);
  constexpr int XV = WIDE ? 16 / int(sizeof(T)) : 1;  // elements per load
  for (int64_t m0 = 0; m0 < M; m0 += MQ) {
    float inv[MQ];
    if constexpr (P == Pro::Norm || P == Pro::AddNorm)
      warp_inv_rms<T, XV, P, MQ>(x, xa, ro, m0, M, K, p.eps, lane, writer, inv);
    for (int c = 0; c < nc; ++c) {
      const int64_t n = col0 + c;
      if (n >= N) break;
      const uint8_t* wr = wcta + (n - n0) * p.row_bytes;
      float acc[MQ] = {};
      for (int64_t b = lane; b < nblocks; b += 32) {
        float v[32];
        decode_q_block<WIDE, sizeof(T) == 2>(p.q, wr + b * bbytes, v);
#pragma unroll
        for (int mm = 0; mm < MQ; ++mm) {
          if (m0 + mm >= M) break;
          acc[mm] += dot_prologue<T, XV, P, 32>(0.f, v, x, xa, nw, (m0 + mm) * xs + b * 32, b * 32, K, inv[mm]);
        }
      }
#pragma unroll
      for (int mm = 0; mm < MQ; ++mm) {
        float s = warp_sum(acc[mm]);
        if (lane == 0 && m0 + mm < M) out[(m0 + mm) * N + n] = Dt<T>::from_f(s);
      }
    }
  }
}

// ---- quant_matmul with dense weights (F32, F16, BF16) -------------------------------------
// cuda_warp_per_column's kernel for the formats with no blocks to decode, quant_matmul's and
// its two fusions' (prologue P). A warp owns output column n (n, n + W, ... for the grid's W
// warps), rows of x 4 at a time (kDenseRows); lane l takes the chunks l, l + 32, ... of 8
// consecutive elements of w's row n and x's rows (the last one shorter where K % 8 != 0) and
// adds each product to its row's FP32 sum in k order; then the lanes are summed by the
// butterfly. VEC (w, every row pointer and K suit 16-byte loads) only decides how a chunk is
// read: as 16-byte vectors, or element by element (the weights byte by byte: any K, any
// offset), so the sums' order depends on K alone: never on M (batch-invariant) nor on the
// pointers' alignment, and silu_and_mul_quant_matmul is bit for bit silu_and_mul then
// quant_matmul (whatever the alignment of either's rows). The fused prologues are
// quant_matmul_kernel's (warp_inv_rms, whose sum of squares' order follows the alignment as
// every quant_matmul kernel's does; dot_prologue).
constexpr int kDenseWarps = 8, kDenseRows = 4;

// The V weights of w's row from element k0 as floats (WB: bytes per weight, 4 = F32; 2 = F16,
// or BF16 when bf16). V = 8: 16-byte aligned loads; V = 1: byte loads (any alignment).
template <int WB, int V>
__device__ __forceinline__ void dense_weights(const uint8_t* row, int64_t k0, bool bf16, float* w) {
  auto half_value = [bf16](uint32_t bits) {  // bits: the 16 bits of one weight, in the low half
    return bf16 ? __uint_as_float(bits << 16) : h2f_bits(uint16_t(bits));
  };
  if constexpr (V == 1) {
    if constexpr (WB == 4) {
      memcpy(w, row + 4 * k0, 4);  // (from a byte pointer: byte loads)
    } else {
      w[0] = half_value(rd16(row + 2 * k0));
    }
  } else {
    static_assert(V == 8, "chunks of 8 weights: 16 or 32 bytes");
    const uint4* src = reinterpret_cast<const uint4*>(row + int64_t(WB) * k0);
#pragma unroll
    for (int i = 0; i < WB / 2; ++i) {
      const uint4 u = src[i];
      const uint32_t words[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if constexpr (WB == 4) {
          w[4 * i + j] = __uint_as_float(words[j]);
        } else {
          w[2 * j] = half_value(words[j] & 0xFFFFu);
          w[2 * j + 1] = half_value(words[j] >> 16);
        }
      }
    }
  }
}

template <typename T, int WB, bool VEC, Pro P>
__global__ void __launch_bounds__(32 * kDenseWarps) dense_matmul_kernel(const QmmParams p, bool bf16) {
  pdl_begin();  // (nothing is read before the previous kernel has finished)
  const int lane = threadIdx.x & 31;
  const int64_t M = p.M, N = p.N, K = p.K, stride = int64_t(gridDim.x) * kDenseWarps;
  int64_t n = int64_t(blockIdx.x) * kDenseWarps + (threadIdx.x >> 5);
  const bool writer = P == Pro::AddNorm && blockIdx.x == 0 && threadIdx.x < 32;  // residual_out (warp 0)
  if (n >= N && !writer) return;
  const auto [x, xa, nw, ro, out, xs] = qmm_rows<T, P>(p);
  constexpr int XV = VEC ? 16 / int(sizeof(T)) : 1;  // x's elements per load
  constexpr int C = 8;                                 // elements per chunk
  for (bool first = true;; first = false, n += stride) {  // (the writer's first pass runs even past N)
    const uint8_t* wr = p.w + (n < N ? n : 0) * p.row_bytes;
    for (int64_t m0 = 0; m0 < M; m0 += kDenseRows) {
      float inv[kDenseRows];
      if constexpr (P == Pro::Norm || P == Pro::AddNorm)
        warp_inv_rms<T, XV, P, kDenseRows>(x, xa, ro, m0, M, K, p.eps, lane, writer && first, inv);
      if (n >= N) continue;  // the writer past the last column: residual_out only
      float acc[kDenseRows] = {};
      for (int64_t k0 = int64_t(lane) * C; k0 < K; k0 += 32 * C) {
        if constexpr (VEC) {  // (K % 8 == 0: whole chunks)
          float w[C];
          dense_weights<WB, C>(wr, k0, bf16, w);
#pragma unroll
          for (int mm = 0; mm < kDenseRows; ++mm) {
            if (m0 + mm >= M) break;
            acc[mm] = dot_prologue<T, XV, P, C>(acc[mm], w, x, xa, nw, (m0 + mm) * xs + k0, k0, K, inv[mm]);
          }
        } else {
          const int len = int(min(int64_t(C), K - k0));
          for (int e = 0; e < len; ++e) {  // the chunk element by element: the same order
            float w;
            dense_weights<WB, 1>(wr, k0 + e, bf16, &w);
#pragma unroll
            for (int mm = 0; mm < kDenseRows; ++mm) {
              if (m0 + mm >= M) break;
              acc[mm] = dot_prologue<T, 1, P, 1>(acc[mm], &w, x, xa, nw, (m0 + mm) * xs + k0 + e, k0 + e, K, inv[mm]);
            }
          }
        }
      }
#pragma unroll
      for (int mm = 0; mm < kDenseRows; ++mm) {
        const float s = warp_sum(acc[mm]);
        if (lane == 0 && m0 + mm < M) out[(m0 + mm) * N + n] = Dt<T>::from_f(s);
      }
    }
    if (n + stride >= N) break;
  }
}

// The fused forms with the prologue's rows staged in shared memory (the launcher's choice when
// 4 rows of K fit in kStageBytes, K <= 2720, at every M): the CTA computes h once for its 8 warps (the per-warp
// kernel above recomputes it in every warp: 8x the loads and, for SiLU, the exponentials)
// and the dot products read it back. Each 32-element block of h is stored 36 floats apart,
// so the lanes' 16-byte reads of consecutive blocks fall in distinct banks. The norm's sum of
// squares: thread t over the 16-byte vectors t, t + 256, ..., the warp butterfly, then the 8
// warps' sums in order: an order set by K and the pointers' alignment only, never by M.
constexpr int kStageThreads = 256, kStageWarps = kStageThreads / 32;
constexpr int kMaxColsPerWarp = 4;  // launch_qmm's cols_per_warp is 1, 2 or 4
constexpr size_t kStageBytes = 48 * 1024;
__host__ __device__ constexpr int64_t staged_floats(int64_t k) { return k / 32 * 36; }
// Whether `rows` rows of K fit the staged kernel's 48 KB (4 rows: K <= 2720; 16 rows: K <= 672).
constexpr bool staged_rows_fit(int64_t rows, int64_t k) {
  return size_t(rows) * size_t(staged_floats(k)) * sizeof(float) <= kStageBytes;
}

// The RoPE + KV-cache epilogue of fused_add_rms_norm_quant_matmul_rope_kv_append (one row):
// out is [1, (heads + 2 kv_heads) head_dim] = q | k | v. A CTA's columns are whole interleaved
// pairs (2i, 2i + 1): n0 and the CTA's column count are even, and so is head_dim.
struct RopeEpi {
  const void* pos;    // positions[0]
  const void* slots;  // slot_mapping[0] (when kv_tokens > 0)
  char* k_cache;
  char* v_cache;
  int64_t num_slots, kv_tokens;
  int heads, kv_heads, head_dim, rotary_half;
  bool pos64, slots64;
  // whether the kernel lets its dependent launch early (pdl_begin, grids of at most one CTA per
  // SM); on unless KS_QMM_ROPE_EARLY_TRIGGER=0. In a decode step the dependent is the attention:
  // one CTA per unit (small tables) then reads its older keys while this kernel ends
  // (paged_attention_after_append), and clusters launch without PDL, since placed early they land
  // on the few SMs this ~120-CTA grid leaves free. SmolLM2 on the H200, batch 1, same call
  // (a2bbdd8): 1887 tokens/s after a 64-token prompt against 1760 with neither (1799 with the
  // trigger alone); off until then, when clusters still took PDL (1444 against 1522 with them).
  bool early_trigger;
};
struct NoRope {};
struct WithRope {
  const RopeEpi& e;
  const RopeTable& tab;
};

// rotary_embedding_kv_append on the CTA's `cols` columns from n0 (even; `v` holds their values
// as the matmul would have stored them): pair (n, n + 1) of q or k within rotary_dim rotates by
// the angle fp32(fp32(pos) * inv_freq[i]) (sincosf, rope_rotate: rope_append_kernel's
// arithmetic, so the same bits); every value goes to out, and k's and v's also to the cache
// row of slot_mapping[0] when it is in [0, num_slots).
template <typename T>
__device__ __forceinline__ void rope_epilogue(const RopeEpi& e, const RopeTable& tab, const float* v, T* out,
                                              int64_t n0, int64_t cols) {
  const int64_t pi = e.pos64 ? static_cast<const int64_t*>(e.pos)[0] : static_cast<const int32_t*>(e.pos)[0];
  const float pos = float(pi);
  int64_t slot = -1;
  if (e.kv_tokens > 0) slot = e.slots64 ? static_cast<const int64_t*>(e.slots)[0] : static_cast<const int32_t*>(e.slots)[0];
  const bool append = slot >= 0 && slot < e.num_slots;
  const int64_t D = e.head_dim, qd = int64_t(e.heads) * D, kd = int64_t(e.kv_heads) * D;
  for (int64_t t = threadIdx.x; 2 * t < cols; t += blockDim.x) {
    const int64_t n = n0 + 2 * t;
    const int region = n < qd ? 0 : n < qd + kd ? 1 : 2;  // q, k, v
    const int64_t off = region == 0 ? n : region == 1 ? n - qd : n - qd - kd;
    const int j = int(off % D);
    float x0 = v[2 * t], x1 = v[2 * t + 1];
    if (region < 2 && j < 2 * e.rotary_half) {
      float sn, c;
      sincosf(pos * tab.inv[j / 2], &sn, &c);
      float f0, f1;
      rope_rotate(x0, x1, c, sn, f0, f1);
      x0 = f0;
      x1 = f1;
    }
    const T r0 = Dt<T>::from_f(x0), r1 = Dt<T>::from_f(x1);
    out[n] = r0;
    out[n + 1] = r1;
    if (region > 0 && append) {
      T* row = reinterpret_cast<T*>(region == 1 ? e.k_cache : e.v_cache) + slot * kd;
      row[off] = r0;
      row[off + 1] = r1;
    }
  }
}

template <typename T, bool WIDE, int MQ, Pro P, bool SW, typename EPI>
__device__ __forceinline__ void quant_matmul_staged_body(const QmmParams& p, const EPI& epi) {
  // (P == None: quant_matmul's variant cuda_staged_x, x's rows staged as they are)
  constexpr bool ROPE = std::is_same_v<EPI, WithRope>;
  static_assert(!ROPE || MQ == 1, "the RoPE epilogue serves one row");
  extern __shared__ __align__(16) float hs[];  // [min(M, MQ)][K / 32][36], then (SW) the weight rows
  __shared__ float red[kStageWarps];
  float* colv = nullptr;  // ROPE: the CTA's column values, rounded to T (static shared memory)
  if constexpr (ROPE) {
    __shared__ float colv_rope[kStageWarps * kMaxColsPerWarp];
    colv = colv_rope;
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nc = p.cols_per_warp;
  const int64_t M = p.M, N = p.N, K = p.K, KS = staged_floats(K);
  const int64_t cta_cols = int64_t(kStageWarps) * nc, n0 = int64_t(blockIdx.x) * cta_cols;
  const int64_t col0 = n0 + int64_t(warp) * nc;  // this warp's first column
  const uint8_t* wcta = p.w + n0 * p.row_bytes;
  if constexpr (SW) {  // the weights first: they do not depend on the previous kernel
    unsigned char* wdst = reinterpret_cast<unsigned char*>(hs + min(M, int64_t(MQ)) * KS);
    wcta = stage_weight_rows(wdst, p.w, p.row_bytes, n0, min(cta_cols, N - n0), threadIdx.x, blockDim.x);
  }
  if constexpr (ROPE)
    pdl_begin(epi.e.early_trigger);
  else
    pdl_begin();
  const int64_t nblocks = K / 32, bbytes = q_block_bytes(p.q);
  const auto [x, xa, nw, ro, out, xs] = qmm_rows<T, P>(p);
  const bool writer = P == Pro::AddNorm && blockIdx.x == 0;  // this CTA writes residual_out
  constexpr int XV = WIDE ? 16 / int(sizeof(T)) : 1;
  const int64_t kv = K / XV;  // vectors per row
  for (int64_t m0 = 0; m0 < M; m0 += MQ) {
#pragma unroll
    for (int mm = 0; mm < MQ; ++mm) {
      if (m0 + mm >= M) break;
      const int64_t row = (m0 + mm) * xs;
      float* hrow = hs + mm * KS;
      float inv = 0.f;
      if constexpr (P == Pro::Norm || P == Pro::AddNorm) {
        const float ss = warp_sum(row_squares<T, XV, P>(x, xa, ro, row, kv, threadIdx.x, kStageThreads, writer));
        if (lane == 0) red[warp] = ss;
        __syncthreads();
        float total = 0.f;
#pragma unroll
        for (int w = 0; w < kStageWarps; ++w) total += red[w];
        inv = 1.0f / sqrtf(total / float(K) + p.eps);  // norm_kernel's expression
        __syncthreads();  // red is reused by the next row
      }
      for (int64_t i = threadIdx.x; i < kv; i += kStageThreads) {
        const auto xv = load_vec<T, XV>(x + row + i * XV);
        Vec<T, XV> av{}, wv{}, uv{};  // only those of prologue P are loaded
        if constexpr (P == Pro::AddNorm) av = load_vec<T, XV>(xa + row + i * XV);
        if constexpr (P == Pro::Norm || P == Pro::AddNorm) wv = load_vec<T, XV>(nw + i * XV);
        if constexpr (P == Pro::Silu) uv = load_vec<T, XV>(x + row + K + i * XV);
#pragma unroll
        for (int j = 0; j < XV; ++j) {
          const int64_t k = i * XV + j;
          hrow[(k >> 5) * 36 + (k & 31)] = prologue<T, P>(xv.f(j), av.f(j), wv.f(j), uv.f(j), inv);
        }
      }
    }
    if constexpr (SW) {
      if (m0 == 0) cp_async_wait<0>();  // this thread's weight copies have landed
    }
    __syncthreads();  // the chunk's rows (and the weights) are staged
    for (int c = 0; c < nc; ++c) {
      const int64_t n = col0 + c;
      if (n >= N) break;
      const uint8_t* wr = wcta + (n - n0) * p.row_bytes;
      float acc[MQ] = {};
      for (int64_t b = lane; b < nblocks; b += 32) {
        float v[32];
        decode_q_block<WIDE, sizeof(T) == 2>(p.q, wr + b * bbytes, v);
#pragma unroll
        for (int mm = 0; mm < MQ; ++mm) {
          if (m0 + mm >= M) break;
          acc[mm] += dot32(v, reinterpret_cast<const float4*>(hs + mm * KS + b * 36));
        }
      }
#pragma unroll
      for (int mm = 0; mm < MQ; ++mm) {
        const float s = warp_sum(acc[mm]);
        if constexpr (ROPE) {
          if (lane == 0) colv[warp * nc + c] = round_to<T>(s);  // the value the matmul would store
        } else {
          if (lane == 0 && m0 + mm < M) out[(m0 + mm) * N + n] = Dt<T>::from_f(s);
        }
      }
    }
    if constexpr (ROPE) {
      __syncthreads();  // every column of the CTA is in colv
      rope_epilogue<T>(epi.e, epi.tab, colv, out, n0, min(cta_cols, N - n0));
    }
    __syncthreads();  // the next chunk overwrites hs
  }
}

template <typename T, bool WIDE, int MQ, Pro P, bool SW>
__global__ void __launch_bounds__(kStageThreads) quant_matmul_staged_kernel(const QmmParams p) {
  quant_matmul_staged_body<T, WIDE, MQ, P, SW>(p, NoRope{});
}

template <typename T, bool WIDE, Pro P, bool SW>
__global__ void __launch_bounds__(kStageThreads)
    quant_matmul_staged_rope_kernel(const QmmParams p, const RopeEpi e, const RopeTable tab) {
  quant_matmul_staged_body<T, WIDE, 1, P, SW>(p, WithRope{e, tab});
}

// ---- variant cuda_row_stream (M = 1) ---------------------------------------------------
// Decode GEMV over long rows: a warp strides over the output columns (n, n + W, ... for W warps
// in the grid) and streams each column's weight row into one of its two shared-memory buffers
// with 16-byte cp.async copies (the row's bytes are contiguous, so its 32 lanes put the whole
// row in flight at once), decoding row n while row n + W is in flight. The first row is issued
// before the kernel's dependency wait (weights are never written by a step's kernels). Each
// column's arithmetic is quant_matmul_kernel's for M = 1 - lane l takes blocks l, l + 32, ... in
// order, a block's 32 products in order, then the butterfly - so the bits are
// cuda_warp_per_column's (tested), and the two may be routed by shape.
constexpr int kStreamWarps = 4;
// one buffer: the row and up to 15 bytes of head misalignment, in 16-byte pieces
__host__ __device__ constexpr int64_t stream_buffer_bytes(int64_t row_bytes) { return (row_bytes + 15) / 16 * 16 + 16; }

template <typename T, bool WIDE>
__global__ void __launch_bounds__(32 * kStreamWarps) quant_gemv_stream_kernel(const QmmParams p) {
  extern __shared__ __align__(16) unsigned char qmm_stream[];  // [warp][2][stream_buffer_bytes]
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t bufb = stream_buffer_bytes(p.row_bytes), N = p.N, K = p.K;
  unsigned char* buf0 = qmm_stream + int64_t(2 * warp) * bufb;
  const int64_t stride = int64_t(gridDim.x) * kStreamWarps;
  int64_t n = int64_t(blockIdx.x) * kStreamWarps + warp;
  const uint8_t* cur = n < N ? stage_weight_rows(buf0, p.w, p.row_bytes, n, 1, lane, 32) : nullptr;
  pdl_begin();
  const int64_t nblocks = K / 32, bbytes = q_block_bytes(p.q);
  const T* x = static_cast<const T*>(p.x);
  T* out = static_cast<T*>(p.out);
  constexpr int XV = WIDE ? 16 / int(sizeof(T)) : 1;
  for (int sel = 0; n < N; n += stride, sel ^= 1) {
    const uint8_t* next = nullptr;
    if (n + stride < N)
      next = stage_weight_rows(buf0 + (sel ^ 1) * bufb, p.w, p.row_bytes, n + stride, 1, lane, 32);
    else
      cp_async_commit();  // an empty group keeps the wait count uniform
    cp_async_wait<1>();   // this lane's copies of row n have landed
    __syncwarp();         // and every lane's are visible
    float acc = 0.f;
    for (int64_t b = lane; b < nblocks; b += 32) {
      float v[32];
      decode_q_block<WIDE, sizeof(T) == 2>(p.q, cur + b * bbytes, v);
      float s = 0.f;
#pragma unroll
      for (int cc = 0; cc < 32 / XV; ++cc) {
        const auto xv = load_vec<T, XV>(x + b * 32 + cc * XV);
#pragma unroll
        for (int j = 0; j < XV; ++j) s += v[cc * XV + j] * xv.f(j);
      }
      acc += s;
    }
    const float sum = warp_sum(acc);
    if (lane == 0) out[n] = Dt<T>::from_f(sum);
    __syncwarp();  // every lane is done with this buffer before the next step refills it
    cur = next;
  }
  cp_async_wait<0>();
}

// ---- variant cuda_bulk_stream (M = 1, sm_90) ----------------------------------------------
// Decode GEMV from a stream: one persistent CTA per SM owns a contiguous range of output columns,
// i.e. a contiguous range of weight bytes, and streams it through a ring of `slots` shared-memory
// stages of whole rows (up to about 128 KB each; fewer bytes where two would not fit). One thread
// of a producer warp moves each stage with a single bulk copy (cp.async.bulk, the TMA unit)
// completing on the stage's "full" mbarrier, so copying costs the computing warps no instructions;
// the producer does not wait for the previous kernel (weights are read-only inputs, as for every
// quant_matmul kernel's staging; KS_QMM_WSTAGE=0: it does), only for a stage's "empty" barrier
// (every consumer thread arrives once per stage) before refilling its slot. The 16 consumer warps
// stage x once as floats (blocks of 32 stored 36 floats apart, so lanes reading different blocks
// hit distinct banks) and then never wait for each other. Every block's dot product is
// cuda_warp_per_column's (decode_q_block, then the 32 products in order from 0: one dependent FMA
// chain), and every row's sum adds lane l's blocks l, l + 32, ... in order and then sums the lanes
// by the same butterfly: the same bits as cuda_warp_per_column (tested), so the two may be routed
// by shape. Since a block is one dependent chain, a lane works on two blocks at a time (two chains
// in flight):
//  - rows of >= 32 blocks: a warp takes two rows, lane l their blocks l, l + 32, ... (x's block
//    read once for both);
//  - shorter rows (SmolLM2: 18 blocks): a warp takes a group of `group` rows (the fewest keeping
//    90% of its lanes busy), its lanes the group's (row, block) items two at a time, each block's
//    sum kept in the warp's row of sums in shared memory, then a row at a time in the order above.
// A stage's byte range is widened to 16-byte boundaries (the rows keep their address modulo 16,
// so the word loads stay aligned); the matrix's last bytes past its last 16-byte boundary come by
// plain loads.
constexpr int kBulkThreads = 32 * (kBulkWarps + 1);  // + the producer warp (kBulkWarps: launch_rules.hpp)

struct BulkParams {
  const void* x;     // [1, K]
  const uint8_t* w;  // [N, row_bytes], 16-byte aligned
  void* out;         // [1, N]
  int64_t N, K, row_bytes;
  int rows_per_stage, slot_bytes, slots, group;  // rows_per_stage: a multiple of group (rows < 32 blocks)
  bool early;  // the producer copies before the previous kernel has finished (KS_QMM_WSTAGE=0: after)
  int tpr;  // rows < 32 blocks: 1, 2 or 4 adjacent lanes per row (bulk_thread_rows, bulk_tpr); 0: warp groups
  int chunk;  // bytes per bulk copy (bulk_chunk_bytes; 0: one copy per stage)
  bool x_vec;  // x staged by 16-byte loads (x 16-byte aligned, unless KS_QMM_BULK_X_VEC=0; bulk_x_vec)
};

template <typename T, ks_qtype_t Q>
__global__ void __launch_bounds__(kBulkThreads, 1) quant_gemv_bulk_kernel(const BulkParams p) {
  extern __shared__ __align__(16) unsigned char bulk_sm[];  // [slots][slot_bytes], x [nb][36], sums [warp][group * nb]
  __shared__ uint64_t full[kBulkMaxSlots], empty[kBulkMaxSlots];
  constexpr int NT = 32 * kBulkWarps;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t N = p.N, RB = p.row_bytes;
  const int nb = int(p.K / 32), rps = p.rows_per_stage, S = p.slots, G = p.group;
  int64_t r0, r1;
  int nst;
  if (!bulk_ring_begin(p.w, N, RB, rps, S, p.slot_bytes, bulk_sm, full, empty, p.early, p.chunk, kBulkWarps, r0, r1, nst))
    return;  // the producer warp
  constexpr int BB = int(q_block_bytes(Q));
  float* xs = reinterpret_cast<float*>(bulk_sm + int64_t(S) * p.slot_bytes);
  float* sums = xs + nb * 36 + warp * G * nb;  // this warp's (short rows)
  pdl_begin();  // x is the previous kernel's output
  const T* xg = static_cast<const T*>(p.x);
  if (p.x_vec) {  // 16-byte pieces of E values (inside one block: 32 % E == 0), 4 loaded before any is stored
    constexpr int E = 16 / int(sizeof(T));
    const int pieces = nb * 32 / E;
    for (int p0 = threadIdx.x; p0 < pieces; p0 += 4 * NT) {
      uint4 raw[4];
#pragma unroll
      for (int u = 0; u < 4; ++u)
        if (p0 + u * NT < pieces) raw[u] = *reinterpret_cast<const uint4*>(xg + int64_t(p0 + u * NT) * E);
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int pc = p0 + u * NT;
        if (pc >= pieces) break;
        const T* e = reinterpret_cast<const T*>(&raw[u]);
        float* d = xs + (pc * E >> 5) * 36 + (pc * E & 31);  // 16-byte aligned: rows of 36 floats, E | 32
#pragma unroll
        for (int j = 0; j < E; j += 4)
          *reinterpret_cast<float4*>(d + j) =
              make_float4(Dt<T>::to_f(e[j]), Dt<T>::to_f(e[j + 1]), Dt<T>::to_f(e[j + 2]), Dt<T>::to_f(e[j + 3]));
      }
    }
  } else {
    for (int k = threadIdx.x; k < nb * 32; k += NT) xs[(k >> 5) * 36 + (k & 31)] = Dt<T>::to_f(xg[k]);
  }
  named_barrier(1, NT);
  T* out = static_cast<T*>(p.out);
  // One block's dot product, cuda_warp_per_column's expression and order.
  auto block_dot = [&](const unsigned char* blk, const float4* xb) {
    float v[32];
    decode_q_block<true>(Q, blk, v);
    return dot32(v, xb);
  };
  const int step_r = 64 / nb, step_b = 64 % nb;  // (short rows) a lane's item pair stride as (rows, blocks)
  for (int i = 0; i < nst; ++i) {
    const int s = i % S;
    const int64_t a = r0 + int64_t(i) * rps;
    const int rows = int(min(r1 - a, int64_t(rps)));
    const unsigned char* src = bulk_sm + int64_t(s) * p.slot_bytes + ((a * RB) & 15);  // row a
    mbar_wait(&full[s], unsigned(i / S) & 1u);
    if (nb >= 32) {
      // Long rows: a warp takes row pairs (t, t + 1), t even, NW pairs apart; lane l blocks l, l + 32, ...
      // of both rows (x's block read once for the two), the pair's chains independent; then a
      // butterfly per row - cuda_warp_per_column's order. A lone last row is paired with itself.
      for (int t = 2 * bulk_rotated(warp, i * ((rps + 1) / 2)); t < rows; t += 2 * kBulkWarps) {
        const unsigned char* ra = src + int64_t(t) * RB;
        const unsigned char* rb = src + int64_t(min(t + 1, rows - 1)) * RB;
        float acc0 = 0.f, acc1 = 0.f;
        for (int b = lane; b < nb; b += 32) {
          const float4* xb = reinterpret_cast<const float4*>(xs + b * 36);
          acc0 += block_dot(ra + b * BB, xb);
          acc1 += block_dot(rb + b * BB, xb);
        }
        const float s0 = warp_sum(acc0), s1 = warp_sum(acc1);
        if (lane == 0) {
          out[a + t] = Dt<T>::from_f(s0);
          if (t + 1 < rows) out[a + t + 1] = Dt<T>::from_f(s1);
        }
      }
    } else if (p.tpr > 0) {
      // Short rows, a thread per row (where a stage holds >= kBulkThreadRowsMin rows; else, or
      // with KS_QMM_BULK_THREAD_ROWS=0, the warp groups below), or p.tpr adjacent lanes per row:
      // a row's words are RB bytes apart across the rows (for the formats' K / 32 * 34, 20 or
      // 18 bytes per row: distinct or paired banks) and every lane of a row reads the same x
      // block at a time (a broadcast). The bits are the warps': block b's sum s_b is what lane b
      // would hold (0 + s_b), and the butterfly is replayed as the tree it is for lane 0 - round
      // o adds lane l + o into lane l for l < o - with the lanes past the row's blocks holding
      // +0, which changes nothing (no partial sum is -0). Blocks 16..31 are folded into 0..15 as
      // they are made (round 16), so 16 sums are live. With tpr lanes per row, thread h of the
      // row holds tree slots l in [W h, W h + W), W = 16 / tpr (blocks l and l + 16): the rounds
      // o >= W add a partner thread's slots (a shuffle within the row's lanes), the others run
      // in thread 0. The stage's rows go to the NT / tpr row slots rotated like the warps' units
      // (the stage's first row to slot (i * rps) mod (NT / tpr)).
      const int tpr = p.tpr, W = 16 / tpr, h = int(threadIdx.x) % tpr, slots = NT / tpr;
      const int g0 = (int(threadIdx.x) / tpr - int((int64_t(i) * rps) % slots) + slots) % slots;
      const unsigned rmask = (tpr == 1 ? 1u : (1u << tpr) - 1u) << (lane & ~(tpr - 1));
      for (int r = g0; r < rows; r += slots) {
        const unsigned char* rw = src + int64_t(r) * RB;
        float acc[16];
#pragma unroll
        for (int j = 0; j < 16; ++j)
          if (j < W) {
            const int b = W * h + j, b2 = b + 16;
            const float s = b < nb ? 0.f + block_dot(rw + b * BB, reinterpret_cast<const float4*>(xs + b * 36)) : 0.f;
            const float s2 =
                b2 < nb ? 0.f + block_dot(rw + b2 * BB, reinterpret_cast<const float4*>(xs + b2 * 36)) : 0.f;
            acc[j] = s + s2;  // round 16: slot b's sum plus slot b + 16's
          }
#pragma unroll
        for (int o = 8; o > 0; o >>= 1) {
          if (o >= W) {  // slots l < o of threads h < o / W take slot l + o from thread h + o / W
            const int d = o / W;
#pragma unroll
            for (int j = 0; j < 16; ++j)
              if (j < W) {
                const float other = __shfl_down_sync(rmask, acc[j], d, tpr);
                if (h < d) acc[j] = acc[j] + other;
              }
          } else {
#pragma unroll
            for (int l = 0; l < 8; ++l)
              if (l < o) acc[l] = acc[l] + acc[l + o];
          }
        }
        if (h == 0) out[a + r] = Dt<T>::from_f(acc[0]);
      }
    } else {
      // Short rows: a stage's rows form groups of G (at least 90% of the lanes busy); a warp takes
      // groups NW apart, its lanes the group's (row, block) items two at a time (j and
      // j + 32: independent chains; a missing second item repeats the first, unstored), each
      // block's sum kept in the warp's row of sums; then lane l adds blocks l, l + 32, ... of
      // each row in order and the butterfly sums the lanes.
      for (int g0 = G * bulk_rotated(warp, i * (rps / G)); g0 < rows; g0 += kBulkWarps * G) {
        const int grows = min(G, rows - g0);
        const unsigned char* gsrc = src + int64_t(g0) * RB;
        int ra = lane / nb, ba = lane % nb, rb = (lane + 32) / nb, bb = (lane + 32) % nb;
        while (ra < grows) {
          const bool two = rb < grows;
          const int r2 = two ? rb : ra, b2 = two ? bb : ba;
          const float sa = block_dot(gsrc + int64_t(ra) * RB + ba * BB, reinterpret_cast<const float4*>(xs + ba * 36));
          const float sb = block_dot(gsrc + int64_t(r2) * RB + b2 * BB, reinterpret_cast<const float4*>(xs + b2 * 36));
          sums[ra * nb + ba] = sa;
          if (two) sums[rb * nb + bb] = sb;
          ra += step_r, ba += step_b;
          if (ba >= nb) ba -= nb, ++ra;
          rb += step_r, bb += step_b;
          if (bb >= nb) bb -= nb, ++rb;
        }
        __syncwarp();
        for (int r = 0; r < grows; ++r) {
          float acc = 0.f;
          for (int b = lane; b < nb; b += 32) acc += sums[r * nb + b];
          const float sum = warp_sum(acc);
          if (lane == 0) out[a + g0 + r] = Dt<T>::from_f(sum);
        }
        __syncwarp();  // the sums are read before the next group writes them
      }
    }
    mbar_arrive(&empty[s]);  // this thread is done with the slot
  }
}

// ---- paged_attention ----------------------------------------------------------------
// A CTA per (query token, head): keys in tiles of kTile; a warp per key computes its
// score (lanes over head_dim, FP32), the tile's scores go through an online softmax
// (FP32; its base moves only where a tile's maximum passes it by more than 8: attn_next_base),
// and thread d accumulates sum_j p_j v_j[d]: each tile's terms in order, then the tiles' sums in
// attn_cascade_add's two levels (the denominator: each tile's sum by the threads and warps, then
// the same two levels).
constexpr int kAttnThreads = 128, kTile = 128;


template <typename T>
__global__ void __launch_bounds__(kAttnThreads) paged_attention_kernel(const AttnParams p) {
  extern __shared__ float attn_sh[];  // q, acc, outer (D floats each: attn_cascade_add's levels)
  __shared__ float sc[kTile];
  __shared__ int64_t slot_of[kTile];
  __shared__ float red[kAttnThreads / 32];
  pdl_begin();
  const int64_t D = p.head_dim;
  float* qv = attn_sh;
  float* acc = attn_sh + D;
  float* outer = attn_sh + 2 * D;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = kAttnThreads / 32;
  const int64_t group = p.num_heads / p.num_kv_heads;
  for (int64_t th = blockIdx.x; th < p.num_tokens * p.num_heads; th += gridDim.x) {
    const int64_t t = th / p.num_heads, h = th % p.num_heads, kvh = h / group;
    const T* q = static_cast<const T*>(p.q) + (t * p.num_heads + h) * D;
    T* out = static_cast<T*>(p.out) + (t * p.num_heads + h) * D;
    const auto [seq, len] = token_context(p, t);
    __syncthreads();  // the previous row's q / acc are no longer read
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
      qv[d] = ld_f(q, d);
      acc[d] = outer[d] = 0.f;
    }
    float run_max = -INFINITY, run_sum = 0.f, outer_sum = 0.f;
    bool any_key = false;  // a key that is not dropped (the same value in every thread)
    for (int64_t j0 = 0; j0 < len; j0 += kTile) {
      const int64_t nt = min(int64_t(kTile), len - j0);
      __syncthreads();  // qv written / the previous tile's scores consumed
      int kept = 0;
      for (int64_t j = threadIdx.x; j < nt; j += blockDim.x) {
        const int64_t pos = j0 + j;
        const int64_t blk = p.block_tables[seq * p.max_blocks_per_seq + pos / p.block_size];
        slot_of[j] = (blk >= 0 && blk < p.num_blocks) ? blk * p.block_size + pos % p.block_size : -1;
        kept |= slot_of[j] >= 0;
      }
      any_key |= __syncthreads_or(kept) != 0;
      for (int64_t j = warp; j < nt; j += nw) {
        float dot = 0.f;
        const int64_t slot = slot_of[j];
        if (slot >= 0) {
          const T* kr = static_cast<const T*>(p.k_cache) + (slot * p.num_kv_heads + kvh) * D;
          for (int64_t d = lane; d < D; d += 32) dot += qv[d] * ld_f(kr, d);
        }
        dot = warp_sum(dot);
        if (lane == 0) sc[j] = slot >= 0 ? dot * p.scale : -INFINITY;  // a dropped key weighs 0
      }
      __syncthreads();
      // tile maximum (max of FP32 scores, NaN ignored as the CPU's std::max does; a NaN
      // score propagates through its exp below)
      float m = -INFINITY;
      for (int64_t j = threadIdx.x; j < nt; j += blockDim.x) m = fmaxf(m, sc[j]);
      m = warp_max(m);
      if (lane == 0) red[warp] = m;
      __syncthreads();
      m = red[0];
      for (int i = 1; i < nw; ++i) m = fmaxf(m, red[i]);
      const float new_max = attn_next_base(run_max, m);  // (the lazy base: weights up to e^8)
      const float corr = attn_base_corr(run_max, new_max);
      __syncthreads();  // red read by all before reuse
      float s = 0.f;
      for (int64_t j = threadIdx.x; j < nt; j += blockDim.x) {
        // Dropped keys and -inf scores weigh 0 (a -inf score against a -inf maximum is
        // settled at the end). A NaN score gives a NaN weight even when the maximum so far
        // is -inf, so the row is NaN as on the CPU (exp(NaN - max)), never a zero or finite
        // row that hides the NaN.
        const float e = (slot_of[j] < 0 || sc[j] == -INFINITY) ? 0.f : expf(sc[j] - new_max);
        sc[j] = e;
        s += e;
      }
      s = warp_sum(s);
      if (lane == 0) red[warp] = s;
      __syncthreads();
      float tile_sum = 0.f;
      for (int i = 0; i < nw; ++i) tile_sum += red[i];
      const bool fold = attn_fold_after(j0, kTile);
      attn_cascade_add(run_sum, outer_sum, corr, tile_sum, fold);
      run_max = new_max;
      for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
        float a = 0.f;  // the tile's terms
        for (int64_t j = 0; j < nt; ++j) {
          const int64_t slot = slot_of[j];
          if (slot < 0) continue;
          a += sc[j] * ld_f(static_cast<const T*>(p.v_cache) + (slot * p.num_kv_heads + kvh) * D, d);
        }
        attn_cascade_add(acc[d], outer[d], corr, a, fold);
      }
    }
    __syncthreads();
    // No key left (all dropped): a zero row. Keys whose scores are all -inf: softmax of
    // all -inf, a NaN row (as the CPU's exp(-inf - -inf)). A NaN sum stays NaN.
    const float total = outer_sum + run_sum;
    const float inv = total == 0.f ? (any_key ? __int_as_float(0x7fffffff) : 0.f) : 1.f / total;
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x)
      out[d] = Dt<T>::from_f(len > 0 ? (outer[d] + acc[d]) * inv : 0.f);
  }
}

}  // namespace

// ---- launchers ----------------------------------------------------------------------
void argmax_cuda(const void* args, ks_stream_t stream) {
  const auto& a = *static_cast<const ops::ArgmaxArgs*>(args);
  DeviceGuard g(a.x.device.device_id, "argmax");
  const DeviceProps& dp = device_props(a.x.device.device_id);
  // a cluster of up to 16 CTAs per row (argmax_cluster, launch_rules.hpp: the sizes measured
  // fastest on the H200); 16 (non-portable) only where a cluster of 16 can be resident, else 8.
  // KS_ARGMAX_CLUSTER=1/2/4/8/16 (experiments) forces the cluster size. The result does not
  // depend on it.
  static const int forced = int(env_number("KS_ARGMAX_CLUSTER", 0));
  int C = 1;
  if (dp.sm90_code) {
    if (forced == 1 || forced == 2 || forced == 4 || forced == 8 || forced == 16)
      C = forced;
    else
      C = argmax_cluster(a.rows, a.cols, dp.sm_count, kArgmaxMaxCluster);
  }
  const auto s = static_cast<cudaStream_t>(stream);
  int64_t* out = static_cast<int64_t*>(a.out.data);
  unsigned grid = 0;
  with_float_type(a.x.dtype, [&](auto tag) {
    using T = decltype(tag);
    if (C == 16) C = cluster16_or_8<argmax_kernel<T>>(a.x.device.device_id, kArgmaxThreads, 0, "argmax");
    const int64_t clusters = std::min<int64_t>(a.rows, int64_t(dp.sm_count) * 8 / C);
    grid = unsigned(clusters * C);
    launch_kernel("argmax", argmax_kernel<T>, dim3(grid), dim3(kArgmaxThreads), 0, s, C, dp.pdl,
                  static_cast<const T*>(a.x.data), out, a.rows, a.cols);
  });
  check_launch("argmax");
  record_launch("argmax", "threads=%lld cluster=%lld grid=%lld", {kArgmaxThreads, C, grid});
}

void embedding_cuda(const void* args, ks_stream_t stream) {
  const auto& a = *static_cast<const ops::EmbeddingArgs*>(args);
  DeviceGuard g(a.out.device.device_id, "embedding");
  const DeviceProps& dp = device_props(a.out.device.device_id);
  EmbParams p{a.out.data, a.ids.data, a.ids.dtype == detail::DType::I64, a.table.data, a.format,
              a.num_ids,  a.hidden,   a.vocab,                            a.row_bytes};
  const unsigned grid = unsigned(std::min<int64_t>(a.num_ids, int64_t(dp.sm_count) * 16));
  const auto s = static_cast<cudaStream_t>(stream);
  with_float_type(a.out.dtype, [&](auto tag) {
    launch_kernel("embedding", embedding_kernel<decltype(tag)>, dim3(grid), dim3(256), 0, s, 1, dp.pdl, p);
  });
  check_launch("embedding");
  record_launch("embedding", "threads=256 grid=%lld", {grid});
}

void dequantize_cuda(const void* args, ks_stream_t stream) {
  const auto& a = *static_cast<const ops::DequantizeArgs*>(args);
  DeviceGuard g(a.out.device.device_id, "dequantize");
  const DeviceProps& dp = device_props(a.out.device.device_id);
  const dim3 grid(unsigned(std::min<int64_t>((a.cols + 255) / 256, 64)), unsigned(std::min<int64_t>(a.rows, 65535)));
  const auto s = static_cast<cudaStream_t>(stream);
  const auto* src = static_cast<const uint8_t*>(a.packed.data);
  with_float_type(a.out.dtype, [&](auto tag) {
    using T = decltype(tag);
    launch_kernel("dequantize", dequantize_kernel<T>, grid, dim3(256), 0, s, 1, dp.pdl, static_cast<T*>(a.out.data), src,
                  a.qtype, a.rows, a.cols, a.row_bytes);
  });
  check_launch("dequantize");
  record_launch("dequantize", "threads=256 grid=%lldx%lld", {grid.x, grid.y});
}

namespace {
// One launcher for quant_matmul and its two fused forms. rows: every pointer the kernel reads
// rows through (16-byte alignment for the vector path).
// MQ_MANY: the rows one decoded weight block serves when M > 1 (4; the cuda_warp_per_column_m16
// variant: 16, Pro::None only). A row's arithmetic does not depend on it.
// (KS_QMM_WSTAGE=0 turns weight staging off: qmm_stage_weights_enabled, common.cuh)

// Word loads of the blocks (Q4_1: 4-byte aligned weights; Q4_0 / Q8_0: 2-byte) and 16-byte
// loads of every row pointer the kernel reads.
bool all_aligned16(std::initializer_list<const void*> rows) {
  for (const void* r : rows)
    if (!aligned16(r)) return false;
  return true;
}
bool qmm_wide(const QmmParams& p, std::initializer_list<const void*> rows) {
  const uintptr_t wa = reinterpret_cast<uintptr_t>(p.w);
  return (p.q == KS_QTYPE_Q4_1 ? wa % 4 == 0 : wa % 2 == 0) && all_aligned16(rows);
}

// dense_matmul_kernel's launch (launch_qmm's for the dense formats): 16-byte chunks where the
// weights and every row pointer are 16-byte aligned and K % 8 == 0 (so every row starts on a
// 16-byte boundary too), else element by element.
template <Pro P>
void launch_dense_qmm(const char* op, const QmmParams& p, detail::DType dt, int dev,
                      std::initializer_list<const void*> rows, ks_stream_t stream) {
  const DeviceProps& dp = device_props(dev);
  const bool vec = aligned16(p.w) && p.K % 8 == 0 && all_aligned16(rows);
  // (a warp per column; past 2^31 - 1 CTAs the warps stride over the columns)
  const int64_t ctas = std::max<int64_t>(1, (p.N + kDenseWarps - 1) / kDenseWarps);
  const unsigned grid = unsigned(std::min<int64_t>(ctas, std::numeric_limits<int32_t>::max()));
  const bool bf16 = p.q == KS_QTYPE_BF16;
  const auto s = static_cast<cudaStream_t>(stream);
  with_float_type(dt, [&](auto tag) {
    using T = decltype(tag);
    auto launch = [&](auto kern) {
      launch_kernel(op, kern, dim3(grid), dim3(32 * kDenseWarps), 0, s, 1, dp.pdl, p, bf16);
    };
    if (p.q == KS_QTYPE_F32)
      vec ? launch(dense_matmul_kernel<T, 4, true, P>) : launch(dense_matmul_kernel<T, 4, false, P>);
    else
      vec ? launch(dense_matmul_kernel<T, 2, true, P>) : launch(dense_matmul_kernel<T, 2, false, P>);
  });
  check_launch(op);
  record_launch(op, "dense_warp_per_column warps_per_cta=%lld m_chunk=%lld vector_loads=%lld grid=%lld",
                {kDenseWarps, kDenseRows, vec ? 1 : 0, grid});
}

// rope (and tab): fused_add_rms_norm_quant_matmul_rope_kv_append's epilogue (Norm / AddNorm, M = 1,
// the staged rows and 16-byte loads: norm_qmm_rope_can_implement checks them first).
// STAGE_X (P == None, M >= 2, 16-byte rows; quant_matmul's cuda_staged_x): x's rows staged in
// shared memory as the fused forms stage theirs, 16 rows per decoded block where 16 fit (else 4).
template <Pro P, int MQ_MANY = kMqMany, bool STAGE_X = false>
void launch_qmm(const char* op, QmmParams p, detail::DType dt, int dev, std::initializer_list<const void*> rows,
                ks_stream_t stream, const RopeEpi* rope = nullptr, const RopeTable* tab = nullptr) {
  static_assert(MQ_MANY == kMqMany || P == Pro::None, "the fused forms chunk rows by 4");
  static_assert(!STAGE_X || (P == Pro::None && MQ_MANY == kMqMany), "staged x: quant_matmul's rows");
  DeviceGuard g(dev, op);
  if (qtype_is_dense(p.q)) {  // cuda_warp_per_column and the fusions' default variants only (can_implement)
    if (rope || STAGE_X || MQ_MANY != kMqMany)
      detail::fail(KS_ERROR_INTERNAL, op, "dense weights reached a block-format-only kernel");
    launch_dense_qmm<P>(op, p, dt, dev, rows, stream);
    return;
  }
  const DeviceProps& dp = device_props(dev);
  constexpr int kWarps = 8;
  // Columns per warp: 2 or 4 where the grid keeps at least 2 CTAs per SM even so and a CTA's
  // weight rows stay within 16 KB (wide matrices of short rows, e.g. an lm_head of 49152 x 576:
  // fewer, longer-lived CTAs with more bytes in flight each). By N, the row bytes and the SM
  // count, never by M; no value depends on it.
  int nc = 1;
  while (nc < 4 && p.N >= int64_t(kWarps) * 2 * nc * 2 * dp.sm_count && int64_t(kWarps) * 2 * nc * p.row_bytes <= 16384)
    nc *= 2;
  p.cols_per_warp = nc;
  const int64_t cta_cols = int64_t(kWarps) * nc;
  const unsigned grid = unsigned(std::max<int64_t>(1, (p.N + cta_cols - 1) / cta_cols));
  const bool wide = qmm_wide(p, rows);
  const bool x16 = STAGE_X && p.M >= 16 && staged_rows_fit(16, p.K);
  const int mq = p.M == 1 ? 1 : x16 ? 16 : MQ_MANY;
  // The fused forms stage their rows when 4 of them fit (K <= 2720), whatever M is: the
  // staged and per-warp kernels sum a row's squares in different orders, so a choice that
  // depended on M would make a row's result depend on the batch. (cuda_staged_x: the variant's
  // can_implement asks for 4 rows' room; its sums are the per-warp kernel's, in the same order.)
  const bool staged = (P != Pro::None || STAGE_X) && staged_rows_fit(kMqMany, p.K);
  const size_t row_smem = staged ? size_t(std::min<int64_t>(p.M, mq)) * size_t(staged_floats(p.K)) * sizeof(float) : 0;
  // Weight staging changes no arithmetic, so it may depend on anything: grids of at most 3 CTAs
  // per SM (qmm_stage_weights_ctas_per_sm; decode-sized matrices, where hiding the weights'
  // latency behind the previous kernel is the gain; measured on the H200 at 488a101: 576 x 576
  // 1.43 vs 1.55 us, SiLU + down 2.42 vs 2.85; from 2 to 3 CTAs per SM at 0736325, which stages
  // SmolLM2's gate|up (384 CTAs, all resident at once: 64 registers, under 48 KB each): batch-1
  // decode 1737 against 1688 tokens/s, the kernel alone 3.09 against 3.14 us), and where the
  // CTA's rows fit next to the staged x rows in the default 48 KB.
  // Larger grids run in waves, where a CTA's load-then-compute phases cost more than they hide
  // (4096 x 4096 Q4_1: 9.45 staged vs 8.50 us).
  // One column per warp only (2-4 columns per warp come with grids larger than that anyway).
  // The budget leaves room for the staged kernel's static red[] (static + dynamic <= 48 KB
  // without an opt-in).
  const size_t w_smem = size_t(staged_weight_bytes(cta_cols, p.row_bytes));
  const size_t static_smem = kStageWarps * sizeof(float) * (rope ? 1 + kMaxColsPerWarp : 1);  // red[] (, colv)
  const size_t staged_smem = row_smem + w_smem + static_smem;  // a staging CTA's shared memory
  // (the CTAs per SM also bounded by their shared memory, with 1 KB per CTA that the runtime
  // reserves: on a GPU with less shared memory per SM than the H200 a grid of 3 per SM would run
  // in waves, where staging loses; registers: the staged kernels take 64 or fewer, 4 CTAs)
  const int64_t cta_smem = int64_t(staged_smem) + 1024;
  const int64_t fit = dp.smem_per_sm > 0 ? std::max<int64_t>(1, dp.smem_per_sm / cta_smem) : 1;
  const int64_t per_sm = std::min<int64_t>(qmm_stage_weights_ctas_per_sm(), fit);
  const bool sw = qmm_stage_weights_enabled() && nc == 1 && int64_t(grid) <= per_sm * int64_t(dp.sm_count) &&
                  staged_smem <= kStageBytes;
  const size_t smem = row_smem + (sw ? w_smem : 0);
  const auto s = static_cast<cudaStream_t>(stream);
  auto go = [&](auto tag, auto sw_tag) {
    using T = decltype(tag);
    constexpr bool SW = decltype(sw_tag)::value;
    auto launch = [&](auto kern) { launch_kernel(op, kern, dim3(grid), dim3(32 * kWarps), smem, s, 1, dp.pdl, p); };
    if constexpr (P == Pro::Norm || P == Pro::AddNorm) {
      if (rope) {  // staged, wide and M = 1 (checked by the variant's can_implement)
        if (!staged || !wide || p.M != 1) detail::fail(KS_ERROR_INTERNAL, op, "the RoPE epilogue needs staged rows");
        launch_kernel(op, quant_matmul_staged_rope_kernel<T, true, P, SW>, dim3(grid), dim3(32 * kWarps), smem, s, 1,
                      dp.pdl, p, *rope, *tab);
        return;
      }
    }
    if constexpr (STAGE_X) {
      if (!staged || !wide || p.M < 2) detail::fail(KS_ERROR_INTERNAL, op, "cuda_staged_x: its rows do not fit");
      x16 ? launch(quant_matmul_staged_kernel<T, true, 16, P, SW>)
          : launch(quant_matmul_staged_kernel<T, true, kMqMany, P, SW>);
      return;
    }
    if constexpr (P != Pro::None) {
      if (staged) {
        if (wide)
          mq == 1 ? launch(quant_matmul_staged_kernel<T, true, 1, P, SW>)
                  : launch(quant_matmul_staged_kernel<T, true, kMqMany, P, SW>);
        else
          mq == 1 ? launch(quant_matmul_staged_kernel<T, false, 1, P, SW>)
                  : launch(quant_matmul_staged_kernel<T, false, kMqMany, P, SW>);
        return;
      }
    }
    if (wide)
      mq == 1 ? launch(quant_matmul_kernel<T, true, 1, P, SW>) : launch(quant_matmul_kernel<T, true, MQ_MANY, P, SW>);
    else
      mq == 1 ? launch(quant_matmul_kernel<T, false, 1, P, SW>)
              : launch(quant_matmul_kernel<T, false, MQ_MANY, P, SW>);
  };
  with_float_type(dt, [&](auto tag) {
    if (sw)
      go(tag, std::true_type{});
    else
      go(tag, std::false_type{});
  });
  check_launch(op);
  record_launch(op,
                "warp_per_column warps_per_cta=%lld m_chunk=%lld wide_loads=%lld staged_rows=%lld cols_per_warp=%lld "
                "staged_weights=%lld rope_epilogue=%lld rope_early_trigger=%lld",
                {kWarps, mq, wide ? 1 : 0, staged ? 1 : 0, nc, sw ? 1 : 0, rope ? 1 : 0,
                 rope && rope->early_trigger ? 1 : 0});
}
}  // namespace

namespace {
QmmParams qmm_params(const ops::QuantMatmulArgs& a) {
  return QmmParams{a.x.data, nullptr, nullptr, nullptr, static_cast<const uint8_t*>(a.weight.data), a.out.data,
                   a.m, a.n, a.k, a.row_bytes, 0.f, a.qtype, 1};
}
}  // namespace

void quant_matmul_cuda(const void* args, ks_stream_t stream) {
  const auto& a = *static_cast<const ops::QuantMatmulArgs*>(args);
  const QmmParams p = qmm_params(a);
  launch_qmm<Pro::None>("quant_matmul", p, a.x.dtype, a.x.device.device_id, {a.x.data}, stream);
}

// Variant cuda_warp_per_column_m16 (M >= 8): each decoded block serves 16 rows of x instead of
// 4, so a batch of 32 decodes the weights twice instead of 8 times. The same per-row sums in
// the same order as cuda_warp_per_column: the same bits (tested), so the two may be routed by M.
void quant_matmul_m16_cuda(const void* args, ks_stream_t stream) {
  const auto& a = *static_cast<const ops::QuantMatmulArgs*>(args);
  const QmmParams p = qmm_params(a);
  launch_qmm<Pro::None, 16>("quant_matmul", p, a.x.dtype, a.x.device.device_id, {a.x.data}, stream);
}

// Variant cuda_staged_x (M >= 2): x's rows staged once per CTA in shared memory (blocks of 32
// stored 36 floats apart), 16 rows per decoded block where 16 rows of K fit in 48 KB, else 4;
// the weights staged too where the grid allows (as cuda_warp_per_column). The per-warp kernel
// reads every row's values from global memory (L1) once per decoded block and column; here
// from shared memory. Each row's sums are cuda_warp_per_column's, in the same order: the same
// bits (GPU test), so the two may be routed by M.
std::string quant_matmul_staged_x_can_implement(const void* args) {
  const auto& a = *static_cast<const ops::QuantMatmulArgs*>(args);
  if (a.m < 2) return "one row: nothing to share between rows";
  if (!staged_rows_fit(kMqMany, a.k))
    return "K > 2720: 4 rows of x do not fit 48 KB of shared memory";
  const QmmParams p = qmm_params(a);
  if (!qmm_wide(p, {a.x.data})) return "x's rows or the weights not aligned for 16-byte / word loads";
  return "";
}

void quant_matmul_staged_x_cuda(const void* args, ks_stream_t stream) {
  const auto& a = *static_cast<const ops::QuantMatmulArgs*>(args);
  const QmmParams p = qmm_params(a);
  launch_qmm<Pro::None, kMqMany, true>("quant_matmul", p, a.x.dtype, a.x.device.device_id, {a.x.data}, stream);
}

std::string quant_matmul_m16_can_implement(const void* args) {
  const auto& a = *static_cast<const ops::QuantMatmulArgs*>(args);
  return a.m >= 8 ? "" : "fewer than 8 rows: cuda_warp_per_column's 4-row chunks already cover them";
}

// Variant cuda_row_stream (M = 1, two row buffers per warp within 48 KB): see
// quant_gemv_stream_kernel. KS_QMM_STREAM_CTAS_PER_SM (default 4) sets the grid's CTAs per SM
// for experiments; there are never more warps than columns.
std::string quant_matmul_stream_can_implement(const void* args) {
  const auto& a = *static_cast<const ops::QuantMatmulArgs*>(args);
  if (a.m != 1) return "M > 1: the row stream serves one row of x (decode)";
  if (2 * kStreamWarps * stream_buffer_bytes(a.row_bytes) > int64_t(kStageBytes))
    return "rows over 5.9 KB: two buffers per warp would exceed 48 KB of shared memory";
  return "";
}

void quant_matmul_stream_cuda(const void* args, ks_stream_t stream) {
  const auto& a = *static_cast<const ops::QuantMatmulArgs*>(args);
  const QmmParams p = qmm_params(a);
  DeviceGuard g(a.x.device.device_id, "quant_matmul");
  const DeviceProps& dp = device_props(a.x.device.device_id);
  static const int64_t ctas_per_sm = [] {
    const long long v = env_number("KS_QMM_STREAM_CTAS_PER_SM", 0);
    return int64_t(v > 0 ? v : 4);
  }();
  const int64_t grid = std::max<int64_t>(
      1, std::min<int64_t>((p.N + kStreamWarps - 1) / kStreamWarps, ctas_per_sm * dp.sm_count));
  const size_t smem = size_t(2 * kStreamWarps * stream_buffer_bytes(p.row_bytes));
  const bool wide = qmm_wide(p, {a.x.data});
  const auto s = static_cast<cudaStream_t>(stream);
  with_float_type(a.x.dtype, [&](auto tag) {
    using T = decltype(tag);
    launch_kernel("quant_matmul", wide ? quant_gemv_stream_kernel<T, true> : quant_gemv_stream_kernel<T, false>,
                  dim3(unsigned(grid)), dim3(32 * kStreamWarps), smem, s, 1, dp.pdl, p);
  });
  check_launch("quant_matmul");
  record_launch("quant_matmul", "row_stream warps_per_cta=%lld grid=%lld wide_loads=%lld buffer_bytes=%lld",
                {kStreamWarps, grid, wide ? 1 : 0, stream_buffer_bytes(p.row_bytes)});
}

// Variant cuda_bulk_stream (M = 1, sm_90): see quant_gemv_bulk_kernel. Its plan (bulk_plan,
// launch_rules.hpp, unit-tested on the CPU) depends on the shape, the SM count and the shared
// memory limit only (none of them changes a value). KS_QMM_BULK_STAGE_KB (default 128) sets
// the bytes of one stage for experiments.
namespace {
// Rows of fewer than 32 blocks go a thread per row where stages hold enough of them
// (bulk_thread_rows, launch_rules.hpp); KS_QMM_BULK_THREAD_ROWS=0: always in warp groups (the
// same bits; for comparisons).
bool bulk_thread_rows_enabled() {
  static const bool on = !env_is("KS_QMM_BULK_THREAD_ROWS", "0");
  return on;
}
// Lanes per short row: bulk_lanes_per_row's (launch_rules.hpp), or KS_QMM_BULK_TPR=1, 2 or 4
// (experiments; the same bits either way).
int bulk_tpr(ks_qtype_t qtype) {
  static const int forced = [] {
    const long long v = env_number("KS_QMM_BULK_TPR", 0);
    return v == 1 || v == 2 || v == 4 ? int(v) : 0;
  }();
  return forced ? forced : bulk_lanes_per_row(q_block_bytes(qtype));
}
BulkPlan bulk_plan_for(const ops::QuantMatmulArgs& a) {
  const int dev = a.x.device.device_id;
  int64_t limit = 0;
  with_float_type_and_qtype(a.x.dtype, a.qtype, [&](auto tag, auto q) {
    limit = opt_in_smem_limit<quant_gemv_bulk_kernel<decltype(tag), decltype(q)::value>>(dev, "quant_matmul");
  });
  static const int64_t target = [] {
    const long long kb = env_number("KS_QMM_BULK_STAGE_KB", 0);
    return int64_t(kb > 0 ? kb : 128) * 1024;
  }();
  return bulk_plan(a.n, a.k, a.row_bytes, device_props(dev).sm_count, limit, target);
}
}  // namespace

std::string quant_matmul_bulk_can_implement(const void* args) {
  const auto& a = *static_cast<const ops::QuantMatmulArgs*>(args);
  if (a.m != 1) return "M > 1: the bulk stream serves one row of x (decode)";
  if (!device_props(a.x.device.device_id).sm90_code) return "needs sm_90 code (bulk copies and mbarriers)";
  if (!aligned16(a.weight.data)) return "weight not 16-byte aligned (bulk copies)";
  if (a.k < 32) return "K = 0: nothing to stream";
  if (a.n > 0 && bulk_plan_for(a).slots < 1) return "x and one stage of rows do not fit the device's shared memory";
  return "";
}

// cuda_bulk_stream's x by 16-byte loads where x is 16-byte aligned (KS_QMM_BULK_X_VEC=0: value by
// value). The same floats in the same places, so the same bits (the quant_matmul stream / block /
// wide-matrix GPU tests passed under it at ae645f0). Measured on the H200 at ae645f0 against the
// value-by-value form, bf16 x, one call (docs/perf/h200_quant_bulk_xvec_ae645f0.csv): Q4_1
// 4096 x 4096 7.16 -> 7.04 us, 14336 x 4096 18.29 -> 18.10, 49152 x 576 12.71 -> 12.45; Q8_0
// 8.60 -> 8.48, 22.17 -> 21.86, 20.09 -> 19.91; Q4_0 7.12 -> 6.99, 18.17 -> 18.02 (1-2%).
static bool bulk_x_vec(const void* x) {
  static const bool on = env_number("KS_QMM_BULK_X_VEC", 1) != 0;
  return on && aligned16(x);
}

void quant_matmul_bulk_cuda(const void* args, ks_stream_t stream) {
  const auto& a = *static_cast<const ops::QuantMatmulArgs*>(args);
  const int dev = a.x.device.device_id;
  DeviceGuard g(dev, "quant_matmul");
  if (a.n == 0) return;  // nothing to write
  const BulkPlan plan = bulk_plan_for(a);
  if (plan.slots < 1) detail::fail(KS_ERROR_INTERNAL, "quant_matmul", "cuda_bulk_stream: no stage fits shared memory");
  const BulkParams p{a.x.data, static_cast<const uint8_t*>(a.weight.data), a.out.data, a.n, a.k, a.row_bytes,
                     plan.rps, plan.slot_bytes, plan.slots, plan.group, qmm_stage_weights_enabled(),
                     bulk_thread_rows_enabled() && bulk_thread_rows(plan, a.k) ? bulk_tpr(a.qtype) : 0,
                     bulk_chunk_bytes(0), bulk_x_vec(a.x.data)};
  const auto s = static_cast<cudaStream_t>(stream);
  with_float_type_and_qtype(a.x.dtype, a.qtype, [&](auto tag, auto q) {
    launch_kernel("quant_matmul", quant_gemv_bulk_kernel<decltype(tag), decltype(q)::value>, dim3(plan.grid),
                  dim3(kBulkThreads), plan.smem, s, 1, device_props(dev).pdl, p);
  });
  check_launch("quant_matmul");
  record_launch("quant_matmul",
                "bulk_stream rows_per_stage=%lld group=%lld slot_bytes=%lld slots=%lld grid=%lld smem=%lld thread_rows=%lld "
                "threads_per_row=%lld x_vec=%lld",
                {plan.rps, plan.group, plan.slot_bytes, plan.slots, plan.grid, (long long)plan.smem,
                 p.tpr > 0 ? 1 : 0, p.tpr, p.x_vec ? 1 : 0});
}

namespace {
QmmParams norm_qmm_params(const ops::NormQuantMatmulArgs& a) {
  return QmmParams{a.residual.data, a.has_x ? a.x.data : nullptr, a.norm_weight.data,
                   a.has_x ? a.residual_out.data : nullptr, static_cast<const uint8_t*>(a.weight.data), a.out.data,
                   a.m, a.n, a.k, a.row_bytes, a.eps, a.qtype, 1};
}
// The rows the norm forms read (16-byte loads need every one aligned): f({rows...}).
template <typename F>
auto with_norm_rows(const ops::NormQuantMatmulArgs& a, F f) {
  return a.has_x ? f({a.residual.data, a.x.data, a.norm_weight.data, a.residual_out.data})
                 : f({a.residual.data, a.norm_weight.data});
}
// fused_add_rms_norm_quant_matmul's launch (rope, tab: the RoPE + cache epilogue of the fusion
// that adds them)
void launch_norm_qmm(const char* op, const ops::NormQuantMatmulArgs& a, ks_stream_t stream,
                     const RopeEpi* rope = nullptr, const RopeTable* tab = nullptr) {
  QmmParams p = norm_qmm_params(a);
  const int dev = a.residual.device.device_id;
  with_norm_rows(a, [&](std::initializer_list<const void*> rows) {
    if (a.has_x)
      launch_qmm<Pro::AddNorm>(op, p, a.residual.dtype, dev, rows, stream, rope, tab);
    else
      launch_qmm<Pro::Norm>(op, p, a.residual.dtype, dev, rows, stream, rope, tab);
  });
}
}  // namespace

void norm_quant_matmul_cuda(const void* args, ks_stream_t stream) {
  launch_norm_qmm("fused_add_rms_norm_quant_matmul", *static_cast<const ops::NormQuantMatmulArgs*>(args), stream);
}

// fused_add_rms_norm_quant_matmul_rope_kv_append, variant cuda_warp_per_column: the staged
// norm + matmul kernel with the RoPE + cache epilogue (one kernel).
std::string norm_qmm_rope_can_implement(const void* args) {
  const auto& a = *static_cast<const ops::NormQmmRopeAppendArgs*>(args);
  if (a.rkv.rope.neox) return "NeoX pairs (i, i + rotary_dim / 2) span CTAs: the two calls run instead";
  // a CTA's column pairs (n0 + 2t, n0 + 2t + 1) are a head's pairs only when every head starts on
  // an even column (an odd head_dim would pair across heads and past out's end)
  if (a.rkv.rope.head_dim % 2 != 0) return "odd head_dim: column pairs would straddle heads";
  if (a.rkv.rope.rotary_dim / 2 > kRopeParamHalf) return "rotary_dim > 1024 (the inverse frequencies travel as a parameter)";
  if (a.mm.m != 1) return "one row only";
  if (!staged_rows_fit(kMqMany, a.mm.k))
    return "K > 2720: the normalized row is not staged in shared memory";
  const QmmParams p = norm_qmm_params(a.mm);
  if (!with_norm_rows(a.mm, [&](std::initializer_list<const void*> rows) { return qmm_wide(p, rows); }))
    return "rows or weights not aligned for 16-byte / word loads";
  return "";
}

void norm_qmm_rope_cuda(const void* args, ks_stream_t stream) {
  const auto& a = *static_cast<const ops::NormQmmRopeAppendArgs*>(args);
  const char* op = "fused_add_rms_norm_quant_matmul_rope_kv_append";
  const ops::RotaryArgs& r = a.rkv.rope;
  const ops::KvCacheAppendArgs& kv = a.rkv.kv;
  RopeTable tab{};
  cpu::rope_inv_freq(r.rotary_dim, r.theta, tab.inv);
  const RopeEpi e{r.positions.data,
                  kv.slot_mapping.data,
                  static_cast<char*>(kv.k_cache.data),
                  static_cast<char*>(kv.v_cache.data),
                  kv.num_slots,
                  kv.num_kv_heads * kv.head_dim > 0 ? kv.num_tokens : 0,
                  int(r.num_heads),
                  int(r.num_kv_heads),
                  int(r.head_dim),
                  int(r.rotary_dim / 2),
                  r.positions.dtype == detail::DType::I64,
                  kv.slot_mapping.dtype == detail::DType::I64,
                  !env_is("KS_QMM_ROPE_EARLY_TRIGGER", "0")};
  launch_norm_qmm(op, a.mm, stream, &e, &tab);
}

void silu_quant_matmul_cuda(const void* args, ks_stream_t stream) {
  const auto& a = *static_cast<const ops::SiluQuantMatmulArgs*>(args);
  const QmmParams p{a.gate_up.data, nullptr, nullptr, nullptr, static_cast<const uint8_t*>(a.weight.data), a.out.data,
                    a.m, a.n, a.k, a.row_bytes, 0.f, a.qtype, 1};
  launch_qmm<Pro::Silu>("silu_and_mul_quant_matmul", p, a.gate_up.dtype, a.gate_up.device.device_id, {a.gate_up.data},
                        stream);
}

std::string paged_attention_can_implement(const void* args) {
  const auto& a = *static_cast<const ops::PagedAttentionArgs*>(args);
  if (a.head_dim > 4096) return "head_dim > 4096 (q and the accumulator's two levels are kept in 3 x head_dim floats of shared memory)";
  return "";
}

void paged_attention_cuda(const void* args, ks_stream_t stream) {
  const auto& a = *static_cast<const ops::PagedAttentionArgs*>(args);
  DeviceGuard g(a.q.device.device_id, "paged_attention");
  const DeviceProps& dp = device_props(a.q.device.device_id);
  const AttnParams p = attn_params(a);
  const unsigned grid = unsigned(std::min<int64_t>(a.num_tokens * a.num_heads, int64_t(dp.sm_count) * 16));
  const size_t smem = size_t(3 * a.head_dim) * sizeof(float);  // q, acc, outer
  const auto s = static_cast<cudaStream_t>(stream);
  with_float_type(a.q.dtype, [&](auto tag) {
    // 48 KB at head_dim 4096, past the default limit with the static arrays: the opt-in limit
    // (once per device; a device with less refuses the call)
    require_opt_in_smem<paged_attention_kernel<decltype(tag)>>(a.q.device.device_id, "paged_attention", smem,
                                                               "head_dim " + std::to_string(a.head_dim));
    launch_kernel("paged_attention", paged_attention_kernel<decltype(tag)>, dim3(grid), dim3(kAttnThreads), smem, s, 1,
                  dp.pdl, p);
  });
  check_launch("paged_attention");
  record_launch("paged_attention", "cta_per_token_head threads=%lld key_tile=%lld grid=%lld", {kAttnThreads, kTile, grid});
}

}  // namespace ks::cuda
