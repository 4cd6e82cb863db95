// CPU fast paths: registry variants above the portable reference.
//
// quant_matmul_a8 "cpu_avx512_vnni": below, before the registration.
//
// quant_matmul "cpu_avx512": out[M, N] = x[M, K] @ dequant(W)^T straight from the
// packed GGUF blocks, for fp32 activations on CPUs with AVX-512 (F + BW).
//  - Each weight element is decoded in FP32 exactly as the contract says
//    (w = d * q + m, fused multiply-add), never to a whole-matrix buffer.
//  - M <= 3 (decode): each block is decoded into two 16-lane registers (Q4_0 / Q4_1 by a
//    16-value table per block) and multiplied into every activation row at once (one pass over
//    the weights), 4 weight rows at a time for one activation row (independent sums).
//  - M >= 4 (prefill): 8 weight rows are decoded into a small FP32 panel that
//    stays in L1, and 6 x 4 register tiles (24 accumulators, 16 lanes each;
//    then 4 x 4 and 1 x 4 for the remainder) sweep the activation rows. Work is
//    split over weight rows (OpenMP).
// Sums are FP32 in a lane-blocked order (16 partial sums per output, reduced at
// the end), so results differ from the reference's left-to-right sums only by
// rounding; the order for one output does not depend on M or on the row's
// place in the batch (batch-invariant).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "backends/cpu/a8_rows.hpp"
#include "backends/cpu/pairwise.hpp"
#include "backends/cpu/quant_blocks.hpp"
#include "backends/cpu/scratch.hpp"
#include "ops/args.hpp"
#include "registry/registry.hpp"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define KS_X86 1
#include <cpuid.h>
#include <immintrin.h>
#endif

namespace ks::cpu {

using namespace ks::ops;

#if KS_X86
namespace {

#define KS_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))

// F16C from CPUID leaf 1 (ECX bit 29): clang's __builtin_cpu_supports does not know "f16c".
// Its register state is AVX's, which the avx512f check has already found enabled by the OS.
bool have_f16c() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & (1u << 29)) != 0;
}

bool have_avx512() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                         __builtin_cpu_supports("fma") && have_f16c();
  return ok;
}

// The block's f16 scale (and Q4_1 min) widened by the F16C instruction (exact,
// like half_to_float) and broadcast: a handful of instructions instead of the
// portable bit-twiddling conversion per block.
KS_AVX512 __attribute__((always_inline)) inline __m128 f16x2(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return _mm_cvtph_ps(_mm_cvtsi32_si128(int(v)));  // lanes 0, 1 = the two halves at p
}

// Decodes one 32-element block of a 4/8-bit format into lo (elements 0..15) and
// hi (16..31), in FP32 per the contract. TABLE (Q4_0 / Q4_1): by a table of the block's 16
// possible values (d * q + m by FMA for Q4_1, d * (q - 8) for Q4_0: the same operations on the
// same values as element by element, so the same bits) in one register, looked up by vpermps,
// which reads only the low 4 bits of each lane's index: the 16 bytes zero-extended to 16 lanes
// index the low nibbles as they are and, shifted right by 4, the high ones (10 vector operations a
// block instead of 14). Measured on a 2-core AVX-512 Xeon (2026-12-05, SmolLM2 on the CPU): the
// table in the decode GEMV (qmm_rows) and element by element in the prefill's panels, where the
// table lost 3-9% (its lookups share a port with the panel's other shuffles).
template <bool TABLE = false>
KS_AVX512 __attribute__((always_inline)) inline void decode_block(ks_qtype_t q, const uint8_t* b, __m512& lo, __m512& hi) {
  if (q == KS_QTYPE_Q8_0) {
    const __m512 d = _mm512_broadcastss_ps(f16x2(b));
    const __m128i q0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2));
    const __m128i q1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 18));
    lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)));
    hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)));
    return;
  }
  const bool q41 = q == KS_QTYPE_Q4_1;
  const __m128 dm = f16x2(b);  // Q4_1: d, m; Q4_0: d (lane 1 unused)
  const __m512 d = _mm512_broadcastss_ps(dm);
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + (q41 ? 4 : 2)));
  if constexpr (TABLE) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 table = q41 ? _mm512_fmadd_ps(d, iota, _mm512_broadcastss_ps(_mm_movehdup_ps(dm)))
                             : _mm512_mul_ps(d, _mm512_sub_ps(iota, _mm512_set1_ps(8.0f)));  // (q - 8 exact)
    const __m512i idx = _mm512_cvtepu8_epi32(raw);
    lo = _mm512_permutexvar_ps(idx, table);
    hi = _mm512_permutexvar_ps(_mm512_srli_epi32(idx, 4), table);
    return;
  }
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m512 fl = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(raw, mask)));
  const __m512 fh = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), mask)));
  if (q41) {
    const __m512 m = _mm512_broadcastss_ps(_mm_movehdup_ps(dm));
    lo = _mm512_fmadd_ps(d, fl, m);
    hi = _mm512_fmadd_ps(d, fh, m);
  } else {  // Q4_0: d * (q - 8); q - 8 is exact in FP32
    const __m512 eight = _mm512_set1_ps(8.0f);
    lo = _mm512_mul_ps(d, _mm512_sub_ps(fl, eight));
    hi = _mm512_mul_ps(d, _mm512_sub_ps(fh, eight));
  }
}

