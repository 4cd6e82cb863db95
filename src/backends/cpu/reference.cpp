// Portable CPU reference for every operator: straightforward loops in FP32 that
// follow docs/contracts.md literally. Row reductions (sums of squares, softmax
// denominators, dot products) use pairwise summation in FP32, whose error grows
// with log2(n) rather than n, so 128K-wide rows still meet the FP32 tolerance.
// The summation tree depends only on the row length, never on the number of
// rows in a call (batch-invariant). Rows are spread over OpenMP threads only
// when a call is large enough to pay for it.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "backends/cpu/pairwise.hpp"
#include "backends/cpu/quant_blocks.hpp"
#include "backends/cpu/scratch.hpp"
#include "backends/cpu/a8_rows.hpp"
#include "ops/args.hpp"
#include "registry/registry.hpp"

namespace ks::cpu {

using namespace ks::ops;
using ks::detail::load_f;
using ks::detail::load_index;
using ks::detail::store_f;

namespace {


void rms_norm_ref(const void* p, ks_stream_t) {
  const auto& a = *static_cast<const RmsNormArgs*>(p);
  const DType dt = a.x.dtype;
  const int64_t H = a.hidden;
  const bool par = a.rows * H > kParallelWork;
  const Scratch scratch(par, size_t(H));
  team(par, [&] {
    float* sq = scratch.get();
#pragma omp for schedule(static)
  for (int64_t r = 0; r < a.rows; ++r) {
    const int64_t base = r * H;
    for (int64_t i = 0; i < H; ++i) {
      const float v = load_f(a.x.data, dt, base + i);
      sq[i] = v * v;
    }
    const float ss = pairwise_sum(sq, H);
    const float scale = 1.0f / std::sqrt(ss / float(H) + a.eps);
    for (int64_t i = 0; i < H; ++i) {
      const float v = load_f(a.x.data, dt, base + i);
      store_f(a.out.data, dt, base + i, v * scale * load_f(a.weight.data, dt, i));
    }
  }
  });
}

void fused_add_rms_norm_ref(const void* p, ks_stream_t) {
  const auto& a = *static_cast<const FusedAddRmsNormArgs*>(p);
  const DType dt = a.x.dtype;
  const int64_t H = a.hidden;
  const bool par = a.rows * H > kParallelWork;
  const Scratch scratch(par, size_t(H), 2);
  team(par, [&] {
    float *s = scratch.get(0), *sq = scratch.get(1);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < a.rows; ++r) {
      const int64_t base = r * H;
      for (int64_t i = 0; i < H; ++i) {
        s[i] = load_f(a.x.data, dt, base + i) + load_f(a.residual.data, dt, base + i);
        sq[i] = s[i] * s[i];
      }
      const float ss = pairwise_sum(sq, H);
      const float scale = 1.0f / std::sqrt(ss / float(H) + a.eps);
      for (int64_t i = 0; i < H; ++i) {
        store_f(a.residual.data, dt, base + i, s[i]);
        store_f(a.x.data, dt, base + i, s[i] * scale * load_f(a.weight.data, dt, i));
      }
    }
  });
}

void silu_and_mul_ref(const void* p, ks_stream_t) {
  const auto& a = *static_cast<const SiluAndMulArgs*>(p);
  const DType dt = a.x.dtype;
  const int64_t D = a.d;
  team(a.rows * D > kParallelWork, [&] {
#pragma omp for schedule(static)
  for (int64_t r = 0; r < a.rows; ++r) {
    for (int64_t i = 0; i < D; ++i) {
      const float g = load_f(a.x.data, dt, r * 2 * D + i);
      const float u = load_f(a.x.data, dt, r * 2 * D + D + i);
      const float sig = 1.0f / (1.0f + std::exp(-g));
      store_f(a.out.data, dt, r * D + i, g * sig * u);
    }
  }
  });
}

void gemv_ref(const void* p, ks_stream_t) {
  const auto& a = *static_cast<const GemvArgs*>(p);
  const DType dt = a.x.dtype;
  const bool par = a.n * a.h > kParallelWork;
  const Scratch scratch(par, size_t(a.h));
  team(par, [&] {
    float* p = scratch.get();
#pragma omp for schedule(static)
    for (int64_t n = 0; n < a.n; ++n) {
      for (int64_t h = 0; h < a.h; ++h) p[h] = load_f(a.weight.data, dt, n * a.h + h) * load_f(a.x.data, dt, h);
      store_f(a.out.data, dt, n, pairwise_sum(p, a.h));
    }
  });
}

void softmax_ref(const void* p, ks_stream_t) {
  const auto& a = *static_cast<const SoftmaxArgs*>(p);
  const DType dt = a.x.dtype;
  const int64_t H = a.cols;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const bool par = a.rows * H > kParallelWork;
  const Scratch scratch(par, size_t(H));
  team(par, [&] {
    float* e = scratch.get();
#pragma omp for schedule(static)
    for (int64_t r = 0; r < a.rows; ++r) {
      const int64_t base = r * H;
      float mx = -std::numeric_limits<float>::infinity();
      bool has_nan = false;
      for (int64_t i = 0; i < H; ++i) {
        const float v = load_f(a.x.data, dt, base + i);
        if (std::isnan(v)) has_nan = true;
        mx = std::max(mx, v);
      }
      // NaN anywhere, a +inf maximum (inf - inf) or an all -inf row: NaN row.
      if (has_nan || std::isinf(mx)) {
        for (int64_t i = 0; i < H; ++i) store_f(a.out.data, dt, base + i, nan);
        continue;
      }
      for (int64_t i = 0; i < H; ++i) e[i] = std::exp(load_f(a.x.data, dt, base + i) - mx);
      const float sum = pairwise_sum(e, H);
      for (int64_t i = 0; i < H; ++i) store_f(a.out.data, dt, base + i, e[i] / sum);
    }
  });
}

void argmax_ref(const void* p, ks_stream_t) {
  const auto& a = *static_cast<const ArgmaxArgs*>(p);
  const DType dt = a.x.dtype;
  for (int64_t r = 0; r < a.rows; ++r) {
    int64_t best = 0;
    float bv = load_f(a.x.data, dt, r * a.cols);
    if (!std::isnan(bv))
      for (int64_t i = 1; i < a.cols; ++i) {
        const float v = load_f(a.x.data, dt, r * a.cols + i);
        if (std::isnan(v)) {
          best = i;
          break;
        }
        if (v > bv) {
          bv = v;
          best = i;
        }
      }
    ks::detail::st<int64_t>(a.out.data, r, best);
  }
}

void embedding_ref(const void* p, ks_stream_t) {
  const auto& a = *static_cast<const EmbeddingArgs*>(p);
  const DType dt = a.out.dtype;
  const int64_t H = a.hidden;
  const int esz = ks::detail::dtype_bytes(dt);
  std::vector<float> row(a.format == KS_QTYPE_NONE ? 0 : size_t(H));
  int64_t bs = 1;
  if (a.format != KS_QTYPE_NONE) qtype_geometry(a.format, &bs, nullptr);
  for (int64_t i = 0; i < a.num_ids; ++i) {
    const int64_t id = load_index(a.ids.data, a.ids.dtype, i);
    char* dst = static_cast<char*>(a.out.data) + i * H * esz;
    if (a.format == KS_QTYPE_NONE) {
      std::memcpy(dst, static_cast<const char*>(a.table.data) + id * H * esz, size_t(H) * esz);
    } else {
      decode_blocks(a.format, static_cast<const uint8_t*>(a.table.data) + id * a.row_bytes, H / bs, row.data());
      for (int64_t j = 0; j < H; ++j) store_f(dst, dt, j, row[j]);
    }
  }
}

void dequantize_ref(const void* p, ks_stream_t) {
  const auto& a = *static_cast<const DequantizeArgs*>(p);
  int64_t bs = 1;
  qtype_geometry(a.qtype, &bs, nullptr);
  const bool par = a.rows * a.cols > kParallelWork;
  const Scratch scratch(par, size_t(a.cols));
  team(par, [&] {
    float* row = scratch.get();
#pragma omp for schedule(static)
    for (int64_t r = 0; r < a.rows; ++r) {
      decode_blocks(a.qtype, static_cast<const uint8_t*>(a.packed.data) + r * a.row_bytes, a.cols / bs, row);
      for (int64_t j = 0; j < a.cols; ++j) store_f(a.out.data, a.out.dtype, r * a.cols + j, row[j]);
    }
  });
}

void gemm_ref(const void* p, ks_stream_t) {
  const auto& a = *static_cast<const GemmArgs*>(p);
  const DType dt = a.a.dtype;
  const bool par = a.m * a.n * a.k > kParallelWork;
  const Scratch scratch(par, size_t(a.k));
  team(par, [&] {
    float* p = scratch.get();
#pragma omp for collapse(2) schedule(static)
    for (int64_t m = 0; m < a.m; ++m)
      for (int64_t n = 0; n < a.n; ++n) {
        for (int64_t k = 0; k < a.k; ++k) p[k] = load_f(a.a.data, dt, m * a.k + k) * load_f(a.b.data, dt, n * a.k + k);
        store_f(a.out.data, dt, m * a.n + n, pairwise_sum(p, a.k));
      }
  });
}

void quant_matmul_ref(const void* p, ks_stream_t) {
  const auto& a = *static_cast<const QuantMatmulArgs*>(p);
  const DType dt = a.x.dtype;
  int64_t bs = 1;
  qtype_geometry(a.qtype, &bs, nullptr);
  const bool par = a.m * a.n * a.k > kParallelWork;
  const Scratch scratch(par, size_t(a.k), 2);
  team(par, [&] {
    float *w = scratch.get(0), *p = scratch.get(1);
#pragma omp for schedule(static)
    for (int64_t n = 0; n < a.n; ++n) {
      decode_blocks(a.qtype, static_cast<const uint8_t*>(a.weight.data) + n * a.row_bytes, a.k / bs, w);
      for (int64_t m = 0; m < a.m; ++m) {
        for (int64_t k = 0; k < a.k; ++k) p[k] = load_f(a.x.data, dt, m * a.k + k) * w[k];
        store_f(a.out.data, dt, m * a.n + n, pairwise_sum(p, a.k));
      }
    }
  });
}

// quant_matmul_a8: each block's exact integer sums formed one code at a time (a8_rows.hpp has the
// rest: x's quantization, the block values, the contract's order).
template <ks_qtype_t Q>
void a8_block_sums_scalar(const uint8_t* row, const int8_t* xq, int64_t nb, int* S) {
  for (int64_t b = 0; b < nb; ++b, row += q_block_bytes(Q), xq += 32) {
    int s = 0;
    if (Q == KS_QTYPE_Q8_0) {
      for (int i = 0; i < 32; ++i) s += int(int8_t(row[2 + i])) * xq[i];
    } else {
      const uint8_t* qs = row + (Q == KS_QTYPE_Q4_1 ? 4 : 2);
      for (int i = 0; i < 16; ++i) s += int(qs[i] & 0x0F) * xq[i] + int(qs[i] >> 4) * xq[i + 16];
    }
    S[b] = s;
  }
}

void quant_matmul_a8_ref(const void* p, ks_stream_t) {
  const auto& a = *static_cast<const QuantMatmulArgs*>(p);
  with_a8_format(a.qtype, [&](auto q) {
    constexpr ks_qtype_t Q = decltype(q)::value;
    a8_matmul<Q>(a, a8_block_sums_scalar<Q>);
  });
}

}  // namespace

