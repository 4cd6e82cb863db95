// A Llama-family decoder (SmolLM2 and friends) from a GGUF file, written only
// against kernscope's public C++ API (include/kernscope/kernscope.hpp): the
// library's first user, not a special case.
//
// Activations are FP32. Weights stay in their GGUF block formats and are
// multiplied straight from the packed blocks (ks::quant_matmul); on CUDA, prefill
// steps of at least kDenseRows tokens multiply through FP32 copies instead (ks::gemm);
// the token embedding doubles as the output head when the file has no output.weight.
// The KV cache is paged (block_size 16): max_batch sequences, each with its own
// blocks (sequence s owns blocks s * B .. s * B + B - 1, B = ceil(max_context / 16)).
//
// With Backend::Cuda every weight, the KV cache and the activations live on the GPU
// (device 0) and every op runs there on the model's own stream; the decode step of
// forward_argmax (one token, greedy) is captured in a CUDA graph per attention table (capacity
// bucket, attention_capacity) and replayed, with the token, position and context length copied
// in before each replay.
#pragma once

#include <kernscope/kernscope.hpp>

#include <cstdint>
#include <array>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "model/device.hpp"
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
  // CUDA only, for prefill steps of many rows: the matrix dequantized once at load, fp32
  // [rows, cols] on the device, multiplied through ks::gemm (cuBLASLt); empty when the
  // copies would exceed the budget (LlamaModel::kDenseRows), then one scratch buffer is used.
  ks::TensorView dense;
};

class LlamaModel {
 public:
  // max_context: KV-cache capacity in tokens per sequence (<= the file's context length);
  // max_batch: sequences decoded together by decode_batch (sequence 0 is forward's).
  LlamaModel(const GgufFile& file, int64_t max_context, ks::Backend backend = ks::Backend::Cpu,
             int64_t max_batch = 1);

  const LlamaConfig& config() const { return cfg_; }
  int64_t max_context() const { return max_ctx_; }

  // Runs tokens[0..n) at positions [pos, pos + n) of the sequence (prefill when
  // n > 1, decode when n == 1), appending their K/V to the cache. Returns the
  // logits of the last token: vocab_size floats, valid until the next call.
  // Throws ks::InvalidArgument if pos + n exceeds max_context.
  const float* forward(const int32_t* tokens, int64_t n, int64_t pos);

  // The same step followed by ks::argmax of the last token's logits: the greedy next
  // id. On CUDA the argmax runs on the device and a one-token step replays a CUDA graph.
  int32_t forward_argmax(const int32_t* tokens, int64_t n, int64_t pos);

  ks::Backend backend() const { return backend_; }
  // CUDA: prefill steps of at least this many rows multiply through FP32 weights with
  // ks::gemm (cuBLASLt) instead of quant_matmul. The FP32 copies of the layers' matrices are
  // made once at load when they fit in KS_DENSE_WEIGHTS_MB (default 1024) MB; then every
  // prefill step of at least kDenseRows rows uses them. Without held copies, prefill steps of
  // at least kScratchDenseRows rows dequantize each matrix into one scratch buffer just before
  // its gemm. decode_batch steps multiply from the packed blocks (ks::quant_matmul, whose
  // routing takes cuda_mma_rows from 8 rows on, for the output head from 4); KS_MODEL_DENSE_DECODE=1 brings back the
  // earlier rule, steps of at least kDenseDecodeRows sequences through the FP32 copies (and an
  // FP32 copy of the output head), for comparisons: cuBLASLt's FP32 kernels for 16 and 32 rows
  // took 9-59 us per matrix on the H200 (ncu, 4a08218).
  // From kTensorCoreDecodeRows rows quant_matmul's routing on sm_90 may take cuda_mma_rows (the
  // block sums on the tensor cores: the same values up to FP32 rounding, not the one-token
  // kernels' bits): for the output head's shape from 4 rows, for every matrix from 8. KS_MODEL_BATCH_INVARIANT=1 keeps every decode step on quant_matmul's
  // per-column kernels (from kTensorCoreDecodeRows rows pinned: cuda_staged_x, or where it
  // declines cuda_warp_per_column_m16 from 8 rows, cuda_warp_per_column below), so a batched row
  // stays bit-identical to that sequence's one-token step at any batch size.
  static constexpr int64_t kDenseRows = 8, kDenseDecodeRows = 16, kScratchDenseRows = 64, kTensorCoreDecodeRows = 4;
  int64_t max_batch() const { return max_batch_; }

