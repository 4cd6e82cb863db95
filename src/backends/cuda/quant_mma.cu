// quant_matmul on CUDA, variant cuda_mma_blocks (contract: docs/contracts.md#quant_matmul, and
// the variant's note there): bf16 / fp16 x with at most 8 rows (decode), Q4_0 and Q4_1 weights,
// the block sums on the tensor cores.
//
// For a block of 32 weights with codes q (Q4_1: w = d q + m; Q4_0: w = d (q - 8)):
//   sum_k x_k w_k = d * S + m * X,   S = sum_k x_k q_k (Q4_0: x_k (q_k - 8)),   X = sum_k x_k.
// The codes are small integers, exact in bf16 and fp16, and so are x's values: every product
// in S is exact, and mma.sync (m16n8k16, FP32 accumulation) sums them. X is a second MMA with
// an all-ones A. The FP32 sums run in the tensor cores' order, so the result differs from the
// per-warp kernel's (d q + m decoded in FP32, FMA chains) by rounding only.
//
// Layout: a CTA owns 16 weight rows (the MMA's M) and splits the row's blocks into 8 contiguous
// ranges, one per warp. The MMA's N (8) holds the rows of x: B's column j is x's row j (zero for
// j >= M), so D[i][j] = row i of the tile times row j of x. The MMA's K (16) runs over a half
// block, in an order of our choosing as long as A and B agree: lane (g = lane / 4, t = lane % 4)
// supplies the 4 code bytes 4t..4t+3 of rows g and g + 8 (one 32-bit word each: low nibbles are
// weights 4t..4t+3 of the block, high nibbles weights 16 + 4t..), which fill A's k slots
// {2t, 2t+1, 2t+8, 2t+9}, and x[g][4t..4t+3] (one 8-byte load) fills B's same slots. The code
// nibbles become bf16 / fp16 pairs by one byte permute under the exponent of 128 (bf16) or 1024
// (fp16), minus 128 or 1024 (Q4_0: 136, 1032) in one packed subtraction, all exact.
// Each warp adds d S + m X per block into FP32 accumulators (rows g, g + 8 by x rows 2t, 2t + 1);
// the CTA then sums its 8 warps in order. No value depends on M or on the grid.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#include "backends/cuda/common.cuh"
#include "backends/cuda/mma_x_staging.hpp"
#include "ops/args.hpp"

