// CPU fast paths: registry variants above the portable reference.
//
// quant_matmul "cpu_avx512": out[M, N] = x[M, K] @ dequant(W)^T straight from the
// packed GGUF blocks, for fp32 activations on CPUs with AVX-512 (F + BW).
//  - Each weight element is decoded in FP32 exactly as the contract says
//    (w = d * q + m, fused multiply-add), never to a whole-matrix buffer.
//  - M <= 3 (decode): each block is decoded into two 16-lane registers and
//    multiplied into every activation row at once (one pass over the weights).
//  - M >= 4 (prefill): 8 weight rows are decoded into a small FP32 panel that
//    stays in L1, and 6 x 4 register tiles (24 accumulators, 16 lanes each;
//    then 4 x 4 and 1 x 4 for the remainder) sweep the activation rows. Work is
//    split over weight rows (OpenMP).
// Sums are FP32 in a lane-blocked order (16 partial sums per output, reduced at
// the end), so results differ from the reference's left-to-right sums only by
// rounding; the order for one output does not depend on M or on the row's
// place in the batch (batch-invariant).
#include <algorithm>
#include <cstring>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "backends/cpu/quant_blocks.hpp"
#include "backends/cpu/scratch.hpp"
#include "ops/args.hpp"
#include "registry/registry.hpp"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define KS_X86 1
#include <immintrin.h>
#endif

namespace ks::cpu {

using namespace ks::ops;

#if KS_X86
namespace {

#define KS_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))

bool have_avx512() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                         __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
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
// hi (16..31), in FP32 per the contract.
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
  const uint8_t* qs = b + (q41 ? 4 : 2);
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i ql = _mm_and_si128(raw, mask);
  const __m128i qh = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
  __m512 fl = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(ql));
  __m512 fh = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(qh));
  const __m128 dm = f16x2(b);  // Q4_1: d, m; Q4_0: d (lane 1 unused)
  const __m512 d = _mm512_broadcastss_ps(dm);
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

// out[m, n] for M <= 3 (decode): one pass over W, each block decoded once.
template <int M>
KS_AVX512 void qmm_small(const QuantMatmulArgs& a, int64_t n0, int64_t n1, int64_t bb) {
  const float* x = static_cast<const float*>(a.x.data);
  float* out = static_cast<float*>(a.out.data);
  const int64_t K = a.k, nb = K / 32;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = static_cast<const uint8_t*>(a.weight.data) + n * a.row_bytes;
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      __m512 lo, hi;
      decode_block(a.qtype, row + b * bb, lo, hi);
      for (int m = 0; m < M; ++m) {
        const float* xr = x + m * K + b * 32;
        acc[m] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xr), acc[m]);
        acc[m] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xr + 16), acc[m]);
      }
    }
    for (int m = 0; m < M; ++m) ks::detail::st<float>(out, m * a.n + n, _mm512_reduce_add_ps(acc[m]));
  }
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
  __m512 acc[MR][4];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    __m512 wv[4];
    for (int j = 0; j < 4; ++j) wv[j] = _mm512_loadu_ps(w + j * K + k);
    for (int i = 0; i < MR; ++i) {
      const __m512 xv = _mm512_loadu_ps(x + (m0 + i) * K + k);
      for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < ncols; ++j) ks::detail::st<float>(out, (m0 + i) * ldo + n0 + j, _mm512_reduce_add_ps(acc[i][j]));
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

constexpr int kMaxGroup = 16;   // query heads per KV head handled by the fast path
constexpr int kMaxDv = 16;      // head_dim / 16

// sc: the calling thread's scratch, room for G x (the longest context rounded up to 16).
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
  __m512 qv[kMaxGroup][kMaxDv];
  for (int64_t h = 0; h < G; ++h)
    for (int64_t v = 0; v < DV; ++v) qv[h][v] = _mm512_loadu_ps(q + h * D + v * 16);
  // scores
  for (int64_t j = 0; j < len; ++j) {
    const int64_t slot = table(j / a.block_size) * a.block_size + j % a.block_size;
    const float* k = kc + (slot * KVH + g) * D;
    __m512 kv[kMaxDv];
    for (int64_t v = 0; v < DV; ++v) kv[v] = _mm512_loadu_ps(k + v * 16);
    for (int64_t h = 0; h < G; ++h) {
      __m512 acc = _mm512_mul_ps(qv[h][0], kv[0]);
      for (int64_t v = 1; v < DV; ++v) acc = _mm512_fmadd_ps(qv[h][v], kv[v], acc);
      sc[h * ld + j] = _mm512_reduce_add_ps(acc) * a.scale;
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
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < ld; j += 16) {
      const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), m));
      _mm512_storeu_ps(s + j, e);
      sum = _mm512_add_ps(sum, e);
    }
    inv_sum[h] = _mm512_reduce_add_ps(sum);
  }
  // P @ V, then divide by the sum
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
  }
  for (int64_t h = 0; h < G; ++h) {
    const __m512 inv = _mm512_set1_ps(inv_sum[h]);
    for (int64_t v = 0; v < DV; ++v) _mm512_storeu_ps(out + h * D + v * 16, _mm512_div_ps(acc[h][v], inv));
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
  const Scratch scratch(true, size_t(a.num_heads / a.num_kv_heads * ((a.max_context_len + 15) / 16 * 16)));
#pragma omp parallel if (tasks > 1)
  {
    float* sc = scratch.get();
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < tasks; ++i) attn_task(a, i / a.num_kv_heads, i % a.num_kv_heads, sc);
  }
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
  v.push_back({"paged_attention", KS_BACKEND_CPU, "cpu_avx512", dtype_bit(detail::DType::F32), 10,
               "AVX-512, one task per (token, KV head) sharing K/V loads across the GQA group",
               ks::cpu::have_avx512, ks::cpu::attn_can_implement, ks::cpu::attn_avx512});
#else
  (void)v;
#endif
}
}  // namespace ks::registry
