// Text generation on top of LlamaModel: tokenizer loading, prefill + decode,
// greedy decoding (kernscope's argmax) or sampling (kernscope's sample op: temperature, top-k,
// top-p, Philox draws keyed by the seed and counted by the step).
#pragma once

#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "model/gguf.hpp"
#include "model/llama.hpp"
#include "model/tokenizer.hpp"

namespace ks::model {

// Builds the byte-level BPE tokenizer from the GGUF's tokenizer.ggml.* metadata.
Tokenizer tokenizer_from_gguf(const GgufFile& f);

// How the next id is chosen from a step's logits.
struct SamplingParams {
  float temperature = 0.0f;  // 0: greedy argmax (lowest index wins ties); > 0: ks::sample
  int64_t top_k = 0;         // 0 (or >= vocab): off
  double top_p = 1.0;        // in (0, 1]; 1: off
  uint64_t seed = 0;         // the draws' Philox key (its bits as int64)
};

struct GenerateOptions {
  int64_t max_tokens = 128;
  SamplingParams sampling;  // greedy by default; with temperature > 0 generated token i draws Philox(seed, i)
  bool stop_at_eos = true;  // stop after an end-of-sequence / end-of-turn token
};

struct GenerateStats {
  int64_t prompt_tokens = 0, generated_tokens = 0;
  double prefill_seconds = 0;      // the prompt's forward pass
  double first_token_seconds = 0;  // prompt in -> first generated token chosen
  double decode_seconds = 0;       // every later token (forward + sampling)
  const char* stop_reason = "";    // "end of turn", "max tokens" or "context full"
  double prefill_tokens_per_second() const { return prefill_seconds > 0 ? prompt_tokens / prefill_seconds : 0; }
  double decode_tokens_per_second() const {
    return decode_seconds > 0 ? double(generated_tokens - 1) / decode_seconds : 0;
  }
};

// The ids that end a reply: the tokenizer's EOS (SmolLM2: <|im_end|>) and
// <|endoftext|>. Looked up once; call it per generated id.
struct EndTokens {
  int32_t eos = -1, end_of_text = -1;
  explicit EndTokens(const Tokenizer& tok) : eos(tok.eos_id()), end_of_text(tok.find_token("<|endoftext|>")) {}
  bool operator()(int32_t id) const { return id == eos || id == end_of_text; }
};

// Picks the next token from host logits[vocab]: temperature 0: kernscope's argmax (the lowest
// index among equal maxima); else kernscope's sample op on the CPU with (temperature, top_k,
// top_p) and seed_offset {seed, step} (docs/contracts.md#sample: the same id for the same
// (seed, step) on every run and backend). A row that sample reports invalid (NaN, +inf, only
// -inf) throws ks::InvalidArgument naming the step.
int32_t sample_token(const float* logits, int64_t vocab, const SamplingParams& sp, uint64_t step,
                     ks::Backend backend = ks::Backend::Cpu);

// Runs prompt then decodes; on_token is called for each generated id in order, as soon as the
// host has it (greedy on CUDA: in groups of up to KS_MODEL_DECODE_STEPS, LlamaModel::decode_greedy).
GenerateStats generate(LlamaModel& model, const Tokenizer& tok, const std::vector<int32_t>& prompt,
                       const GenerateOptions& opt, const std::function<void(int32_t)>& on_token);

}  // namespace ks::model