namespace ks::cuda {
namespace {

constexpr int kMmaWarps = 8;   // a CTA's warps: the row's blocks split in 8 contiguous ranges
constexpr int kMmaRows = 16;   // a CTA's weight rows (the MMA's M)
constexpr int kMmaXRows = 8;   // rows of x one MMA carries (its N)

struct MmaQmmParams {
  const void* x;     // [M, K], M <= 8
  const uint8_t* w;  // [N, row_bytes]
  void* out;         // [M, N]
  int64_t M, N, K, row_bytes;
};

// The packed constants of one element type: the high byte put above a code (a code n becomes
// base + n, base = the bits kHigh << 8), and a pair of ones.
template <typename T>
struct MmaType;
template <>
struct MmaType<__nv_bfloat16> {
  static constexpr uint32_t kHigh = 0x43u;         // bf16 0x43nn = 128 + nn (nn < 128)
  static constexpr uint32_t kOnes = 0x3F803F80u;   // (1, 1)
};
template <>
struct MmaType<__half> {
  static constexpr uint32_t kHigh = 0x64u;         // fp16 0x64nn = 1024 + nn (nn < 256)
  static constexpr uint32_t kOnes = 0x3C003C00u;
};

// (base + n0, base + n1) - (off, off) for a pair made by code_pair: exact (small integers).
template <typename T>
__device__ __forceinline__ uint32_t sub_pair(uint32_t v, uint32_t off) {
  using T2 = std::conditional_t<std::is_same_v<T, __half>, __half2, __nv_bfloat162>;
  T2 a, b;
  std::memcpy(&a, &v, 4);
  std::memcpy(&b, &off, 4);
  const T2 r = __hsub2(a, b);
  uint32_t u;
  std::memcpy(&u, &r, 4);
  return u;
}
// Codes (< 16) in bytes i and i + 1 of w (sel 0x4140: bytes 0, 1; 0x4342: bytes 2, 3) as the
// pair (base + code_i, base + code_i+1): low half the lower byte.
template <typename T>
__device__ __forceinline__ uint32_t code_pair(uint32_t w, uint32_t sel) {
  return __byte_perm(w, MmaType<T>::kHigh, sel);
}

// A Q4 block's words for lane t: h its first word (Q4_1, 20-byte blocks, 4-byte aligned: d | m <<
// 16; Q4_0, 18-byte blocks, 2-byte aligned: d in the low half), q its code bytes 4t..4t+3.
template <bool Q41>
__device__ __forceinline__ void q4_words(const uint8_t* blk, int t, uint32_t& h, uint32_t& q) {
  if constexpr (Q41) {
    const uint32_t* p = reinterpret_cast<const uint32_t*>(blk);
    h = p[0];
    q = p[1 + t];
  } else {
    const uint16_t* p = reinterpret_cast<const uint16_t*>(blk);
    h = p[0];
    q = uint32_t(p[1 + 2 * t]) | (uint32_t(p[2 + 2 * t]) << 16);
  }
}

// A's fragments of one Q4 block of 16 weight rows: the lane's code bytes qa (row g) and qb (row
// g + 8) as exact bf16 / fp16 pairs, alo the block's weights 0..15, ahi 16..31 (each: (row g,
// slots 2t..), (row g + 8, 2t..), (row g, 2t + 8..), (row g + 8, 2t + 8..)).
template <typename T, bool Q41>
__device__ __forceinline__ void q4_a_frags(uint32_t qa, uint32_t qb, uint32_t (&alo)[4], uint32_t (&ahi)[4]) {
  // What to subtract from code_pair's values, in both halves: the base (Q4_1: codes 0..15), or
  // base + 8 (Q4_0: codes - 8), i.e. what code_pair makes of a code 0 or 8
  constexpr uint32_t off = (MmaType<T>::kHigh << 8) | (Q41 ? 0u : 8u), off2 = off | (off << 16);
  const uint32_t la = qa & 0x0F0F0F0Fu, lb = qb & 0x0F0F0F0Fu;
  const uint32_t ua = (qa >> 4) & 0x0F0F0F0Fu, ub = (qb >> 4) & 0x0F0F0F0Fu;
  alo[0] = sub_pair<T>(code_pair<T>(la, 0x4140u), off2);
  alo[1] = sub_pair<T>(code_pair<T>(lb, 0x4140u), off2);
  alo[2] = sub_pair<T>(code_pair<T>(la, 0x4342u), off2);
  alo[3] = sub_pair<T>(code_pair<T>(lb, 0x4342u), off2);
  ahi[0] = sub_pair<T>(code_pair<T>(ua, 0x4140u), off2);
  ahi[1] = sub_pair<T>(code_pair<T>(ub, 0x4140u), off2);
  ahi[2] = sub_pair<T>(code_pair<T>(ua, 0x4342u), off2);
  ahi[3] = sub_pair<T>(code_pair<T>(ub, 0x4342u), off2);
}

// acc += one Q4 block's factored sums (the contract's d S + m X): s the MMA's S of rows g, g + 8
// by B's columns 2t, 2t + 1 (acc's order), da / db the rows' d; Q4_1 also ma / mb, the rows' m,
// times X0 / X1, the columns' X.
template <bool Q41>
__device__ __forceinline__ void add_q4_sums(float (&acc)[4], const float (&s)[4], float da, float db, float ma = 0.f,
                                            float mb = 0.f, float X0 = 0.f, float X1 = 0.f) {
  if constexpr (Q41) {
    acc[0] += da * s[0] + ma * X0;
    acc[1] += da * s[1] + ma * X1;
    acc[2] += db * s[2] + mb * X0;
    acc[3] += db * s[3] + mb * X1;
  } else {
    acc[0] += da * s[0];
    acc[1] += da * s[1];
    acc[2] += db * s[2];
    acc[3] += db * s[3];
  }
}

// One Q4 block of 16 weight rows (the lane's rows g and g + 8) against up to 8 rows of x (B's
// columns): acc += d S + m X (Q4_1; Q4_0: d S). ha / hb: the rows' first word (Q4_1: d | m << 16;
// Q4_0: d in the low half); qa / qb: their code bytes 4t..4t+3; xl / xh: B's pairs of weights
// 4t..4t+3 and 16 + 4t.. of the block (column g). acc: (row g, column 2t), (g, 2t + 1), (g + 8,
// 2t), (g + 8, 2t + 1).
// PRE_X: X of columns 2t, 2t + 1 given (xs0, xs1: the caller's FP32 sums of B's columns), not
// summed by two more MMAs with an all-ones A.
template <typename T, bool Q41, bool PRE_X = false>
__device__ __forceinline__ void mma_q4_block(float (&acc)[4], uint32_t ha, uint32_t hb, uint32_t qa, uint32_t qb,
                                             uint2 xl, uint2 xh, float xs0 = 0.f, float xs1 = 0.f) {
  const float da = h2f_bits(uint16_t(ha)), db = h2f_bits(uint16_t(hb));
  uint32_t alo[4], ahi[4];
  q4_a_frags<T, Q41>(qa, qb, alo, ahi);
  float s[4] = {0.f, 0.f, 0.f, 0.f};
  mma_16816<T>(s, alo, xl.x, xl.y);
  mma_16816<T>(s, ahi, xh.x, xh.y);
  // s: (row g, x row 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1)
  if constexpr (Q41) {
    const float ma = h2f_bits(uint16_t(ha >> 16)), mb = h2f_bits(uint16_t(hb >> 16));
    float xs[4] = {xs0, xs1, 0.f, 0.f};  // X of x rows 2t, 2t + 1 (in every row of D)
    if constexpr (!PRE_X) {
      const uint32_t ones[4] = {MmaType<T>::kOnes, MmaType<T>::kOnes, MmaType<T>::kOnes, MmaType<T>::kOnes};
      xs[0] = xs[1] = 0.f;
      mma_16816<T>(xs, ones, xl.x, xl.y);
      mma_16816<T>(xs, ones, xh.x, xh.y);
    }
    add_q4_sums<true>(acc, s, da, db, ma, mb, xs[0], xs[1]);
  } else {
    add_q4_sums<false>(acc, s, da, db);
  }
}

// U: the blocks whose loads a warp issues together (the launcher: 8 where a warp's range has more
// than 4 blocks, else 4: fewer registers, more resident warps).
template <typename T, bool Q41, int U>
__global__ void __launch_bounds__(32 * kMmaWarps) quant_mma_kernel(const MmaQmmParams p) {
  __shared__ float part[kMmaWarps][kMmaRows][kMmaXRows];  // each warp's sums (weight row, x row)
  pdl_begin();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int64_t n0 = int64_t(blockIdx.x) * kMmaRows;
  // This lane's two weight rows; rows past N read the last row and are never written.
  const uint8_t* wa = p.w + min(n0 + g, p.N - 1) * p.row_bytes;
  const uint8_t* wb = p.w + min(n0 + g + 8, p.N - 1) * p.row_bytes;
  const bool has_x = g < p.M;  // B's column g: row g of x, zeros past M
  const T* xr = static_cast<const T*>(p.x) + (has_x ? int64_t(g) * p.K : 0);
  const int64_t nblocks = p.K / 32, per_warp = (nblocks + kMmaWarps - 1) / kMmaWarps;
  const int64_t b_end = min(nblocks, (warp + 1) * per_warp);
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  // U blocks per step: all their loads are issued before the first is used (the bytes
  // in flight that hide DRAM latency); a step's blocks past the warp's range load nothing.
  for (int64_t b0 = warp * per_warp; b0 < b_end; b0 += U) {
    uint2 xl[U], xh[U];
    uint32_t ha[U], hb[U], qa[U], qb[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t b = b0 + u;
      xl[u] = xh[u] = make_uint2(0u, 0u);
      ha[u] = hb[u] = qa[u] = qb[u] = 0u;
      if (b >= b_end) continue;
      if (has_x) {
        xl[u] = *reinterpret_cast<const uint2*>(xr + b * 32 + 4 * t);
        xh[u] = *reinterpret_cast<const uint2*>(xr + b * 32 + 16 + 4 * t);
      }
      q4_words<Q41>(wa + b * q_block_bytes(Q41 ? KS_QTYPE_Q4_1 : KS_QTYPE_Q4_0), t, ha[u], qa[u]);
      q4_words<Q41>(wb + b * q_block_bytes(Q41 ? KS_QTYPE_Q4_1 : KS_QTYPE_Q4_0), t, hb[u], qb[u]);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (b0 + u >= b_end) break;
      mma_q4_block<T, Q41>(acc, ha[u], hb[u], qa[u], qb[u], xl[u], xh[u]);
    }
  }
  part[warp][g][2 * t] = acc[0];
  part[warp][g][2 * t + 1] = acc[1];
  part[warp][g + 8][2 * t] = acc[2];
  part[warp][g + 8][2 * t + 1] = acc[3];
  __syncthreads();
  if (threadIdx.x < kMmaRows * kMmaXRows) {
    const int r = threadIdx.x / kMmaXRows, j = threadIdx.x % kMmaXRows;
    const int64_t n = n0 + r;
    if (n < p.N && j < p.M) {
      float sum = 0.f;
#pragma unroll
      for (int w = 0; w < kMmaWarps; ++w) sum += part[w][r][j];
      static_cast<T*>(p.out)[int64_t(j) * p.N + n] = Dt<T>::from_f(sum);
    }
  }
}

// ---- variant cuda_mma_stream -----------------------------------------------------------------
// The same block sums on the tensor cores, fed by a stream: a persistent CTA per SM (at most)
// owns a contiguous range of groups of tps tiles of 16 weight rows, and copies each group's rows
// chunk by chunk (kc blocks of every row) into a ring of kStreamStages shared-memory stages with
// 16-byte cp.async copies (each row's chunk as the 16-byte pieces that cover it, so every copy
// is aligned; the copy of the weights' last piece stops at their end). The first three stages
// are issued before the dependency wait: no kernel writes weights, so under PDL their DRAM
// latency overlaps the previous kernel, and with at most one CTA per SM the kernel lets the next
// one launch at once (pdl_begin), so a sequence of these calls keeps the DRAM busy.
// Rows sit `pitch` bytes apart in a stage (16 mod 128): the 8 row groups of a warp's fragment
// loads fall in 8 distinct 4-bank groups when the rows are 16-byte aligned.
// x enters as B's fragments, staged in shared memory once per chunk: bf16 / fp16 x as they are
// (B's column m = row m of x, M <= 8); fp32 x as three bf16 pieces per row (columns 3m, 3m + 1,
// 3m + 2; M <= 2): x = x1 + x2 + x3 with x1 = rz(x), x2 = rz(x - x1), x3 = x - x1 - x2, all exact
// for a finite normal x (each piece holds the next 8 significant bits of the 24), so the codes'
// products stay exact and only the FP32 sums round; a non-finite x is all in its first piece.
// Q8_0 codes c (signed bytes) enter as two exact nibble codes, c = 16 (h - 8) + l with
// l = c & 15 and h = (c ^ 0x80) >> 4: S = 16 S_h + S_l from four MMAs.
// Warp w of the CTA's 16 takes tile w % tps of a group and the chunk's blocks w / tps, + 16 / tps, ...;
// at a group's last chunk the warps' sums meet in shared memory and are added in warp order (and
// pieces in order). The order depends on the shape (K, N, block format) only, not on M, the
// grid or the device.
constexpr int kStreamStages = 4;
constexpr int kStreamWarps = 16;
constexpr int kStreamThreads = 32 * kStreamWarps;
constexpr int64_t kStreamStageBytes = 40 * 1024;  // a stage's weight bytes (about)

// The MMA's element type: x's own (bf16, fp16), bf16 for fp32 x (its pieces).
template <typename T>
using MmaElem = std::conditional_t<std::is_same_v<T, float>, __nv_bfloat16, T>;

struct MmaStreamParams {
  const void* x;     // [M, K]
  const uint8_t* w;  // [N, row_bytes], 16-byte aligned
  void* out;         // [M, N]
  int64_t M, N, K, row_bytes;
  int64_t groups;    // groups of tps tiles of 16 rows
  int kc;            // blocks per chunk
  int nchunks;       // chunks per row
  int tps;           // tiles per group (1, 2 or 4)
  int pitch;         // bytes between a stage's rows
  int ppr;           // 16-byte pieces copied per row and chunk
  int xcols;         // B's columns in use: M, or 3 M for fp32 x
  int early;         // 1: the first stages' copies issued before the dependency wait (KS_QMM_WSTAGE=0: 0)
};

template <typename T>
__device__ __forceinline__ uint32_t bits16(T v) {
  uint16_t u;
  std::memcpy(&u, &v, 2);
  return u;
}
// The bf16 pieces of an FP32 value (bf16_piece_words, mma_x_staging.hpp: rz, each the next 8 of
// its 24 significant bits; a non-finite value is all in the first) or a 16-bit value as it is: P
// pieces' 16-bit patterns.
template <typename T, int P>
__device__ __forceinline__ void x_pieces(float v, uint32_t (&bits)[P]) {
  if constexpr (P == 3) {
    uint32_t w[3];
    bf16_piece_words(v, w);
    bits[0] = w[0] >> 16;
    bits[1] = w[1] >> 16;
    bits[2] = w[2] >> 16;
  } else {
    bits[0] = bits16(Dt<T>::from_f(v));  // v came from a T: exact
  }
}

// Element k of B's column c as a float: bf16 / fp16 x: row c's value; fp32 x: piece c % 3 of row
// c / 3 (x_pieces), exact in bf16.
template <typename T>
__device__ __forceinline__ float x_value(const T* x, int64_t K, int c, int64_t k) {
  if constexpr (std::is_same_v<T, float>) {
    uint32_t b[3];
    x_pieces<T, 3>(x[int64_t(c / 3) * K + k], b);
    const int piece = c % 3;
    return __bfloat162float(__ushort_as_bfloat16(uint16_t(piece == 0 ? b[0] : piece == 1 ? b[1] : b[2])));
  } else {
    return Dt<T>::to_f(x[int64_t(c) * K + k]);
  }
}
// A's fragments of one Q8_0 block of 16 weight rows as exact nibble codes: a[0] the low nibbles
// l of weights 0..15, a[1] of 16..31, a[2] / a[3] the high nibbles h - 8 of the same (c = 16 (h -
// 8) + l). a0 / b0: code bytes 4t.. of rows g / g + 8, a1 / b1: bytes 16 + 4t...
template <typename T>
__device__ __forceinline__ void q8_a_frags(uint32_t a0, uint32_t a1, uint32_t b0, uint32_t b1, uint32_t (&a)[4][4]) {
  constexpr uint32_t lo = MmaType<T>::kHigh << 8, lo2 = lo | (lo << 16), hi = lo | 8u, hi2 = hi | (hi << 16);
  const uint32_t n[8] = {a0 & 0x0F0F0F0Fu, b0 & 0x0F0F0F0Fu, a1 & 0x0F0F0F0Fu, b1 & 0x0F0F0F0Fu,
                         ((a0 ^ 0x80808080u) >> 4) & 0x0F0F0F0Fu, ((b0 ^ 0x80808080u) >> 4) & 0x0F0F0F0Fu,
                         ((a1 ^ 0x80808080u) >> 4) & 0x0F0F0F0Fu, ((b1 ^ 0x80808080u) >> 4) & 0x0F0F0F0Fu};
#pragma unroll
  for (int i = 0; i < 4; ++i) {  // (low, weights 4t..), (low, 16 + 4t..), (high, 4t..), (high, 16 + 4t..)
    const uint32_t ra = n[2 * i], rb = n[2 * i + 1], off2 = i < 2 ? lo2 : hi2;
    a[i][0] = sub_pair<T>(code_pair<T>(ra, 0x4140u), off2);
    a[i][1] = sub_pair<T>(code_pair<T>(rb, 0x4140u), off2);
    a[i][2] = sub_pair<T>(code_pair<T>(ra, 0x4342u), off2);
    a[i][3] = sub_pair<T>(code_pair<T>(rb, 0x4342u), off2);
  }
}

// acc += one Q8_0 block's d S with S = 16 S_h + S_l from the nibble MMAs (sl, sh; acc's order),
// da / db the d of rows g / g + 8.
__device__ __forceinline__ void add_q8_sums(float (&acc)[4], const float (&sl)[4], const float (&sh)[4], float da,
                                            float db) {
  acc[0] += da * (16.f * sh[0] + sl[0]);
  acc[1] += da * (16.f * sh[1] + sl[1]);
  acc[2] += db * (16.f * sh[2] + sl[2]);
  acc[3] += db * (16.f * sh[3] + sl[3]);
}

// One Q8_0 block (34 bytes: d, 32 signed code bytes; 2-byte aligned) of rows g and g + 8:
// acc += d S. a0 / b0: code bytes 4t..4t+3 of rows g / g + 8 (weights 4t..), a1 / b1: bytes
// 16 + 4t.. (weights 16 + 4t..), with B's pairs xl / xh of the same weights.
template <typename T>
__device__ __forceinline__ void mma_q8_block(float (&acc)[4], uint32_t ha, uint32_t hb, uint32_t a0, uint32_t a1,
                                             uint32_t b0, uint32_t b1, uint2 xl, uint2 xh) {
  uint32_t a[4][4];
  q8_a_frags<T>(a0, a1, b0, b1, a);
  float sl[4] = {0.f, 0.f, 0.f, 0.f}, sh[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint2 xv = (i & 1) ? xh : xl;
    mma_16816<T>(i < 2 ? sl : sh, a[i], xv.x, xv.y);
  }
  add_q8_sums(acc, sl, sh, h2f_bits(uint16_t(ha)), h2f_bits(uint16_t(hb)));
}

// A Q8_0 block's words for lane t: h = d, c0 / c1 = code bytes 4t.. and 16 + 4t...
__device__ __forceinline__ void q8_words(const uint8_t* blk, int t, uint32_t& h, uint32_t& c0, uint32_t& c1) {
  const uint16_t* p = reinterpret_cast<const uint16_t*>(blk);
  h = p[0];
  c0 = uint32_t(p[1 + 2 * t]) | (uint32_t(p[2 + 2 * t]) << 16);
  c1 = uint32_t(p[9 + 2 * t]) | (uint32_t(p[10 + 2 * t]) << 16);
}

template <typename T, ks_qtype_t Q>
__global__ void __launch_bounds__(kStreamThreads, 1) quant_mma_stream_kernel(const MmaStreamParams p) {
  using TM = MmaElem<T>;
  constexpr int BB = int(q_block_bytes(Q)), U = 4;
  extern __shared__ __align__(16) unsigned char qms[];  // [stage][16 tps rows][pitch], then B's pairs
  __shared__ float part[kStreamWarps][16][8];             // each warp's sums (tile row, B column)
  __shared__ __align__(16) uint32_t xzero[16];            // B's pairs of the columns past xcols
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int64_t N = p.N, RB = p.row_bytes, nb = p.K / 32, wbytes = N * RB;
  const int rows_ps = 16 * p.tps;
  const int64_t stage_bytes = int64_t(rows_ps) * p.pitch;
  uint32_t* xs = reinterpret_cast<uint32_t*>(qms + kStreamStages * stage_bytes);  // [block][column][16 pairs]
  float* xsum = reinterpret_cast<float*>(xs + p.kc * p.xcols * 16);                // Q4_1: [block][8] X sums
  const int64_t gbeg = int64_t(blockIdx.x) * p.groups / gridDim.x;
  const int64_t gend = (int64_t(blockIdx.x) + 1) * p.groups / gridDim.x;
  const int64_t items = (gend - gbeg) * p.nchunks;  // (group, chunk), chunks innermost
  // Item i's copies: warp w takes rows w, w + 16, ... of the group; its lanes the row chunk's
  // 16-byte pieces (contiguous bytes). One commit group per item (empty past the last).
  auto issue = [&](int64_t i) {
    if (i < items) {
      const int64_t n0 = (gbeg + i / p.nchunks) * rows_ps, b0 = (i % p.nchunks) * int64_t(p.kc);
      const int rows = int(min(int64_t(rows_ps), N - n0));
      unsigned char* st = qms + (i % kStreamStages) * stage_bytes;
      for (int r = warp; r < rows; r += kStreamWarps) {
        const int64_t a0 = ((n0 + r) * RB + b0 * BB) & ~int64_t(15);
        unsigned char* d = st + int64_t(r) * p.pitch;
        for (int j = lane; j < p.ppr; j += 32) {
          const int64_t a = a0 + 16 * int64_t(j), left = wbytes - a;
          cp_async_bytes(d + 16 * j, left > 0 ? p.w + a : p.w, left >= 16 ? 16 : left > 0 ? int(left) : 0);
        }
      }
    }
    cp_async_commit();
  };
  if (p.early)
    for (int i = 0; i < kStreamStages - 1; ++i) issue(i);
  if (threadIdx.x < 16) xzero[threadIdx.x] = 0u;
  pdl_begin();  // x is the previous kernel's output: read from here on
  if (!p.early)
    for (int i = 0; i < kStreamStages - 1; ++i) issue(i);
  const int tl = warp % p.tps, wsub = warp / p.tps, nsub = kStreamWarps / p.tps;
  // this lane's B column: its pairs at xcol + block * xstride (the zeros, stride 0, past xcols)
  const bool has_x = g < p.xcols;
  const int xstride = has_x ? p.xcols * 16 : 0;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  int64_t staged_chunk = -1;
  for (int64_t i = 0; i < items; ++i) {
    cp_async_wait<kStreamStages - 2>();  // item i's copies (this thread's) have landed
    __syncthreads();                      // everyone's; and item i - 1 is done with its stage
    issue(i + kStreamStages - 1);
    const int64_t grp = gbeg + i / p.nchunks, ch = i % p.nchunks, b0 = ch * p.kc;
    const int kcur = int(min(int64_t(p.kc), nb - b0));
    if (ch != staged_chunk) {
      // B's pairs of the chunk's blocks, column by column: a thread takes 8 consecutive values
      // (4 threads of a warp per block: coalesced reads of x); Q4_1: its 8 values' FP32 sum, then
      // the 4 threads' sums by two butterfly steps, is the block's X (0 past xcols).
      const T* xg = static_cast<const T*>(p.x);
      const int n8 = kcur * 4, iters = (n8 + kStreamThreads - 1) / kStreamThreads;  // warp-uniform trip count
      for (int c = 0; c < p.xcols; ++c)
        for (int it = 0; it < iters; ++it) {
          const int e = it * kStreamThreads + int(threadIdx.x);
          float sum = 0.f;
          if (e < n8) {
            const int64_t k = b0 * 32 + 8 * int64_t(e);
            float v[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) v[j] = x_value<T>(xg, p.K, c, k + j);
            uint32_t* dst = xs + ((e >> 2) * p.xcols + c) * 16 + (e & 3) * 4;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              dst[j] = bits16(Dt<TM>::from_f(v[2 * j])) | (bits16(Dt<TM>::from_f(v[2 * j + 1])) << 16);
              sum += v[2 * j];
              sum += v[2 * j + 1];
            }
          }
          if constexpr (Q == KS_QTYPE_Q4_1) {
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            if (e < n8 && (e & 3) == 0) xsum[(e >> 2) * 8 + c] = sum;
          }
        }
      if constexpr (Q == KS_QTYPE_Q4_1)
        for (int e = threadIdx.x; e < kcur * 8; e += kStreamThreads)
          if ((e & 7) >= p.xcols) xsum[e] = 0.f;
      staged_chunk = ch;
      __syncthreads();
    }
    const unsigned char* st = qms + (i % kStreamStages) * stage_bytes;
    const int64_t nt = grp * rows_ps + tl * 16;  // this warp's tile's first row
    if (nt < N) {
      const int64_t sa = (nt + g) * RB + b0 * BB, sb = sa + 8 * RB;  // the rows' chunk starts (weight offsets)
      const unsigned char* wa = st + (tl * 16 + g) * p.pitch + (sa & 15);
      const unsigned char* wb = st + (tl * 16 + g + 8) * p.pitch + (sb & 15);
      const uint32_t* xcol = has_x ? xs + g * 16 : xzero;
      uint2 xl[U], xh[U];
      float2 xx[U];
      uint32_t ha[U], hb[U], qa[U], qb[U], qa1[U], qb1[U];
      auto load = [&](int u, int bl) {
        const uint32_t* xp = xcol + bl * xstride;
        if constexpr (Q == KS_QTYPE_Q4_1) xx[u] = *reinterpret_cast<const float2*>(xsum + bl * 8 + 2 * t);
        xl[u] = *reinterpret_cast<const uint2*>(xp + 2 * t);
        xh[u] = *reinterpret_cast<const uint2*>(xp + 8 + 2 * t);
        if constexpr (Q == KS_QTYPE_Q8_0) {
          q8_words(wa + bl * BB, t, ha[u], qa[u], qa1[u]);
          q8_words(wb + bl * BB, t, hb[u], qb[u], qb1[u]);
        } else {
          q4_words<Q == KS_QTYPE_Q4_1>(wa + bl * BB, t, ha[u], qa[u]);
          q4_words<Q == KS_QTYPE_Q4_1>(wb + bl * BB, t, hb[u], qb[u]);
        }
      };
      auto block = [&](int u) {
        if constexpr (Q == KS_QTYPE_Q8_0)
          mma_q8_block<TM>(acc, ha[u], hb[u], qa[u], qa1[u], qb[u], qb1[u], xl[u], xh[u]);
        else if constexpr (Q == KS_QTYPE_Q4_1)
          mma_q4_block<TM, true, true>(acc, ha[u], hb[u], qa[u], qb[u], xl[u], xh[u], xx[u].x, xx[u].y);
        else
          mma_q4_block<TM, false>(acc, ha[u], hb[u], qa[u], qb[u], xl[u], xh[u]);
      };
      int bl0 = wsub;
      for (; bl0 + (U - 1) * nsub < kcur; bl0 += U * nsub) {  // U whole blocks: every load, then every MMA
#pragma unroll
        for (int u = 0; u < U; ++u) load(u, bl0 + u * nsub);
#pragma unroll
        for (int u = 0; u < U; ++u) block(u);
      }
      for (; bl0 < kcur; bl0 += nsub) {  // the rest, one by one
        load(0, bl0);
        block(0);
      }
    }
    if (ch == p.nchunks - 1) {  // the group's last chunk: its sums, warps (then pieces) in order
      part[warp][g][2 * t] = acc[0];
      part[warp][g][2 * t + 1] = acc[1];
      part[warp][g + 8][2 * t] = acc[2];
      part[warp][g + 8][2 * t + 1] = acc[3];
      acc[0] = acc[1] = acc[2] = acc[3] = 0.f;
      __syncthreads();
      constexpr int pieces = std::is_same_v<T, float> ? 3 : 1;
      const int M = int(p.M);
      for (int e = threadIdx.x; e < rows_ps * M; e += kStreamThreads) {
        const int r = e / M, m = e - r * M;
        const int64_t n = grp * rows_ps + r;
        if (n >= N) continue;
        float sum = 0.f;
        for (int s = 0; s < nsub; ++s)
#pragma unroll
          for (int c = 0; c < pieces; ++c) sum += part[r / 16 + s * p.tps][r % 16][m * pieces + c];
        static_cast<T*>(p.out)[int64_t(m) * N + n] = Dt<T>::from_f(sum);
      }
    }
  }
  cp_async_wait<0>();
}
}  // namespace

