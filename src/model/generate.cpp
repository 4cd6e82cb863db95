#include "model/generate.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>

namespace ks::model {

Tokenizer tokenizer_from_gguf(const GgufFile& f) {
  const std::string model = f.get_string("tokenizer.ggml.model");
  if (model != "gpt2")
    throw GgufError("tokenizer.ggml.model is '" + model + "'; only byte-level BPE ('gpt2') is supported");
  std::vector<std::string> tokens = f.get_string_array("tokenizer.ggml.tokens");
  // The model's embedding and output rows are the ids the tokenizer must cover, one for one (as
  // llama.cpp requires): a longer vocabulary failed only when a prompt used an id past the table,
  // a shorter one only when the model produced an id past the vocabulary.
  if (const GgufTensorInfo* emb = f.tensor("token_embd.weight"); emb && emb->ne.size() == 2 && emb->ne[1] != int64_t(tokens.size()))
    throw GgufError("tokenizer.ggml.tokens has " + std::to_string(tokens.size()) + " entries but token_embd.weight has " +
                    std::to_string(emb->ne[1]) + " rows (one per token id)");
  std::vector<int32_t> types;
  if (f.find("tokenizer.ggml.token_type")) {
    const std::vector<int64_t> raw = f.get_int_array("tokenizer.ggml.token_type");
    for (size_t i = 0; i < raw.size(); ++i) {
      if (raw[i] < 0 || raw[i] > 6)  // GGUF's token types: 0 undefined .. 6 byte
        throw GgufError("tokenizer.ggml.token_type[" + std::to_string(i) + "] is " + std::to_string(raw[i]) +
                        "; expected 0 to 6");
      types.push_back(int32_t(raw[i]));
    }
  } else {
    types.assign(tokens.size(), 1);
  }
  std::vector<std::string> merges = f.get_string_array("tokenizer.ggml.merges");
  // (an id past the vocabulary is refused naming the key, not cut to 32 bits)
  const auto token_id = [&](const char* key) {
    const uint64_t v = f.get_uint(key, 0);
    if (!tokens.empty() && v >= tokens.size())  // (an empty vocabulary: the tokenizer's own message)
      throw GgufError(std::string(key) + " is " + std::to_string(v) + "; the vocabulary has " +
                      std::to_string(tokens.size()) + " tokens");
    return int32_t(v);
  };
  const int32_t bos = token_id("tokenizer.ggml.bos_token_id");
  const int32_t eos = token_id("tokenizer.ggml.eos_token_id");
  const std::string pre = f.find("tokenizer.ggml.pre") ? f.get_string("tokenizer.ggml.pre") : "default";
  return Tokenizer(std::move(tokens), std::move(types), std::move(merges), bos, eos, pre);
}

int32_t sample_token(const float* logits, int64_t vocab, const SamplingParams& sp, uint64_t step, ks::Backend be) {
  const ks::TensorView x(const_cast<float*>(logits), ks::DType::F32, {1, vocab});
  int64_t idx = 0;
  if (!(sp.temperature > 0.0f)) {  // greedy; temperature 0 never divides
    ks::argmax(ks::TensorView(&idx, ks::DType::I64, {1}), x, be);
    return int32_t(idx);
  }
  int64_t seed_offset[2];
  std::memcpy(&seed_offset[0], &sp.seed, sizeof(int64_t));  // (the seed's bits)
  seed_offset[1] = int64_t(step);
  uint8_t valid = 0;
  ks::sample(ks::TensorView(&idx, ks::DType::I64, {1}), ks::TensorView(&valid, ks::DType::U8, {1}), x,
             ks::TensorView(seed_offset, ks::DType::I64, {2}), sp.temperature, sp.top_k, sp.top_p, be);
  if (!valid) {
    // the row is invalid (the sample contract) where a logit is NaN or +inf, every one is -inf, or
    // logits / temperature overflows FP32 (a tiny temperature): name which
    bool nonfinite = false, any = false;
    for (int64_t i = 0; i < vocab; ++i) {
      nonfinite = nonfinite || std::isnan(logits[i]) || logits[i] == INFINITY;
      any = any || logits[i] > -INFINITY;
    }
    if (!nonfinite && any) {
      char t[32];
      std::snprintf(t, sizeof t, "%g", double(sp.temperature));
      throw ks::InvalidArgument(KS_ERROR_INVALID_ARGUMENT, "generate: the logits of step " + std::to_string(step) +
                                                               " divided by the temperature (" + t +
                                                               ") overflow FP32: use a larger temperature, or 0 for greedy");
    }
    throw ks::InvalidArgument(KS_ERROR_INVALID_ARGUMENT, "generate: the logits of step " + std::to_string(step) +
                                                             " hold NaN or +inf or are all -inf; nothing to sample");
  }
  return int32_t(idx);
}

GenerateStats generate(LlamaModel& model, const Tokenizer& tok, const std::vector<int32_t>& prompt,
                       const GenerateOptions& opt, const std::function<void(int32_t)>& on_token) {
  using clock = std::chrono::steady_clock;
  GenerateStats st;
  st.prompt_tokens = int64_t(prompt.size());
  if (prompt.empty()) throw ks::InvalidArgument(KS_ERROR_INVALID_ARGUMENT, "generate: the prompt has no tokens");
  const int64_t vocab = model.config().vocab_size;
  const EndTokens is_end(tok);
  // Greedy decoding asks the model for the argmax directly: the prompt's through
  // forward_argmax, every later one through decode_greedy (on CUDA: computed on the device,
  // the GPU running ahead of the host in CUDA graphs of chained steps). Sampling reads the
  // logits of each step.
  const bool greedy = !(opt.sampling.temperature > 0.0f);
  const float* logits = nullptr;
  int32_t greedy_next = 0;
  auto t0 = clock::now();
  if (greedy)
    greedy_next = model.forward_argmax(prompt.data(), int64_t(prompt.size()), 0);
  else
    logits = model.forward(prompt.data(), int64_t(prompt.size()), 0);
  auto t1 = clock::now();
  st.prefill_seconds = std::chrono::duration<double>(t1 - t0).count();
  int64_t pos = int64_t(prompt.size());  // where the next step feeds the last id
  auto t_first = t1;
  // Reports one generated id; false when generation ends with it (and why, in stop_reason).
  auto emit = [&](int32_t next) {
    if (st.generated_tokens == 0) {
      t_first = clock::now();
      st.first_token_seconds = std::chrono::duration<double>(t_first - t0).count();
    }
    ++st.generated_tokens;
    on_token(next);
    if (opt.stop_at_eos && is_end(next)) {
      st.stop_reason = "end of turn";
      return false;
    }
    if (st.generated_tokens == opt.max_tokens) {
      st.stop_reason = "max tokens";
      return false;
    }
    if (pos >= model.max_context()) {
      st.stop_reason = "context full";
      return false;
    }
    return true;
  };
  if (opt.max_tokens > 0) {
    if (greedy) {
      // as many steps as can end generation by max_tokens or the context; emit decides
      if (emit(greedy_next))
        model.decode_greedy(0, greedy_next, pos, std::min(opt.max_tokens - 1, model.max_context() - pos),
                            [&](int32_t id) {
                              ++pos;
                              return emit(id);
                            });
    } else {
      const SamplingParams& sp = opt.sampling;
      uint64_t step = 0;  // generated token i draws with offset i
      for (int32_t next = sample_token(logits, vocab, sp, step++); emit(next); next = sample_token(logits, vocab, sp, step++))
        logits = model.forward(&next, 1, pos++);
    }
  }
  st.decode_seconds = std::chrono::duration<double>(clock::now() - t_first).count();
  return st;
}

}  // namespace ks::model
