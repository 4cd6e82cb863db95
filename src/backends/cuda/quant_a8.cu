// quant_matmul_a8 on CUDA (contract: docs/contracts.md#quant_matmul_a8; the arithmetic in
// core/a8_quant.hpp, shared with the CPU reference): x quantized to int8 per block of 32, each
// block's dot product an exact int32 sum by dp4a (4 code products per instruction), its value
// formed in FP32, the blocks of a row summed lane by lane (lane l: blocks l, l + 32, ... in order)
// and then across the warp by the butterfly of warp_sum. Both variants sum in that order, so they
// give the same bits. The lane sums are __fadd_rn: a plain += let the compiler fuse the block
// value's last product into the add (one rounding fewer than the contract's; the GPU test caught it
// at K = 4096, 4 blocks per lane).
//
// Why: the FP32-x kernels spend about 6 instructions per weight (decode, convert, FMA; docs/cuda.md,
// quant_matmul) and are bound by issuing them, near half of the copy bandwidth at 4096 x 4096 and
// larger. With int8 x, a block of 32 weights costs a lane about 30 instructions (5 word loads,
// 8 nibble masks, 8 dp4a, the scales), about one per weight.
//
//   cuda_a8_warp (any M, sm_80+): a warp per output column, x's row m quantized into shared memory
//     by the CTA before the columns of that row are summed (weights re-read per row from L1 / L2;
//     every CTA quantizes every row, with two CTA barriers per row: a decode-sized kernel, heavy
//     for large M).
//   cuda_a8_bulk_stream (M = 1, sm_90): cuda_bulk_stream's ring (a CTA per SM streams its contiguous
//     rows through shared-memory stages, one bulk copy each, issued by a producer warp that does not
//     wait for the previous kernel) feeding 16 warps that take the stage's rows in pairs.
//     x is quantized after griddepcontrol.wait, on the chain from the previous kernel's end to this
//     one's (the weights are in flight meanwhile); by 16-byte loads, one round trip for K up to
//     16384 (a8_stage_row_vec; measured on the H200 in 4f4a7d1's call, bf16 x, this trigger rule:
//     Q4_1 4096 x 4096 6.44 -> 4.48 us, 14336 x 4096 11.94 -> 10.50, Q8_0 8.23 -> 6.60 and
//     17.75 -> 17.21; docs/perf/h200_quant_a8.md).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cfloat>
#include <cstdint>
#include <string>

#include "backends/cuda/common.cuh"
#include "backends/cuda/launch_rules.hpp"
#include "core/a8_quant.hpp"
#include "ops/args.hpp"

namespace ks::cuda {
namespace {

// One block of x as staged: 32 codes (8 words: codes 4j..4j+3 in word j, lowest byte first), the
// scale d, d * Q (Q4_1) and Q (Q4_0). 48 bytes: lanes reading consecutive blocks with 16-byte
// loads hit distinct banks in each quarter warp.
struct alignas(16) A8X {
  int q[8];
  float d, dq;
  int qs, pad;
};
static_assert(sizeof(A8X) == 48, "A8X is 48 bytes");

// Quantizes a row of x (nb blocks of T) into xs: warp `warp` of `nwarps` takes blocks warp,
// warp + nwarps, ..., lane i its element i (a8_scale / a8_code, the max and the code sum by
// warp reductions). A warp loads 8 blocks' values before it reduces any, so their L2 / DRAM
// round trips overlap (one block at a time, the loads waited on each other's shuffles).
template <typename T>
__device__ __forceinline__ void a8_stage_row(const T* xr, int nb, A8X* xs, int warp, int nwarps, int lane) {
  constexpr int U = 8;
  for (int b0 = warp; b0 < nb; b0 += U * nwarps) {
    float v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int b = b0 + u * nwarps;
      v[u] = b < nb ? Dt<T>::to_f(xr[int64_t(b) * 32 + lane]) : 0.f;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int b = b0 + u * nwarps;  // the same for every lane of the warp
      if (b >= nb) break;
      const float av = fabsf(v[u]);
      const bool finite = av <= FLT_MAX;
      const bool bad = __any_sync(0xffffffffu, !finite);
      float amax = finite ? av : 0.f;
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
      const A8Scale sc = a8_scale(amax, bad);
      const int c = bad ? 0 : a8_code(v[u], sc.inv);
      const int qs = __reduce_add_sync(0xffffffffu, c);
      reinterpret_cast<int8_t*>(xs[b].q)[lane] = int8_t(c);
      if (lane == 0) {
        xs[b].d = sc.d;
        xs[b].dq = a8_dq(sc.d, qs);
        xs[b].qs = qs;
      }
    }
  }
}

// The same staging from 16-byte loads (x 16-byte aligned): thread `tid` of `nthreads` (whole warps)
// takes the row's 16-byte pieces tid, tid + nthreads, ..., up to U of them loaded before any is
// reduced, so a row of nthreads pieces or fewer costs one round trip. A block is L = 4 adjacent
// lanes' pieces (8 fp16 / bf16 values each; fp32: 8 lanes of 4), its maximum and code sum reduced
// over those lanes: the same max, scale, codes and (exact integer) sum as a8_stage_row, so the same
// bits. (The per-block form loads one value per lane: 8 blocks per warp per round trip.)
template <typename T>
__device__ __forceinline__ void a8_stage_row_vec(const T* xr, int nb, A8X* xs, int tid, int nthreads) {
  constexpr int E = 16 / int(sizeof(T)), L = 32 / E, U = 4;
  const int pieces = nb * L;
  for (int p0 = 0; p0 < pieces; p0 += U * nthreads) {
    uint4 raw[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int pc = p0 + u * nthreads + tid;  // the same validity for a block's L lanes
      raw[u] = pc < pieces ? *reinterpret_cast<const uint4*>(xr + int64_t(pc) * E) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int pc = p0 + u * nthreads + tid;
      if (p0 + u * nthreads >= pieces) break;  // (uniform over the CTA)
      const T* e = reinterpret_cast<const T*>(&raw[u]);
      float v[E];
      float amax = 0.f;
      bool bad = false;
#pragma unroll
      for (int i = 0; i < E; ++i) {
        v[i] = Dt<T>::to_f(e[i]);
        const float av = fabsf(v[i]);
        const bool finite = av <= FLT_MAX;
        bad |= !finite;
        amax = fmaxf(amax, finite ? av : 0.f);
      }
#pragma unroll
      for (int o = L / 2; o > 0; o >>= 1) {
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        bad |= __shfl_xor_sync(0xffffffffu, int(bad), o) != 0;
      }
      const A8Scale sc = a8_scale(amax, bad);
      int qs = 0;
      uint32_t w[E / 4];
#pragma unroll
      for (int j = 0; j < E / 4; ++j) {
        uint32_t word = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int c = bad ? 0 : a8_code(v[4 * j + i], sc.inv);
          qs += c;
          word |= uint32_t(uint8_t(int8_t(c))) << (8 * i);
        }
        w[j] = word;
      }
#pragma unroll
      for (int o = L / 2; o > 0; o >>= 1) qs += __shfl_xor_sync(0xffffffffu, qs, o);
      if (pc < pieces) {
        const int b = pc / L, part = pc % L;
        int* q = xs[b].q + part * (E / 4);
#pragma unroll
        for (int j = 0; j < E / 4; ++j) q[j] = int(w[j]);
        if (part == 0) {
          xs[b].d = sc.d;
          xs[b].dq = a8_dq(sc.d, qs);
          xs[b].qs = qs;
        }
      }
    }
  }
}