  // forward / forward_argmax for sequence `seq` (0 <= seq < max_batch).
  const float* forward_seq(int64_t seq, const int32_t* tokens, int64_t n, int64_t pos);
  int32_t forward_argmax_seq(int64_t seq, const int32_t* tokens, int64_t n, int64_t pos);

  // One decode step of b sequences at once (b <= max_batch): sequence i takes tokens[i] at
  // position positions[i] (its cache must hold positions 0..positions[i]-1) and gets the
  // greedy next id in next_ids[i]. Below kTensorCoreDecodeRows sequences (or with
  // KS_MODEL_BATCH_INVARIANT=1), a row's result equals that sequence's own one-token step bit
  // for bit when the attention splits the row's context alike in both: the batch's longest
  // context picks the row's own table (attention_capacity), and the batch is small enough that the
  // cluster size follows the table alone (on CUDA it shrinks once 3 b C >= 2 SMs: for SmolLM2 on
  // the H200's 132 SMs, from 11 sequences on tables of 2048+ tokens); every other op is
  // batch-invariant. From kTensorCoreDecodeRows on (CUDA, sm_90), quant_matmul's routing picks
  // cuda_mma_rows (the output head from 4 sequences, every matrix from 8), whose sums run in another order than the one-token kernels' (the same values
  // up to FP32 rounding); with KS_MODEL_DENSE_DECODE=1 the matmuls of kDenseDecodeRows and more
  // go through ks::gemm on the FP32 copies instead (cuBLASLt's order). On CUDA the step is one CUDA graph per (b, attention table).
  void decode_batch(const int32_t* tokens, const int64_t* positions, int64_t b, int32_t* next_ids);
  // Greedy decode of sequence `seq` for up to `count` steps: step i (0 <= i < count) feeds the
  // previous step's id (step 0: `first`) at position pos + i and yields the next greedy id,
  // which goes to on_token; generation ends when on_token returns false or after `count` steps.
  // Returns the ids given to on_token. The ids are forward_argmax_seq's, bit for bit (the same
  // kernels on the same inputs); positions pos .. pos + count - 1 must fit the context
  // (ks::InvalidArgument otherwise, before anything runs).
  // On CUDA the GPU runs ahead of the host (KS_MODEL_DECODE_STEPS, default kDecodeSteps): the
  // steps go in CUDA graphs of that many chained steps - each step's argmax writes the id the
  // next step embeds, on the device, and the host stages every step's position, slot and length
  // beforehand - and the next graph is queued before the host reads the previous one's ids, so
  // the GPU does not wait for the host between steps. on_token then sees the ids in groups, and
  // when it stops early up to 2 * KS_MODEL_DECODE_STEPS - 1 steps past the last reported id may
  // already have run: they wrote K/V only at positions after it (in this sequence's own blocks),
  // which a later step at those positions overwrites and no step before them reads; the call
  // waits for them before returning. KS_MODEL_DECODE_STEPS=0: one forward_argmax_seq per step;
  // a value that is not a whole number in [0, kMaxDecodeSteps] makes the constructor throw
  // ks::InvalidArgument. on_token must not call into the model (steps are still queued on its
  // buffers); if it throws, the queued steps finish and the exception propagates.
  int64_t decode_greedy(int64_t seq, int32_t first, int64_t pos, int64_t count,
                        const std::function<bool(int32_t)>& on_token);
  static constexpr int64_t kDecodeSteps = 4, kMaxDecodeSteps = 32;
  // Makes decode_greedy's CUDA graphs now, so that its calls do not (ksctl generate does this
  // before the prompt): the graphs of every attention table that steps 1..steps after a prompt
  // of `rows` tokens use (lengths rows + 1 .. rows + steps); one step runs eagerly first, token 0
  // at the context's last position of sequence 0 (K/V that any step at that position overwrites
  // before reading). rows: the most rows a call will run before decoding (the prompt's tokens);
  // the step buffers are sized for them first, because a call of more rows than they hold
  // replaces them and with them the graphs, which decode_greedy then makes again (the first
  // table's before its first step, a later table's when its steps are reached). A no-op on the
  // CPU, with KS_MODEL_DECODE_STEPS=0, or when the graphs are held.
  void prepare_decode_greedy(int64_t rows = 1, int64_t steps = 1);
  // Whether decode_greedy's graphs are held now, for any capacity bucket (CUDA).
  bool decode_greedy_prepared() const;
  // The KV-cache capacity (tokens) of the block table a step whose longest context is `len`
  // tokens runs attention with: the tables hold KS_MODEL_ATTN_BUCKET tokens (default kAttnBucket),
  // twice that, ... and the whole cache (KS_MODEL_ATTN_BUCKET=0: the whole cache alone), each
  // rounded up to whole blocks of 16; a step takes the narrowest of at least
  // KS_MODEL_ATTN_HEADROOM (default kAttnHeadroom) times len, or the widest. On CUDA
  // (cuda_gqa_cluster) a (token, kv head) unit's cluster holds up to capacity / 64 CTAs (at most
  // 16; fewer when the batch alone fills the GPU), of which ceil(len / keys per step) take keys
  // (64 keys for SmolLM2's fp32 heads of 64), so a table of more than 256 keys that fits leaves
  // that live split uncapped, and a much wider one launches clusters that mostly idle; a table of
  // at most 256 keys runs one CTA per unit on purpose (below). Headroom 2 dates from
  // clusters of capacity / 128 CTAs (headroom 1 then capped the split: 2% slower); with / 64 the
  // two measured the same (87eb81b, KS_ATTN_CAPACITY_KEYS=64: 1638 / 1519 tokens/s at headroom 2,
  // 1640 / 1516 at 1, after 64 / 512-token prompts). Headroom 1 since 2026-12-01: decode attention
  // runs one CTA per unit, no cluster, for tables of at most 256 keys (gqa_one_cta_keys), which
  // beat the cluster at 64-192 live keys and lost at 200-368 (tables of 128 with one CTA up to
  // 128 were 2% faster after 200-token prompts but 0.6% slower after 64: 54d78ee, not taken);
  // headroom 1 gives contexts up to 256 the 256-key table (headroom 2 only up to 128).
  int64_t attention_capacity(int64_t len) const { return table_tokens_[size_t(table_for(len))]; }
  static constexpr int64_t kAttnBucket = 256, kAttnHeadroom = 1;
  // KS_MODEL_STEP_TIMING=1 on CUDA: the GPU time of each graph-replayed step since the last call,
  // in microseconds (DeviceStream::take_replay_us); empty otherwise
  std::vector<float> take_step_times_us() { return stream_ ? stream_->take_replay_us() : std::vector<float>{}; }

