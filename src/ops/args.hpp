// Validated argument packs, one per operator. src/ops/<op>.cpp fills them after
// every validation rule has passed; backends read them. Sizes are int64.
#pragma once

#include "core/common.hpp"

namespace ks::ops {

using detail::DType;
using detail::View;

struct RmsNormArgs {
  View out, x, weight;
  float eps;
  int64_t rows, hidden;
};

struct FusedAddRmsNormArgs {
  View x, residual, weight;
  float eps;
  int64_t rows, hidden;
};

struct SiluAndMulArgs {
  View out, x;
  int64_t rows, d;  // out is [rows, d], x is [rows, 2d]
};

struct GemvArgs {
  View out, x, weight;
  int64_t n, h;
};

struct SoftmaxArgs {
  View out, x;
  int64_t rows, cols;
};

struct EmbeddingArgs {
  View out, ids, table;
  ks_qtype_t format;  // KS_QTYPE_NONE: dense table in out's dtype
  int64_t num_ids, hidden, vocab, row_bytes;
};

struct DequantizeArgs {
  View out, packed;
  ks_qtype_t qtype;
  int64_t rows, cols, row_bytes;
};

struct GemmArgs {
  View out, a, b;
  int64_t m, n, k;
};

struct QuantMatmulArgs {
  View out, x, weight;
  ks_qtype_t qtype;
  int64_t m, n, k, row_bytes;
};

// fused_add_rms_norm_quant_matmul: has_x false -> plain rms_norm of residual (no residual_out).
struct NormQuantMatmulArgs {
  View out, residual_out, x, residual, norm_weight, weight;
  bool has_x;
  float eps;
  ks_qtype_t qtype;
  int64_t m, n, k, row_bytes;
};

// silu_and_mul_quant_matmul: gate_up [m, 2k], weight [n, row_bytes] over k columns.
struct SiluQuantMatmulArgs {
  View out, gate_up, weight;
  ks_qtype_t qtype;
  int64_t m, n, k, row_bytes;
};

struct RotaryArgs {
  View q, k, positions;
  bool has_k, neox;
  int64_t num_tokens, num_heads, num_kv_heads, head_dim, rotary_dim;
  // element strides of q and k (tokens, heads); the last dimension is contiguous
  int64_t q_token_stride, q_head_stride, k_token_stride, k_head_stride;
  double theta;
};

struct KvCacheAppendArgs {
  View k_cache, v_cache, k, v, slot_mapping;
  int64_t num_tokens, num_kv_heads, head_dim, num_slots;
};

// rotary_embedding_kv_append: rotary_embedding's args (k given), then kv_cache_append's
// (k the same tensor, rotated).
struct RopeKvAppendArgs {
  RotaryArgs rope;
  KvCacheAppendArgs kv;
};

// fused_add_rms_norm_quant_matmul_rope_kv_append (one token): the norm + q/k/v matmul into
// out [1, (num_heads + 2 num_kv_heads) head_dim], then rotary_embedding_kv_append on out's
// q, k and v slices (rkv's q, k and v views point into out).
struct NormQmmRopeAppendArgs {
  NormQuantMatmulArgs mm;
  RopeKvAppendArgs rkv;
};

}  // namespace ks::ops
namespace ks::cpu {
// The fusion's two steps through backend `be`'s registry choices (backends/cpu/fused_matmul.cpp).
void norm_qmm_rope_append_composed(const void* args, ks_stream_t stream, ks_backend_t be);
// rotary_embedding_kv_append_paged_attention's two steps likewise.
void rope_append_attention_composed(const void* args, ks_stream_t stream, ks_backend_t be);
}  // namespace ks::cpu
namespace ks::ops {

struct PagedAttentionArgs {
  View out, q, k_cache, v_cache, block_tables, seq_ids, context_lens;
  bool has_seq_ids;
  float scale;
  int64_t num_tokens, num_heads, num_kv_heads, head_dim, block_size, num_blocks, num_seqs,
      max_blocks_per_seq;
  // Largest context_lens entry, found while validating host tensors (device tensors:
  // the bound max_blocks_per_seq * block_size). Sizes the CPU kernels' scratch.
  int64_t max_context_len = 0;
  // paged_attention_after_append's promise (0: none): the kernel before this call on its stream
  // wrote no cache row that a token t reads below context_lens[t] - fresh_keys, and none of
  // block_tables, seq_ids and context_lens; a CUDA kernel may read those before it ends
  int64_t fresh_keys = 0;
};

// rotary_embedding_kv_append_paged_attention: rkv's step, then attn's (attn.q is rkv.rope.q,
// attn's caches rkv.kv's).
struct RopeKvAppendAttentionArgs {
  RopeKvAppendArgs rkv;
  PagedAttentionArgs attn;
};

struct VarlenAttentionArgs {
  View out, q, k, v, cu_q, cu_k;
  float scale;
  bool causal;
  int64_t total_q, total_k, num_heads, num_kv_heads, head_dim, num_seqs;
};

struct ArgmaxArgs {
  View out, x;
  int64_t rows, cols;
};

struct SampleArgs {
  View out, valid, logits, seed_offset;
  bool has_valid;
  float temperature;  // fp32(temperature), > 0
  int64_t top_k;      // 0: off (also when >= vocab)
  double top_p;       // 1: off
  int64_t rows, vocab;
};

// Packed-format geometry; false for an unknown format.
bool qtype_geometry(ks_qtype_t q, int64_t* block_size, int64_t* block_bytes);
// fused_add_rms_norm_quant_matmul's argument rules, under the name `op` (also those of the
// fusion that adds RoPE and the cache append); fills everything but the backend. leading_dims:
// residual, x and residual_out may be [..., K] with out [..., N] (M = the leading dims' product);
// false: [M, K] and [M, N] only (the RoPE fusion).
void validate_norm_quant_matmul(const char* op, NormQuantMatmulArgs& a, DLTensor* out, DLTensor* residual_out,
                                const DLTensor* x, const DLTensor* residual, const DLTensor* norm_weight, double eps,
                                const DLTensor* weight, ks_qtype_t qtype, bool leading_dims = true);
const char* qtype_name(ks_qtype_t q);

}  // namespace ks::ops
