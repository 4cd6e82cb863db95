// Kernel parameters of the CUDA paged_attention variants (attention.cu, model_ops.cu),
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
  // pos / block_size == (pos * bs_mul) >> bs_shift for 0 <= pos < 2^31 (round-up reciprocal:
  // l = ceil(log2 block_size), bs_shift = 31 + l, bs_mul = ceil(2^bs_shift / block_size) < 2^32)
  uint32_t bs_mul;
  int bs_shift;
  // cuda_gqa_cluster: 1 = only the first ceil(len / keys per step) CTAs of a cluster take keys
  // (the default); 0 = all C (KS_ATTN_LIVE_SPLIT=0, for comparisons)
  int live_split;
  int min_keys_per_cta;  // 0: one step of keys (KS_ATTN_MIN_KEYS)
  // cuda_mma_cluster's split beyond a cluster (few units): `splits` CTAs per unit (clusters of
  // one), each leaving its softmax state in `ws` for attention_combine_kernel; 1: no split
  int splits;
  int split_keys;  // the fewest keys a split CTA takes (live_ctas), 256 (KS_ATTN_SPLIT_KEYS)
  float* ws;
  // with the split: nullptr, attention_combine_kernel merges the states; else a counter per unit
  // (zero between calls) by which the unit's last split CTA to finish finds itself and merges
  // them (the default: no combine kernel; KS_ATTN_LAST_COMBINE=0 launches it)
  unsigned* ws_count;
  // cuda_gqa_cluster's cluster merge: 0 = each CTA's state read by the others through
  // distributed shared memory between two cluster barriers; else the byte offset, in rank 0's
  // dynamic shared memory, of the area into which every CTA pushes its state (one barrier)
  int push_off;
  // cuda_gqa_cluster and cuda_mma_cluster: the first this many keys of a CTA's range are
  // prefetched into L2 before griddepcontrol.wait (warm_keys_l2); 0: none, the default
  // (KS_ATTN_PREFETCH_KEYS)
  int prefetch_keys;
  // cuda_gqa_cluster with one CTA per unit (not the fused RoPE kernel) and cuda_mma_cluster with
  // 8 warps and at most one CTA per SM: > 0 = the caller's promise
  // (paged_attention_after_append's fresh_keys) that the kernel before this one in the stream
  // writes neither seq_ids, context_lens, block_tables nor a cache row that a token reads below
  // context_lens[t] - prewait_fresh; the older keys' first copies then go out before
  // griddepcontrol.wait. 0: nothing read before it
  int prewait_fresh;
  int prewait_steps;  // with prewait_fresh: the first 1 or 2 steps' older keys so (2 by default)
};

#if defined(__CUDACC__)
// Token t's sequence (seq_ids[t], or t without seq_ids) and its live context length, by the
// contract's rules for device index tensors: a seq id outside [0, num_seqs) or a negative length
// gives 0 keys (a zero row), and a length past the block table's capacity is clamped to it.
// Shared by every CUDA paged_attention kernel and cuda_mma_cluster's combine kernel.
struct TokenContext {
  int64_t seq, len;
};
// pos / block_size for 0 <= pos < 2^31 by AttnParams' round-up reciprocal (bs_mul, bs_shift),
// without a division.
__device__ __forceinline__ int block_of(uint32_t bs_mul, int bs_shift, int pos) {
  return int((uint64_t(uint32_t(pos)) * bs_mul) >> bs_shift);
}
// l2_only: read through L2 alone (ld.global.cg), for reads before griddepcontrol.wait, so that no
// L1 line they fill can serve the same words after the wait.
__device__ __forceinline__ TokenContext token_context(const AttnParams& p, int64_t t, bool l2_only = false) {
  const int64_t seq = p.seq_ids ? int64_t(l2_only ? __ldcg(p.seq_ids + t) : p.seq_ids[t]) : t;
  int64_t len = l2_only ? __ldcg(p.context_lens + t) : p.context_lens[t];
  if (seq < 0 || seq >= p.num_seqs || len < 0) len = 0;
  return {seq, min(len, p.max_blocks_per_seq * p.block_size)};
}
#endif

// The round-up reciprocal of d (1 <= d < 2^31) for 31-bit numerators: with e = mul * d -
// 2^shift < d <= 2^l, n * e < 2^(31 + l) = 2^shift, so floor(n * mul / 2^shift) = floor(n / d).
inline void div_magic(int64_t d, uint32_t* mul, int* shift) {
  int l = 0;
  while (l < 62 && (int64_t(1) << l) < d) ++l;  // (attn_params runs for every block_size)
  *shift = 31 + l;
  const unsigned __int128 num = (unsigned __int128)1 << *shift;
  *mul = uint32_t((num + uint64_t(d) - 1) / uint64_t(d));
}

inline AttnParams attn_params(const ops::PagedAttentionArgs& a) {
  AttnParams p{a.out.data,
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
                    int(a.num_heads / a.num_kv_heads),
                    0,
                    0,
                    1,
                    0,
                    1,
                    256,
                    nullptr,
                    nullptr,
                    0};
  // (by name: a positional list put these in the wrong fields once)
  p.prefetch_keys = 0;
  p.prewait_fresh = 0;
  p.prewait_steps = 2;
  div_magic(a.block_size, &p.bs_mul, &p.bs_shift);
  return p;
}

}  // namespace ks::cuda