template <ks_qtype_t Q>
struct A8Fmt {
  static constexpr int code_words = Q == KS_QTYPE_Q8_0 ? 8 : 4;  // 32-bit words of a block's codes
};

// A weight block's header word (dw in the low half, Q4_1's mw in the high half) and code words
// (bytes 4j..4j+3 of its codes in word j) from p. ALIGNED: p is 2-byte aligned (4-byte for Q4_1)
// and the 4-byte words covering the block are read (for Q4_0 / Q8_0 blocks at a 4-byte boundary,
// 2 bytes past the block: the caller keeps them inside the row's storage); else byte loads.
template <ks_qtype_t Q, bool ALIGNED>
__device__ __forceinline__ uint32_t a8_load_block(const unsigned char* p, uint32_t (&cw)[A8Fmt<Q>::code_words]) {
  constexpr int NCW = A8Fmt<Q>::code_words;
  if constexpr (!ALIGNED) {
    constexpr int hb = Q == KS_QTYPE_Q4_1 ? 4 : 2;
#pragma unroll
    for (int j = 0; j < NCW; ++j) {
      const unsigned char* c = p + hb + 4 * j;
      cw[j] = uint32_t(c[0]) | uint32_t(c[1]) << 8 | uint32_t(c[2]) << 16 | uint32_t(c[3]) << 24;
    }
    return uint32_t(p[0]) | uint32_t(p[1]) << 8 | (hb == 4 ? uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24 : 0u);
  } else if constexpr (Q == KS_QTYPE_Q4_1) {
    const uint32_t* w = reinterpret_cast<const uint32_t*>(p);
#pragma unroll
    for (int j = 0; j < NCW; ++j) cw[j] = w[j + 1];
    return w[0];
  } else {
    // One byte permute per word: a block at a 4-byte boundary has its codes 2 bytes into word j
    // (bytes 2, 3 of r[j] and 0, 1 of r[j + 1]: selector 0x5432), one 2 bytes past it in word
    // j + 1 (0x7654); its fp16 scale is bytes 0, 1 (0x4410, zeros above) or 2, 3 (0x4432) of r[0].
    // (A funnel shift and a select per word before: 8 / 16 instructions per Q4_0 / Q8_0 block.)
    const unsigned off = unsigned(reinterpret_cast<uintptr_t>(p)) & 2u;
    const uint32_t* w = reinterpret_cast<const uint32_t*>(p - off);
    uint32_t r[NCW + 1];
#pragma unroll
    for (int j = 0; j <= NCW; ++j) r[j] = w[j];
    const unsigned sel = off ? 0x7654u : 0x5432u;
#pragma unroll
    for (int j = 0; j < NCW; ++j) cw[j] = __byte_perm(r[j], r[j + 1], sel);
    return __byte_perm(r[0], 0u, off ? 0x4432u : 0x4410u);
  }
}