 private:
  // A buffer on the model's device: host memory (CPU) or device memory (CUDA).
  struct Buffer {
    ks::Tensor host;
    DeviceArray dev;
    ks::TensorView view;
  };
  Buffer alloc(ks::DType dtype, const std::vector<int64_t>& shape);
  // a copy on the device (CUDA; with_dense: also its fp32 dequantized copy); w itself on the CPU
  Weight upload(const Weight& w, bool with_dense = false);
  // w's FP32 dequantized copy on the device (w.dense), made once
  void add_dense(Weight& w);
  // out[n, rows] = x[n, cols] @ W^T: ks::gemm on W.dense when held and n >= kDenseRows
  // (decode steps: only with KS_MODEL_DENSE_DECODE=1, n >= kDenseDecodeRows, and not with
  // KS_MODEL_BATCH_INVARIANT=1); for prefill steps of >= kScratchDenseRows
  // rows without held copies, ks::gemm on W dequantized into the scratch; else quant_matmul on
  // the blocks (each weight element dequantized in FP32 every way; sums in FP32)
  void matmul(const ks::TensorView& out, const ks::TensorView& x, const Weight& w, int64_t n, bool prefill);
  struct Layer {
    Weight attn_norm, wq, wk, wv, wo, ffn_norm, w_gate_up, w_down;
    Weight w_qkv;  // wq | wk | wv rows stacked (one matmul for one-token steps); empty if formats differ
    Buffer k_cache, v_cache;  // [num_blocks, block_size, num_kv_heads, head_dim] fp32
  };
  void ensure_capacity(int64_t n);
  // the KV-cache slot of sequence seq's position pos (its own blocks, in order)
  int64_t slot_of(int64_t seq, int64_t pos) const { return seq * blocks_per_seq_ * block_size_ + pos; }
  void check_positions(const char* what, int64_t n, int64_t pos) const;  // throws ks::InvalidArgument
  // ids, positions, seq ids, lengths, slots: row i is token tokens[i] of sequence seq[i] at pos[i]
  void stage_rows(const int32_t* tokens, const int64_t* seq, const int64_t* pos, int64_t n);
  // every op of the step on the model's backend and stream; logits of the last row, or of
  // every row (all_rows, for decode_batch), into the logits buffer
  void run_layers(int64_t n, bool all_rows, bool prefill = false);
  void decode_rows(const int32_t* tokens, const int64_t* seq, const int64_t* pos, int64_t b, int32_t* next_ids);
  ks_stream_t stream() const { return stream_ ? stream_->handle() : nullptr; }