std::string quant_matmul_mma_can_implement(const void* args) {
  const auto& a = *static_cast<const ops::QuantMatmulArgs*>(args);
  if (a.m > kMmaXRows) return "M > 8: one MMA's 8 columns carry the rows of x (decode sizes)";
  if (a.qtype != KS_QTYPE_Q4_0 && a.qtype != KS_QTYPE_Q4_1)
    return "Q4_0 and Q4_1 only (8-bit codes do not fit bf16's mantissa by one byte permute)";
  if (reinterpret_cast<uintptr_t>(a.x.data) % 8 != 0) return "x not 8-byte aligned (8-byte loads of x)";
  const uintptr_t wa = reinterpret_cast<uintptr_t>(a.weight.data);
  if (wa % (a.qtype == KS_QTYPE_Q4_1 ? 4 : 2) != 0)
    return "weight not aligned to its block words (Q4_1: 4 bytes, Q4_0: 2)";
  if (device_props(a.x.device.device_id).major < 8) return "needs sm_80 or newer (bf16 / fp16 mma.sync)";
  return "";
}

void quant_matmul_mma_cuda(const void* args, ks_stream_t stream) {
  const auto& a = *static_cast<const ops::QuantMatmulArgs*>(args);
  const int dev = a.x.device.device_id;
  DeviceGuard guard(dev, "quant_matmul");
  const DeviceProps& dp = device_props(dev);
  const MmaQmmParams p{a.x.data, static_cast<const uint8_t*>(a.weight.data), a.out.data, a.m, a.n, a.k, a.row_bytes};
  const unsigned grid = unsigned((a.n + kMmaRows - 1) / kMmaRows);
  const auto s = static_cast<cudaStream_t>(stream);
  const int64_t per_warp = (a.k / 32 + kMmaWarps - 1) / kMmaWarps;
  const int unroll = per_warp > 4 ? 8 : 4;
  auto go = [&](auto tag) {
    using T = decltype(tag);
    auto launch = [&](auto kern) { launch_kernel("quant_matmul", kern, dim3(grid), dim3(32 * kMmaWarps), 0, s, 1, dp.pdl, p); };
    if (a.qtype == KS_QTYPE_Q4_1)
      unroll == 8 ? launch(quant_mma_kernel<T, true, 8>) : launch(quant_mma_kernel<T, true, 4>);
    else
      unroll == 8 ? launch(quant_mma_kernel<T, false, 8>) : launch(quant_mma_kernel<T, false, 4>);
  };
  if (a.x.dtype == detail::DType::F16)
    go(__half{});
  else
    go(__nv_bfloat16{});
  check_launch("quant_matmul");
  record_launch("quant_matmul", "mma_blocks rows_per_cta=%lld warps_per_cta=%lld x_rows_per_mma=%lld blocks_per_step=%lld",
                {kMmaRows, kMmaWarps, kMmaXRows, unroll});
}

