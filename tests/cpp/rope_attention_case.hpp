// Inputs of one decode step for rotary_embedding_kv_append_paged_attention, shared by the CPU
// test (tests/cpp/test_decode_fusions.cpp) and the CUDA test (tests/cuda/test_cuda_ops.cpp):
// each token is the newest position of its own sequence (the fused op's precondition), with the
// hostile corners of a real step: a full context, a one-key context, an empty context (len 0:
// appended, zero output), a skipped append (slot -1: the attention reads the cache's old row at
// that position), sequences in a shuffled order through seq_ids, blocks shuffled over the cache,
// spare blocks no table names, and random cache contents everywhere else.
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

#include "test_util.hpp"

namespace kstest {

struct RopeAttnCase {
  int64_t T, H, KVH, D, rotary_dim, block_size, blocks_per_seq;
  bool neox, with_seq_ids;
  size_t offset_bytes = 0;  // every float tensor this many bytes into its buffer (misaligned views)
  std::string name(DType dt) const {
    return std::string(ks::dtype_name(dt)) + (neox ? " neox" : " interleaved") + " T " + std::to_string(T) + " H " +
           std::to_string(H) + "/" + std::to_string(KVH) + " D " + std::to_string(D) + " rotary_dim " +
           std::to_string(rotary_dim) + " capacity " + std::to_string(block_size * blocks_per_seq) +
           (with_seq_ids ? " seq_ids" : "") + " offset " + std::to_string(offset_bytes);
  }
};

struct RopeAttnInputs {
  Buf q, k, v, pos, slots, k_cache, v_cache, block_tables, seq_ids, context_lens;
  float scale;
};

// T tokens; sequence of token t: seq_ids[t] (a shuffle of T + 1 sequences) or t. Context
// lengths: token 0 the whole capacity, token 1 one key, token 2 none (len 0), the others
// random in [1, capacity]; position len - 1 (token 2: 3), its slot from the block table, or
// -1 for every token t % 5 == 3.
inline RopeAttnInputs make_rope_attn_inputs(DType dt, const RopeAttnCase& c) {
  const int64_t S = c.with_seq_ids ? c.T + 1 : c.T, cap = c.block_size * c.blocks_per_seq;
  const int64_t num_blocks = S * c.blocks_per_seq + 3;
  const size_t off = c.offset_bytes;
  RopeAttnInputs in{Buf(dt, {c.T, c.H, c.D}, off),
                    Buf(dt, {c.T, c.KVH, c.D}, off),
                    Buf(dt, {c.T, c.KVH, c.D}, off),
                    Buf(c.T % 2 ? DType::I64 : DType::I32, {c.T}),
                    Buf(c.T % 2 ? DType::I32 : DType::I64, {c.T}),
                    Buf(dt, {num_blocks, c.block_size, c.KVH, c.D}, off),
                    Buf(dt, {num_blocks, c.block_size, c.KVH, c.D}, off),
                    Buf(DType::I32, {S, c.blocks_per_seq}),
                    Buf(DType::I32, {c.T}),
                    Buf(DType::I32, {c.T}),
                    float(1.0 / std::sqrt(double(c.D)))};
  fill_normal(in.q);
  fill_normal(in.k);
  fill_normal(in.v);
  fill_normal(in.k_cache);
  fill_normal(in.v_cache);
  std::vector<int64_t> blocks(static_cast<size_t>(num_blocks));
  std::iota(blocks.begin(), blocks.end(), int64_t(0));
  std::shuffle(blocks.begin(), blocks.end(), rng());
  for (int64_t i = 0; i < S * c.blocks_per_seq; ++i) in.block_tables.set(i, double(blocks[size_t(i)]));
  std::vector<int64_t> seq(static_cast<size_t>(S));
  std::iota(seq.begin(), seq.end(), int64_t(0));
  if (c.with_seq_ids) std::shuffle(seq.begin(), seq.end(), rng());
  std::uniform_int_distribution<int64_t> len_d(1, cap);
  for (int64_t t = 0; t < c.T; ++t) {
    const int64_t s = seq[size_t(t)];
    const int64_t len = t == 0 ? cap : t == 1 ? 1 : t == 2 ? 0 : len_d(rng());
    const int64_t p = len > 0 ? len - 1 : std::min<int64_t>(3, cap - 1);
    const int64_t slot = int64_t(in.block_tables.get(s * c.blocks_per_seq + p / c.block_size)) * c.block_size +
                         p % c.block_size;
    in.seq_ids.set(t, double(s));
    in.context_lens.set(t, double(len));
    in.pos.set(t, double(p));
    in.slots.set(t, double(t % 5 == 3 ? -1 : slot));
  }
  return in;
}

}  // namespace kstest