// d + the byte products of a (unsigned bytes) and b (signed bytes): PTX dp4a.u32.s32.
__device__ __forceinline__ int dp4a_us(uint32_t a, int b, int c) {
  int d;
  asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

// One block's value (a8_block_value) from its bytes at p and x's staged block. 4-bit formats: the
// low nibbles by a signed dp4a into S_lo; the high nibbles stay in place (c & 0xF0, i.e. 16 c, an
// unsigned byte) and a mixed-sign dp4a sums them into H = 16 S_hi, exactly; S = S_lo + H / 16 (an
// exact shift): one shift per code word fewer than shifting each word down, the same S. Measured
// on the H200 at 002f53d (bf16 x, one call): Q4_1 14336 x 4096 12.18 -> 11.92 us, 49152 x 576
// 9.80 -> 9.48; Q4_0 12.50 -> 12.41 (then behind KS_QMM_A8_HI16=1; the only form since).
template <ks_qtype_t Q, bool ALIGNED>
__device__ __forceinline__ float a8_block(const unsigned char* p, const int4& x0, const int4& x1, const float4& xs) {
  uint32_t cw[A8Fmt<Q>::code_words];
  const uint32_t hdr = a8_load_block<Q, ALIGNED>(p, cw);
  int S = 0;
  if constexpr (Q == KS_QTYPE_Q8_0) {
    S = __dp4a(int(cw[0]), x0.x, S);
    S = __dp4a(int(cw[1]), x0.y, S);
    S = __dp4a(int(cw[2]), x0.z, S);
    S = __dp4a(int(cw[3]), x0.w, S);
    S = __dp4a(int(cw[4]), x1.x, S);
    S = __dp4a(int(cw[5]), x1.y, S);
    S = __dp4a(int(cw[6]), x1.z, S);
    S = __dp4a(int(cw[7]), x1.w, S);
  } else {  // low nibbles: weights 4j..4j+3 (x words 0..3); high nibbles: 16 + 4j.. (x words 4..7)
    constexpr uint32_t lo = 0x0f0f0f0fu;
    S = __dp4a(int(cw[0] & lo), x0.x, S);
    S = __dp4a(int(cw[1] & lo), x0.y, S);
    S = __dp4a(int(cw[2] & lo), x0.z, S);
    S = __dp4a(int(cw[3] & lo), x0.w, S);
    constexpr uint32_t hi = 0xf0f0f0f0u;
    int H = 0;
    H = dp4a_us(cw[0] & hi, x1.x, H);
    H = dp4a_us(cw[1] & hi, x1.y, H);
    H = dp4a_us(cw[2] & hi, x1.z, H);
    H = dp4a_us(cw[3] & hi, x1.w, H);
    S += H >> 4;  // H is 16 times an integer: the shift is exact
  }
  const float dw = h2f_bits(uint16_t(hdr & 0xffffu));
  const float mw = Q == KS_QTYPE_Q4_1 ? h2f_bits(uint16_t(hdr >> 16)) : 0.f;
  return a8_block_value<Q>(dw, mw, xs.x, xs.y, S, __float_as_int(xs.z));
}

// x's staged block b as the loads a8_block takes.
struct A8XRegs {
  int4 x0, x1;
  float4 s;
};
__device__ __forceinline__ A8XRegs a8_x(const A8X* xs, int b) {
  const int4* q = reinterpret_cast<const int4*>(xs[b].q);
  return {q[0], q[1], *reinterpret_cast<const float4*>(&xs[b].d)};
}

// Rows t .. t + R - 1 of the `rows` rows at src (RB bytes apart, 4-byte aligned; PAD: laid out as
// a8_row_pad says, block b at a8_padded_block_offset) dotted with x's staged blocks in the
// contract's order (lane l: blocks l, l + 32, ...; then warp_sum); lane 0 writes their outputs.
// Rows past the last are summed as the last row and not written. A warp's x loads serve R rows:
// at R = 4, half of R = 2's x traffic per row.
template <typename T, ks_qtype_t Q, int R, bool PAD>
__device__ __forceinline__ void a8_row_group(const unsigned char* src, int64_t RB, int t, int rows, const A8X* xs,
                                             int nb, int lane, T* out) {
  constexpr int BB = int(q_block_bytes(Q));
  constexpr A8RowPad pad = PAD ? a8_row_pad(BB) : A8RowPad{};
  static_assert(!PAD || pad.group_blocks > 0, "no padded layout for this format");
  const unsigned char* r[R];
#pragma unroll
  for (int i = 0; i < R; ++i) r[i] = src + int64_t(min(t + i, rows - 1)) * RB;
  float acc[R];
#pragma unroll
  for (int i = 0; i < R; ++i) acc[i] = 0.f;
  for (int b = lane; b < nb; b += 32) {
    const A8XRegs xr = a8_x(xs, b);
    const int off = PAD ? int(a8_padded_block_offset(b, BB, pad)) : b * BB;
#pragma unroll
    for (int i = 0; i < R; ++i) acc[i] = __fadd_rn(acc[i], a8_block<Q, true>(r[i] + off, xr.x0, xr.x1, xr.s));
  }
  float s[R];
#pragma unroll
  for (int i = 0; i < R; ++i) s[i] = warp_sum(acc[i]);
  if (lane == 0) {
#pragma unroll
    for (int i = 0; i < R; ++i)
      if (i == 0 || t + i < rows) out[t + i] = Dt<T>::from_f(s[i]);
  }
}

// ---- cuda_a8_warp: any M -------------------------------------------------------------------
constexpr int kA8WarpWarps = 8;

struct A8Params {
  const void* x;     // [M, K]
  const uint8_t* w;  // [N, row_bytes]
  void* out;         // [M, N]
  int64_t M, N, K, row_bytes;
};

template <typename T, ks_qtype_t Q, bool ALIGNED>
__global__ void __launch_bounds__(32 * kA8WarpWarps) quant_matmul_a8_warp_kernel(const A8Params p) {
  extern __shared__ __align__(16) unsigned char a8_warp_sm[];
  A8X* xs = reinterpret_cast<A8X*>(a8_warp_sm);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nb = int(p.K / 32);
  const int64_t n = int64_t(blockIdx.x) * kA8WarpWarps + warp;
  const unsigned char* row = p.w + n * p.row_bytes;
  pdl_begin();  // x is the previous kernel's output
  const T* x = static_cast<const T*>(p.x);
  T* out = static_cast<T*>(p.out);
  for (int64_t m = 0; m < p.M; ++m) {
    if (m > 0) __syncthreads();  // every warp is done with row m - 1's codes
    a8_stage_row<T>(x + m * p.K, nb, xs, warp, kA8WarpWarps, lane);
    __syncthreads();
    if (n < p.N) {
      float acc = 0.f;
      for (int b = lane; b < nb; b += 32) {
        const A8XRegs xr = a8_x(xs, b);
        acc = __fadd_rn(acc, a8_block<Q, ALIGNED>(row + int64_t(b) * q_block_bytes(Q), xr.x0, xr.x1, xr.s));
      }
      const float s = warp_sum(acc);
      if (lane == 0) out[m * p.N + n] = Dt<T>::from_f(s);
    }
  }
}

// ---- cuda_a8_bulk_stream: M = 1, sm_90 -------------------------------------------------------
constexpr int kA8BulkThreads = 32 * (kBulkWarps + 1);  // + the producer warp

struct A8BulkParams {
  const void* x;
  const uint8_t* w;  // 16-byte aligned, row_bytes a multiple of 4
  void* out;
  int64_t N, K, row_bytes;
  int rows_per_stage, slot_bytes, slots;
  bool early;
  int chunk;  // bytes per bulk copy (bulk_chunk_bytes; 0: one copy per stage)
  bool x_vec;  // x 16-byte aligned: staged by 16-byte loads (a8_stage_row_vec)
};

// R: rows per warp step (a8_row_group; the plan's rows_per_step, a8_bulk_plan)
template <typename T, ks_qtype_t Q, int R>
__global__ void __launch_bounds__(kA8BulkThreads, 1) quant_gemv_a8_bulk_kernel(const A8BulkParams p) {
  extern __shared__ __align__(16) unsigned char a8_sm[];  // [slots][slot_bytes], x [nb] A8X
  __shared__ uint64_t full[kBulkMaxSlots], empty[kBulkMaxSlots];
  constexpr int NT = 32 * kBulkWarps;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t N = p.N, RB = p.row_bytes;
  const int nb = int(p.K / 32), rps = p.rows_per_stage, S = p.slots;
  int64_t r0, r1;
  int nst;
  if (!bulk_ring_begin(p.w, N, RB, rps, S, p.slot_bytes, a8_sm, full, empty, p.early, p.chunk, kBulkWarps, r0, r1, nst))
    return;  // the producer warp
  A8X* xs = reinterpret_cast<A8X*>(a8_sm + int64_t(S) * p.slot_bytes);
  pdl_begin();  // x is the previous kernel's output
  if (p.x_vec)
    a8_stage_row_vec<T>(static_cast<const T*>(p.x), nb, xs, int(threadIdx.x), NT);
  else
    a8_stage_row<T>(static_cast<const T*>(p.x), nb, xs, warp, kBulkWarps, lane);
  named_barrier(1, NT);
  T* out = static_cast<T*>(p.out);
  const int units = (rps + R - 1) / R;
  for (int i = 0; i < nst; ++i) {
    const int s = i % S;
    const int64_t a = r0 + int64_t(i) * rps;
    const int rows = int(min(r1 - a, int64_t(rps)));
    const unsigned char* src = a8_sm + int64_t(s) * p.slot_bytes + ((a * RB) & 15);  // row a
    mbar_wait(&full[s], unsigned(i / S) & 1u);
    // groups of R rows dealt across stages (bulk_rotated), so short stages still spread over every warp
    for (int t = R * bulk_rotated(warp, i * units); t < rows; t += R * kBulkWarps)
      a8_row_group<T, Q, R, false>(src, RB, t, rows, xs, nb, lane, out + a);
    mbar_arrive(&empty[s]);  // this thread is done with the slot
  }
}

// bytes per bulk copy of the weight rows (cuda_a8_bulk_stream's stages, cuda_a8_resident's rows)
constexpr int kA8ChunkBytes = 4096;

// ---- cuda_a8_resident: M = 1, the matrix resident in shared memory in one wave -------------
// Each CTA copies its contiguous rows (a8_resident_plan: 1 or 2 CTAs per SM) into shared
// memory at once by 16-byte cp.async copies (stage_weight_rows) before it waits for the previous
// kernel, then quantizes x, then its warps take the rows in pairs with the arithmetic and order of
// the other variants (the same bits). Where the call takes at most half of each SM's shared memory
// it lets the next kernel launch at entry, so the next call's CTAs start beside this one's and
// their copies overlap its x staging and sums; else after the wait (the plan's entry_trigger).
struct A8ResParams {
  const void* x;
  const uint8_t* w;  // 4-byte aligned, row_bytes a multiple of 4
  void* out;
  int64_t N, K, row_bytes;
  int64_t smem_row_bytes;  // a staged row's bytes (row_bytes; the PAD form: a8_padded_row_bytes)
  bool x_vec;              // x 16-byte aligned: staged by 16-byte loads
  bool entry_trigger;      // griddepcontrol.launch_dependents at entry, else after the wait
};

// Rows n0 .. n0 + rows - 1 of w (16-byte aligned, row_bytes a multiple of 16) into dst (16-byte
// aligned) as a8_row_pad lays them out for block size BB, `stride` bytes per staged row: 16-byte
// cp.async copies, thread t of nt taking copies t, t + nt, ... (row-major), one commit group.
template <int BB>
__device__ __forceinline__ void stage_padded_rows(unsigned char* dst, const uint8_t* w, int64_t row_bytes, int64_t n0,
                                                  int rows, int64_t stride, unsigned t, unsigned nt) {
  constexpr A8RowPad pad = a8_row_pad(BB);
  constexpr int GB = pad.group_blocks * BB;  // a group's bytes, a multiple of 16
  static_assert(pad.group_blocks > 0 && GB % 16 == 0, "a padded format");
  const int rc = int(row_bytes / 16);  // copies per row
  const uint8_t* src = w + n0 * row_bytes;
  int row = int(t / unsigned(rc)), k = int(t % unsigned(rc));
  const int step_rows = int(nt / unsigned(rc)), step_k = int(nt % unsigned(rc));
  while (row < rows) {
    cp_async_bytes(dst + row * stride + 16 * k + (16 * k / GB) * pad.pad_bytes, src + int64_t(row) * row_bytes + 16 * k,
                   16);
    row += step_rows;
    k += step_k;
    if (k >= rc) {
      k -= rc;
      ++row;
    }
  }
  cp_async_commit();
}

// Timeline (a build with -DKS_ATTN_TIMELINE=ON only, which defines KS_QMM_TIMELINE here: a
// measurement, never in a release build): each CTA of cuda_a8_resident takes the next of its SM's
// kQtlSlots slots (a ring: the last 64 CTAs each SM ran) and stores %globaltimer (ns) there:
// 0 entry (thread 0), 1 blockIdx.x, 2 the out pointer (a call's identity under bench_ops' rotated
// sets), 3 thread 0's copies issued, 4 its wait returned, 5 its part of x staged, 6 past the CTA
// barrier (every row landed, x staged), 8 + w warp w's sums done. ks_debug_qmm_timeline copies the
// rings out and clears them (bench_ops, KS_QMM_TIMELINE=1: bench/qmm_timeline.hpp).
#if defined(KS_QMM_TIMELINE)
constexpr int kQtlSms = 160, kQtlSlots = 64, kQtlEvents = 24;
__device__ unsigned long long ks_qmm_tl[kQtlSms * kQtlSlots * kQtlEvents];
__device__ unsigned ks_qmm_tl_next[kQtlSms];
__device__ __forceinline__ unsigned long long qtl_now() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)::"memory");
  return t;
}
#endif

