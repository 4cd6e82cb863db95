// Kernel parameters of both paged_attention variants (attention.cu, model_ops.cu),
// built once from the validated arguments.
#pragma once

#include <cstdint>

#include "ops/args.hpp"

namespace ks::cuda {

struct AttnParams {
  void* out;
  const void* q;
  const void* k_cache;
  const void* v_cache;
  const int32_t* block_tables;
  const int32_t* seq_ids;  // nullptr: token t uses row t
  const int32_t* context_lens;
  float scale;
  int64_t num_tokens, num_heads, num_kv_heads, head_dim, block_size, num_blocks, num_seqs, max_blocks_per_seq;
  int group;  // query heads per kv head
};

inline AttnParams attn_params(const ops::PagedAttentionArgs& a) {
  return AttnParams{a.out.data,
                    a.q.data,
                    a.k_cache.data,
                    a.v_cache.data,
                    static_cast<const int32_t*>(a.block_tables.data),
                    a.has_seq_ids ? static_cast<const int32_t*>(a.seq_ids.data) : nullptr,
                    static_cast<const int32_t*>(a.context_lens.data),
                    a.scale,
                    a.num_tokens,
                    a.num_heads,
                    a.num_kv_heads,
                    a.head_dim,
                    a.block_size,
                    a.num_blocks,
                    a.num_seqs,
                    a.max_blocks_per_seq,
                    int(a.num_heads / a.num_kv_heads)};
}

}  // namespace ks::cuda