// The lanes' running sums of the quant_matmul kernels below go in groups of `steps` loop steps
// (one step: one FMA per lane and accumulator) whose sums are then added in order: one group
// where the row has at most 128 steps (the plain running sum, as before 2026-12-05), else
// groups of max(128, sqrt(steps)) steps, so a lane's sum passes through at most about
// 2 sqrt(steps) roundings and stays within the contract's 8 sqrt(K) bound for any K (one running
// sum per lane drifted past it at K = 2^20 on equal-sign terms: the adversarial run of 2026-12-04).
inline int64_t lane_sum_group(int64_t steps) {
  if (steps <= 128) return std::max<int64_t>(steps, 1);
  int64_t r = int64_t(std::sqrt(double(steps)));
  while (r * r < steps) ++r;
  return std::max<int64_t>(128, r);
}

// out[m, n] for M <= 3 (decode): one pass over W, each block decoded once. R weight rows at a
// time, each with its own sums (the same order as one row alone: the same bits): a row's lane
// sum is a chain of two dependent FMAs a block, 8 cycles of latency, longer than the block's
// decode, so one row at a time left the Q4_1 GEMV at 14 GB/s on two cores that read 32 GB/s
// (2026-12-05).
template <int M, int R>
KS_AVX512 void qmm_rows(const QuantMatmulArgs& a, int64_t n, int64_t bb, int64_t group) {
  const float* x = static_cast<const float*>(a.x.data);
  float* out = static_cast<float*>(a.out.data);
  const int64_t K = a.k, nb = K / 32;
  const uint8_t* row[R];
  for (int r = 0; r < R; ++r) row[r] = static_cast<const uint8_t*>(a.weight.data) + (n + r) * a.row_bytes;
  __m512 tot[R][M];  // (set by the first group: b0 == 0 below; zeros for the compiler, which cannot see nb > 0)
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) tot[r][m] = _mm512_setzero_ps();
  for (int64_t b0 = 0; b0 < nb; b0 += group) {
    __m512 acc[R][M];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
    for (int64_t b = b0; b < std::min(nb, b0 + group); ++b) {
      for (int r = 0; r < R; ++r) {
        __m512 lo, hi;
        decode_block<true>(a.qtype, row[r] + b * bb, lo, hi);
        for (int m = 0; m < M; ++m) {
          const float* xr = x + m * K + b * 32;
          acc[r][m] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xr), acc[r][m]);
          acc[r][m] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xr + 16), acc[r][m]);
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) tot[r][m] = b0 == 0 ? acc[r][m] : _mm512_add_ps(tot[r][m], acc[r][m]);
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) ks::detail::st<float>(out, m * a.n + n + r, _mm512_reduce_add_ps(tot[r][m]));
}