// BULK: the rows by one lane's bulk copies on an mbarrier (w 16-byte aligned), else every thread's
// cp.async (a template parameter: a runtime flag changed the sums' code for Q4_0 / Q4_1, 55 -> 48
// registers, and cost them 0.2-0.9 us at cf135c6). PAD: the rows staged as a8_row_pad lays them
// out (Q4_0 / Q8_0; w 16-byte aligned, row_bytes a multiple of 16; not with BULK). R: rows per
// warp step (a8_row_group).
template <typename T, ks_qtype_t Q, bool BULK, bool PAD, int R>
__global__ void __launch_bounds__(32 * kA8ResidentMaxWarps, 2) quant_gemv_a8_resident_kernel(const A8ResParams p) {
  static_assert(!(BULK && PAD), "bulk copies are linear: no padded rows");
  extern __shared__ __align__(16) unsigned char a8r_sm[];  // x [nb] A8X, then the CTA's rows
  const int NT = int(blockDim.x), nwarps = NT / 32;
  __shared__ uint64_t rows_landed;  // (BULK)
#if defined(KS_QMM_TIMELINE)
  __shared__ unsigned long long* tl;
  unsigned long long tl_t[4] = {qtl_now(), 0, 0, 0};
  unsigned tl_sm = 0, tl_slot = 0;
  if (threadIdx.x == 0) {  // (the slot taken at entry: its round trip off the measured path)
    asm volatile("mov.u32 %0, %%smid;" : "=r"(tl_sm));
    tl_slot = atomicAdd(&ks_qmm_tl_next[tl_sm % kQtlSms], 1u);
  }
#endif
  if (p.entry_trigger) pdl_trigger();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nb = int(p.K / 32);
  const int64_t r0 = int64_t(blockIdx.x) * p.N / gridDim.x, r1 = (int64_t(blockIdx.x) + 1) * p.N / gridDim.x;
  A8X* xs = reinterpret_cast<A8X*>(a8r_sm);
  unsigned char* dst = a8r_sm + int64_t(nb) * sizeof(A8X);
  const unsigned char* rows;
  if constexpr (BULK) {  // one lane's bulk copies of the CTA's rows (as one stage of the bulk ring)
    if (threadIdx.x == 0) {
      mbar_init(&rows_landed, 1);
      mbar_init_fence();
      bulk_rows_produce(p.w, p.N, p.row_bytes, r0, r1, int(r1 - r0), 1, 1, dst, 0, &rows_landed, nullptr, true,
                        kA8ChunkBytes);
    }
    rows = dst + ((r0 * p.row_bytes) & 15);
  } else if constexpr (PAD) {
    stage_padded_rows<int(q_block_bytes(Q))>(dst, p.w, p.row_bytes, r0, int(r1 - r0), p.smem_row_bytes, threadIdx.x, NT);
    rows = dst;
  } else {
    rows = stage_weight_rows(dst, p.w, p.row_bytes, r0, r1 - r0, threadIdx.x, NT);
  }
#if defined(KS_QMM_TIMELINE)
  tl_t[1] = qtl_now();
#endif
  pdl_wait();  // x is the previous kernel's output
#if defined(KS_QMM_TIMELINE)
  tl_t[2] = qtl_now();
#endif
  if (!p.entry_trigger) pdl_trigger();
  if (p.x_vec)
    a8_stage_row_vec<T>(static_cast<const T*>(p.x), nb, xs, int(threadIdx.x), NT);
  else
    a8_stage_row<T>(static_cast<const T*>(p.x), nb, xs, warp, nwarps, lane);
#if defined(KS_QMM_TIMELINE)
  if (threadIdx.x == 0) {
    __threadfence_block();  // (x's stores issued: the stamp after them)
    tl_t[3] = qtl_now();
  }
#endif
  if constexpr (BULK) {
    __syncthreads();  // x's blocks (the barrier's initialization long done: thread 0 made it)
    mbar_wait(&rows_landed, 0);
  } else {
    cp_async_wait<0>();  // this thread's copies have landed
    __syncthreads();     // everyone's, and x's blocks
  }
#if defined(KS_QMM_TIMELINE)
  if (threadIdx.x == 0) {
    const unsigned long long synced = qtl_now();
    tl = ks_qmm_tl + (size_t(tl_sm % kQtlSms) * kQtlSlots + tl_slot % kQtlSlots) * kQtlEvents;
    tl[0] = tl_t[0];
    tl[1] = blockIdx.x;
    tl[2] = reinterpret_cast<uintptr_t>(p.out);
    tl[3] = tl_t[1];
    tl[4] = tl_t[2];
    tl[5] = tl_t[3];
    tl[6] = synced;
  }
  __syncthreads();  // (tl)
#endif
  const int n = int(r1 - r0);
  for (int t = R * warp; t < n; t += R * nwarps)
    a8_row_group<T, Q, R, PAD>(rows, p.smem_row_bytes, t, n, xs, nb, lane, static_cast<T*>(p.out) + r0);
#if defined(KS_QMM_TIMELINE)
  if (lane == 0 && warp < kQtlEvents - 8) {
    __threadfence_block();  // (the outputs' stores issued)
    tl[8 + warp] = qtl_now();
  }
#endif
}

