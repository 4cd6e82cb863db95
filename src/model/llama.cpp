#include "model/llama.hpp"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cmath>
#include <cstring>
#include <iterator>
#include <string_view>
#include <stdexcept>

namespace ks::model {

namespace {
// Pins op to variant on this thread for the scope (ks::force_variant), then puts the caller's own
// pin, if any, back.
struct ScopedPin {
  ScopedPin(const char* op, const char* variant) : op_(op), before_(ks::forced_variant(op)) {
    ks::force_variant(op, variant);
  }
  ~ScopedPin() { ks_force_variant(op_, before_.empty() ? nullptr : before_.c_str()); }
  ScopedPin(const ScopedPin&) = delete;
  ScopedPin& operator=(const ScopedPin&) = delete;

 private:
  const char* op_;
  std::string before_;
};

ks::QType qtype_from_ggml(uint32_t t, const std::string& name) {
  switch (t) {
    case 0: return ks::QType::F32;
    case 1: return ks::QType::F16;
    case 2: return ks::QType::Q4_0;
    case 3: return ks::QType::Q4_1;
    case 8: return ks::QType::Q8_0;
    case 30: return ks::QType::BF16;
    default:
      throw GgufError("tensor '" + name + "' has GGML type " + ggml_type_name(t) +
                      ", which kernscope cannot decode yet");
  }
}

Weight matrix(const GgufFile& f, const std::string& name, int64_t rows, int64_t cols) {
  const GgufTensorInfo& t = f.require_tensor(name);
  if (t.ne.size() != 2 || t.ne[0] != cols || t.ne[1] != rows)
    throw GgufError("tensor '" + name + "' must be " + std::to_string(rows) + " x " + std::to_string(cols));
  Weight w;
  w.qtype = qtype_from_ggml(t.ggml_type, name);
  w.rows = rows;
  w.cols = cols;
  w.data = ks::TensorView(const_cast<uint8_t*>(t.data), ks::DType::U8, {rows, int64_t(t.nbytes / uint64_t(rows))});
  return w;
}

Weight norm(const GgufFile& f, const std::string& name, int64_t n) {
  const GgufTensorInfo& t = f.require_tensor(name);
  if (t.ggml_type != 0 || t.ne.size() != 1 || t.ne[0] != n)
    throw GgufError("norm '" + name + "' must be F32 of length " + std::to_string(n));
  Weight w;
  w.rows = 1;
  w.cols = n;
  w.data = ks::TensorView(const_cast<uint8_t*>(t.data), ks::DType::F32, {n});
  return w;
}

}  // namespace

LlamaConfig LlamaConfig::from_gguf(const GgufFile& f) {
  const std::string arch = f.get_string("general.architecture");
  if (arch != "llama") throw GgufError("general.architecture is '" + arch + "'; only 'llama' is supported");
  LlamaConfig c;
  // Counts read from the file are bounded before anything is sized by them: a block count of 10^7
  // in a 5 MB file made the layer table take 16 GB before the first missing tensor was noticed.
  const uint64_t blocks = f.get_uint("llama.block_count");
  if (blocks == 0 || blocks > 65536)
    throw GgufError("llama.block_count is " + std::to_string(blocks) + "; expected 1 to 65536");
  c.n_layers = int64_t(blocks);
  if (!f.tensor("blk." + std::to_string(blocks - 1) + ".attn_norm.weight"))
    throw GgufError("llama.block_count is " + std::to_string(blocks) + " but the file has no tensor 'blk." +
                    std::to_string(blocks - 1) + ".attn_norm.weight' (its last layer's)");
  c.hidden_size = int64_t(f.get_uint("llama.embedding_length"));
  c.intermediate_size = int64_t(f.get_uint("llama.feed_forward_length"));
  c.num_heads = int64_t(f.get_uint("llama.attention.head_count"));
  c.num_kv_heads = int64_t(f.get_uint("llama.attention.head_count_kv", uint64_t(c.num_heads)));
  // (at most 2^30 tokens: the attention kernels' key positions are 32-bit with room to spare)
  const uint64_t ctx = f.get_uint("llama.context_length", 2048);
  if (ctx == 0 || ctx > (uint64_t(1) << 30))
    throw GgufError("llama.context_length is " + std::to_string(ctx) + "; expected 1 to 2^30");
  c.context_length = int64_t(ctx);
  c.rms_eps = f.get_float("llama.attention.layer_norm_rms_epsilon", 1e-5);
  c.rope_theta = f.get_float("llama.rope.freq_base", 10000.0);
  if (c.num_heads <= 0 || c.hidden_size % c.num_heads != 0)
    throw GgufError("llama.attention.head_count must divide llama.embedding_length");
  c.head_dim = c.hidden_size / c.num_heads;
  c.rotary_dim = int64_t(f.get_uint("llama.rope.dimension_count", uint64_t(c.head_dim)));
  // What this loader does not implement is refused by name, not run with wrong results: RoPE
  // scaling (linear, YaRN, Llama 3.1's frequency factors in rope_freqs.weight) and mixtures of
  // experts (Mixtral-style files also say 'llama').
  if (f.find("llama.rope.scaling.type")) {
    const std::string t = f.get_string("llama.rope.scaling.type");
    if (t != "none")
      throw GgufError("llama.rope.scaling.type is '" + t + "'; RoPE scaling is not implemented (unscaled RoPE only)");
  }
  if (const double factor = f.get_float("llama.rope.scaling.factor", 1.0); factor != 1.0 && factor != 0.0)
    throw GgufError("llama.rope.scaling.factor is " + std::to_string(factor) +
                    "; RoPE scaling is not implemented (unscaled RoPE only)");
  if (f.tensor("rope_freqs.weight"))
    throw GgufError("the file has rope_freqs.weight (RoPE frequency factors, e.g. Llama 3.1's); not implemented");
  if (const uint64_t experts = f.get_uint("llama.expert_count", 0); experts > 0)
    throw GgufError("llama.expert_count is " + std::to_string(experts) + "; mixtures of experts are not implemented");
  const GgufTensorInfo& emb = f.require_tensor("token_embd.weight");
  if (emb.ne.size() != 2 || emb.ne[0] != c.hidden_size) throw GgufError("token_embd.weight has the wrong shape");
  c.vocab_size = emb.ne[1];
  if (c.n_layers <= 0 || c.num_kv_heads <= 0 || c.num_heads % c.num_kv_heads != 0 || c.rotary_dim <= 0 ||
      c.rotary_dim > c.head_dim || c.rotary_dim % 2 != 0 || c.intermediate_size <= 0)
    throw GgufError("inconsistent llama hyper-parameters in the GGUF metadata");
  return c;
}

LlamaModel::Buffer LlamaModel::alloc(ks::DType dtype, const std::vector<int64_t>& shape) {
  Buffer b;
  if (on_device_) {
    size_t bytes = ks::dtype_size(dtype);
    for (int64_t d : shape) bytes *= size_t(d);
    b.dev = DeviceArray(bytes);
    b.view = b.dev.view(dtype, shape);
  } else {
    b.host = ks::Tensor(dtype, shape);
    b.view = b.host.view();
  }
  return b;
}

Weight LlamaModel::upload(const Weight& w, bool with_dense) {
  if (!on_device_) return w;
  DeviceArray& d = dev_weights_.emplace_back(w.data.nbytes());
  stream_->to_device(d.data(), w.data.data(), w.data.nbytes());
  Weight r = w;
  r.data = d.view(w.data.dtype(), w.data.shape());
  if (with_dense) add_dense(r);
  return r;
}

void LlamaModel::add_dense(Weight& w) {
  if (!on_device_ || w.rows <= 0 || w.cols <= 0) return;
  DeviceArray& f = dev_weights_.emplace_back(size_t(w.rows * w.cols) * sizeof(float));
  w.dense = f.view(ks::DType::F32, {w.rows, w.cols});
  ks::dequantize(w.dense, w.data, w.qtype, ks::Backend::Cuda, stream());
}

void LlamaModel::matmul(const ks::TensorView& out, const ks::TensorView& x, const Weight& w, int64_t n, bool prefill) {
  if (dense_rows_ && w.dense.data() &&
      (prefill ? n >= kDenseRows : dense_decode_ && !batch_invariant_ && n >= kDenseDecodeRows)) {
    ks::gemm(out, x, w.dense, backend_, stream());
    return;
  }
  if (batch_invariant_ && on_device_ && !prefill && n >= kTensorCoreDecodeRows) {
    // the routing's choice from 4 rows (sm_90: cuda_mma_rows, for the output head from 4 rows and
    // every matrix from 8) sums in another order than the one-token step's kernels: pin a
    // per-column variant that gives their bits for this call on this thread: cuda_staged_x, or
    // where it declines (K > 2720: BackendUnavailable, raised before anything launches)
    // cuda_warp_per_column_m16 from 8 rows (it declines fewer), else cuda_warp_per_column; then
    // the caller's own pin, if any, is put back. Dense weights (F32 / F16 / BF16): only
    // cuda_warp_per_column takes them (its dense kernel sums a row alike at every M).
    const bool dense = w.qtype == ks::QType::F32 || w.qtype == ks::QType::F16 || w.qtype == ks::QType::BF16;
    ScopedPin pin("quant_matmul", dense ? "cuda_warp_per_column" : "cuda_staged_x");
    try {
      ks::quant_matmul(out, x, w.data, w.qtype, backend_, stream());
    } catch (const ks::BackendUnavailable&) {
      ks::force_variant("quant_matmul", n >= 8 ? "cuda_warp_per_column_m16" : "cuda_warp_per_column");
      ks::quant_matmul(out, x, w.data, w.qtype, backend_, stream());
    }
    return;
  }
  if (dense_rows_ && !w.dense.data() && prefill && n >= kScratchDenseRows &&
      size_t(w.rows * w.cols) * sizeof(float) <= dense_scratch_.bytes()) {
    // the same FP32 values, dequantized now into the scratch (stream order keeps it safe to reuse)
    const ks::TensorView d = dense_scratch_.view(ks::DType::F32, {w.rows, w.cols});
    ks::dequantize(d, w.data, w.qtype, ks::Backend::Cuda, stream());
    ks::gemm(out, x, d, backend_, stream());
    return;
  }
  ks::quant_matmul(out, x, w.data, w.qtype, backend_, stream());
}

namespace {
// The environment variable `name` as a whole number in [0, most] (digits only; unset or empty:
// fallback); anything else throws ks::InvalidArgument naming it and the unit.
int64_t env_whole_number(const char* name, int64_t fallback, int64_t most, const char* unit) {
  const char* e = std::getenv(name);
  if (!e || !*e) return fallback;
  int64_t v = 0;
  bool ok = true;
  for (const char* c = e; *c && ok; ++c) {
    ok = *c >= '0' && *c <= '9';
    v = ok ? v * 10 + (*c - '0') : v;
    ok = ok && v <= most;
  }
  if (!ok)
    throw ks::InvalidArgument(KS_ERROR_INVALID_ARGUMENT, std::string("LlamaModel: ") + name + "='" + e +
                                                             "' is not a whole number of " + unit + " in [0, " +
                                                             std::to_string(most) + "]");
  return v;
}

// KS_MODEL_ABLATE's parts, bit i of LlamaModel::ablate_ for part i
constexpr const char* kAblateParts[] = {"qkv", "attention", "oproj", "gateup", "down", "head"};
int ablate_index(std::string_view part) {
  for (int i = 0; i < int(std::size(kAblateParts)); ++i)
    if (part == kAblateParts[i]) return i;
  return -1;
}
}  // namespace

bool LlamaModel::ablated(const char* part) const {
  const int i = ablate_index(part);
  return i >= 0 && ((ablate_ >> i) & 1u);
}

LlamaModel::LlamaModel(const GgufFile& f, int64_t max_context, ks::Backend backend, int64_t max_batch)
    : cfg_(LlamaConfig::from_gguf(f)), backend_(backend), max_batch_(max_batch) {
  if (max_context <= 0) throw ks::InvalidArgument(KS_ERROR_INVALID_ARGUMENT, "LlamaModel: max_context must be > 0");
  if (max_batch <= 0) throw ks::InvalidArgument(KS_ERROR_INVALID_ARGUMENT, "LlamaModel: max_batch must be > 0");
  on_device_ = backend == ks::Backend::Cuda;
  if (const char* e = std::getenv("KS_MODEL_FUSE")) fuse_decode_ = std::string(e) != "0";
  if (const char* e = std::getenv("KS_MODEL_BATCH_INVARIANT")) batch_invariant_ = std::string(e) == "1";
  if (const char* e = std::getenv("KS_MODEL_DENSE_DECODE")) dense_decode_ = std::string(e) == "1";
  if (const char* e = std::getenv("KS_MODEL_SPLIT_HEAD")) split_head_ = std::string(e) == "1";
  if (const char* e = std::getenv("KS_MODEL_BATCH_SILU_FUSE")) batch_silu_fuse_ = std::string(e) == "1";
  if (const char* e = std::getenv("KS_MODEL_FUSE_ATTN")) fuse_attn_ = std::string(e) == "1";
  if (const char* e = std::getenv("KS_MODEL_ATTN_PREWAIT")) attn_prewait_ = std::string(e) != "0";
  if (const char* e = std::getenv("KS_MODEL_ABLATE")) {  // parsed once into ablate_'s bits
    const std::string list = e;
    for (size_t i = 0; i <= list.size();) {  // (empty items, as in "head,," or "", name nothing)
      const size_t j = std::min(list.find(',', i), list.size());
      const std::string part = list.substr(i, j - i);
      const int bit = ablate_index(part);
      if (!part.empty() && bit < 0)
        throw ks::InvalidArgument(KS_ERROR_INVALID_ARGUMENT,
                                  "LlamaModel: KS_MODEL_ABLATE names '" + part + "'; known: qkv, attention, oproj, gateup, down, head");
      if (bit >= 0) ablate_ |= 1u << bit;
      i = j + 1;
    }
    if (ablate_ != 0)
      std::fprintf(stderr, "[model] KS_MODEL_ABLATE=%s: the one-token step leaves these kernels out (timing only; the outputs are wrong)\n", e);
  }
  fuse_rope_ = on_device_ && !fuse_attn_;  // (KS_MODEL_FUSE_ATTN=1 rotates in the attention's kernel)
  // "0" / "1" only, as the README's table says (another value, set but empty included, keeps the
  // default: before, any value but "1" turned the default fusion off)
  if (const char* e = std::getenv("KS_MODEL_FUSE_ROPE"); e && (std::string(e) == "0" || std::string(e) == "1"))
    fuse_rope_ = e[0] == '1';
  chain_steps_ = env_whole_number("KS_MODEL_DECODE_STEPS", kDecodeSteps, kMaxDecodeSteps, "steps");
  if (on_device_) stream_ = std::make_unique<DeviceStream>();
  max_ctx_ = std::min(max_context, cfg_.context_length);
  blocks_per_seq_ = (max_ctx_ + block_size_ - 1) / block_size_;
  {  // the attention tables' capacities: bucket, 2 bucket, 4 bucket, ... then max_context
    const int64_t bucket = env_whole_number("KS_MODEL_ATTN_BUCKET", kAttnBucket, int64_t(1) << 30, "tokens");
    attn_headroom_ = std::max<int64_t>(1, env_whole_number("KS_MODEL_ATTN_HEADROOM", kAttnHeadroom, 64, "times"));
    // (whole blocks: the kernels see a table's width in blocks)
    const int64_t whole = blocks_per_seq_ * block_size_;
    for (int64_t t = bucket; t > 0 && t < max_ctx_; t *= 2) {
      const int64_t r = (t + block_size_ - 1) / block_size_ * block_size_;
      if (r < whole && (table_tokens_.empty() || r > table_tokens_.back())) table_tokens_.push_back(r);
    }
    table_tokens_.push_back(whole);
  }
  // FP32 copies of the matrices for steps of many rows (CUDA): held when they fit the budget,
  // else (prefill only) dequantized per step into one scratch buffer of the largest matrix
  bool hold_dense = false;
  // (KS_DENSE_WEIGHTS_MB: a whole number of MB, checked on every backend as the other model switches)
  const int64_t budget_mb = env_whole_number("KS_DENSE_WEIGHTS_MB", 1024, int64_t(1) << 30, "MB");
  // an FP32 copy of the output head is of use only to decode_batch steps of >= kDenseDecodeRows rows
  // under KS_MODEL_DENSE_DECODE=1
  const bool dense_head = dense_decode_ && max_batch_ >= kDenseDecodeRows && !batch_invariant_;
  if (on_device_ && max_ctx_ >= kDenseRows) {
    const auto& k = cfg_;
    const int64_t kvd = k.num_kv_heads * k.head_dim;
    const int64_t per_layer = 2 * k.hidden_size * k.hidden_size + 2 * kvd * k.hidden_size +
                              3 * k.intermediate_size * k.hidden_size;  // q, o; k, v; gate|up, down
    dense_rows_ = true;
    const double elems =
        double(per_layer) * double(k.n_layers) + (dense_head ? double(k.vocab_size) * double(k.hidden_size) : 0.0);
    hold_dense = elems * 4.0 <= double(budget_mb) * 1048576.0;  // the layers' matrices (and the output head)
    if (!hold_dense && max_ctx_ >= kScratchDenseRows) {  // the scratch serves prefill steps of >= 64 rows only
      const int64_t largest = std::max({k.hidden_size * k.hidden_size, kvd * k.hidden_size,
                                        2 * k.intermediate_size * k.hidden_size});
      dense_scratch_ = DeviceArray(size_t(largest) * sizeof(float));
    }
  }
  num_blocks_ = blocks_per_seq_ * max_batch_;
  const auto& c = cfg_;
  const int64_t kv_dim = c.num_kv_heads * c.head_dim;
  tok_embd_ = matrix(f, "token_embd.weight", c.vocab_size, c.hidden_size);
  out_norm_ = norm(f, "output_norm.weight", c.hidden_size);
  const bool tied = !f.tensor("output.weight");
  lm_head_ = tied ? tok_embd_ : matrix(f, "output.weight", c.vocab_size, c.hidden_size);
  layers_.resize(size_t(c.n_layers));
  for (int64_t l = 0; l < c.n_layers; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    Layer& L = layers_[size_t(l)];
    L.attn_norm = upload(norm(f, p + "attn_norm.weight", c.hidden_size));
    L.ffn_norm = upload(norm(f, p + "ffn_norm.weight", c.hidden_size));
    const Weight wq = matrix(f, p + "attn_q.weight", c.hidden_size, c.hidden_size);
    const Weight wk = matrix(f, p + "attn_k.weight", kv_dim, c.hidden_size);
    const Weight wv = matrix(f, p + "attn_v.weight", kv_dim, c.hidden_size);
    L.wq = upload(wq, hold_dense);
    L.wk = upload(wk, hold_dense);
    L.wv = upload(wv, hold_dense);
    // q | k | v rows stacked, for one matmul per one-token step (decode); each output row
    // is computed exactly as by the separate matrices (same row, same K)
    if (wq.qtype == wk.qtype && wq.qtype == wv.qtype && wq.data.size(1) == wk.data.size(1) &&
        wq.data.size(1) == wv.data.size(1)) {
      const size_t bq = wq.data.nbytes(), bk = wk.data.nbytes(), bv = wv.data.nbytes();
      std::vector<uint8_t>& qkv = owned_.emplace_back(bq + bk + bv);
      std::memcpy(qkv.data(), wq.data.data(), bq);
      std::memcpy(qkv.data() + bq, wk.data.data(), bk);
      std::memcpy(qkv.data() + bq + bk, wv.data.data(), bv);
      Weight w = wq;
      w.rows = c.hidden_size + 2 * kv_dim;
      w.data = ks::TensorView(qkv.data(), ks::DType::U8, {w.rows, wq.data.size(1)});
      L.w_qkv = upload(w);
    }
    L.wo = upload(matrix(f, p + "attn_output.weight", c.hidden_size, c.hidden_size), hold_dense);
    L.w_down = upload(matrix(f, p + "ffn_down.weight", c.hidden_size, c.intermediate_size), hold_dense);
    // gate and up rows stacked into one [2 * intermediate, hidden] matrix, so one
    // quant_matmul yields rows laid out as silu_and_mul expects (gate | up).
    Weight g = matrix(f, p + "ffn_gate.weight", c.intermediate_size, c.hidden_size);
    Weight u = matrix(f, p + "ffn_up.weight", c.intermediate_size, c.hidden_size);
    if (g.qtype != u.qtype) throw GgufError(p + "ffn_gate and ffn_up must share a block format");
    std::vector<uint8_t>& buf = owned_.emplace_back(g.data.nbytes() + u.data.nbytes());
    std::memcpy(buf.data(), g.data.data(), g.data.nbytes());
    std::memcpy(buf.data() + g.data.nbytes(), u.data.data(), u.data.nbytes());
    Weight gu = g;
    gu.rows = 2 * c.intermediate_size;
    gu.data = ks::TensorView(buf.data(), ks::DType::U8, {2 * c.intermediate_size, g.data.size(1)});
    L.w_gate_up = upload(gu, hold_dense);
    L.k_cache = alloc(ks::DType::F32, {num_blocks_, block_size_, c.num_kv_heads, c.head_dim});
    L.v_cache = alloc(ks::DType::F32, {num_blocks_, block_size_, c.num_kv_heads, c.head_dim});
  }
  qkv_fused_ = std::all_of(layers_.begin(), layers_.end(), [](const Layer& L) { return L.w_qkv.rows > 0; });
  tok_embd_ = upload(tok_embd_);
  out_norm_ = upload(out_norm_);
  lm_head_ = tied ? tok_embd_ : upload(lm_head_);
  if (hold_dense && dense_head) add_dense(lm_head_);  // (prefill computes one row's logits: quant_matmul)
  std::vector<std::vector<int32_t>> tables;  // (kept until the copies are done)
  for (const int64_t tokens : table_tokens_) {
    const int64_t w = (tokens + block_size_ - 1) / block_size_;
    std::vector<int32_t>& table = tables.emplace_back(static_cast<size_t>(max_batch_ * w));
    for (int64_t s = 0; s < max_batch_; ++s)  // sequence s: its own blocks
      for (int64_t b = 0; b < w; ++b) table[size_t(s * w + b)] = int32_t(s * blocks_per_seq_ + b);
    Buffer& t = tables_.emplace_back(alloc(ks::DType::I32, {max_batch_, w}));
    if (on_device_)
      stream_->to_device(t.view.data(), table.data(), table.size() * 4);
    else
      std::memcpy(t.view.data(), table.data(), table.size() * 4);
  }
  if (on_device_) stream_->sync();  // the staging vectors (owned_, tables) outlive the copies from here on
  logits_ = ks::Tensor(ks::DType::F32, {max_batch_, c.vocab_size});
  if (on_device_) {
    logits_dev_ = alloc(ks::DType::F32, {max_batch_, c.vocab_size});
    next_id_ = alloc(ks::DType::I64, {max_batch_});
    owned_.clear();  // the merged gate|up matrices now live on the device
  }
}

namespace {
// Where a step's inputs sit in the CUDA step block (LlamaModel::step_dev_ / step_host_): the
// slots (int64), then the ids, positions, sequence ids and lengths (int32), each on a 16-byte
// boundary, for a step of `cap` rows (the block is sized for the capacity).
struct StepLayout {
  size_t slots, ids, pos, seq, lens, bytes;
};
StepLayout step_layout(int64_t cap) {
  auto up = [](size_t b) { return (b + 15) & ~size_t(15); };
  const size_t s8 = up(size_t(cap) * 8), s4 = up(size_t(cap) * 4);
  return StepLayout{0, s8, s8 + s4, s8 + 2 * s4, s8 + 3 * s4, s8 + 4 * s4};
}
// decode_greedy's blocks for graphs of up to k chained steps. On the device (chain_dev_): the
// ids (int64 [k]) from 0, then from `steps` each step's inputs in kChainStepBytes: the slot
// (int64), then the position, sequence id and length (int32). On the host (chain_host_,
// pinned): two sets of staged step inputs (in(p), the device layout's step part), two sets of
// copied-out ids (out(p)) and the first id (int64).
constexpr size_t kChainStepBytes = 32;
// One step's inputs at b, in that layout.
void put_chain_step(char* b, int64_t slot, int64_t pos, int64_t seq, int64_t len) {
  const int32_t v[3] = {int32_t(pos), int32_t(seq), int32_t(len)};
  std::memcpy(b, &slot, 8);
  std::memcpy(b + 8, v, 12);
}
struct ChainLayout {
  size_t k;
  size_t steps() const { return k * 8; }
  size_t dev_bytes() const { return k * (8 + kChainStepBytes); }
  size_t in(int p) const { return size_t(p) * k * kChainStepBytes; }
  size_t out(int p) const { return 2 * k * kChainStepBytes + size_t(p) * k * 8; }
  size_t first() const { return 2 * k * (kChainStepBytes + 8); }
  size_t host_bytes() const { return first() + 8; }
};
}  // namespace

void LlamaModel::ensure_capacity(int64_t n) {
  if (n <= cap_) return;
  const auto& c = cfg_;
  const int64_t kv_dim = c.num_kv_heads * c.head_dim;
  if (stream_) {
    stream_->sync();
    drop_graphs();  // they point into the buffers replaced below
  }
  x_ = alloc(ks::DType::F32, {n, c.hidden_size});
  res_ = alloc(ks::DType::F32, {n, c.hidden_size});
  res2_ = alloc(ks::DType::F32, {n, c.hidden_size});  // the fused decode's second residual buffer
  h_ = alloc(ks::DType::F32, {n, c.hidden_size});
  q_ = alloc(ks::DType::F32, {n, c.hidden_size});
  k_ = alloc(ks::DType::F32, {n, kv_dim});
  v_ = alloc(ks::DType::F32, {n, kv_dim});
  qkv_ = alloc(ks::DType::F32, {1, c.hidden_size + 2 * kv_dim});  // one-token steps only
  attn_ = alloc(ks::DType::F32, {n, c.hidden_size});
  gu_ = alloc(ks::DType::F32, {n, 2 * c.intermediate_size});
  act_ = alloc(ks::DType::F32, {n, c.intermediate_size});
  // the step inputs' block (stage_rows lays each step out in it): on CUDA a pinned host block
  // and its device twin, one copy per step; on the CPU a host block the kernels read directly
  const size_t bytes = step_layout(n).bytes;
  if (on_device_) {
    DeviceArray d(bytes);  // (every allocation first: a failure leaves the old blocks in place)
    PinnedArray h(bytes), ids(size_t(n) * 8);
    step_dev_ = std::move(d);
    step_host_ = std::move(h);
    next_host_ = std::move(ids);
  } else {
    step_cpu_.assign(bytes / 8, 0);
  }
  cap_ = n;
}

int LlamaModel::table_for(int64_t len) const {
  const int64_t want = std::min(len * attn_headroom_, table_tokens_.back());
  int t = 0;
  while (size_t(t + 1) < table_tokens_.size() && table_tokens_[size_t(t)] < want) ++t;
  return t;
}

void LlamaModel::drop_graphs() {
  step_graphs_.clear();
  chain_graphs_.clear();
}

bool LlamaModel::decode_greedy_prepared() const {
  for (const auto& g : chain_graphs_)
    if (!g[0].empty()) return true;
  return false;
}

void LlamaModel::stage_rows(const int32_t* tokens, const int64_t* seq, const int64_t* pos, int64_t n) {
  // Per row: the token, its position, its sequence, the keys it sees (causal: 0..pos) and its
  // cache slot (the sequence's own blocks), laid out for n rows in the step block (the same
  // addresses for every step of n rows, so a graph captured for n replays with them). On
  // CUDA the pinned block goes over in one copy of just those bytes and the kernels read the
  // device twin; on the CPU they read the host block itself.
  const StepLayout L = step_layout(n);
  // an earlier step's copy may still read the pinned block (only after a step that threw: every
  // step ends in a sync)
  if (on_device_) stream_->wait_for_copies();
  char* h = on_device_ ? static_cast<char*>(step_host_.data()) : reinterpret_cast<char*>(step_cpu_.data());
  auto view = [&](ks::DType dt, size_t off) {
    return on_device_ ? step_dev_.view(dt, {n}, off) : ks::TensorView(h + off, dt, {n});
  };
  slots_.view = view(ks::DType::I64, L.slots);
  ids_.view = view(ks::DType::I32, L.ids);
  pos_.view = view(ks::DType::I32, L.pos);
  seq_ids_.view = view(ks::DType::I32, L.seq);
  ctx_lens_.view = view(ks::DType::I32, L.lens);
  auto* slots = reinterpret_cast<int64_t*>(h + L.slots);
  auto* ids = reinterpret_cast<int32_t*>(h + L.ids);
  auto* p = reinterpret_cast<int32_t*>(h + L.pos);
  auto* sq = reinterpret_cast<int32_t*>(h + L.seq);
  auto* lens = reinterpret_cast<int32_t*>(h + L.lens);
  int64_t longest = 0;
  for (int64_t i = 0; i < n; ++i) {
    slots[i] = slot_of(seq[i], pos[i]);
    ids[i] = tokens[i];
    p[i] = int32_t(pos[i]);
    sq[i] = int32_t(seq[i]);
    lens[i] = int32_t(pos[i] + 1);
    longest = std::max(longest, pos[i] + 1);
  }
  table_ = table_for(longest);
  if (on_device_) stream_->to_device(step_dev_.data(), step_host_.data(), L.bytes);
}

void LlamaModel::run_layers(int64_t n, bool all_rows, bool prefill) {
  const auto& c = cfg_;
  const auto be = backend_;
  const ks_stream_t s = stream();
  const int64_t H = c.hidden_size, kv_dim = c.num_kv_heads * c.head_dim;
  // The step's first n rows of a buffer sized for the most rows (ensure_capacity: [rows, cols]) or
  // of a step input (TensorView::slice checks n against the rows there)
  auto rows = [n](const Buffer& t) { return t.view.slice(0, n); };
  const ks::TensorView ids = rows(ids_), positions = rows(pos_);
  // h holds the normalized input of the current sub-block and x the sub-block's
  // output; they trade buffers each layer so no copy is needed.
  ks::TensorView x = rows(x_), h = rows(h_);
  // One-token steps take q, k and v from one matmul: consecutive slices of a qkv row.
  const bool fused_qkv = n == 1 && qkv_fused_;
  auto part = [&](int64_t col, int64_t cols) {
    return ks::TensorView(static_cast<float*>(qkv_.view.data()) + col, ks::DType::F32, {1, cols},
                          qkv_.view.device());
  };
  const ks::TensorView res = rows(res_), attn = rows(attn_), gu = rows(gu_), act = rows(act_);
  const ks::TensorView q = fused_qkv ? part(0, H) : rows(q_), k = fused_qkv ? part(H, kv_dim) : rows(k_),
                       v = fused_qkv ? part(H + kv_dim, kv_dim) : rows(v_);
  const ks::TensorView q3 = q.reshape({n, c.num_heads, c.head_dim}), k3 = k.reshape({n, c.num_kv_heads, c.head_dim}),
                       v3 = v.reshape({n, c.num_kv_heads, c.head_dim}),
                       attn3 = attn.reshape({n, c.num_heads, c.head_dim});
  const float scale = 1.0f / std::sqrt(float(c.head_dim));
  const ks::TensorView slots = rows(slots_), seq_ids = rows(seq_ids_), ctx_lens = rows(ctx_lens_);
  // layer l's attention of q3 over its cache, into attn3. after_append: right after the kernel
  // that appended each row's new key (a decode step: every row the newest token of its own
  // sequence), so the call promises that kernel wrote only each row's last key
  // (paged_attention_after_append, fresh_keys 1: the older keys may be read while it ends;
  // KS_MODEL_ATTN_PREWAIT=0: no promise, for comparisons)
  auto attention = [&](const Layer& L, bool after_append) {
    ks::paged_attention_after_append(attn3, q3, L.k_cache.view, L.v_cache.view, tables_[size_t(table_)].view, seq_ids,
                                     ctx_lens, scale, after_append && attn_prewait_ ? 1 : 0, be, s);
  };
  // RoPE on q3 and k3, their append (k3, v3) to layer l's cache, then the attention: one call
  // (fused; a decode step only: every row is the newest token of its own sequence) or two
  auto rope_append_attention = [&](const Layer& L, bool fused) {
    if (fused) {
      ks::rotary_embedding_kv_append_paged_attention(attn3, q3, k3, v3, positions, c.rotary_dim, c.rope_theta,
                                                     /*is_neox=*/false, L.k_cache.view, L.v_cache.view, slots,
                                                     tables_[size_t(table_)].view, seq_ids, ctx_lens, scale, be, s);
    } else {
      ks::rotary_embedding_kv_append(q3, k3, v3, positions, c.rotary_dim, c.rope_theta, /*is_neox=*/false,
                                     L.k_cache.view, L.v_cache.view, slots, be, s);
      attention(L, true);
    }
  };

  ks::embedding(res, ids, tok_embd_.data, tok_embd_.qtype, be, s);
  // The last row's logits (a sequence's step), or every row's (decode_batch).
  const int64_t first = all_rows ? 0 : n - 1, m = all_rows ? n : 1;
  const ks::TensorView logits = (on_device_ ? logits_dev_.view : logits_.view()).slice(0, m);
  if (fused_qkv && fuse_decode_) {
    // One-token step, 5 kernels per layer on CUDA: [norm -> qkv -> rope + kv append] [attention]
    // [o proj] [add + norm -> gate|up] [silu_and_mul -> down]; 6 with KS_MODEL_FUSE_ROPE=0 (and
    // on the CPU): [norm -> qkv] [rope + kv append] and the rest (the same bits). The
    // residual stream alternates between res and res2 (the fused op writes x + residual to a
    // second buffer).
    ks::TensorView r = res, r_next = rows(res2_);
    const ks::TensorView none;
    for (int64_t l = 0; l < c.n_layers; ++l) {
      Layer& L = layers_[size_t(l)];
      if (ablated("qkv")) {
      } else if (fuse_rope_) {  // [norm -> qkv -> rope + kv append]
        ks::fused_add_rms_norm_quant_matmul_rope_kv_append(
            qkv_.view, l == 0 ? none : r_next, l == 0 ? none : x, r, L.attn_norm.data, c.rms_eps, L.w_qkv.data,
            L.w_qkv.qtype, c.num_heads, c.num_kv_heads, positions, c.rotary_dim, c.rope_theta, /*is_neox=*/false,
            L.k_cache.view, L.v_cache.view, slots, be, s);
      } else {
        ks::fused_add_rms_norm_quant_matmul(qkv_.view, l == 0 ? none : r_next, l == 0 ? none : x, r,
                                            L.attn_norm.data, c.rms_eps, L.w_qkv.data, L.w_qkv.qtype, be, s);
      }
      if (l > 0) std::swap(r, r_next);  // (the RoPE step reads neither)
      if (ablated("attention")) {
      } else if (fuse_rope_) {
        attention(L, true);
      } else {
        rope_append_attention(L, fuse_attn_);
      }
      if (!ablated("oproj")) ks::quant_matmul(x, attn, L.wo.data, L.wo.qtype, be, s);
      if (!ablated("gateup"))
        ks::fused_add_rms_norm_quant_matmul(gu, r_next, x, r, L.ffn_norm.data, c.rms_eps, L.w_gate_up.data,
                                            L.w_gate_up.qtype, be, s);
      std::swap(r, r_next);
      if (!ablated("down")) ks::silu_and_mul_quant_matmul(x, gu, L.w_down.data, L.w_down.qtype, be, s);
    }
    if (ablated("head")) {
    } else if (split_head_) {  // the final norm, then the output head through quant_matmul's own routing
      const ks::TensorView x_out = x.slice(first, m), res_out = r.slice(first, m);
      ks::fused_add_rms_norm(x_out, res_out, out_norm_.data, c.rms_eps, be, s);
      ks::quant_matmul(logits, x_out, lm_head_.data, lm_head_.qtype, be, s);
    } else {
      ks::fused_add_rms_norm_quant_matmul(logits, r_next.slice(first, m), x.slice(first, m), r.slice(first, m),
                                          out_norm_.data, c.rms_eps, lm_head_.data, lm_head_.qtype, be, s);
    }
    return;
  }
  for (int64_t l = 0; l < c.n_layers; ++l) {
    Layer& L = layers_[size_t(l)];
    if (l == 0) {
      ks::rms_norm(h, res, L.attn_norm.data, c.rms_eps, be, s);
    } else {  // res += x (previous block's output); h = rms_norm(res)
      ks::fused_add_rms_norm(x, res, L.attn_norm.data, c.rms_eps, be, s);
      std::swap(h, x);
    }
    if (fused_qkv) {
      ks::quant_matmul(qkv_.view, h, L.w_qkv.data, L.w_qkv.qtype, be, s);
    } else {
      matmul(q, h, L.wq, n, prefill);
      matmul(k, h, L.wk, n, prefill);
      matmul(v, h, L.wv, n, prefill);
    }
    // GGUF stores Q/K permuted for the interleaved (GPT-J) pairing. A decode step (one token per
    // sequence) runs RoPE and the append as one kernel, or (KS_MODEL_FUSE_ATTN=1) all three; a
    // prefill's tokens read each other's new keys, so not there.
    if (!prefill && fuse_decode_) {
      rope_append_attention(L, /*fused=*/fuse_attn_);
    } else {
      ks::rotary_embedding(q3, k3, positions, c.rotary_dim, c.rope_theta, /*is_neox=*/false, be, s);
      ks::kv_cache_append(L.k_cache.view, L.v_cache.view, k3, v3, slots, be, s);
      attention(L, false);
    }
    matmul(x, attn, L.wo, n, prefill);
    ks::fused_add_rms_norm(x, res, L.ffn_norm.data, c.rms_eps, be, s);  // res += attn out; x = norm
    matmul(gu, x, L.w_gate_up, n, prefill);
    // (KS_MODEL_BATCH_SILU_FUSE=1, experiments) one kernel: silu_and_mul_quant_matmul's
    // cuda_mma_rows, pinned for this call (no routing cell yet); the same bits as silu_and_mul
    // then quant_matmul's cuda_mma_rows, which the routing takes from 8 rows. Where it declines
    // (e.g. below sm_80: nothing launched), the two calls.
    auto fused_silu_down = [&] {
      if (!(batch_silu_fuse_ && on_device_ && !prefill && n >= 8 && !batch_invariant_ && !dense_decode_)) return false;
      ScopedPin pin("silu_and_mul_quant_matmul", "cuda_mma_rows");
      try {
        ks::silu_and_mul_quant_matmul(x, gu, L.w_down.data, L.w_down.qtype, be, s);
        return true;
      } catch (const ks::BackendUnavailable&) {
        return false;
      }
    };
    if (!fused_silu_down()) {
      ks::silu_and_mul(act, gu, be, s);
      matmul(x, act, L.w_down, n, prefill);
    }
  }
  const ks::TensorView x_out = x.slice(first, m), res_out = res.slice(first, m);
  ks::fused_add_rms_norm(x_out, res_out, out_norm_.data, c.rms_eps, be, s);
  matmul(logits, x_out, lm_head_, m, prefill);
}

void LlamaModel::check_positions(const char* what, int64_t n, int64_t pos) const {
  if (n <= 0 || pos < 0 || pos + n > max_ctx_)
    throw ks::InvalidArgument(KS_ERROR_INVALID_ARGUMENT, std::string("LlamaModel::") + what + ": positions [" +
                                                             std::to_string(pos) + ", " + std::to_string(pos + n) +
                                                             ") exceed the context of " + std::to_string(max_ctx_));
}

const float* LlamaModel::forward(const int32_t* tokens, int64_t n, int64_t pos) {
  return forward_seq(0, tokens, n, pos);
}

int32_t LlamaModel::forward_argmax(const int32_t* tokens, int64_t n, int64_t pos) {
  return forward_argmax_seq(0, tokens, n, pos);
}

namespace {
void check_seq(const char* what, int64_t seq, int64_t max_batch) {
  if (seq < 0 || seq >= max_batch)
    throw ks::InvalidArgument(KS_ERROR_INVALID_ARGUMENT, std::string("LlamaModel::") + what + ": sequence " +
                                                             std::to_string(seq) + " is outside [0, " +
                                                             std::to_string(max_batch) + ")");
}
}  // namespace

const float* LlamaModel::forward_seq(int64_t seq, const int32_t* tokens, int64_t n, int64_t pos) {
  check_seq("forward", seq, max_batch_);
  check_positions("forward", n, pos);
  ensure_capacity(n);
  std::vector<int64_t> seqs(static_cast<size_t>(n), seq), poss(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) poss[size_t(i)] = pos + i;
  stage_rows(tokens, seqs.data(), poss.data(), n);
  run_layers(n, false, /*prefill=*/true);
  if (on_device_) {
    stream_->to_host(logits_.data<float>(), logits_dev_.view.data(), size_t(cfg_.vocab_size) * 4);
    stream_->sync();
  }
  return logits_.data<float>();
}

int32_t LlamaModel::forward_argmax_seq(int64_t seq, const int32_t* tokens, int64_t n, int64_t pos) {
  if (n == 1) {  // a one-token step: the batched path with one row (graph-replayed on CUDA)
    check_seq("forward_argmax", seq, max_batch_);
    check_positions("forward_argmax", n, pos);
    int32_t next = 0;
    decode_rows(tokens, &seq, &pos, 1, &next);
    return next;
  }
  const float* logits = forward_seq(seq, tokens, n, pos);
  int64_t idx = 0;
  ks::argmax(ks::TensorView(&idx, ks::DType::I64, {1}),
             ks::TensorView(const_cast<float*>(logits), ks::DType::F32, {1, cfg_.vocab_size}), ks::Backend::Cpu);
  return int32_t(idx);
}

void LlamaModel::decode_batch(const int32_t* tokens, const int64_t* positions, int64_t b, int32_t* next_ids) {
  if (b <= 0 || b > max_batch_)
    throw ks::InvalidArgument(KS_ERROR_INVALID_ARGUMENT, "LlamaModel::decode_batch: b = " + std::to_string(b) +
                                                             " is outside [1, " + std::to_string(max_batch_) + "]");
  std::vector<int64_t> seqs(static_cast<size_t>(b));
  for (int64_t i = 0; i < b; ++i) {
    check_positions("decode_batch", 1, positions[i]);
    seqs[size_t(i)] = i;
  }
  decode_rows(tokens, seqs.data(), positions, b, next_ids);
}

// One token for each of b rows (row i: sequence seq[i] at pos[i]); greedy ids out. On CUDA
// the step (layers + argmax) is captured once per row count after a first eager run, and
// replayed: the tokens, positions, sequence ids, lengths and slots are read from device
// buffers that stage_rows has just written (ordered on the stream).
void LlamaModel::decode_rows(const int32_t* tokens, const int64_t* seq, const int64_t* pos, int64_t b,
                             int32_t* next_ids) {
  ensure_capacity(b);
  stage_rows(tokens, seq, pos, b);
  if (!on_device_) {
    batch_ids_.resize(size_t(b));
    run_layers(b, true);
    ks::argmax(ks::TensorView(batch_ids_.data(), ks::DType::I64, {b}), logits_.view().slice(0, b), backend_);
  } else {
    auto step = [&] {
      run_layers(b, true);
      ks::argmax(next_id_.view.slice(0, b), logits_dev_.view.slice(0, b), ks::Backend::Cuda, stream());
    };
    const int t = table_;  // (stage_rows': the step's longest context)
    auto held = std::find_if(step_graphs_.begin(), step_graphs_.end(),
                             [&](const StepGraph& g) { return g.rows == b && g.table == t; });
    if (held != step_graphs_.end()) {
      stream_->replay(held->graph);
    } else {
      step();  // eager first: every kernel loaded and configured outside a capture
      step_graphs_.push_back(StepGraph{b, t, stream_->capture_graph(step)});
    }
    stream_->to_host(next_host_.data(), next_id_.view.data(), size_t(b) * 8);
    stream_->sync();
  }
  const int64_t* got = on_device_ ? static_cast<const int64_t*>(next_host_.data()) : batch_ids_.data();
  for (int64_t i = 0; i < b; ++i) next_ids[i] = int32_t(got[i]);
}

// Step j of a graph of k chained steps (CUDA, one row): the layers on step j's inputs in
// chain_dev_, embedding id j, and the argmax into id (j + 1) mod k, the next step's.
void LlamaModel::chain_step(int64_t j, int64_t k) {
  const ChainLayout L{size_t(chain_steps_)};
  const size_t in = L.steps() + size_t(j) * kChainStepBytes;
  ids_.view = chain_dev_.view(ks::DType::I64, {1}, size_t(j) * 8);
  slots_.view = chain_dev_.view(ks::DType::I64, {1}, in);
  pos_.view = chain_dev_.view(ks::DType::I32, {1}, in + 8);
  seq_ids_.view = chain_dev_.view(ks::DType::I32, {1}, in + 12);
  ctx_lens_.view = chain_dev_.view(ks::DType::I32, {1}, in + 16);
  run_layers(1, true);
  ks::argmax(chain_dev_.view(ks::DType::I64, {1}, size_t((j + 1) % k) * 8), logits_dev_.view.slice(0, 1),
             ks::Backend::Cuda, stream());
}

const DeviceGraph& LlamaModel::chain_graph(int t, int64_t k) {
  const int64_t K = chain_steps_;
  if (chain_graphs_.size() < tables_.size()) chain_graphs_.resize(tables_.size());
  DeviceGraph& g = chain_graphs_[size_t(t)][k == K ? 0 : 1];
  if (g.empty()) {
    // Captured without an eager step of its own: every table runs the same kernel functions (only
    // the attention's cluster size and shared memory differ, host-side launch settings), and
    // prepare_chains ran one eager step before any chained graph was made.
    table_ = t;
    g = stream_->capture_graph([&] {
      for (int64_t j = 0; j < k; ++j) chain_step(j, k);
    });
  }
  return g;
}

bool LlamaModel::chains_held(int t) const {
  return size_t(t) < chain_graphs_.size() && !chain_graphs_[size_t(t)][0].empty() &&
         (chain_steps_ == 1 || !chain_graphs_[size_t(t)][1].empty());
}

void LlamaModel::prepare_chains(int t0, int t1) {
  const int64_t K = chain_steps_;
  const ChainLayout L{size_t(K)};
  if (chain_dev_.bytes() < L.dev_bytes()) {
    DeviceArray d(L.dev_bytes());
    PinnedArray h(L.host_bytes());
    chain_graphs_.clear();  // they read the old block
    chain_dev_ = std::move(d);
    chain_host_ = std::move(h);
  }
  bool missing = false;
  for (int t = t0; t <= t1; ++t) missing = missing || !chains_held(t);
  if (!missing) return;
  // One step eagerly first (every kernel loaded and configured outside a capture): token 0 at
  // the context's last position of sequence 0, whose K/V any step there writes before reading.
  stream_->wait_for_copies();
  char* host = static_cast<char*>(chain_host_.data());
  char* dev = static_cast<char*>(chain_dev_.data());
  const int64_t last = max_ctx_ - 1;
  std::memset(host + L.first(), 0, 8);
  put_chain_step(host + L.in(0), slot_of(0, last), last, 0, 1);  // (length 1: attention reads position 0 only)
  stream_->to_device(dev, host + L.first(), 8);
  stream_->to_device(dev + L.steps(), host + L.in(0), kChainStepBytes);
  table_ = t0;
  chain_step(0, 1);
  stream_->sync();
  for (int t = t0; t <= t1; ++t) {
    // both or neither (a failure leaves none held for t, and the next call tries again)
    try {
      chain_graph(t, K);
      if (K > 1) chain_graph(t, 1);
    } catch (...) {
      if (size_t(t) < chain_graphs_.size())
        for (auto& g : chain_graphs_[size_t(t)]) g.reset();
      throw;
    }
  }
}

void LlamaModel::prepare_decode_greedy(int64_t rows, int64_t steps) {
  if (!on_device_ || chain_steps_ == 0) return;
  ensure_capacity(std::max<int64_t>(rows, 1));
  // the tables of the steps after a prompt of `rows` tokens: lengths rows + 1 .. rows + steps
  const int64_t first = std::min(std::max<int64_t>(rows, 0) + 1, max_ctx_);
  prepare_chains(table_for(first), table_for(std::min(first + std::max<int64_t>(steps, 1) - 1, max_ctx_)));
}

int64_t LlamaModel::decode_greedy(int64_t seq, int32_t first, int64_t pos, int64_t count,
                                  const std::function<bool(int32_t)>& on_token) {
  check_seq("decode_greedy", seq, max_batch_);
  if (count <= 0) return 0;
  check_positions("decode_greedy", count, pos);
  const int64_t K = on_device_ ? chain_steps_ : 0;
  if (K == 0) {  // a step at a time
    int32_t id = first;
    for (int64_t i = 0; i < count; ++i) {
      id = forward_argmax_seq(seq, &id, 1, pos + i);
      if (!on_token(id)) return i + 1;
    }
    return count;
  }
  ensure_capacity(1);
  prepare_chains(table_for(pos + 1), table_for(pos + 1));  // (a later table's graphs: made when reached)
  const ChainLayout L{size_t(K)};
  char* host = static_cast<char*>(chain_host_.data());
  char* dev = static_cast<char*>(chain_dev_.data());
  stream_->wait_for_copies();  // (chain_host_'s last reader was a copy of a call that ended in a sync)
  // step `at`'s inputs (position pos + at) into slot j of the staged set p
  auto stage = [&](int p, int64_t j, int64_t at) {
    put_chain_step(host + L.in(p) + size_t(j) * kChainStepBytes, slot_of(seq, pos + at), pos + at, seq, pos + at + 1);
  };
  *reinterpret_cast<int64_t*>(host + L.first()) = first;
  stream_->to_device(dev, host + L.first(), 8);
  int64_t queued = 0, given = 0;  // steps queued, ids given to on_token
  try {
    // Graphs of K steps while K are left (and share a table), else of one; two in flight: set
    // p = parity of the graph.
    struct Flight {
      int64_t k;
      int p;
    };
    Flight flight[2];
    int nflight = 0, p_next = 0;
    // A graph's steps share one attention table (a group that would reach into the next table
    // goes a step at a time), so each step runs the kernels a step at a time would run.
    auto enqueue = [&] {
      const int t = table_for(pos + queued + 1);
      const int64_t k = count - queued >= K && table_for(pos + queued + K) == t ? K : 1;
      const DeviceGraph& g = chain_graph(t, k);
      const int p = p_next;
      for (int64_t j = 0; j < k; ++j) stage(p, j, queued + j);
      stream_->to_device(dev + L.steps(), host + L.in(p), size_t(k) * kChainStepBytes);
      stream_->launch(g);
      stream_->to_host(host + L.out(p), dev, size_t(k) * 8);
      stream_->record(chain_done_[p]);
      flight[nflight++] = Flight{k, p};
      p_next ^= 1;
      queued += k;
    };
    while (nflight < 2 && queued < count) enqueue();
    while (nflight > 0) {
      const Flight f = flight[0];
      flight[0] = flight[1];
      --nflight;
      chain_done_[f.p].wait();
      const auto* ids = reinterpret_cast<const int64_t*>(host + L.out(f.p));
      for (int64_t j = 0; j < f.k; ++j) {  // step j's id is id (j + 1) mod k
        ++given;
        if (!on_token(int32_t(ids[(j + 1) % f.k]))) {
          stream_->sync();  // the steps already queued finish before anything else uses the buffers
          return given;
        }
      }
      if (queued < count) enqueue();
    }
  } catch (...) {
    try {
      stream_->sync();
    } catch (...) {
    }
    throw;
  }
  stream_->sync();
  return given;
}

}  // namespace ks::model