// Shared by the reference and the fast CPU paths: the FP32 inverse frequencies.
void rope_inv_freq(int64_t rotary_dim, double theta, float* inv_freq) {
  for (int64_t i = 0; i < rotary_dim / 2; ++i)
    inv_freq[i] = float(std::pow(theta, -double(2 * i) / double(rotary_dim)));
}

namespace {

void rotate_heads(void* base, DType dt, int64_t tok, int64_t heads, int64_t token_stride, int64_t head_stride,
                  const RotaryArgs& a, float pos, const float* inv_freq) {
  const int64_t half = a.rotary_dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    const int64_t off = tok * token_stride + h * head_stride;
    for (int64_t i = 0; i < half; ++i) {
      const float ang = pos * inv_freq[i];
      const float c = std::cos(ang), s = std::sin(ang);
      const int64_t i0 = a.neox ? off + i : off + 2 * i;
      const int64_t i1 = a.neox ? off + i + half : off + 2 * i + 1;
      const float x0 = load_f(base, dt, i0), x1 = load_f(base, dt, i1);
      store_f(base, dt, i0, x0 * c - x1 * s);
      store_f(base, dt, i1, x1 * c + x0 * s);
    }
  }
}

void rotary_ref(const void* p, ks_stream_t) {
  const auto& a = *static_cast<const RotaryArgs*>(p);
  std::vector<float> inv_freq(size_t(a.rotary_dim / 2));
  rope_inv_freq(a.rotary_dim, a.theta, inv_freq.data());
  for (int64_t t = 0; t < a.num_tokens; ++t) {
    const float pos = float(load_index(a.positions.data, a.positions.dtype, t));
    rotate_heads(a.q.data, a.q.dtype, t, a.num_heads, a.q_token_stride, a.q_head_stride, a, pos, inv_freq.data());
    if (a.has_k)
      rotate_heads(a.k.data, a.k.dtype, t, a.num_kv_heads, a.k_token_stride, a.k_head_stride, a, pos, inv_freq.data());
  }
}