bool a8_aligned(const ops::QuantMatmulArgs& a) {
  return (reinterpret_cast<uintptr_t>(a.weight.data) & 3u) == 0 && a.row_bytes % 4 == 0;
}

int64_t a8_warp_smem(const ops::QuantMatmulArgs& a) { return a.k / 32 * int64_t(sizeof(A8X)); }

int64_t a8_warp_smem_limit(const ops::QuantMatmulArgs& a) {
  int64_t limit = 0;
  with_float_type_and_qtype(a.x.dtype, a.qtype, [&](auto tag, auto q) {
    limit = opt_in_smem_limit<quant_matmul_a8_warp_kernel<decltype(tag), decltype(q)::value, false>>(
        a.x.device.device_id, "quant_matmul_a8");
    limit = std::min(limit, opt_in_smem_limit<quant_matmul_a8_warp_kernel<decltype(tag), decltype(q)::value, true>>(
                                a.x.device.device_id, "quant_matmul_a8"));
  });
  return limit;
}

// The ring's defaults, measured on the H200 at 4096 x 4096, 14336 x 4096 and 49152 x 576 (bf16 x;
// docs/cuda.md#cuda-a8-bulk-stream): stages of about 32 KB for Q8_0 (its 14336 x 4096 17.9 us
// against 20.1 at 64 KB) and 64 KB for Q4_0 / Q4_1 (12.2 against 12.5 - 13.5 at 32 KB), each
// moved as bulk copies of 4 KB (Q8_0 14336 x 4096 17.9 against 18.7 as one copy; within 2%
// elsewhere). KS_QMM_A8_STAGE_KB and KS_QMM_BULK_CHUNK_KB override them (experiments).
// x staged by 16-byte loads where it is 16-byte aligned (KS_QMM_A8_X_VEC=0: value by value)
bool a8_x_vec(const void* x) {
  static const bool on = env_number("KS_QMM_A8_X_VEC", 1) != 0;
  return on && aligned16(x);
}
int64_t a8_stage_target(ks_qtype_t q) {
  static const long long kb = env_number("KS_QMM_A8_STAGE_KB", 0);
  return int64_t(kb > 0 ? kb : q == KS_QTYPE_Q8_0 ? 32 : 64) * 1024;
}
// A list of kernels sharing one parameter type: the smallest dynamic shared memory limit, the
// largest static bytes, and (KS_QMM_A8_RES_CARVEOUT=n, a measurement) every kernel's preferred
// shared-memory carveout set to n percent once per device.
template <auto... Ks>
struct A8KernelList {
  static int64_t min_limit(int dev) { return std::min({opt_in_smem_limit<Ks>(dev, "quant_matmul_a8")...}); }
  static int64_t max_static() { return std::max({static_smem_bytes<Ks>("quant_matmul_a8")...}); }
  static void carveout(int dev) {
    static const long long pct = env_number("KS_QMM_A8_RES_CARVEOUT", -1);
    if (pct < 0) return;
    once_per_device<int>(dev, [&](int d) {
      DeviceGuard guard(d, "quant_matmul_a8");
      (check_cuda(cudaFuncSetAttribute(Ks, cudaFuncAttributePreferredSharedMemoryCarveout, int(pct)), "quant_matmul_a8",
                  "set the shared memory carveout"),
       ...);
      return 0;
    });
  }
};
// rows per warp step of cuda_a8_bulk_stream: the plan's (a8_bulk_plan), or KS_QMM_A8_BULK_ROWS=2 / 4
// (a measurement)
int a8_bulk_forced_rows() {
  static const int r = [] {
    const long long v = env_number("KS_QMM_A8_BULK_ROWS", 0);
    return v == 2 || v == 4 ? int(v) : 0;
  }();
  return r;
}
BulkPlan a8_bulk_plan_for(const ops::QuantMatmulArgs& a) {
  const int dev = a.x.device.device_id;
  // (both forms' limit: the plan's rows per step is known after it)
  int64_t limit = 0;
  with_float_type_and_qtype(a.x.dtype, a.qtype, [&](auto tag, auto q) {
    using T = decltype(tag);
    constexpr ks_qtype_t Q = decltype(q)::value;
    limit = A8KernelList<quant_gemv_a8_bulk_kernel<T, Q, 2>, quant_gemv_a8_bulk_kernel<T, Q, 4>>::min_limit(dev);
  });
  return a8_bulk_plan(a.n, a.k, a.row_bytes, device_props(dev).sm_count, limit, a8_stage_target(a.qtype),
                      int64_t(sizeof(A8X)), int64_t(q_block_bytes(a.qtype)), a8_bulk_forced_rows());
}