template <int M>
KS_AVX512 void qmm_small(const QuantMatmulArgs& a, int64_t n0, int64_t n1, int64_t bb) {
  const int64_t group = (lane_sum_group(2 * (a.k / 32)) + 1) / 2;  // blocks per group (two steps per block)
  constexpr int R = M == 1 ? 4 : M == 2 ? 2 : 1;  // (R * M chains)
  int64_t n = n0;
  for (; n + R <= n1; n += R) qmm_rows<M, R>(a, n, bb, group);
  for (; n < n1; ++n) qmm_rows<M, 1>(a, n, bb, group);
}

constexpr int kPanelRows = 8;

// Decodes weight rows [n, n + rows) into panel (kPanelRows x K floats); missing
// rows (past N) repeat the last row and are never stored.
KS_AVX512 void decode_panel(const QuantMatmulArgs& a, int64_t n, int rows, int64_t bb, float* panel) {
  const int64_t K = a.k, nb = K / 32;
  for (int r = 0; r < kPanelRows; ++r) {
    const int64_t src = n + std::min(r, rows - 1);
    const uint8_t* row = static_cast<const uint8_t*>(a.weight.data) + src * a.row_bytes;
    float* dst = panel + int64_t(r) * K;
    for (int64_t b = 0; b < nb; ++b) {
      __m512 lo, hi;
      decode_block(a.qtype, row + b * bb, lo, hi);
      _mm512_storeu_ps(dst + b * 32, lo);
      _mm512_storeu_ps(dst + b * 32 + 16, hi);
    }
  }
}

// tile: MR activation rows x 4 panel rows, K a multiple of 16.
template <int MR>
KS_AVX512 void tile(const float* x, int64_t K, const float* w, int64_t m0, float* out, int64_t ldo, int64_t n0,
                    int ncols) {
  // (the lanes' sums in groups of lane_sum_group steps; one group up to K = 2048)
  const int64_t group = 16 * lane_sum_group(K / 16);
  __m512 tot[MR][4];
  for (int64_t k0 = 0; k0 < K; k0 += group) {
    __m512 acc[MR][4];
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_setzero_ps();
    for (int64_t k = k0; k < std::min(K, k0 + group); k += 16) {
      __m512 wv[4];
      for (int j = 0; j < 4; ++j) wv[j] = _mm512_loadu_ps(w + j * K + k);
      for (int i = 0; i < MR; ++i) {
        const __m512 xv = _mm512_loadu_ps(x + (m0 + i) * K + k);
        for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
      }
    }
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < 4; ++j) tot[i][j] = k0 == 0 ? acc[i][j] : _mm512_add_ps(tot[i][j], acc[i][j]);
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < ncols; ++j) ks::detail::st<float>(out, (m0 + i) * ldo + n0 + j, _mm512_reduce_add_ps(tot[i][j]));
}

KS_AVX512 void qmm_panel(const QuantMatmulArgs& a, int64_t chunk0, int64_t chunk1, int64_t bb, float* panel) {
  const float* x = static_cast<const float*>(a.x.data);
  float* out = static_cast<float*>(a.out.data);
  const int64_t K = a.k;
  for (int64_t c = chunk0; c < chunk1; ++c) {
    const int64_t n = c * kPanelRows;
    const int rows = int(std::min<int64_t>(kPanelRows, a.n - n));
    decode_panel(a, n, rows, bb, panel);
    for (int half = 0; half < kPanelRows / 4; ++half) {
      const int ncols = std::clamp(rows - half * 4, 0, 4);
      if (ncols == 0) break;
      const float* w = panel + int64_t(half) * 4 * K;
      int64_t m = 0;
      for (; m + 6 <= a.m; m += 6) tile<6>(x, K, w, m, out, a.n, n + half * 4, ncols);
      for (; m + 4 <= a.m; m += 4) tile<4>(x, K, w, m, out, a.n, n + half * 4, ncols);
      for (; m < a.m; ++m) tile<1>(x, K, w, m, out, a.n, n + half * 4, ncols);
    }
  }
}

std::string qmm_can_implement(const void* p) {
  const auto& a = *static_cast<const QuantMatmulArgs*>(p);
  if (a.x.dtype != DType::F32) return "needs fp32 activations";
  if (a.qtype != KS_QTYPE_Q4_0 && a.qtype != KS_QTYPE_Q4_1 && a.qtype != KS_QTYPE_Q8_0)
    return "handles Q4_0, Q4_1 and Q8_0 only";
  return "";
}