namespace {
// cuda_mma_stream's plan for an N x K matrix of bb-byte blocks with xcols columns of B: a stage
// of about kStreamStageBytes (whole rows of 1, 2 or 4 tiles where 16 rows fit, keeping at least
// one group per SM; else chunks of a multiple of 16 blocks), the pitch, and the grid (a CTA per
// group up to one per SM). Depends on the shape and the SM count only (the grid: not the sums).
struct StreamPlan {
  int kc = 0, nchunks = 1, tps = 1, pitch = 16, ppr = 1;
  int64_t groups = 0;
  size_t smem = 0;
  unsigned grid = 0;
};
StreamPlan stream_plan(int64_t N, int64_t K, int bb, int xcols, int sm_count) {
  StreamPlan s;
  const int64_t nb = K / 32, tile = 16 * nb * bb, ntiles = (N + 15) / 16;
  if (tile <= kStreamStageBytes) {
    s.kc = int(nb);
    while (s.tps < 4 && 2 * s.tps * tile <= kStreamStageBytes && 2 * int64_t(s.tps) * sm_count <= ntiles) s.tps *= 2;
  } else {
    const int64_t kmax = std::max<int64_t>(16, kStreamStageBytes / (16 * bb) / 16 * 16);
    const int64_t chunks = (nb + kmax - 1) / kmax;
    s.kc = int(((nb + chunks - 1) / chunks + 15) / 16 * 16);
    s.nchunks = int((nb + s.kc - 1) / s.kc);
  }
  s.ppr = int((int64_t(s.kc) * bb + 30) / 16);
  s.pitch = (16 * s.ppr + 111) / 128 * 128 + 16;  // the smallest multiple of 16 >= the pieces that is 16 mod 128
  s.groups = (ntiles + s.tps - 1) / s.tps;
  s.grid = unsigned(std::min<int64_t>(s.groups, sm_count));
  s.smem = size_t(kStreamStages) * 16 * size_t(s.tps) * size_t(s.pitch) + size_t(s.kc) * size_t(xcols) * 64 +
           size_t(s.kc) * 8 * sizeof(float);  // the stages, B's pairs, X sums
  return s;
}
// B's columns in use by call a (M, or 3 M for fp32 x), and the call's plan: one derivation for
// can_implement and the launcher.
int stream_xcols(const ops::QuantMatmulArgs& a) { return int(a.x.dtype == detail::DType::F32 ? 3 * a.m : a.m); }
StreamPlan stream_plan(const ops::QuantMatmulArgs& a, int sm_count) {
  return stream_plan(a.n, a.k, int(q_block_bytes(a.qtype)), stream_xcols(a), sm_count);
}
// The dynamic shared memory one CTA of quant_mma_stream_kernel<T, Q> may take on device dev.
template <typename T, ks_qtype_t Q>
int stream_smem_limit(int dev) {
  return int(opt_in_smem_limit<quant_mma_stream_kernel<T, Q>>(dev, "quant_matmul"));
}
}  // namespace

// (block formats only: the variant is block_formats_only, which the registry checks before this)
std::string quant_matmul_mma_stream_can_implement(const void* args) {
  const auto& a = *static_cast<const ops::QuantMatmulArgs*>(args);
  if (a.m > kMmaXRows) return "M > 8: one MMA's 8 columns carry the rows of x (decode sizes)";
  if (a.x.dtype == detail::DType::F32 && a.m > 2)
    return "fp32 x with M > 2: each row takes three of the MMA's 8 columns (its bf16 pieces)";
  if (reinterpret_cast<uintptr_t>(a.weight.data) % 16 != 0) return "weight not 16-byte aligned (16-byte cp.async copies)";
  const int dev = a.x.device.device_id;
  const DeviceProps& dp = device_props(dev);
  if (dp.major < 8) return "needs sm_80 or newer (mma.sync, cp.async)";
  const StreamPlan plan = stream_plan(a, dp.sm_count);
  int limit = 0;
  with_float_type_and_qtype(a.x.dtype, a.qtype, [&](auto tag, auto q) {
    limit = stream_smem_limit<decltype(tag), decltype(q)::value>(dev);
  });
  if (plan.smem > size_t(limit)) return "its stages do not fit the device's shared memory";
  return "";
}

void quant_matmul_mma_stream_cuda(const void* args, ks_stream_t stream) {
  const auto& a = *static_cast<const ops::QuantMatmulArgs*>(args);
  const int dev = a.x.device.device_id;
  DeviceGuard guard(dev, "quant_matmul");
  const DeviceProps& dp = device_props(dev);
  if (a.m == 0 || a.n == 0) return;  // nothing to write
  const StreamPlan plan = stream_plan(a, dp.sm_count);
  const MmaStreamParams p{a.x.data, static_cast<const uint8_t*>(a.weight.data), a.out.data, a.m, a.n, a.k,
                          a.row_bytes, plan.groups, plan.kc, plan.nchunks, plan.tps, plan.pitch, plan.ppr,
                          stream_xcols(a), qmm_stage_weights_enabled() ? 1 : 0};
  const auto s = static_cast<cudaStream_t>(stream);
  with_float_type_and_qtype(a.x.dtype, a.qtype, [&](auto tag, auto q) {
    using T = decltype(tag);
    constexpr ks_qtype_t Q = decltype(q)::value;
    if (plan.smem > size_t(stream_smem_limit<T, Q>(dev)))
      detail::fail(KS_ERROR_INTERNAL, "quant_matmul", "cuda_mma_stream: its stages do not fit shared memory");
    launch_kernel("quant_matmul", quant_mma_stream_kernel<T, Q>, dim3(plan.grid), dim3(kStreamThreads), plan.smem, s, 1,
                  dp.pdl, p);
  });
  check_launch("quant_matmul");
  record_launch("quant_matmul",
                "mma_stream stages=%lld blocks_per_chunk=%lld chunks=%lld tiles_per_group=%lld pitch=%lld grid=%lld "
                "smem=%lld",
                {kStreamStages, plan.kc, plan.nchunks, plan.tps, plan.pitch, plan.grid, int64_t(plan.smem)});
}