// cuda_a8_resident's forms for x of T and weights of Q: (bulk copies, padded rows, rows per warp
// step). The smallest dynamic shared memory limit and the largest static bytes over the forms a
// call may launch size the plan.
template <typename T, ks_qtype_t Q>
struct A8ResidentForms {
  static constexpr bool kPad = a8_row_pad(q_block_bytes(Q)).group_blocks > 0;
  using Kernel = void (*)(A8ResParams);
  template <bool BULK, bool PAD, int R>
  static constexpr Kernel kK = quant_gemv_a8_resident_kernel<T, Q, BULK, PAD, R>;
  template <bool PADDED, int = 0>  // (the padded kernels named only for the formats that have them)
  struct Select {
    using type = A8KernelList<kK<true, false, 2>, kK<false, false, 2>, kK<false, false, 4>>;
  };
  template <int D>
  struct Select<true, D> {
    using type = A8KernelList<kK<true, false, 2>, kK<false, false, 2>, kK<false, false, 4>, kK<false, true, 2>,
                              kK<false, true, 4>>;
  };
  using All = typename Select<kPad>::type;
  static Kernel pick(bool bulk, bool pad, int rows) {
    if (bulk) return kK<true, false, 2>;
    if constexpr (kPad)
      if (pad) return rows == 4 ? kK<false, true, 4> : kK<false, true, 2>;
    return rows == 4 ? kK<false, false, 4> : kK<false, false, 2>;
  }
  static int64_t limit(int dev) {
    All::carveout(dev);
    return All::min_limit(dev);
  }
  static int64_t static_bytes() { return All::max_static(); }
};

// How a call stages its rows (measurements, all off by default): bulk copies (KS_QMM_A8_RES_BULK=1;
// w 16-byte aligned; 2 rows per warp step), padded (KS_QMM_A8_RES_PAD=1: a8_row_pad's formats,
// w 16-byte aligned, row_bytes a multiple of 16), else as in memory. Padded rows end the bank
// conflicts of the Q4_0 / Q8_0 sums but were not faster in 364b09a's call: Q8_0 4096 x 4096 6.02
// against 6.38 us at 2 rows per step, 6.37 against 5.92 at 4 rows and 8 warps; Q4_0 3.85 against
// 3.31 at 2 rows, 4.43 against 3.48 at 4 rows and 8 warps (docs/perf/h200_quant_a8.md).
struct A8ResidentLayout {
  bool bulk, pad;
  int64_t smem_row_bytes;
};
A8ResidentLayout a8_resident_layout(const ops::QuantMatmulArgs& a) {
  static const bool bulk_on = env_number("KS_QMM_A8_RES_BULK", 0) != 0;
  static const bool pad_on = env_number("KS_QMM_A8_RES_PAD", 0) != 0;
  const bool w16 = aligned16(a.weight.data), bulk = bulk_on && w16;
  const A8RowPad pad = a8_row_pad(q_block_bytes(a.qtype));
  const bool padded = !bulk && pad_on && pad.group_blocks > 0 && w16 && a.row_bytes % 16 == 0;
  return {bulk, padded, padded ? a8_padded_row_bytes(a.row_bytes, q_block_bytes(a.qtype), pad) : a.row_bytes};
}

