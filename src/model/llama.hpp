// A Llama-family decoder (SmolLM2 and friends) from a GGUF file, written only
// against kernscope's public C++ API (include/kernscope/kernscope.hpp): the
// library's first user, not a special case.
//
// Activations are FP32. Weights stay in their GGUF block formats and are
// multiplied straight from the packed blocks (ks::quant_matmul); the token
// embedding doubles as the output head when the file has no output.weight.
// The KV cache is paged (block_size 16) with one sequence.
#pragma once

#include <kernscope/kernscope.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "model/gguf.hpp"

namespace ks::model {

struct LlamaConfig {
  int64_t n_layers = 0, hidden_size = 0, intermediate_size = 0, num_heads = 0, num_kv_heads = 0, head_dim = 0,
          vocab_size = 0, context_length = 0, rotary_dim = 0;
  double rms_eps = 1e-5, rope_theta = 10000.0;
  static LlamaConfig from_gguf(const GgufFile& f);
};

// A weight matrix [rows, cols] as packed GGUF rows (or a dense fp32 vector).
struct Weight {
  ks::TensorView data;  // uint8 [rows, row_bytes] when packed; fp32 [cols] for norms
  ks::QType qtype = ks::QType::None;
  int64_t rows = 0, cols = 0;
};

class LlamaModel {
 public:
  // max_context: KV-cache capacity in tokens (<= the file's context length).
  LlamaModel(const GgufFile& file, int64_t max_context, ks::Backend backend = ks::Backend::Cpu);

  const LlamaConfig& config() const { return cfg_; }
  int64_t max_context() const { return max_ctx_; }

  // Runs tokens[0..n) at positions [pos, pos + n) of the sequence (prefill when
  // n > 1, decode when n == 1), appending their K/V to the cache. Returns the
  // logits of the last token: vocab_size floats, valid until the next call.
  // Throws ks::InvalidArgument if pos + n exceeds max_context.
  const float* forward(const int32_t* tokens, int64_t n, int64_t pos);

 private:
  struct Layer {
    Weight attn_norm, wq, wk, wv, wo, ffn_norm, w_gate_up, w_down;
    ks::Tensor k_cache, v_cache;  // [num_blocks, block_size, num_kv_heads, head_dim] fp32
  };
  void ensure_capacity(int64_t n);

  LlamaConfig cfg_;
  int64_t max_ctx_, block_size_ = 16, num_blocks_;
  ks::Backend backend_;
  Weight tok_embd_, out_norm_, lm_head_;
  std::vector<Layer> layers_;
  std::vector<std::vector<uint8_t>> owned_;  // merged gate|up matrices
  ks::Tensor block_table_;                   // int32 [1, num_blocks]
  // Scratch, sized for the largest n seen.
  int64_t cap_ = 0;
  ks::Tensor x_, res_, h_, q_, k_, v_, attn_, gu_, act_, ids_, pos_, seq_ids_, ctx_lens_, logits_;
};

}  // namespace ks::model