namespace {
// ---- variant cuda_mma_diag -------------------------------------------------------------------
// One row of x (decode GEMV) on the tensor cores with all of the MMA's 8 columns in use: a column
// is a block of the row, not a row of x. One m16n8k16 MMA takes 16 weight rows (A's rows) by two
// weights of each of 8 consecutive blocks (A's 16 k slots: k slots 2c, 2c + 1 hold block c's two
// weights), and B is x placed block-diagonally: B[k][c] is x's value of the weight in k slot k
// when k / 2 == c, else 0. So D[r][c] sums row r's products of block c only, and 16 such MMAs
// (two accumulators of 8, added at the end) give S of 16 rows x 8 blocks. A lane (g = lane / 4,
// t = lane % 4) holds A's codes of rows g, g + 8 in blocks t, t + 4 (k slots 2t.., 2t + 8..) and
// D's S of rows g, g + 8 in blocks 2t, 2t + 1: its epilogue, d S + m X (Q4_1; Q4_0: d S; Q8_0:
// d (16 S_h + S_l)), uses every value it holds, where cuda_mma_stream at M = 1 keeps 1 column
// of 8. B's nonzero pairs sit with lanes g == t (b0) and g == t + 4 (b1); the others hold zeros.
// Pairing (the same for A and B): Q4 code word i (bytes 4i..4i+3; low nibbles weights 4i.., high
// 16 + 4i..) gives MMA 4i + j the weights (4i, 4i + 2), (4i + 1, 4i + 3), (16 + 4i, 18 + 4i),
// (17 + 4i, 19 + 4i) for j = 0..3, each pair from one LOP3 (the nibbles under bf16's exponent of
// 128 or fp16's of 1024) and one packed exact subtraction (of 128 or 1024; Q4_0: 136 or 1032).
// Q8_0 word i (weights 4i..4i+3) gives MMA 2i + j the weights (4i + j, 4i + j + 2) as the exact
// nibble codes of cuda_mma_stream (c = 16 (h - 8) + l), S_l and S_h from two MMAs each.
// The stream: a persistent CTA per SM (at most) owns a contiguous range of 16-row tiles, as units
// of (tile, group of 8 blocks), groups innermost; warp w takes units w, w + W, w + 2W, ... (W the
// CTA's warps). Each warp has its own ring of 2-4 slots (as many as fit: 3 for the 4-bit formats
// and 2 for Q8_0 on an H200 at K = 4096; one unit each: the 16 rows' bytes of the
// group), filled by bulk copies (one per row, by lanes 0..15) that complete on the slot's mbarrier,
// the first slots before the dependency wait (PDL: no kernel writes weights). No CTA barrier
// between units, so each warp's latency is hidden by the others'. x's pairs for the whole row are
// staged once per CTA in shared memory, [block][16 pairs] in MMA order, with X (Q4_1) the FP32
// sum of the block's 32 values in pair order by 4 threads of 8 (then two butterfly steps). A lane
// adds its blocks' d S + m X in order (block 2t, then 2t + 1); the 4 lanes of a row are summed by
// two butterfly steps into the unit's row sums, and a row's result is the sum of its units' row
// sums in group order (per batch of whole tiles, after a CTA barrier). The order of every sum
// depends on K and the block format only (not on N, M, the grid or the device).
// Measured at c14fbe2 (H200, bf16 x, bench_ops --variants; docs/perf/h200_quant_diag_c14fbe2.csv):
// 1.26x cuda_mma_stream at Q4_1 14336 x 4096 (19.44 against 24.42 us), 1.39x at Q8_0 (32.9
// against 45.7), but cuda_bulk_stream's FMA chains stay ahead (18.30 and 22.35): at 0.55 issued
// instructions per scheduler cycle (Nsight Compute, 0e015f0) the codes' conversion (a shift, a
// LOP3 and a packed subtraction per pair) and the MMAs' operands cost about what bulk_stream's
// conversion and FMAs do. Not routed.
constexpr int kDiagPairs = 16;  // B's pairs per block (MMAs per group of 8 blocks and nibble kind)

// v in a register the compiler cannot fold into an immediate (a LOP3 takes one immediate)
__device__ __forceinline__ uint32_t opaque_u32(uint32_t v) {
  uint32_t r;
  asm volatile("mov.b32 %0, %1;" : "=r"(r) : "r"(v));
  return r;
}

// x's element in pair s (half 0 or 1) of a block, for block format Q (the pairing above)
template <ks_qtype_t Q>
__device__ __forceinline__ int diag_elem(int s, int half) {
  if constexpr (Q == KS_QTYPE_Q8_0)
    return 4 * (s >> 1) + (s & 1) + 2 * half;
  else
    return ((s & 3) >> 1) * 16 + 4 * (s >> 2) + (s & 1) + 2 * half;
}

// Code bytes 4i..4i+3 of the block at blk (Q4_1: 4-byte aligned, codes from byte 4; Q4_0: from 2,
// Q8_0: from 2, both 2-byte aligned) and its header word (Q4_1: d | m << 16; others: d)
template <ks_qtype_t Q>
__device__ __forceinline__ uint32_t diag_word(const unsigned char* blk, int i) {
  if constexpr (Q == KS_QTYPE_Q4_1) {
    return reinterpret_cast<const uint32_t*>(blk)[1 + i];
  } else {
    const uint16_t* h = reinterpret_cast<const uint16_t*>(blk);
    return __byte_perm(h[1 + 2 * i], h[2 + 2 * i], 0x5410);
  }
}
template <ks_qtype_t Q>
__device__ __forceinline__ uint32_t diag_header(const unsigned char* blk) {
  if constexpr (Q == KS_QTYPE_Q4_1)
    return *reinterpret_cast<const uint32_t*>(blk);
  else
    return *reinterpret_cast<const uint16_t*>(blk);
}

// (v & 0x000F000F) ^ k in one LOP3 (k in a register: the mask is the instruction's immediate;
// the compiler's own form takes two LOP3s, an AND and an OR, for two constants)
__device__ __forceinline__ uint32_t nibbles_under(uint32_t v, uint32_t k) {
  uint32_t r;
  asm("lop3.b32 %0, %1, 0x000F000F, %2, 0x6A;" : "=r"(r) : "r"(v), "r"(k));  // (a & b) ^ c
  return r;
}
// (c0, c2) and (c1, c3) of the 4-bit fields at bit SH of each byte of w (bytes 0..3), as exact T
// pairs minus `off2` (in both halves): the fields under the exponent (k: the base in both halves,
// xor'd with what to flip in the fields, as Q8_0's high nibbles' top bit) by one LOP3, then one
// packed subtraction.
template <typename T, int SH>
__device__ __forceinline__ void nibble_pairs(uint32_t w, uint32_t k, uint32_t off2, uint32_t& p02, uint32_t& p13) {
  p02 = sub_pair<T>(nibbles_under(w >> SH, k), off2);
  p13 = sub_pair<T>(nibbles_under(w >> (SH + 8), k), off2);
}

// A lane's share of one unit (16 weight rows x one group of 8 blocks, nbk of them real) from a
// ring slot: wa / wb the rows g / g + 8 at the group's first block, xs x's pairs from the group's
// first block on ([block][16 pairs]), X (Q4_1) the blocks' sums; adds d S + m X of blocks 2t, 2t + 1
// (those < nbk) to acc0 / acc1 (rows g, g + 8).
template <typename T, ks_qtype_t Q>
__device__ __forceinline__ void diag_unit(const unsigned char* wa, const unsigned char* wb, const uint32_t* xs,
                                          const float* X, const uint32_t* xzero, int nbk, float& acc0, float& acc1) {
  constexpr int BB = int(q_block_bytes(Q));
  constexpr bool Q8 = Q == KS_QTYPE_Q8_0, Q41 = Q == KS_QTYPE_Q4_1;
  constexpr uint32_t kBase = MmaType<T>::kHigh << 8;
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  // B: this lane's registers (block g's pairs where g == t (b0) or g == t + 4 (b1), else zeros)
  const uint4* x0 = reinterpret_cast<const uint4*>(g == t ? xs + g * kDiagPairs : xzero);
  const uint4* x1 = reinterpret_cast<const uint4*>(g == t + 4 ? xs + g * kDiagPairs : xzero);
  uint32_t bx0[kDiagPairs], bx1[kDiagPairs];
#pragma unroll
  for (int q = 0; q < kDiagPairs / 4; ++q) {
    const uint4 u0 = x0[q], u1 = x1[q];
    bx0[4 * q] = u0.x, bx0[4 * q + 1] = u0.y, bx0[4 * q + 2] = u0.z, bx0[4 * q + 3] = u0.w;
    bx1[4 * q] = u1.x, bx1[4 * q + 1] = u1.y, bx1[4 * q + 2] = u1.z, bx1[4 * q + 3] = u1.w;
  }
  // A: blocks t and t + 4 of rows g and g + 8 (a block past nbk reads the group's last real one:
  // its codes meet B's zeros)
  const int ba = min(t, nbk - 1) * BB, bc = min(t + 4, nbk - 1) * BB;
  // The code words' nibble pairs: low nibbles under klo minus olo, high under khi minus ohi (Q8_0:
  // c = 16 (h - 8) + l, the high nibble's top bit flipped by khi; Q4: both the codes, Q4_0 - 8)
  constexpr uint32_t olo = (kBase | (Q41 || Q8 ? 0u : 8u)) * 0x10001u, ohi = Q8 ? (kBase | 8u) * 0x10001u : olo;
  const uint32_t klo = opaque_u32(kBase * 0x10001u), khi = opaque_u32(kBase * 0x10001u ^ (Q8 ? 0x00080008u : 0u));
  float c0[4] = {0.f, 0.f, 0.f, 0.f}, c1[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int w = 0; w < (Q8 ? 8 : 4); ++w) {
    const uint32_t q[4] = {diag_word<Q>(wa + ba, w), diag_word<Q>(wb + ba, w), diag_word<Q>(wa + bc, w),
                           diag_word<Q>(wb + bc, w)};
    uint32_t l02[4], l13[4], h02[4], h13[4];
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      nibble_pairs<T, 0>(q[r], klo, olo, l02[r], l13[r]);
      nibble_pairs<T, 4>(q[r], khi, ohi, h02[r], h13[r]);
    }
    if constexpr (Q8) {  // c0 sums the low nibbles' MMAs (S_l), c1 the high nibbles' (S_h)
      mma_16816<T>(c0, l02, bx0[2 * w], bx1[2 * w]);
      mma_16816<T>(c1, h02, bx0[2 * w], bx1[2 * w]);
      mma_16816<T>(c0, l13, bx0[2 * w + 1], bx1[2 * w + 1]);
      mma_16816<T>(c1, h13, bx0[2 * w + 1], bx1[2 * w + 1]);
    } else {  // two accumulators of S (shorter MMA chains), added in the epilogue
      mma_16816<T>(c0, l02, bx0[4 * w], bx1[4 * w]);
      mma_16816<T>(c1, l13, bx0[4 * w + 1], bx1[4 * w + 1]);
      mma_16816<T>(c0, h02, bx0[4 * w + 2], bx1[4 * w + 2]);
      mma_16816<T>(c1, h13, bx0[4 * w + 3], bx1[4 * w + 3]);
    }
  }
  // d S + m X of blocks 2t, 2t + 1 (c: (row g, 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1))
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int blk = 2 * t + h;
    if (blk < nbk) {
      const uint32_t ha = diag_header<Q>(wa + blk * BB), hb = diag_header<Q>(wb + blk * BB);
      const float da = h2f_bits(uint16_t(ha)), db = h2f_bits(uint16_t(hb));
      if constexpr (Q8) {
        acc0 += da * (16.f * c1[h] + c0[h]);
        acc1 += db * (16.f * c1[2 + h] + c0[2 + h]);
      } else {
        const float sa = c0[h] + c1[h], sb = c0[2 + h] + c1[2 + h];
        if constexpr (Q41) {
          acc0 += da * sa + h2f_bits(uint16_t(ha >> 16)) * X[blk];
          acc1 += db * sb + h2f_bits(uint16_t(hb >> 16)) * X[blk];
        } else {
          acc0 += da * sa;
          acc1 += db * sb;
        }
      }
    }
  }
}

// A CTA's warps: 24 for the 4-bit formats (3 ring slots of 2.8 KB each), 16 for Q8_0 (2 slots of
// 4.6 KB). Measured at c14fbe2 (H200, bf16, Q4_1): 24 warps 19.44 us at 14336 x 4096 against 20.12
// with 16 and 20.10 with 32; 13.32 against 13.87 / 14.38 at 49152 x 576; 8.05 against 7.77 / 8.36
// at 4096 x 4096 (docs/perf/h200_quant_diag_c14fbe2.csv).
constexpr int diag_warps(ks_qtype_t q) { return q == KS_QTYPE_Q8_0 ? 16 : 24; }
constexpr int kDiagMaxUnits = 256;  // units whose row sums a CTA holds at once (one batch)

struct DiagParams {
  const void* x;     // [1, K]
  const uint8_t* w;  // [N, row_bytes], 16-byte aligned
  void* out;         // [1, N]
  int64_t N, K, row_bytes;
  int64_t ntiles;    // tiles of 16 rows
  int ng;            // groups of 8 blocks per row (the last one partial where K / 32 is not a multiple of 8)
  int stages;        // slots of each warp's ring
  int pitch;         // bytes between a slot's rows (the 16-byte pieces that cover 8 blocks)
  int early;         // 1: the first slots' copies issued before the dependency wait (KS_QMM_WSTAGE=0: 0)
};