void qmm_avx512(const void* p, ks_stream_t) {
  const auto& a = *static_cast<const QuantMatmulArgs*>(p);
  int64_t bs = 0, bb = 0;
  qtype_geometry(a.qtype, &bs, &bb);
  const int64_t work = a.m * a.n * a.k;
  if (a.m <= 3) {
#pragma omp parallel if (work > (1 << 17))
    {
#ifdef _OPENMP
      const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
#else
      const int64_t nt = 1, t = 0;
#endif
      const int64_t n0 = a.n * t / nt, n1 = a.n * (t + 1) / nt;
      if (a.m == 1) qmm_small<1>(a, n0, n1, bb);
      else if (a.m == 2) qmm_small<2>(a, n0, n1, bb);
      else qmm_small<3>(a, n0, n1, bb);
    }
    return;
  }
  const int64_t chunks = (a.n + kPanelRows - 1) / kPanelRows;
  const Scratch scratch(true, size_t(kPanelRows * a.k));  // a team of one when `if` is false
#pragma omp parallel if (work > (1 << 17))
  {
    float* panel = scratch.get();
#ifdef _OPENMP
    const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
#else
    const int64_t nt = 1, t = 0;
#endif
    qmm_panel(a, chunks * t / nt, chunks * (t + 1) / nt, bb, panel);
  }
}


// ---- paged_attention, fp32 -------------------------------------------------
// One task per (query token, KV head): the GQA group's query heads share each
// K/V row load. Scores go to a buffer (FP32 dot products, 16-lane partial sums),
// then max, exp (a vectorized exp, <= 2 ulp), sum and the P @ V accumulation,
// as the two-pass FP32 softmax in the contract.