A8ResidentPlan a8_resident_plan_for(const ops::QuantMatmulArgs& a) {
  const int dev = a.x.device.device_id;
  static const int ctas = int(env_number("KS_QMM_A8_RES_CTAS", 0));
  static const bool waves = env_number("KS_QMM_A8_RES_WAVES", 0) != 0;
  static const int warps = int(env_number("KS_QMM_A8_RES_WARPS", 0));
  static const int rows = int(env_number("KS_QMM_A8_RES_ROWS", 0));  // 2 or 4 (else the plan's)
  int64_t limit = 0, static_bytes = 0;
  with_float_type_and_qtype(a.x.dtype, a.qtype, [&](auto tag, auto q) {
    using Forms = A8ResidentForms<decltype(tag), decltype(q)::value>;
    limit = Forms::limit(dev);
    static const int64_t st = Forms::static_bytes();
    static_bytes = st;
  });
  const DeviceProps& dp = device_props(dev);
  const A8ResidentLayout lay = a8_resident_layout(a);
  const bool forced_ctas = ctas >= 1 && ctas <= 8, forced_warps = warps >= 4 && warps <= kA8ResidentMaxWarps;
  const A8ResidentPlan plan =
      a8_resident_plan(a.n, a.k, lay.smem_row_bytes, dp.sm_count, dp.smem_per_sm, limit, int64_t(sizeof(A8X)),
                       forced_ctas ? ctas : 0, !waves, forced_warps ? warps : 0, static_bytes,
                       lay.bulk ? 2 : rows == 2 || rows == 4 ? rows : 0);
  if (plan.grid && !waves && (forced_ctas || forced_warps)) {
    // A forced CTA count or width: the plan counts shared memory only, and the plan's own choices
    // (at most 2 CTAs of 16 warps at <= 64 registers) fit the registers by construction; a forced
    // one may not (e.g. 5 CTAs of 8 warps at 64 registers), and then the call would not be one
    // wave: the variant declines (can_implement says so) instead of claiming it.
    int fit = 0;
    DeviceGuard g(dev, "quant_matmul_a8");
    with_float_type_and_qtype(a.x.dtype, a.qtype, [&](auto tag, auto q) {
      using Forms = A8ResidentForms<decltype(tag), decltype(q)::value>;
      if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit, Forms::pick(lay.bulk, lay.pad, plan.rows_per_step),
                                                        32 * plan.warps, plan.smem) != cudaSuccess) {
        (void)cudaGetLastError();  // (an answer here: the configuration cannot be resident)
        fit = 0;
      }
    });
    if (fit < plan.ctas_per_sm) return A8ResidentPlan{};
  }
  return plan;
}
}  // namespace

std::string quant_matmul_a8_warp_can_implement(const void* args) {
  const auto& a = *static_cast<const ops::QuantMatmulArgs*>(args);
  if (device_props(a.x.device.device_id).major < 8) return "needs sm_80 or newer (__reduce_add_sync)";
  if (a8_warp_smem(a) > a8_warp_smem_limit(a)) return "K too large: x's quantized row does not fit shared memory";
  return "";
}

void quant_matmul_a8_warp_cuda(const void* args, ks_stream_t stream) {
  const auto& a = *static_cast<const ops::QuantMatmulArgs*>(args);
  const int dev = a.x.device.device_id;
  DeviceGuard g(dev, "quant_matmul_a8");
  if (a.n == 0 || a.m == 0) return;
  const A8Params p{a.x.data, static_cast<const uint8_t*>(a.weight.data), a.out.data, a.m, a.n, a.k, a.row_bytes};
  const unsigned grid = unsigned((a.n + kA8WarpWarps - 1) / kA8WarpWarps);
  const bool aligned = a8_aligned(a);
  const auto s = static_cast<cudaStream_t>(stream);
  with_float_type_and_qtype(a.x.dtype, a.qtype, [&](auto tag, auto q) {
    using T = decltype(tag);
    constexpr ks_qtype_t Q = decltype(q)::value;
    launch_kernel("quant_matmul_a8", aligned ? quant_matmul_a8_warp_kernel<T, Q, true> : quant_matmul_a8_warp_kernel<T, Q, false>,
                  dim3(grid), dim3(32 * kA8WarpWarps), size_t(a8_warp_smem(a)), s, 1, device_props(dev).pdl, p);
  });
  check_launch("quant_matmul_a8");
  record_launch("quant_matmul_a8", "a8_warp warps_per_cta=%lld grid=%lld word_loads=%lld smem=%lld",
                {kA8WarpWarps, grid, aligned ? 1 : 0, a8_warp_smem(a)});
}

std::string quant_matmul_a8_bulk_can_implement(const void* args) {
  const auto& a = *static_cast<const ops::QuantMatmulArgs*>(args);
  if (a.m != 1) return "M > 1: the bulk stream serves one row of x (decode)";
  if (!device_props(a.x.device.device_id).sm90_code) return "needs sm_90 code (bulk copies and mbarriers)";
  if (!aligned16(a.weight.data)) return "weight not 16-byte aligned (bulk copies)";
  if (a.row_bytes % 4 != 0) return "row_bytes not a multiple of 4 (word loads of the blocks)";
  if (a.n > 0 && a8_bulk_plan_for(a).slots < 1) return "x and one stage of rows do not fit the device's shared memory";
  return "";
}