template <typename T, ks_qtype_t Q, int kDiagWarps>
__global__ void __launch_bounds__(32 * kDiagWarps, 1) quant_mma_diag_kernel(const DiagParams p) {
  constexpr int BB = int(q_block_bytes(Q)), kDiagThreads = 32 * kDiagWarps;
  extern __shared__ __align__(16) unsigned char qms[];  // x's pairs [ng * 8 blocks][16], X [ng * 8], rings
  __shared__ float part[kDiagMaxUnits][16];              // each unit's row sums (one batch of tiles)
  __shared__ __align__(16) uint32_t xzero[kDiagPairs];   // B's registers of a lane without x
  __shared__ __align__(8) uint64_t bars[kDiagWarps][4];  // each warp's ring slots' barriers
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int64_t N = p.N, RB = p.row_bytes, nb = p.K / 32, wbytes = N * RB;
  const int nb8 = p.ng * 8, S = p.stages;
  uint32_t* xs = reinterpret_cast<uint32_t*>(qms);
  float* xsum = reinterpret_cast<float*>(xs + nb8 * kDiagPairs);
  unsigned char* ring = qms + size_t(nb8) * (kDiagPairs * 4 + 4) + size_t(warp) * S * 16 * p.pitch;
  // the CTA's tiles, as units (tile, group) with groups innermost; warp w takes units w, w + W, ...
  const int64_t tb = int64_t(blockIdx.x) * p.ntiles / gridDim.x;
  const int64_t te = (int64_t(blockIdx.x) + 1) * p.ntiles / gridDim.x;
  const int units = int((te - tb) * p.ng);  // (< 2^31: can_implement)
  // Unit warp + W j's rows into slot j % S (W the CTA's warps), completing on the slot's barrier (16 arrivals, one
  // per row lane, each declaring its bytes): lane r < 16 copies row r's bytes that cover the
  // group's blocks by one bulk copy, from the 16-byte piece holding its first byte, whole pieces
  // up to the weights' last whole piece; a row ending in the weights' last partial piece (the last
  // row only) gets its last bytes by plain loads and stores before its arrival. The lane orders
  // the warp's earlier reads of the slot (its __syncwarp, then a proxy fence) before the copy.
  uint64_t* bar = bars[warp];
  auto copy = [&](int j) {
    const int u = warp + kDiagWarps * j;
    if (u >= units || lane >= 16) return;
    const unsigned tile = unsigned(u) / unsigned(p.ng), gi = unsigned(u) - tile * unsigned(p.ng);
    const int64_t n = (tb + tile) * 16 + lane;
    unsigned bytes = 0;
    unsigned char* d = ring + (j % S) * 16 * p.pitch + lane * p.pitch;
    const uint8_t* src = p.w;
    if (n < N) {
      const int nbk = int(min(int64_t(8), nb - 8 * int64_t(gi)));
      const int64_t a = n * RB + int64_t(gi) * 8 * BB, a0 = a & ~int64_t(15), end = a + nbk * BB;
      bytes = unsigned(min((end - a0 + 15) & ~int64_t(15), (wbytes - a0) & ~int64_t(15)));
      src = p.w + a0;
      for (int64_t b = a0 + bytes; b < end; ++b) d[b - a0] = p.w[b];  // (the last row's last partial piece)
    }
    mbar_arrive_expect_tx(bar + j % S, bytes);
    if (bytes) {
      fence_proxy_async_smem();
      bulk_copy_g2s(d, src, bytes, bar + j % S);
    }
  };
  if (lane < S) mbar_init(bar + lane, 16);
  mbar_init_fence();
  __syncwarp();
  if (p.early)
    for (int j = 0; j < S - 1; ++j) copy(j);
  if (threadIdx.x < kDiagPairs) xzero[threadIdx.x] = 0u;
  pdl_begin();  // x is the previous kernel's output: read from here on
  if (!p.early)
    for (int j = 0; j < S - 1; ++j) copy(j);
  {
    // x's pairs of every block (zeros past nb, up to whole groups of 8): 4 threads per block, 4
    // pairs each; Q4_1: their 8 values' FP32 sum in pair order, then the 4 threads' by two
    // butterfly steps, is the block's X
    const T* xg = static_cast<const T*>(p.x);
    const int n4 = nb8 * 4, iters = (n4 + kDiagThreads - 1) / kDiagThreads;  // warp-uniform
    for (int it = 0; it < iters; ++it) {
      const int e = it * kDiagThreads + int(threadIdx.x), bl = e >> 2;
      float sum = 0.f;
      if (e < n4) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int s = 4 * (e & 3) + j;
          float v0 = 0.f, v1 = 0.f;
          if (bl < nb) {
            v0 = Dt<T>::to_f(xg[int64_t(bl) * 32 + diag_elem<Q>(s, 0)]);
            v1 = Dt<T>::to_f(xg[int64_t(bl) * 32 + diag_elem<Q>(s, 1)]);
          }
          xs[bl * kDiagPairs + s] = bits16(Dt<T>::from_f(v0)) | (bits16(Dt<T>::from_f(v1)) << 16);
          sum += v0;
          sum += v1;
        }
      }
      if constexpr (Q == KS_QTYPE_Q4_1) {
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        if (e < n4 && (e & 3) == 0) xsum[bl] = sum;
      }
    }
  }
  __syncthreads();
  const int tiles_pb = kDiagMaxUnits / p.ng, units_pb = tiles_pb * p.ng;  // a batch: whole tiles
  int j = 0;  // the warp's units so far
  for (int ub = 0; ub < units; ub += units_pb) {
    const int ue = min(units, ub + units_pb);
    for (int u = warp + kDiagWarps * j; u < ue; u += kDiagWarps, ++j) {
      __syncwarp();  // unit j - 1's slot is free
      copy(j + S - 1);
      mbar_wait(bar + j % S, unsigned(j / S) & 1u);  // unit j's rows have landed
      const unsigned tl = unsigned(u) / unsigned(p.ng);
      const int64_t tile = tb + tl;
      const int gi = int(unsigned(u) - tl * unsigned(p.ng));
      const int nbk = int(min(int64_t(8), nb - 8 * int64_t(gi)));
      const unsigned char* st = ring + (j % S) * 16 * p.pitch;
      const int64_t sa = (tile * 16 + g) * RB + int64_t(gi) * 8 * BB, sb = sa + 8 * RB;
      float acc0 = 0.f, acc1 = 0.f;
      diag_unit<T, Q>(st + g * p.pitch + int(sa & 15), st + (g + 8) * p.pitch + int(sb & 15),
                      xs + gi * 8 * kDiagPairs, xsum + gi * 8, xzero, nbk, acc0, acc1);
      acc0 += __shfl_xor_sync(0xffffffffu, acc0, 1);
      acc0 += __shfl_xor_sync(0xffffffffu, acc0, 2);
      acc1 += __shfl_xor_sync(0xffffffffu, acc1, 1);
      acc1 += __shfl_xor_sync(0xffffffffu, acc1, 2);
      if (t == 0) part[u - ub][g] = acc0, part[u - ub][g + 8] = acc1;
    }
    __syncthreads();
    // the batch's rows: each the sum of its groups' row sums in group order
    const int rows = (ue - ub) / p.ng * 16;
    for (int e = threadIdx.x; e < rows; e += kDiagThreads) {
      const int tl = e >> 4, r = e & 15;
      const int64_t n = (tb + ub / p.ng + tl) * 16 + r;
      if (n >= N) continue;
      float sum = 0.f;
      for (int q = 0; q < p.ng; ++q) sum += part[tl * p.ng + q][r];
      static_cast<T*>(p.out)[n] = Dt<T>::from_f(sum);
    }
    __syncthreads();
  }
  // (every slot's last phase was waited for: no copy is in flight)
}

// cuda_mma_diag's plan for an N x K matrix of bb-byte blocks: the slot's pitch (the pieces that
// cover 8 blocks from any 2-byte offset), the shared memory of x's pairs and X, the ring's stages
// (4, or fewer where they do not fit `limit` bytes; 0: not even 2 fit), and the grid (a CTA per
// 16-row tile up to one per SM).
struct DiagPlan {
  int ng = 0, pitch = 0, stages = 0;
  int64_t ntiles = 0;
  size_t smem = 0;
  unsigned grid = 0;
};
DiagPlan diag_plan(int64_t N, int64_t K, int bb, int warps, int sm_count, size_t limit) {
  DiagPlan d;
  d.ng = int((K / 32 + 7) / 8);
  d.pitch = (14 + 8 * bb + 15) / 16 * 16;
  d.ntiles = (N + 15) / 16;
  d.grid = unsigned(std::min<int64_t>(d.ntiles, sm_count));
  const size_t xbytes = size_t(d.ng) * 8 * (kDiagPairs * 4 + 4), slot = 16 * size_t(d.pitch) * warps;
  for (d.stages = 4; d.stages >= 2; --d.stages) {
    d.smem = xbytes + size_t(d.stages) * slot;
    if (d.smem <= limit) break;
  }
  if (d.stages < 2) d.stages = 0;
  return d;
}
template <typename T, ks_qtype_t Q>
size_t diag_smem_limit(int dev) {
  return size_t(opt_in_smem_limit<quant_mma_diag_kernel<T, Q, diag_warps(Q)>>(dev, "quant_matmul"));
}
DiagPlan diag_plan(const ops::QuantMatmulArgs& a, const DeviceProps& dp) {
  size_t limit = 0;
  with_float_type_and_qtype(a.x.dtype, a.qtype, [&](auto tag, auto q) {
    if constexpr (!std::is_same_v<decltype(tag), float>) limit = diag_smem_limit<decltype(tag), decltype(q)::value>(a.x.device.device_id);
  });
  return diag_plan(a.n, a.k, int(q_block_bytes(a.qtype)), diag_warps(a.qtype), dp.sm_count, limit);
}
}  // namespace

// (block formats only: the variant is block_formats_only, which the registry checks before this)
std::string quant_matmul_mma_diag_can_implement(const void* args) {
  const auto& a = *static_cast<const ops::QuantMatmulArgs*>(args);
  // (fp32 x: the registered dtypes, bf16 and fp16, already decline it)
  if (a.m != 1) return "M != 1: B's 8 columns carry 8 blocks of one row of x (decode GEMV)";
  if (reinterpret_cast<uintptr_t>(a.weight.data) % 16 != 0)
    return "weight not 16-byte aligned (bulk copies from its 16-byte pieces)";
  if (a.k / 32 > int64_t(kDiagMaxUnits) * 8) return "K > 65536: a tile's groups of 8 blocks exceed one batch of row sums";
  const DeviceProps& dp = device_props(a.x.device.device_id);
  if (dp.major < 9) return "needs sm_90 (bulk copies completing on mbarriers)";
  const DiagPlan plan = diag_plan(a, dp);
  if ((plan.ntiles / plan.grid + 1) * plan.ng >= (int64_t(1) << 31))
    return "N too large: a CTA's units (16 rows x 8 blocks) would pass 2^31";
  if (plan.stages == 0) return "x's pairs and two ring slots per warp do not fit the device's shared memory";
  return "";
}

void quant_matmul_mma_diag_cuda(const void* args, ks_stream_t stream) {
  const auto& a = *static_cast<const ops::QuantMatmulArgs*>(args);
  const int dev = a.x.device.device_id;
  DeviceGuard guard(dev, "quant_matmul");
  const DeviceProps& dp = device_props(dev);
  if (a.n == 0) return;  // nothing to write
  const DiagPlan plan = diag_plan(a, dp);
  if (plan.stages == 0) detail::fail(KS_ERROR_INTERNAL, "quant_matmul", "cuda_mma_diag: its ring does not fit shared memory");
  const DiagParams p{a.x.data, static_cast<const uint8_t*>(a.weight.data), a.out.data, a.n, a.k, a.row_bytes,
                     plan.ntiles, plan.ng, plan.stages, plan.pitch, qmm_stage_weights_enabled() ? 1 : 0};
  const auto s = static_cast<cudaStream_t>(stream);
  with_float_type_and_qtype(a.x.dtype, a.qtype, [&](auto tag, auto q) {
    using T = decltype(tag);
    if constexpr (std::is_same_v<T, float>)
      detail::fail(KS_ERROR_INTERNAL, "quant_matmul", "cuda_mma_diag: fp32 x");
    else {
      constexpr ks_qtype_t Q = decltype(q)::value;
      launch_kernel("quant_matmul", quant_mma_diag_kernel<T, Q, diag_warps(Q)>, dim3(plan.grid), dim3(32 * diag_warps(Q)),
                    plan.smem, s, 1, dp.pdl, p);
    }
  });
  check_launch("quant_matmul");
  record_launch("quant_matmul", "mma_diag warps=%lld stages=%lld groups_per_row=%lld pitch=%lld grid=%lld smem=%lld",
                {diag_warps(a.qtype), plan.stages, plan.ng, plan.pitch, plan.grid, int64_t(plan.smem)});
}