// exp(x) for 16 lanes; x <= 0 here (scores minus their max). Range reduction
// x = n ln2 + r, |r| <= ln2/2, degree-7 Taylor polynomial (truncation < 1e-8
// relative), then scaling by 2^n (underflows cleanly to 0). NaN stays NaN:
// vmaxps returns its second operand when one is NaN, so x goes second (with x
// first, a NaN score became exp(-104) = 0 and the row's NaN was lost).
KS_AVX512 __attribute__((always_inline)) inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-104.0f), x);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// Lane k of the result: the sum of v[k]'s 16 lanes, for 16 vectors at once. Within each 128-bit
// quarter, (l0 + l2) + (l1 + l3) (unpack, then 64-bit shuffles); then the quarters as
// (q0 + q1) + (q2 + q3) (128-bit shuffles). A fixed tree: the same bits for the same vectors.
KS_AVX512 __attribute__((always_inline)) inline __m512 hsum16(const __m512 (&v)[16]) {
  __m512 w[4];
  for (int g = 0; g < 4; ++g) {
    const __m512 a = _mm512_add_ps(_mm512_unpacklo_ps(v[4 * g], v[4 * g + 1]), _mm512_unpackhi_ps(v[4 * g], v[4 * g + 1]));
    const __m512 b = _mm512_add_ps(_mm512_unpacklo_ps(v[4 * g + 2], v[4 * g + 3]),
                                   _mm512_unpackhi_ps(v[4 * g + 2], v[4 * g + 3]));
    // a: per quarter (v0 l0+l2, v1 l0+l2, v0 l1+l3, v1 l1+l3); b the same for v2, v3
    w[g] = _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x44), _mm512_shuffle_ps(a, b, 0xEE));  // quarter q: 4 vectors' sums
  }
  // w[g]'s quarter q holds quarter q's sums of v[4g .. 4g + 3]: add the quarters, w[g]'s into result quarter g
  const __m512 y01 = _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
  const __m512 y23 = _mm512_add_ps(_mm512_shuffle_f32x4(w[2], w[3], 0x88), _mm512_shuffle_f32x4(w[2], w[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(y01, y23, 0x88), _mm512_shuffle_f32x4(y01, y23, 0xDD));
}

constexpr int kMaxGroup = 16;   // query heads per KV head handled by the fast path
constexpr int kMaxDv = 16;      // head_dim / 16
// Keys per group of the softmax denominator's and P @ V's running sums: each group is summed in
// registers, then the groups pairwise (PairwiseAccumulator), so the error grows with log2 of the
// context, not with its length (one running sum per lane drifted 1.6e-3 at 128K equal keys).
constexpr int64_t kAttnKeyGroup = 64;

// The calling thread's scratch, offsets in floats: the scores at 0 (G x the longest context
// rounded up to 16), then a group's P @ V sums (G x D), their pairwise partials, a group's
// denominator (16) and its partials; `total` floats in all (what the caller allocates).
struct AttnScratch {
  int64_t pv_group, pv_levels, den_group, den_levels, total;
  AttnScratch(int64_t G, int64_t D, int64_t max_len)
      : pv_group(G * ((max_len + 15) / 16 * 16)),
        pv_levels(pv_group + G * D),
        den_group(pv_levels + PairwiseAccumulator::kLevels * G * D),
        den_levels(den_group + 16),
        total(den_levels + PairwiseAccumulator::kLevels * 16) {}
};

// sc: the calling thread's scratch (AttnScratch), the scores first.
KS_AVX512 void attn_task(const PagedAttentionArgs& a, int64_t t, int64_t g, float* sc) {
  const int64_t D = a.head_dim, KVH = a.num_kv_heads, G = a.num_heads / KVH, DV = D / 16;
  using ks::detail::load_index;
  const int64_t seq = a.has_seq_ids ? load_index(a.seq_ids.data, DType::I32, t) : t;
  const int64_t len = load_index(a.context_lens.data, DType::I32, t);
  const float* q = static_cast<const float*>(a.q.data) + (t * a.num_heads + g * G) * D;
  float* out = static_cast<float*>(a.out.data) + (t * a.num_heads + g * G) * D;
  const float* kc = static_cast<const float*>(a.k_cache.data);
  const float* vc = static_cast<const float*>(a.v_cache.data);
  const int64_t tbase = seq * a.max_blocks_per_seq;
  auto table = [&](int64_t b) { return load_index(a.block_tables.data, DType::I32, tbase + b); };
  if (len == 0) {
    std::memset(out, 0, size_t(G * D) * sizeof(float));
    return;
  }
  const int64_t ld = (len + 15) / 16 * 16;
  const AttnScratch at(G, D, a.max_context_len);
  float* const pv_group = sc + at.pv_group;
  float* const pv_levels = sc + at.pv_levels;
  float* const den_group = sc + at.den_group;
  float* const den_levels = sc + at.den_levels;
  __m512 qv[kMaxGroup][kMaxDv];
  for (int64_t h = 0; h < G; ++h)
    for (int64_t v = 0; v < DV; ++v) qv[h][v] = _mm512_loadu_ps(q + h * D + v * 16);
  // scores, 16 keys at a time: each key's 16 lane sums as before (one multiply, then FMAs over
  // head_dim / 16), the 16 keys' horizontal sums by one transposing tree (hsum16: about 45
  // instructions for 16 keys, where a reduction per key took about 10 each), stored as a vector;
  // keys past len (the last chunk's) are zero rows, their scores overwritten by -inf below
  const __m512 scale = _mm512_set1_ps(float(a.scale));
  for (int64_t j0 = 0; j0 < len; j0 += 16) {
    const int nk = int(std::min<int64_t>(16, len - j0));
    const float* krow[16];
    for (int i = 0; i < nk; ++i) {
      const int64_t j = j0 + i;
      krow[i] = kc + ((table(j / a.block_size) * a.block_size + j % a.block_size) * KVH + g) * D;
    }
    for (int64_t h = 0; h < G; ++h) {
      __m512 acc[16];
      for (int i = 0; i < 16; ++i) {
        if (i >= nk) {
          acc[i] = _mm512_setzero_ps();
          continue;
        }
        acc[i] = _mm512_mul_ps(qv[h][0], _mm512_loadu_ps(krow[i]));
        for (int64_t v = 1; v < DV; ++v) acc[i] = _mm512_fmadd_ps(qv[h][v], _mm512_loadu_ps(krow[i] + v * 16), acc[i]);
      }
      _mm512_storeu_ps(sc + h * ld + j0, _mm512_mul_ps(hsum16(acc), scale));
    }
  }
  // softmax per head (padding lanes hold -inf -> exp 0)
  const __m512 ninf = _mm512_set1_ps(-__builtin_inff());
  float inv_sum[kMaxGroup];
  for (int64_t h = 0; h < G; ++h) {
    float* s = sc + h * ld;
    for (int64_t j = len; j < ld; ++j) s[j] = -__builtin_inff();
    __m512 mx = ninf;
    for (int64_t j = 0; j < ld; j += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + j));
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    PairwiseAccumulator den(den_levels, 16);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < ld; j += 16) {
      const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), m));
      _mm512_storeu_ps(s + j, e);
      sum = _mm512_add_ps(sum, e);
      if ((j + 16) % kAttnKeyGroup == 0 || j + 16 == ld) {
        _mm512_storeu_ps(den_group, sum);
        den.add(den_group);
        sum = _mm512_setzero_ps();
      }
    }
    den.sum(den_group);
    inv_sum[h] = _mm512_reduce_add_ps(_mm512_loadu_ps(den_group));
  }
  // P @ V in groups of kAttnKeyGroup keys, the groups summed pairwise, then divided by the sum
  PairwiseAccumulator pv(pv_levels, G * D);
  __m512 acc[kMaxGroup][kMaxDv];
  for (int64_t h = 0; h < G; ++h)
    for (int64_t v = 0; v < DV; ++v) acc[h][v] = _mm512_setzero_ps();
  for (int64_t j = 0; j < len; ++j) {
    const int64_t slot = table(j / a.block_size) * a.block_size + j % a.block_size;
    const float* vr = vc + (slot * KVH + g) * D;
    __m512 vv[kMaxDv];
    for (int64_t v = 0; v < DV; ++v) vv[v] = _mm512_loadu_ps(vr + v * 16);
    for (int64_t h = 0; h < G; ++h) {
      const __m512 p = _mm512_set1_ps(sc[h * ld + j]);
      for (int64_t v = 0; v < DV; ++v) acc[h][v] = _mm512_fmadd_ps(p, vv[v], acc[h][v]);
    }
    if ((j + 1) % kAttnKeyGroup == 0 || j + 1 == len) {
      for (int64_t h = 0; h < G; ++h)
        for (int64_t v = 0; v < DV; ++v) {
          _mm512_storeu_ps(pv_group + h * D + v * 16, acc[h][v]);
          acc[h][v] = _mm512_setzero_ps();
        }
      pv.add(pv_group);
    }
  }
  pv.sum(pv_group);
  for (int64_t h = 0; h < G; ++h) {
    const __m512 inv = _mm512_set1_ps(inv_sum[h]);
    for (int64_t v = 0; v < DV; ++v)
      _mm512_storeu_ps(out + h * D + v * 16, _mm512_div_ps(_mm512_loadu_ps(pv_group + h * D + v * 16), inv));
  }
}

