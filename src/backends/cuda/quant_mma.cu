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
  // What to subtract from code_pair's values, in both halves: the base (Q4_1: codes 0..15), or
  // base + 8 (Q4_0: codes - 8), i.e. what code_pair makes of a code 0 or 8
  constexpr uint32_t off = (MmaType<T>::kHigh << 8) | (Q41 ? 0u : 8u), off2 = off | (off << 16);
  const uint32_t ones[4] = {MmaType<T>::kOnes, MmaType<T>::kOnes, MmaType<T>::kOnes, MmaType<T>::kOnes};
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
      if constexpr (Q41) {  // 20-byte blocks: d, m (fp16), 16 code bytes; 4-byte aligned
        const uint32_t* pa = reinterpret_cast<const uint32_t*>(wa + b * 20);
        const uint32_t* pb = reinterpret_cast<const uint32_t*>(wb + b * 20);
        ha[u] = pa[0];
        hb[u] = pb[0];
        qa[u] = pa[1 + t];
        qb[u] = pb[1 + t];
      } else {  // Q4_0: 18-byte blocks: d (fp16), 16 code bytes; 2-byte aligned
        const uint16_t* pa = reinterpret_cast<const uint16_t*>(wa + b * 18);
        const uint16_t* pb = reinterpret_cast<const uint16_t*>(wb + b * 18);
        ha[u] = pa[0];
        hb[u] = pb[0];
        qa[u] = uint32_t(pa[1 + 2 * t]) | (uint32_t(pa[2 + 2 * t]) << 16);
        qb[u] = uint32_t(pb[1 + 2 * t]) | (uint32_t(pb[2 + 2 * t]) << 16);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (b0 + u >= b_end) break;
      const float da = h2f_bits(uint16_t(ha[u])), db = h2f_bits(uint16_t(hb[u]));
      const uint32_t la = qa[u] & 0x0F0F0F0Fu, lb = qb[u] & 0x0F0F0F0Fu;
      const uint32_t ua = (qa[u] >> 4) & 0x0F0F0F0Fu, ub = (qb[u] >> 4) & 0x0F0F0F0Fu;
      // A: (row g, slots 2t..), (row g + 8, 2t..), (row g, 2t + 8..), (row g + 8, 2t + 8..)
      const uint32_t alo[4] = {sub_pair<T>(code_pair<T>(la, 0x4140u), off2), sub_pair<T>(code_pair<T>(lb, 0x4140u), off2),
                               sub_pair<T>(code_pair<T>(la, 0x4342u), off2), sub_pair<T>(code_pair<T>(lb, 0x4342u), off2)};
      const uint32_t ahi[4] = {sub_pair<T>(code_pair<T>(ua, 0x4140u), off2), sub_pair<T>(code_pair<T>(ub, 0x4140u), off2),
                               sub_pair<T>(code_pair<T>(ua, 0x4342u), off2), sub_pair<T>(code_pair<T>(ub, 0x4342u), off2)};
      float s[4] = {0.f, 0.f, 0.f, 0.f};
      mma_16816<T>(s, alo, xl[u].x, xl[u].y);
      mma_16816<T>(s, ahi, xh[u].x, xh[u].y);
      // s: (row g, x row 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1)
      if constexpr (Q41) {
        const float ma = h2f_bits(uint16_t(ha[u] >> 16)), mb = h2f_bits(uint16_t(hb[u] >> 16));
        float xs[4] = {0.f, 0.f, 0.f, 0.f};  // X of x rows 2t, 2t + 1 (in every row of D)
        mma_16816<T>(xs, ones, xl[u].x, xl[u].y);
        mma_16816<T>(xs, ones, xh[u].x, xh[u].y);
        acc[0] += da * s[0] + ma * xs[0];
        acc[1] += da * s[1] + ma * xs[1];
        acc[2] += db * s[2] + mb * xs[0];
        acc[3] += db * s[3] + mb * xs[1];
      } else {
        acc[0] += da * s[0];
        acc[1] += da * s[1];
        acc[2] += db * s[2];
        acc[3] += db * s[3];
      }
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

}  // namespace ks::cuda