namespace {
// ---- variant cuda_mma_rows -------------------------------------------------------------------
// Many rows of x (batched decode, prefill) on the tensor cores: the factored block sums of
// cuda_mma_blocks (d S + m X per block of 32, S on mma.sync m16n8k16) with B's 8 columns being 8
// rows of x, any number of such row groups. fp32 x enters as cuda_mma_stream's three exact bf16
// pieces, but the pieces are not separate columns: the three MMAs of a block chain into one
// accumulator (S of the whole FP32 value, the products exact, the sum rounded in FP32), so a
// column is one row of x whatever the dtype.
// A CTA (8 warps) owns mt tiles of 16 weight rows (mt from N alone: 1, 2, 4 or 8, the largest that
// leaves at least 128 CTAs of rows) and rg groups of 8 rows of x (rg from M and the grid: 1 to
// 4). Its warps are mt tiles x ks = 8 / mt splits of K: warp (tile i, split j) sums blocks j, j +
// ks, j + 2 ks, ... of its tile's rows in that order, for all rg groups from one decode of each
// block's codes. x is staged per chunk of kc blocks (the whole row, or a multiple of 8 blocks, so
// a warp's blocks come in the same order however K is chunked) as B's pairs in shared memory, [block][group][piece]
// [half][column][8 pairs]: a fragment load is 256 contiguous bytes. Q4_1's X is the FP32 sum of
// a block's 32 values of the row (8 per thread in order, then a butterfly over 4 lanes). At the
// end the ks warps of a tile meet in shared memory, added in split order. The order of every
// sum depends on N, K and the block format only: a row's result is the same in any batch
// (batch-invariant), and differs from the one-row variants' by FP32 rounding only.
// (kRowsWarps, kRowsMaxGroups and the plan: launch_rules.hpp)
constexpr int kRowsThreads = 32 * kRowsWarps;

struct MmaRowsParams {
  const void* x;     // [M, K] (SILU: gate_up [M, 2K], gate then up)
  const uint8_t* w;  // [N, row_bytes]
  void* out;         // [M, N]
  int64_t M, N, K, row_bytes;
  int64_t x_stride;  // elements between rows of x: K (SILU: 2K)
  int mt;  // weight tiles (16 rows) per CTA
  int rg;  // groups of 8 rows of x per CTA
  int kc;  // blocks per staged chunk (a multiple of 8, or every block of the row)
  int prefetch;  // 1: L2 prefetch of the CTA's rows' first chunk before the dependency wait
  int early;     // 1: the first chunk's first blocks loaded before the dependency wait (KS_QMM_WSTAGE=0: 0)
};

// SILU: the rows of x are silu(gate) * up of a gate_up row, each value rounded to T as
// silu_and_mul stores it (silu_and_mul_quant_matmul's variant cuda_mma_rows: the same bits as
// silu_and_mul, then this kernel on its output).
template <typename T, ks_qtype_t Q, bool SILU = false>
__global__ void __launch_bounds__(kRowsThreads, 2) quant_mma_rows_kernel(const MmaRowsParams p) {
  using TM = MmaElem<T>;
  constexpr int P = std::is_same_v<T, float> ? 3 : 1;  // pieces per value
  constexpr int BB = int(q_block_bytes(Q)), U = 4;
  constexpr bool Q41 = Q == KS_QTYPE_Q4_1;
  extern __shared__ __align__(16) unsigned char qrs[];
  const int rg = p.rg, kc = p.kc, ks = kRowsWarps / p.mt;
  uint32_t* xs = reinterpret_cast<uint32_t*>(qrs);                 // [kc][rg][P][2][8][8] pairs
  float* xsum = reinterpret_cast<float*>(xs + kc * rg * P * 128);  // [kc][rg][8] (Q4_1)
  float* part = xsum + (Q41 ? kc * rg * 8 : 0);                    // [warp][16][rg * 8]
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int64_t N = p.N, M = p.M, RB = p.row_bytes, nb = p.K / 32;
  const int tile = warp / ks, split = warp % ks;
  const int64_t n0 = (int64_t(blockIdx.x) * p.mt + tile) * 16;  // this warp's tile's first row
  const bool live = n0 < N;
  // the lane's rows g and g + 8; rows past N read the last row and are never written
  const uint8_t* wa = p.w + min(n0 + g, N - 1) * RB;
  const uint8_t* wb = p.w + min(n0 + g + 8, N - 1) * RB;
  if (p.prefetch && p.early) {  // weights are read-only inputs (the contract): hints for L2 before the wait
    const int64_t row0 = int64_t(blockIdx.x) * p.mt * 16, rows = min(int64_t(p.mt) * 16, N - row0);
    const int64_t lines = (min(int64_t(kc), nb) * BB + 127) / 128 + 1;  // the chunk's bytes may straddle a line
    for (int64_t e = threadIdx.x; e < rows * lines; e += kRowsThreads) {
      const int64_t r = e / lines, a = (row0 + r) * RB + (e % lines) * 128;
      if (a < N * RB) prefetch_l2(p.w + a);
    }
  }
  // The words of U of this warp's blocks (split + u ks of the chunk at c0), in registers. A
  // chunk's first U are loaded before its x is staged, so the two latencies overlap (and the
  // first chunk's before the dependency wait: weights are read-only inputs, no kernel writes
  // them; after it with KS_QMM_WSTAGE=0); the others just before their MMAs.
  uint32_t ha[U], hb[U], qa[U], qb[U], qa1[U], qb1[U];
  auto load_blocks = [&](int64_t c0, int kcur, int bl0) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int bl = bl0 + u * ks;
      ha[u] = hb[u] = qa[u] = qb[u] = qa1[u] = qb1[u] = 0u;
      if (bl >= kcur) continue;
      const int64_t off = (c0 + bl) * BB;
      if constexpr (Q == KS_QTYPE_Q8_0) {
        q8_words(wa + off, t, ha[u], qa[u], qa1[u]);
        q8_words(wb + off, t, hb[u], qb[u], qb1[u]);
      } else {
        q4_words<Q41>(wa + off, t, ha[u], qa[u]);
        q4_words<Q41>(wb + off, t, hb[u], qb[u]);
      }
    }
  };
  const int cols = rg * 8;  // the CTA's rows of x
  if (p.early && live && int64_t(blockIdx.y) * cols < M) load_blocks(0, int(min(int64_t(kc), nb)), split);
  pdl_begin();
  if (!p.early && live && int64_t(blockIdx.y) * cols < M) load_blocks(0, int(min(int64_t(kc), nb)), split);
  bool loaded = true;  // (the loads above: the first row range's first chunk)
  for (int64_t y = blockIdx.y; y * cols < M; y += gridDim.y) {
    const int64_t r0 = y * cols;
    float acc[kRowsMaxGroups][4] = {};
    for (int64_t c0 = 0; c0 < nb; c0 += kc) {
      const int kcur = int(min(int64_t(kc), nb - c0));
      if (live && !loaded) load_blocks(c0, kcur, split);
      loaded = false;
      __syncthreads();  // the previous chunk's (or row range's) readers are done
      // B's pairs of rows r0.., blocks c0..: element e = (row j, quarter q of a block) holds 8
      // consecutive values (4 pairs); a row's elements are contiguous (coalesced reads of x) and
      // 4 consecutive elements are one block of one row. SU elements per thread and round, all
      // their loads issued before the first is used (one L2 latency per round, not per pair).
      constexpr int SU = SILU ? 2 : 4;  // (SILU: the up values too; 4 in flight spilled registers)
      const int per_row = kcur * 4, total = cols * per_row;
      const uint32_t magic = div_magic(uint32_t(per_row));  // (e < 2^16: see div_magic)
      for (int e0 = 0; e0 < total; e0 += SU * kRowsThreads) {  // warp-uniform trip count (the shuffles)
        float v[SU][8], up[SILU ? SU : 1][8];
#pragma unroll
        for (int u = 0; u < SU; ++u) {
          const int e = e0 + u * kRowsThreads + int(threadIdx.x);
          const int j = int(div_by_magic(uint32_t(e), magic)), q = e - j * per_row;
          const int64_t row = r0 + j;
#pragma unroll
          for (int i = 0; i < 8; ++i) v[u][i] = 0.f;
          if constexpr (SILU) {
#pragma unroll
            for (int i = 0; i < 8; ++i) up[u][i] = 0.f;
          }
          if (e < total && row < M) {
            const int64_t k = (c0 + (q >> 2)) * 32 + (q & 3) * 8;
            if constexpr (std::is_same_v<T, float>) {
              const float2* xr = reinterpret_cast<const float2*>(static_cast<const float*>(p.x) + row * p.x_stride + k);
#pragma unroll
              for (int i = 0; i < 4; ++i) {
                const float2 f = xr[i];
                v[u][2 * i] = f.x;
                v[u][2 * i + 1] = f.y;
                if constexpr (SILU) {  // (up: K values after the gate)
                  const float2 g = reinterpret_cast<const float2*>(reinterpret_cast<const float*>(xr) + p.K)[i];
                  up[u][2 * i] = g.x;
                  up[u][2 * i + 1] = g.y;
                }
              }
            } else {
              const T* xr = static_cast<const T*>(p.x) + row * p.x_stride + k;
#pragma unroll
              for (int i = 0; i < 8; ++i) {
                v[u][i] = Dt<T>::to_f(xr[i]);
                if constexpr (SILU) up[u][i] = Dt<T>::to_f(xr[p.K + i]);
              }
            }
          }
        }
#pragma unroll
        for (int u = 0; u < SU; ++u) {
          if constexpr (SILU) {  // silu_and_mul's values (0 where nothing was loaded: silu(0) * 0)
#pragma unroll
            for (int i = 0; i < 8; ++i) v[u][i] = round_to<T>(silu_times<T>(v[u][i], up[u][i]));
          }
          const int e = e0 + u * kRowsThreads + int(threadIdx.x);
          const bool ok = e < total;
          const int j = ok ? int(div_by_magic(uint32_t(e), magic)) : 0, q = ok ? e - j * per_row : 0;
          const int bl = q >> 2, qu = q & 3;  // pairs 4 qu .. 4 qu + 3 of the block: half qu / 2
          if (ok) {
            uint32_t pr[P][4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              if constexpr (P == 3) {  // the pieces' upper halves, paired by one byte permute
                uint32_t w0[3], w1[3];
                bf16_piece_words(v[u][2 * i], w0);
                bf16_piece_words(v[u][2 * i + 1], w1);
#pragma unroll
                for (int c = 0; c < 3; ++c) pr[c][i] = __byte_perm(w0[c], w1[c], 0x7632);
              } else {
                uint32_t b0[P], b1[P];
                x_pieces<T, P>(v[u][2 * i], b0);
                x_pieces<T, P>(v[u][2 * i + 1], b1);
#pragma unroll
                for (int c = 0; c < P; ++c) pr[c][i] = b0[c] | (b1[c] << 16);
              }
            }
            uint32_t* dst = xs + (bl * rg + j / 8) * P * 128 + (qu >> 1) * 64 + (j % 8) * 8 + (qu & 1) * 4;
#pragma unroll
            for (int c = 0; c < P; ++c) *reinterpret_cast<uint4*>(dst + c * 128) = make_uint4(pr[c][0], pr[c][1], pr[c][2], pr[c][3]);
          }
          if constexpr (Q41) {  // the block's X: 8 values in order, then the 4 quarters by a butterfly
            float sum = 0.f;
#pragma unroll
            for (int i = 0; i < 8; ++i) sum += v[u][i];
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            if (ok && qu == 0) xsum[(bl * rg + j / 8) * 8 + j % 8] = sum;
          }
        }
      }
      __syncthreads();
      if (!live) continue;
      // this warp's blocks of the chunk: split, split + ks, ... (U of them loaded together)
      for (int bl0 = split; bl0 < kcur; bl0 += U * ks) {
        if (bl0 != split) load_blocks(c0, kcur, bl0);  // (the chunk's first U: before the staging)
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int bl = bl0 + u * ks;
          if (bl >= kcur) break;
          const float da = h2f_bits(uint16_t(ha[u])), db = h2f_bits(uint16_t(hb[u]));
          const uint32_t* xb = xs + bl * rg * P * 128 + g * 8 + 2 * t;
          if constexpr (Q == KS_QTYPE_Q8_0) {
            uint32_t a[4][4];
            q8_a_frags<TM>(qa[u], qa1[u], qb[u], qb1[u], a);
#pragma unroll
            for (int r = 0; r < kRowsMaxGroups; ++r) {
              if (r >= rg) break;
              float sl[4] = {0.f, 0.f, 0.f, 0.f}, sh[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
              for (int c = 0; c < P; ++c) {
                const uint2 xl = *reinterpret_cast<const uint2*>(xb + (r * P + c) * 128);
                const uint2 xh = *reinterpret_cast<const uint2*>(xb + (r * P + c) * 128 + 64);
                mma_16816<TM>(sl, a[0], xl.x, xl.y);
                mma_16816<TM>(sl, a[1], xh.x, xh.y);
                mma_16816<TM>(sh, a[2], xl.x, xl.y);
                mma_16816<TM>(sh, a[3], xh.x, xh.y);
              }
              add_q8_sums(acc[r], sl, sh, da, db);
            }
          } else {
            uint32_t alo[4], ahi[4];
            q4_a_frags<TM, Q41>(qa[u], qb[u], alo, ahi);
            const float ma = Q41 ? h2f_bits(uint16_t(ha[u] >> 16)) : 0.f;
            const float mb = Q41 ? h2f_bits(uint16_t(hb[u] >> 16)) : 0.f;
#pragma unroll
            for (int r = 0; r < kRowsMaxGroups; ++r) {
              if (r >= rg) break;
              float s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
              for (int c = 0; c < P; ++c) {
                const uint2 xl = *reinterpret_cast<const uint2*>(xb + (r * P + c) * 128);
                const uint2 xh = *reinterpret_cast<const uint2*>(xb + (r * P + c) * 128 + 64);
                mma_16816<TM>(s, alo, xl.x, xl.y);
                mma_16816<TM>(s, ahi, xh.x, xh.y);
              }
              float2 X = make_float2(0.f, 0.f);  // (Q4_1's X of columns 2t, 2t + 1)
              if constexpr (Q41) X = *reinterpret_cast<const float2*>(xsum + (bl * rg + r) * 8 + 2 * t);
              add_q4_sums<Q41>(acc[r], s, da, db, ma, mb, X.x, X.y);
            }
          }
        }
      }
    }
    // the tile's splits meet: (weight row, x row) sums added in split order
#pragma unroll
    for (int r = 0; r < kRowsMaxGroups; ++r) {
      if (r >= rg) break;
      float* pw = part + (warp * 16) * cols + r * 8 + 2 * t;
      pw[g * cols] = acc[r][0];
      pw[g * cols + 1] = acc[r][1];
      pw[(g + 8) * cols] = acc[r][2];
      pw[(g + 8) * cols + 1] = acc[r][3];
    }
    __syncthreads();
    for (int e = threadIdx.x; e < p.mt * 16 * cols; e += kRowsThreads) {
      const int rr = e / cols, j = e % cols, ti = rr / 16;
      const int64_t n = (int64_t(blockIdx.x) * p.mt) * 16 + rr, m = r0 + j;
      if (n >= N || m >= M) continue;
      float sum = 0.f;
      for (int sp = 0; sp < ks; ++sp) sum += part[((ti * ks + sp) * 16 + rr % 16) * cols + j];
      static_cast<T*>(p.out)[m * N + n] = Dt<T>::from_f(sum);
    }
    __syncthreads();  // part is read before the next row range writes it (K = 0 stages nothing)
  }
}
}  // namespace