  LlamaConfig cfg_;
  int64_t max_ctx_, block_size_ = 16, num_blocks_, blocks_per_seq_, max_batch_ = 1;
  ks::Backend backend_;
  bool on_device_ = false;
  bool qkv_fused_ = false;  // every layer has w_qkv
  // one-token steps fuse each norm into the matmul after it, silu_and_mul into the down
  // projection and the kv append into RoPE (ks::fused_add_rms_norm_quant_matmul,
  // ks::silu_and_mul_quant_matmul, ks::rotary_embedding_kv_append): 6 kernels per layer
  // instead of 10; decode_batch steps (several sequences, one token each) fuse the kv append
  // into RoPE only (11 kernels per layer instead of 12: the batched matmuls take cuda_mma_rows,
  // which the fused norm / SiLU forms do not have); KS_MODEL_FUSE=0 runs the unfused sequence
  // instead (comparisons)
  bool fuse_decode_ = true;
  bool dense_rows_ = false;    // CUDA steps of >= kDenseRows rows may go through ks::gemm
  bool batch_invariant_ = false;  // KS_MODEL_BATCH_INVARIANT=1: decode steps stay on quant_matmul
  bool dense_decode_ = false;     // KS_MODEL_DENSE_DECODE=1: decode steps of >= kDenseDecodeRows via ks::gemm
  // KS_MODEL_SPLIT_HEAD=1: the fused one-token step ends with fused_add_rms_norm, then
  // quant_matmul for the output head (whose routing may pick another variant, e.g.
  // cuda_row_stream) instead of fused_add_rms_norm_quant_matmul (comparisons)
  bool split_head_ = false;
  // KS_MODEL_BATCH_SILU_FUSE=1 (experiments; not yet measured): decode_batch steps of 8 or more
  // sequences on CUDA run SiLU and the down projection as one kernel, silu_and_mul_quant_matmul's
  // cuda_mma_rows (the same bits as the two calls there); not with KS_MODEL_BATCH_INVARIANT=1 or
  // KS_MODEL_DENSE_DECODE=1
  bool batch_silu_fuse_ = false;
  // The one-token step's q/k/v matmul also rotates and appends (5 kernels per layer): on by
  // default on CUDA since the kernel no longer lets the attention launch early (measured as
  // KS_PDL_OFF=paged_attention: 1643-1651 tokens/s against 1631-1638 for the 6-kernel step in
  // three H200 calls; docs/perf/model.md); off on the CPU (the same op composed there: nothing to
  // gain). KS_MODEL_FUSE_ROPE=0 / 1 forces it either way.
  bool fuse_rope_ = false;
  // KS_MODEL_FUSE_ATTN=1: decode steps (one token per sequence) run
  // ks::rotary_embedding_kv_append_paged_attention (one kernel on CUDA) instead of
  // rotary_embedding_kv_append and paged_attention (the same bits). Off by default: measured
  // slower on the H200 at 7ab7934 (batch 1: 1209 against 1645 tokens/s; docs/perf/model.md).
  // It turns the default q/k/v + RoPE fusion off (whose matmul already rotates) unless
  // KS_MODEL_FUSE_ROPE=1 is set, which then wins.
  bool fuse_attn_ = false;
  // KS_MODEL_ATTN_PREWAIT=0: decode steps call paged_attention without after_append's promise
  bool attn_prewait_ = true;
  // KS_MODEL_ABLATE=part,part (timing experiments only: the outputs are WRONG): the fused
  // one-token step leaves out the named kernels (qkv: norm + q/k/v (+ RoPE + append), attention,
  // oproj, gateup: add + norm + gate|up, down: SiLU + down, head: the final norm + output head),
  // so a decode rate with and without one part gives that part's cost inside the step's graph
  // (PDL overlap included), which the kernels' times alone do not
  unsigned ablate_ = 0;  // bit i: part i of kAblateParts (llama.cpp) left out
  bool ablated(const char* part) const;  // part: one of those names
  DeviceArray dense_scratch_;  // fp32, the largest matrix (when the copies are not held)
  std::unique_ptr<DeviceStream> stream_;  // CUDA only
  Weight tok_embd_, out_norm_, lm_head_;
  std::vector<Layer> layers_;
  std::vector<std::vector<uint8_t>> owned_;  // merged gate|up matrices
  std::vector<DeviceArray> dev_weights_;     // device copies of the weights (CUDA)
  // Block tables by capacity bucket: tables_[i] is int32 [max_batch, ceil(table_tokens_[i] / 16)],
  // sequence s's own first blocks. On CUDA the decode attention sizes its split (clusters) by the
  // table's capacity, and a graph replays one size at every length, so a step takes the narrowest
  // table its longest context fits (table_for) and each table gets its own graphs: a short context
  // does not pay for the split a long one needs. The choice depends on the step's longest context
  // only, so graph-replayed, chained and eager steps of one length run the same kernels.
  std::vector<Buffer> tables_;
  std::vector<int64_t> table_tokens_;
  int table_ = 0;  // the table of the step being run or captured (stage_rows / the chain sets it)
  int64_t attn_headroom_ = 1;  // KS_MODEL_ATTN_HEADROOM: a table of at least this many times the context
  int table_for(int64_t len) const;
  // Scratch, sized for the largest n seen.
  int64_t cap_ = 0;
  Buffer x_, res_, res2_, h_, q_, k_, v_, qkv_, attn_, gu_, act_, ids_, pos_, seq_ids_, ctx_lens_, slots_, logits_dev_, next_id_;
  std::vector<int64_t> batch_ids_;                // decode_batch's argmax results (CPU)
  // decode_rows' graphs (CUDA): one per (rows, table), captured after an eager first step
  struct StepGraph {
    int64_t rows;
    int table;
    DeviceGraph graph;
  };
  std::vector<StepGraph> step_graphs_;
  // A step's inputs (slots_, ids_, pos_, seq_ids_, ctx_lens_ are views set by stage_rows):
  // CUDA: written into the pinned step_host_, sent with one copy to step_dev_, which the
  // kernels read; next_host_: the argmax ids, pinned. CPU: step_cpu_ (int64 words), read in place.
  DeviceArray step_dev_;
  PinnedArray step_host_, next_host_;
  std::vector<int64_t> step_cpu_;
  // decode_greedy's chained steps (CUDA): chain_dev_ holds the ids (int64 [chain_steps_]; step j
  // of a graph of k steps embeds id j and its argmax writes id (j + 1) mod k), then each step's
  // inputs (ChainLayout); chain_host_ (pinned) holds two sets of staged inputs and of copied-out
  // ids, one per graph in flight, and the first id. chain_graphs_[t][0]: chain_steps_ steps on
  // table t, [1]: one (the last steps of a call, and steps whose group would cross into the
  // next table); captured on first use, dropped with the buffers they read.
  int64_t chain_steps_ = kDecodeSteps;
  DeviceArray chain_dev_;
  PinnedArray chain_host_;
  std::vector<std::array<DeviceGraph, 2>> chain_graphs_;
  DeviceEvent chain_done_[2];
  void chain_step(int64_t j, int64_t k);  // enqueues step j of a graph of k chained steps (on table_)
  const DeviceGraph& chain_graph(int t, int64_t k);  // table t's graph of k chained steps (made if missing)
  bool chains_held(int t) const;                      // table t's graphs of K and 1 steps are held
  void prepare_chains(int t0, int t1);  // tables t0..t1's graphs where missing, after one eager step
  void drop_graphs();  // every decode graph (they read buffers about to be replaced)
  ks::Tensor logits_;            // the last token's logits on the host (decode_batch: every row's)
};

}  // namespace ks::model