std::string attn_can_implement(const void* p) {
  const auto& a = *static_cast<const PagedAttentionArgs*>(p);
  if (a.q.dtype != DType::F32) return "needs fp32";
  if (a.head_dim % 16 != 0 || a.head_dim / 16 > kMaxDv) return "needs head_dim a multiple of 16, at most 256";
  if (a.num_heads / a.num_kv_heads > kMaxGroup) return "needs at most 16 query heads per KV head";
  return "";
}

void attn_avx512(const void* p, ks_stream_t) {
  const auto& a = *static_cast<const PagedAttentionArgs*>(p);
  const int64_t tasks = a.num_tokens * a.num_kv_heads;
  const Scratch scratch(true, size_t(AttnScratch(a.num_heads / a.num_kv_heads, a.head_dim, a.max_context_len).total));
#pragma omp parallel if (tasks > 1)
  {
    float* sc = scratch.get();
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < tasks; ++i) attn_task(a, i / a.num_kv_heads, i % a.num_kv_heads, sc);
  }
}
// quant_matmul_a8 "cpu_avx512_vnni": the blocks' exact integer sums by VNNI (vpdpbusd: unsigned
// bytes times signed bytes, 4 products per 32-bit lane, no saturation), everything else as the
// reference (a8_rows.hpp), so the same bits. A block's 32 codes are one 256-bit vector against
// x's 32 codes: Q4_0 / Q4_1 nibbles in the weights' order (low nibbles are weights 0..15, high
// nibbles 16..31), Q8_0's signed codes as c + 128 (c ^ 0x80) with 128 sum q taken off by a second
// vpdpbusd of 128s against -q (x's codes lie in [-127, 127], so -q is a byte too).
#define KS_AVX512_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,f16c")))