namespace {
// cuda_mma_rows' plan: rows_plan in launch_rules.hpp (unit-tested on the CPU), with the
// experiments' switches read per call here: KS_QMM_ROWS_GROUPS=1..4 sets rg (at most the call's
// groups), KS_QMM_ROWS_STAGE_KB=N the stage budget (default 96), KS_QMM_ROWS_PREFETCH=1 the L2
// prefetch of the CTA's first chunk of weights before the dependency wait; for tests,
// KS_QMM_ROWS_MAX_GRID_Y=n caps the grid's y (the tests' way to make CTAs loop over several row
// ranges without 65536 of them). None of them changes a sum's order.
struct RowsLaunch {
  RowsPlan plan;
  int prefetch = 0;
  dim3 grid;
};
RowsLaunch rows_launch(int64_t M, int64_t N, int64_t K, bool fp32, bool q41, int sm_count, int64_t smem_limit) {
  RowsLaunch l;
  l.plan = rows_plan(M, N, K, fp32, q41, sm_count, smem_limit, int(env_number("KS_QMM_ROWS_GROUPS", 0)),
                     env_number("KS_QMM_ROWS_STAGE_KB", 0));
  l.prefetch = env_is("KS_QMM_ROWS_PREFETCH", "1") ? 1 : 0;
  const long long ycap = env_number("KS_QMM_ROWS_MAX_GRID_Y", 65535);
  l.grid = dim3(unsigned(l.plan.grid_x),
                unsigned(std::min<int64_t>(l.plan.grid_y, ycap >= 1 && ycap <= 65535 ? ycap : 65535)));
  return l;
}
// One call of the kernel: quant_matmul's, or silu_and_mul_quant_matmul's (silu: x is gate_up).
struct RowsCall {
  const char* op;
  detail::View out, x, weight;
  ks_qtype_t qtype;
  int64_t m, n, k, row_bytes;
  bool silu;
};
RowsCall rows_call(const ops::QuantMatmulArgs& a) {
  return {"quant_matmul", a.out, a.x, a.weight, a.qtype, a.m, a.n, a.k, a.row_bytes, false};
}
RowsCall rows_call(const ops::SiluQuantMatmulArgs& a) {
  return {"silu_and_mul_quant_matmul", a.out, a.gate_up, a.weight, a.qtype, a.m, a.n, a.k, a.row_bytes, true};
}
// f(k) with the kernel instantiation of call c's types as a constant (decltype(k)::value).
template <typename F>
void with_rows_kernel(const RowsCall& c, F&& f) {
  with_float_type_and_qtype(c.x.dtype, c.qtype, [&](auto tag, auto q) {
    using T = decltype(tag);
    constexpr ks_qtype_t Q = decltype(q)::value;
    if (c.silu)
      f(std::integral_constant<decltype(&quant_mma_rows_kernel<T, Q, true>), &quant_mma_rows_kernel<T, Q, true>>{});
    else
      f(std::integral_constant<decltype(&quant_mma_rows_kernel<T, Q, false>), &quant_mma_rows_kernel<T, Q, false>>{});
  });
}
RowsLaunch rows_launch(const RowsCall& c, int sm_count) {
  int64_t limit = 0;  // the dynamic shared memory one CTA of the kernel may take
  with_rows_kernel(c, [&](auto k) { limit = opt_in_smem_limit<decltype(k)::value>(c.x.device.device_id, c.op); });
  return rows_launch(c.m, c.n, c.k, c.x.dtype == detail::DType::F32, c.qtype == KS_QTYPE_Q4_1, sm_count, limit);
}
// (the block format: the op's own can_implement, which the registry's check runs first)
std::string mma_rows_can_implement(const RowsCall& c) {
  if (c.n > int64_t(INT32_MAX) * 16) return "N too large for the grid";
  if (c.x.dtype == detail::DType::F32 && reinterpret_cast<uintptr_t>(c.x.data) % 8 != 0)
    return std::string(c.silu ? "fp32 gate_up" : "fp32 x") + " not 8-byte aligned (8-byte loads of value pairs)";
  if (reinterpret_cast<uintptr_t>(c.weight.data) % (c.qtype == KS_QTYPE_Q4_1 ? 4 : 2) != 0)
    return "weight not aligned to its block words (Q4_1: 4 bytes, Q4_0 / Q8_0: 2)";
  const DeviceProps& dp = device_props(c.x.device.device_id);
  if (dp.major < 8) return "needs sm_80 or newer (bf16 / fp16 mma.sync)";
  if (rows_launch(c, dp.sm_count).plan.smem == 0) return "8 blocks of one group of x do not fit the device's shared memory";
  return "";
}
void mma_rows_run(const RowsCall& c, ks_stream_t stream) {
  const int dev = c.x.device.device_id;
  DeviceGuard guard(dev, c.op);
  const DeviceProps& dp = device_props(dev);
  if (c.m == 0 || c.n == 0) return;  // nothing to write
  const RowsLaunch l = rows_launch(c, dp.sm_count);
  const RowsPlan& plan = l.plan;
  const MmaRowsParams p{c.x.data, static_cast<const uint8_t*>(c.weight.data), c.out.data, c.m, c.n, c.k,
                        c.row_bytes, c.silu ? 2 * c.k : c.k, plan.mt, plan.rg, plan.kc, l.prefetch,
                        qmm_stage_weights_enabled() ? 1 : 0};
  const auto s = static_cast<cudaStream_t>(stream);
  with_rows_kernel(c, [&](auto k) {
    constexpr auto kern = decltype(k)::value;
    if (plan.smem == 0 || int64_t(plan.smem) > opt_in_smem_limit<kern>(dev, c.op))
      detail::fail(KS_ERROR_INTERNAL, c.op, "cuda_mma_rows: its staged x does not fit shared memory");
    launch_kernel(c.op, kern, l.grid, dim3(kRowsThreads), plan.smem, s, 1, dp.pdl, p);
  });
  check_launch(c.op);
  record_launch(c.op,
                "mma_rows tiles_per_cta=%lld x_groups_per_cta=%lld blocks_per_chunk=%lld grid=%lldx%lld smem=%lld "
                "prefetch=%lld silu=%lld",
                {plan.mt, plan.rg, plan.kc, l.grid.x, l.grid.y, int64_t(plan.smem), l.prefetch, c.silu ? 1 : 0});
}
}  // namespace

std::string quant_matmul_mma_rows_can_implement(const void* args) {
  return mma_rows_can_implement(rows_call(*static_cast<const ops::QuantMatmulArgs*>(args)));
}
void quant_matmul_mma_rows_cuda(const void* args, ks_stream_t stream) {
  mma_rows_run(rows_call(*static_cast<const ops::QuantMatmulArgs*>(args)), stream);
}
// silu_and_mul_quant_matmul's variant cuda_mma_rows: silu_and_mul's values staged as the rows of x
std::string silu_quant_matmul_mma_rows_can_implement(const void* args) {
  return mma_rows_can_implement(rows_call(*static_cast<const ops::SiluQuantMatmulArgs*>(args)));
}
void silu_quant_matmul_mma_rows_cuda(const void* args, ks_stream_t stream) {
  mma_rows_run(rows_call(*static_cast<const ops::SiluQuantMatmulArgs*>(args)), stream);
}

}  // namespace ks::cuda