void kv_cache_append_ref(const void* p, ks_stream_t) {
  const auto& a = *static_cast<const KvCacheAppendArgs*>(p);
  const size_t row = size_t(a.num_kv_heads * a.head_dim * ks::detail::dtype_bytes(a.k.dtype));
  for (int64_t t = 0; t < a.num_tokens; ++t) {
    const int64_t s = load_index(a.slot_mapping.data, a.slot_mapping.dtype, t);
    if (s < 0) continue;
    std::memcpy(static_cast<char*>(a.k_cache.data) + s * row, static_cast<const char*>(a.k.data) + t * row, row);
    std::memcpy(static_cast<char*>(a.v_cache.data) + s * row, static_cast<const char*>(a.v.data) + t * row, row);
  }
}

// Keys whose weighted V rows the attention references add left to right before the group's sum
// joins the pairwise order (PairwiseAccumulator), as pairwise_sum's base of 8 terms.
constexpr int64_t kRefKeyGroup = 8;

void paged_attention_ref(const void* p, ks_stream_t) {
  const auto& a = *static_cast<const PagedAttentionArgs*>(p);
  const DType dt = a.q.dtype;
  const int64_t D = a.head_dim, KVH = a.num_kv_heads, group = a.num_heads / a.num_kv_heads;
  auto bt = [&](int64_t i) { return load_index(a.block_tables.data, DType::I32, i); };
  const int64_t max_len = a.max_context_len;
  const bool par = a.num_tokens * a.num_heads * D > kParallelWork;
  const Scratch scratch(par, size_t(max_len + (2 + PairwiseAccumulator::kLevels) * D));
  team(par, [&] {
    float* const sc = scratch.get();
    float* const acc = sc + max_len;
    float* const qv = acc + D;
    float* const levels = qv + D;
#pragma omp for collapse(2) schedule(static)
    for (int64_t t = 0; t < a.num_tokens; ++t)
      for (int64_t h = 0; h < a.num_heads; ++h) {
        const int64_t seq = a.has_seq_ids ? load_index(a.seq_ids.data, DType::I32, t) : t;
        const int64_t len = load_index(a.context_lens.data, DType::I32, t);
        const int64_t kvh = h / group;
        const int64_t qoff = (t * a.num_heads + h) * D;
        for (int64_t d = 0; d < D; ++d) qv[d] = load_f(a.q.data, dt, qoff + d);
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < len; ++j) {
          const int64_t slot = bt(seq * a.max_blocks_per_seq + j / a.block_size) * a.block_size + j % a.block_size;
          const int64_t koff = (slot * KVH + kvh) * D;
          float dot = 0.f;
          for (int64_t d = 0; d < D; ++d) dot += qv[d] * load_f(a.k_cache.data, dt, koff + d);
          sc[j] = dot * a.scale;
          mx = std::max(mx, sc[j]);
        }
        for (int64_t j = 0; j < len; ++j) sc[j] = std::exp(sc[j] - mx);
        const float sum = pairwise_sum(sc, len);
        // the weighted V rows in groups of kRefKeyGroup keys, the groups summed pairwise
        PairwiseAccumulator pv(levels, D);
        std::fill(acc, acc + D, 0.f);
        for (int64_t j = 0; j < len; ++j) {
          const int64_t slot = bt(seq * a.max_blocks_per_seq + j / a.block_size) * a.block_size + j % a.block_size;
          const int64_t voff = (slot * KVH + kvh) * D;
          const float w = sc[j] / sum;
          for (int64_t d = 0; d < D; ++d) acc[d] += w * load_f(a.v_cache.data, dt, voff + d);
          if ((j + 1) % kRefKeyGroup == 0 || j + 1 == len) {
            pv.add(acc);
            std::fill(acc, acc + D, 0.f);
          }
        }
        pv.sum(acc);  // (0 for a context of no keys)
        for (int64_t d = 0; d < D; ++d) store_f(a.out.data, dt, qoff + d, acc[d]);
      }
  });
}

}  // namespace