void quant_matmul_a8_bulk_cuda(const void* args, ks_stream_t stream) {
  const auto& a = *static_cast<const ops::QuantMatmulArgs*>(args);
  const int dev = a.x.device.device_id;
  DeviceGuard g(dev, "quant_matmul_a8");
  if (a.n == 0) return;
  const BulkPlan plan = a8_bulk_plan_for(a);
  if (plan.slots < 1) detail::fail(KS_ERROR_INTERNAL, "quant_matmul_a8", "cuda_a8_bulk_stream: no stage fits");
  const A8BulkParams p{a.x.data, static_cast<const uint8_t*>(a.weight.data), a.out.data, a.n, a.k, a.row_bytes,
                       plan.rps, plan.slot_bytes, plan.slots, qmm_stage_weights_enabled(), bulk_chunk_bytes(kA8ChunkBytes),
                       a8_x_vec(a.x.data)};
  const auto s = static_cast<cudaStream_t>(stream);
  with_float_type_and_qtype(a.x.dtype, a.qtype, [&](auto tag, auto q) {
    using T = decltype(tag);
    constexpr ks_qtype_t Q = decltype(q)::value;
    // (rows per warp step: the plan's, 4 or 2)
    launch_kernel("quant_matmul_a8", plan.group == 4 ? quant_gemv_a8_bulk_kernel<T, Q, 4> : quant_gemv_a8_bulk_kernel<T, Q, 2>,
                  dim3(plan.grid), dim3(kA8BulkThreads), plan.smem, s, 1, device_props(dev).pdl, p);
  });
  check_launch("quant_matmul_a8");
  record_launch("quant_matmul_a8",
                "a8_bulk_stream rows_per_stage=%lld slot_bytes=%lld slots=%lld grid=%lld smem=%lld copy_bytes=%lld "
                "x_vec=%lld rows_per_step=%lld",
                {plan.rps, plan.slot_bytes, plan.slots, plan.grid, (long long)plan.smem, p.chunk, p.x_vec ? 1 : 0,
                 plan.group});
}

std::string quant_matmul_a8_resident_can_implement(const void* args) {
  const auto& a = *static_cast<const ops::QuantMatmulArgs*>(args);
  if (a.m != 1) return "M > 1: the resident kernel serves one row of x (decode)";
  if (!device_props(a.x.device.device_id).sm90_code) return "needs sm_90 code (the next call's launch at entry)";
  if (!a8_aligned(a)) return "weight not 4-byte aligned or row_bytes not a multiple of 4 (word loads of the blocks)";
  if (a.n > 0 && a8_resident_plan_for(a).grid == 0)
    return "the matrix and x do not fit the SMs' shared memory in one wave (cuda_a8_bulk_stream streams it), or a "
           "forced KS_QMM_A8_RES_CTAS / KS_QMM_A8_RES_WARPS does not fit the SMs' registers";
  return "";
}

void quant_matmul_a8_resident_cuda(const void* args, ks_stream_t stream) {
  const auto& a = *static_cast<const ops::QuantMatmulArgs*>(args);
  const int dev = a.x.device.device_id;
  DeviceGuard g(dev, "quant_matmul_a8");
  if (a.n == 0) return;
  const A8ResidentPlan plan = a8_resident_plan_for(a);
  if (plan.grid == 0) detail::fail(KS_ERROR_INTERNAL, "quant_matmul_a8", "cuda_a8_resident: the matrix does not fit");
  // KS_QMM_A8_RES_TRIGGER=1 / 0 (measurements): at entry / after the wait whatever the plan says
  static const long long trig = env_number("KS_QMM_A8_RES_TRIGGER", -1);
  const bool entry = trig < 0 ? plan.entry_trigger : trig != 0;
  const A8ResidentLayout lay = a8_resident_layout(a);
  const A8ResParams p{a.x.data, static_cast<const uint8_t*>(a.weight.data), a.out.data, a.n, a.k, a.row_bytes,
                      lay.smem_row_bytes, a8_x_vec(a.x.data), entry};
  const auto s = static_cast<cudaStream_t>(stream);
  with_float_type_and_qtype(a.x.dtype, a.qtype, [&](auto tag, auto q) {
    using Forms = A8ResidentForms<decltype(tag), decltype(q)::value>;
    launch_kernel("quant_matmul_a8", Forms::pick(lay.bulk, lay.pad, plan.rows_per_step), dim3(plan.grid),
                  dim3(32 * plan.warps), plan.smem, s, 1, device_props(dev).pdl, p);
  });
  check_launch("quant_matmul_a8");
  record_launch("quant_matmul_a8",
                "a8_resident grid=%lld ctas_per_sm=%lld warps=%lld rows_cta=%lld smem=%lld x_vec=%lld entry_trigger=%lld "
                "bulk=%lld padded=%lld rows_per_step=%lld",
                {plan.grid, plan.ctas_per_sm, plan.warps, plan.rows_cta, (long long)plan.smem, p.x_vec ? 1 : 0,
                 entry ? 1 : 0, lay.bulk ? 1 : 0, lay.pad ? 1 : 0, plan.rows_per_step});
}

}  // namespace ks::cuda

#if defined(KS_QMM_TIMELINE)
// The timeline build's read-out (see ks_qmm_tl): copies up to n of its 160 x 64 x 24 entries (ns;
// 0 = not recorded) into host, then clears them and the slots' counters. Returns the entries
// copied, -1 on a CUDA error. Not part of the ABI: only a -DKS_ATTN_TIMELINE=ON build has it.
extern "C" __attribute__((visibility("default"))) long long ks_debug_qmm_timeline(unsigned long long* host, size_t n) {
  constexpr size_t kAll = size_t(ks::cuda::kQtlSms) * ks::cuda::kQtlSlots * ks::cuda::kQtlEvents;
  const size_t m = n < kAll ? n : kAll;
  void *dev = nullptr, *next = nullptr;
  if (cudaGetSymbolAddress(&dev, ks::cuda::ks_qmm_tl) != cudaSuccess ||
      cudaGetSymbolAddress(&next, ks::cuda::ks_qmm_tl_next) != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess ||
      cudaMemcpy(host, dev, m * sizeof(unsigned long long), cudaMemcpyDeviceToHost) != cudaSuccess ||
      cudaMemset(dev, 0, kAll * sizeof(unsigned long long)) != cudaSuccess ||
      cudaMemset(next, 0, ks::cuda::kQtlSms * sizeof(unsigned)) != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess)
    return -1;
  return (long long)m;
}
#endif