bool have_avx512_vnni() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  return ok;
}

template <ks_qtype_t Q>
KS_AVX512_VNNI void a8_block_sums_vnni(const uint8_t* row, const int8_t* xq, int64_t nb, int* S) {
  const __m128i low4 = _mm_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b, row += q_block_bytes(Q), xq += 32) {
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
    __m256i acc;
    if constexpr (Q == KS_QTYPE_Q8_0) {
      const __m256i w =
          _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 2)), _mm256_set1_epi8(char(0x80)));
      acc = _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, xv);
      acc = _mm256_dpbusd_epi32(acc, _mm256_set1_epi8(char(0x80)), _mm256_sub_epi8(_mm256_setzero_si256(), xv));
    } else {
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + (Q == KS_QTYPE_Q4_1 ? 4 : 2)));
      const __m256i w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(c, 4), low4), _mm_and_si128(c, low4));
      acc = _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, xv);
    }
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(acc), _mm256_extracti128_si256(acc, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    S[b] = _mm_cvtsi128_si32(s4);
  }
}

// The rest of an output in 16-lane vectors, the same FP32 operations as a8_matmul's scalar finish:
// the block values 16 blocks at a time (fp16 scales widened by vcvtph2ps: exact), the contract's 32
// lane sums as two vectors (lanes 0..15, 16..31; missing blocks add +0, which changes no lane sum:
// one starting at +0 is never -0), then its butterfly as shuffles (o = 16 adds the two vectors;
// IEEE addition commutes, so both halves hold the same sums).
template <ks_qtype_t Q>
KS_AVX512_VNNI float a8_finish_vnni(const float* dw, const float* mw, const float* d, const float* dq, const int* qs,
                                    const int* S, int64_t nb) {
  __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  for (int64_t b0 = 0; b0 < nb; b0 += 16) {
    const __mmask16 k = nb - b0 >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (nb - b0)) - 1u);
    const __m512 sc = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, dw + b0), _mm512_maskz_loadu_ps(k, d + b0));
    const __m512i Si = _mm512_maskz_loadu_epi32(k, S + b0);
    __m512 v;
    if constexpr (Q == KS_QTYPE_Q4_1) {
      const __m512 m = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, mw + b0), _mm512_maskz_loadu_ps(k, dq + b0));
      v = _mm512_fmadd_ps(sc, _mm512_cvtepi32_ps(Si), m);
    } else if constexpr (Q == KS_QTYPE_Q4_0) {
      const __m512i Qi = _mm512_maskz_loadu_epi32(k, qs + b0);
      v = _mm512_mul_ps(sc, _mm512_cvtepi32_ps(_mm512_sub_epi32(Si, _mm512_slli_epi32(Qi, 3))));
    } else {
      v = _mm512_mul_ps(sc, _mm512_cvtepi32_ps(Si));
    }
    v = _mm512_maskz_mov_ps(k, v);  // +0 past the row's blocks
    acc[(b0 / 16) & 1] = _mm512_add_ps(acc[(b0 / 16) & 1], v);
  }
  __m512 t = _mm512_add_ps(acc[0], acc[1]);                              // o = 16
  t = _mm512_add_ps(t, _mm512_shuffle_f32x4(t, t, 0x4E));                // o = 8: swap the 256-bit halves
  t = _mm512_add_ps(t, _mm512_shuffle_f32x4(t, t, 0xB1));                // o = 4: swap 128-bit pairs
  t = _mm512_add_ps(t, _mm512_permute_ps(t, 0x4E));                      // o = 2
  t = _mm512_add_ps(t, _mm512_permute_ps(t, 0xB1));                      // o = 1
  return _mm512_cvtss_f32(t);
}