void register_reference(std::vector<registry::Variant>& v) {
  using registry::kFloatDTypes;
  const int prio = 0;
  v.push_back({"rms_norm", KS_BACKEND_CPU, "cpu_reference", kFloatDTypes, prio,
               "portable FP32 loops; row-order sums", nullptr, nullptr, rms_norm_ref});
  v.push_back({"fused_add_rms_norm", KS_BACKEND_CPU, "cpu_reference", kFloatDTypes, prio,
               "portable FP32 loops; row-order sums", nullptr, nullptr, fused_add_rms_norm_ref});
  v.push_back({"silu_and_mul", KS_BACKEND_CPU, "cpu_reference", kFloatDTypes, prio, "portable FP32 loops",
               nullptr, nullptr, silu_and_mul_ref});
  v.push_back({"gemv", KS_BACKEND_CPU, "cpu_reference", kFloatDTypes, prio, "portable FP32 dot products",
               nullptr, nullptr, gemv_ref});
  v.push_back({"softmax", KS_BACKEND_CPU, "cpu_reference", kFloatDTypes, prio, "portable FP32, max-subtracted",
               nullptr, nullptr, softmax_ref});
  v.push_back({"argmax", KS_BACKEND_CPU, "cpu_reference", kFloatDTypes, prio, "first maximum; first NaN wins",
               nullptr, nullptr, argmax_ref});
  v.push_back({"embedding", KS_BACKEND_CPU, "cpu_reference", kFloatDTypes, prio, "row gather; packed rows decoded",
               nullptr, nullptr, embedding_ref});
  v.push_back({"dequantize", KS_BACKEND_CPU, "cpu_reference", kFloatDTypes, prio, "GGUF block decode in FP32",
               nullptr, nullptr, dequantize_ref});
  v.push_back({"gemm", KS_BACKEND_CPU, "cpu_reference", kFloatDTypes, prio, "triple loop, FP32 accumulation",
               nullptr, nullptr, gemm_ref});
  v.push_back({"quant_matmul", KS_BACKEND_CPU, "cpu_reference", kFloatDTypes, prio,
               "decode each weight row to FP32, then dot products", nullptr, nullptr, quant_matmul_ref});
  v.push_back({"quant_matmul_a8", KS_BACKEND_CPU, "cpu_reference", kFloatDTypes, prio,
               "x quantized per 32-block to int8, exact integer block sums, FP32 block values in the contract's order",
               nullptr, nullptr, quant_matmul_a8_ref});
  v.push_back({"rotary_embedding", KS_BACKEND_CPU, "cpu_reference", kFloatDTypes, prio, "NeoX / interleaved, FP32",
               nullptr, nullptr, rotary_ref});
  v.push_back({"kv_cache_append", KS_BACKEND_CPU, "cpu_reference", kFloatDTypes, prio, "row copies by slot_mapping",
               nullptr, nullptr, kv_cache_append_ref});
  v.push_back({"paged_attention", KS_BACKEND_CPU, "cpu_reference", kFloatDTypes, prio,
               "two-pass FP32 softmax over the paged cache", nullptr, nullptr, paged_attention_ref});
}

}  // namespace ks::cpu

namespace ks::cpu {
void register_fused_matmul(std::vector<registry::Variant>& v);  // src/backends/cpu/fused_matmul.cpp
}
namespace ks::registry {
void register_cpu_fast(std::vector<Variant>& v);  // src/backends/cpu/fast.cpp
void register_cpu_variants(std::vector<Variant>& v) {
  ks::cpu::register_reference(v);
  ks::cpu::register_fused_matmul(v);
  register_cpu_fast(v);
}
}  // namespace ks::registry
