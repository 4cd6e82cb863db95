// The (rows, cols) each op is routed by (docs/routing.md#shape-keys-rows-cols), its tensors' device,
// and the packed-weight ops' block format (a cell's "qtype").
#include <cstring>
#include <limits>
#include <string_view>

#include "ops/args.hpp"
#include "registry/routing.hpp"

namespace ks::registry {

namespace {
template <typename A>
const A& as(const void* p) {
  return *static_cast<const A*>(p);
}
RouteKey key(int64_t rows, int64_t cols, const detail::View& v, const char* qtype = "") {
  return {rows, cols, v.device.device_id, qtype};
}
// A block format's name in routing cells ("qtype": "q4_1", ...); "" for none or an unknown one
const char* qtype_key(ks_qtype_t q) {
  switch (q) {
    case KS_QTYPE_F32: return "f32";
    case KS_QTYPE_F16: return "f16";
    case KS_QTYPE_BF16: return "bf16";
    case KS_QTYPE_Q4_0: return "q4_0";
    case KS_QTYPE_Q4_1: return "q4_1";
    case KS_QTYPE_Q8_0: return "q8_0";
    default: return "";
  }
}
// x * y for a key's cols, saturating at int64's largest (empty tensors bound neither factor)
int64_t sat_mul(int64_t x, int64_t y) {
  int64_t r = 0;
  return __builtin_mul_overflow(x, y, &r) ? std::numeric_limits<int64_t>::max() : r;
}
}  // namespace

// The ops whose cols key (route_key below) is a product, and its factors' names; nullptr for
// the others. ks_op_cols_factors answers from here, so `ksctl which --cols AxB` and Python's
// which(cols="AxB") take a product exactly where route_key multiplies.
const char* cols_factors(std::string_view op) {
  if (op == "quant_matmul" || op == "quant_matmul_a8" || op == "fused_add_rms_norm_quant_matmul" ||
      op == "fused_add_rms_norm_quant_matmul_rope_kv_append" || op == "silu_and_mul_quant_matmul")
    return "N x K (the packed weight's rows times its columns)";
  if (op == "paged_attention" || op == "rotary_embedding_kv_append_paged_attention")
    return "max_blocks_per_seq x block_size (the block table's capacity in keys)";
  return nullptr;
}

RouteKey route_key(const char* op, const void* args) {
  using namespace ks::ops;
  const auto is = [&](const char* name) { return std::strcmp(op, name) == 0; };
  if (is("rms_norm")) { const auto& a = as<RmsNormArgs>(args); return key(a.rows, a.hidden, a.x); }
  if (is("fused_add_rms_norm")) { const auto& a = as<FusedAddRmsNormArgs>(args); return key(a.rows, a.hidden, a.x); }
  if (is("silu_and_mul")) { const auto& a = as<SiluAndMulArgs>(args); return key(a.rows, a.d, a.x); }
  if (is("gemv")) { const auto& a = as<GemvArgs>(args); return key(a.n, a.h, a.x); }
  if (is("softmax")) { const auto& a = as<SoftmaxArgs>(args); return key(a.rows, a.cols, a.x); }
  if (is("argmax")) { const auto& a = as<ArgmaxArgs>(args); return key(a.rows, a.cols, a.x); }
  if (is("sample")) { const auto& a = as<SampleArgs>(args); return key(a.rows, a.vocab, a.logits); }
  if (is("gemm")) { const auto& a = as<GemmArgs>(args); return key(a.m, a.n, a.a); }
  // the quantized matmuls: cols = the weight's elements N x K (a GEMV's time follows its bytes; N
  // alone would give a 4096 x 576 matrix's cell to 4096 x 4096)
  if (is("quant_matmul") || is("quant_matmul_a8")) { const auto& a = as<QuantMatmulArgs>(args); return key(a.m, sat_mul(a.n, a.k), a.x, qtype_key(a.qtype)); }
  if (is("fused_add_rms_norm_quant_matmul")) { const auto& a = as<NormQuantMatmulArgs>(args); return key(a.m, sat_mul(a.n, a.k), a.residual, qtype_key(a.qtype)); }
  if (is("fused_add_rms_norm_quant_matmul_rope_kv_append")) {
    const auto& a = as<NormQmmRopeAppendArgs>(args).mm;
    return key(a.m, sat_mul(a.n, a.k), a.residual, qtype_key(a.qtype));
  }
  if (is("silu_and_mul_quant_matmul")) { const auto& a = as<SiluQuantMatmulArgs>(args); return key(a.m, sat_mul(a.n, a.k), a.gate_up, qtype_key(a.qtype)); }
  if (is("embedding")) { const auto& a = as<EmbeddingArgs>(args); return key(a.num_ids, a.hidden, a.out, qtype_key(a.format)); }
  if (is("dequantize")) { const auto& a = as<DequantizeArgs>(args); return key(a.rows, a.cols, a.out, qtype_key(a.qtype)); }
  if (is("rotary_embedding")) { const auto& a = as<RotaryArgs>(args); return key(a.num_tokens, a.num_heads, a.q); }
  if (is("rotary_embedding_kv_append")) { const auto& a = as<RopeKvAppendArgs>(args); return key(a.rope.num_tokens, a.rope.num_heads, a.rope.q); }
  if (is("kv_cache_append")) { const auto& a = as<KvCacheAppendArgs>(args); return key(a.num_tokens, a.num_kv_heads, a.k); }
  if (is("paged_attention")) {
    const auto& a = as<PagedAttentionArgs>(args);
    return key(a.num_tokens, sat_mul(a.max_blocks_per_seq, a.block_size), a.q);
  }
  if (is("rotary_embedding_kv_append_paged_attention")) {
    const auto& a = as<RopeKvAppendAttentionArgs>(args).attn;
    return key(a.num_tokens, sat_mul(a.max_blocks_per_seq, a.block_size), a.q);
  }
  if (is("varlen_attention")) { const auto& a = as<VarlenAttentionArgs>(args); return key(a.total_q, a.total_k, a.q); }
  return {};
}

}  // namespace ks::registry