// Weight row n against every row of x: the row's scales widened 16 blocks per conversion, then per
// row of x the blocks' sums and the finish. (A function of its own: the OpenMP body's lambda does
// not take the target attribute.)
template <ks_qtype_t Q>
KS_AVX512_VNNI void a8_vnni_weight_row(const QuantMatmulArgs& a, const A8Rows& x, const float* dq, int64_t n, float* dw,
                                       float* mw, int* S) {
  const int64_t nb = a.k / 32;
  const uint8_t* row = static_cast<const uint8_t*>(a.weight.data) + n * a.row_bytes;
  for (int64_t b0 = 0; b0 < nb; b0 += 16) {
    alignas(32) uint16_t h[16] = {}, hm[16] = {};
    for (int64_t b = b0; b < std::min(nb, b0 + 16); ++b) {
      h[b - b0] = rd_u16(row + b * q_block_bytes(Q));
      if (Q == KS_QTYPE_Q4_1) hm[b - b0] = rd_u16(row + b * q_block_bytes(Q) + 2);
    }
    _mm512_storeu_ps(dw + b0, _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(h))));
    if (Q == KS_QTYPE_Q4_1)
      _mm512_storeu_ps(mw + b0, _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(hm))));
  }
  for (int64_t m = 0; m < a.m; ++m) {
    a8_block_sums_vnni<Q>(row, x.q.data() + m * a.k, nb, S);
    const float s = a8_finish_vnni<Q>(dw, mw, x.d.data() + m * nb, dq + m * nb, x.qsum.data() + m * nb, S, nb);
    detail::store_f(a.out.data, a.x.dtype, m * a.n + n, s);
  }
}

template <ks_qtype_t Q>
void qmm_a8_vnni_rows(const QuantMatmulArgs& a) {
  const A8Rows x = a8_quantize_rows(a);
  const int64_t nbp = (a.k / 32 + 15) / 16 * 16;
  std::vector<float> dq(x.d.size());  // d * Q per block of x (Q4_1's minimum term)
  for (size_t i = 0; i < dq.size(); ++i) dq[i] = a8_dq(x.d[i], x.qsum[i]);
  const bool par = a.m * a.n * a.k > kParallelWork;
  const Scratch scratch(par, size_t(nbp), 3);
  team(par, [&] {
    float* dw = scratch.get(0);
    float* mw = scratch.get(1);
    int* S = reinterpret_cast<int*>(scratch.get(2));
#pragma omp for schedule(static)
    for (int64_t n = 0; n < a.n; ++n) a8_vnni_weight_row<Q>(a, x, dq.data(), n, dw, mw, S);
  });
}

void qmm_a8_vnni(const void* p, ks_stream_t) {
  const auto& a = *static_cast<const QuantMatmulArgs*>(p);
  with_a8_format(a.qtype, [&](auto q) { qmm_a8_vnni_rows<decltype(q)::value>(a); });
}

}  // namespace
#endif  // KS_X86

}  // namespace ks::cpu

namespace ks::registry {
void register_cpu_fast(std::vector<Variant>& v) {
#if KS_X86
  v.push_back({"quant_matmul", KS_BACKEND_CPU, "cpu_avx512", dtype_bit(detail::DType::F32), 10,
               "AVX-512 from packed Q4_0/Q4_1/Q8_0 blocks; 6x4 register tiles for M >= 4",
               ks::cpu::have_avx512, ks::cpu::qmm_can_implement, ks::cpu::qmm_avx512});
  v.push_back({"quant_matmul_a8", KS_BACKEND_CPU, "cpu_avx512_vnni", kFloatDTypes, 10,
               "the blocks' integer sums by AVX-512 VNNI (vpdpbusd), the reference's quantization, block values "
               "and order: the same bits",
               ks::cpu::have_avx512_vnni, nullptr, ks::cpu::qmm_a8_vnni});
  v.push_back({"paged_attention", KS_BACKEND_CPU, "cpu_avx512", dtype_bit(detail::DType::F32), 10,
               "AVX-512, one task per (token, KV head) sharing K/V loads across the GQA group",
               ks::cpu::have_avx512, ks::cpu::attn_can_implement, ks::cpu::attn_avx512});
#else
  (void)v;
#endif
}
}  // namespace ks::registry
