// SmolLM2-135M-Instruct end to end against the independent reference made by
// HF transformers on the H200 (scripts/make_reference.py ->
// tests/data/reference_generation.json).
//
// Rules (also in docs/contracts.md, "Model reference"):
//  * Tokenizer: our encoding of each chat-formatted prompt equals the HF ids.
//  * Greedy ids: equal to the reference's, token for token. One allowance: at a
//    step where the reference's top-1/top-2 logit margin is below kTieMargin, our
//    pick may be the reference's runner-up; the sequences then legitimately
//    diverge, and the comparison stops there. (No case needs it today.)
//  * First-step logits: our logits for the reference's top-5 ids agree within
//    kLogitAtol. Both sides dequantize the same blocks in FP32 and compute in FP32
//    (TF32 off) with different summation orders; over 30 layers that gives errors
//    of order 1e-4 on logits of magnitude ~25 (measured: see the test log), so
//    2e-3 leaves an order of magnitude of headroom while still catching any real
//    defect (a wrong RoPE pairing or norm moves logits by > 0.1).
#include <gtest/gtest.h>
#include <kernscope/kernscope.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <stdexcept>

#include "model/generate.hpp"
#include "test_util.hpp"

namespace {

constexpr double kTieMargin = 2e-3;
constexpr double kLogitAtol = 2e-3;

std::string model_path() {
  const char* p = std::getenv("KS_MODEL_PATH");
  return p ? p : "";
}

bool have_model() {
  const std::string p = model_path();
  if (p.empty() || !std::ifstream(p).good()) {
    if (std::getenv("KS_REQUIRE_MODEL")) ADD_FAILURE() << "KS_REQUIRE_MODEL is set but KS_MODEL_PATH='" << p << "' is missing";
    return false;
  }
  return true;
}

nlohmann::json reference() {
  const char* dir = std::getenv("KS_TEST_DATA");
  std::ifstream f(std::string(dir ? dir : "tests/data") + "/reference_generation.json");
  EXPECT_TRUE(f.good()) << "reference_generation.json not found (KS_TEST_DATA)";
  return nlohmann::json::parse(f);
}

struct Fixture {
  explicit Fixture(ks::Backend be = ks::Backend::Cpu) : model(file, 512, be) {}
  ks::model::GgufFile file = ks::model::GgufFile::open(model_path());
  ks::model::Tokenizer tok = ks::model::tokenizer_from_gguf(file);
  ks::model::LlamaModel model;
};

// Greedy decode of n ids after the prompt; returns the ids and the first logits.
std::vector<int32_t> greedy(Fixture& fx, const std::vector<int32_t>& prompt, size_t n, std::vector<float>* first) {
  ks::model::GenerateOptions opt;
  opt.max_tokens = int64_t(n);
  opt.stop_at_eos = false;
  std::vector<int32_t> out;
  // The first step's logits, from a prefill of the prompt (generate() repeats it,
  // writing the same cache positions).
  const float* logits = fx.model.forward(prompt.data(), int64_t(prompt.size()), 0);
  if (first) first->assign(logits, logits + fx.model.config().vocab_size);
  ks::model::generate(fx.model, fx.tok, prompt, opt, [&](int32_t id) { out.push_back(id); });
  return out;
}

void compare_ids(const std::vector<int32_t>& got, const nlohmann::json& c, const std::string& label) {
  const auto want = c["greedy_ids"].get<std::vector<int32_t>>();
  const auto margin = c["top1_top2_margin"].get<std::vector<double>>();
  ASSERT_EQ(got.size(), want.size()) << label;
  for (size_t i = 0; i < want.size(); ++i) {
    if (got[i] == want[i]) continue;
    ASSERT_LT(margin[i], kTieMargin) << label << ": first difference at step " << i << " (got " << got[i]
                                     << ", want " << want[i] << ") where the reference margin is " << margin[i];
    std::printf("%s: near-tie divergence at step %zu (margin %.5f); comparison stops\n", label.c_str(), i, margin[i]);
    return;
  }
}

TEST(Model, TokenizerMatchesReferencePromptIds) {
  if (!have_model()) GTEST_SKIP() << "set KS_MODEL_PATH (make test does)";
  Fixture fx;
  const nlohmann::json ref = reference();
  for (const auto& c : ref["cases"]) {
    const auto text = c["prompt_text"].get<std::string>();
    const auto want = c["prompt_ids"].get<std::vector<int32_t>>();
    EXPECT_EQ(fx.tok.encode(text, /*parse_special=*/true), want) << text;
    EXPECT_EQ(ks::model::apply_chat_template({{"user", c["prompt"].get<std::string>()}}), text);
  }
}

TEST(Model, GreedyIdsAndFirstLogitsMatchTransformers) {
  if (!have_model()) GTEST_SKIP() << "set KS_MODEL_PATH (make test does)";
  Fixture fx;
  double worst = 0;
  const nlohmann::json ref = reference();
  ASSERT_GE(ref["cases"].size(), 3u);
  for (const auto& c : ref["cases"]) {
    const auto prompt = c["prompt_ids"].get<std::vector<int32_t>>();
    const size_t n = c["greedy_ids"].size();
    ASSERT_GE(n, 32u) << "the reference must hold at least 32 greedy ids per prompt";
    std::vector<float> first;
    const auto got = greedy(fx, prompt, n, &first);
    compare_ids(got, c, c["prompt"].get<std::string>());
    const auto ids = c["first_step_top5"]["ids"].get<std::vector<int32_t>>();
    const auto vals = c["first_step_top5"]["logits"].get<std::vector<double>>();
    for (size_t i = 0; i < ids.size(); ++i) {
      const double d = std::fabs(first[size_t(ids[i])] - vals[i]);
      worst = std::max(worst, d);
      EXPECT_LE(d, kLogitAtol) << "logit of id " << ids[i] << ": got " << first[size_t(ids[i])] << ", want " << vals[i];
    }
  }
  std::printf("largest first-step logit difference vs transformers: %.3g\n", worst);
}

// The portable reference variants alone (fast paths pinned off) give the same
// greedy ids: the fast paths are checked against the reference, not a replacement.
TEST(Model, ReferenceVariantsGiveTheSameIds) {
  if (!have_model()) GTEST_SKIP() << "set KS_MODEL_PATH (make test does)";
  Fixture fx;
  const nlohmann::json ref = reference();
  const auto c = ref["cases"][0];
  ASSERT_EQ(ks_force_variant("quant_matmul", "cpu_reference"), KS_SUCCESS);
  ASSERT_EQ(ks_force_variant("paged_attention", "cpu_reference"), KS_SUCCESS);
  const auto prompt = c["prompt_ids"].get<std::vector<int32_t>>();
  auto got = greedy(fx, prompt, 12, nullptr);
  ASSERT_EQ(ks_force_variant(nullptr, nullptr), KS_SUCCESS);
  auto want = c["greedy_ids"].get<std::vector<int32_t>>();
  want.resize(12);
  EXPECT_EQ(got, want);
}

// Causal prefill (one call, each prompt token with its own context length)
// equals feeding the same tokens one at a time through the decode path.
TEST(Model, PrefillEqualsTokenByTokenDecode) {
  if (!have_model()) GTEST_SKIP() << "set KS_MODEL_PATH (make test does)";
  Fixture a, b;
  const nlohmann::json ref = reference();
  const auto prompt = ref["cases"][1]["prompt_ids"].get<std::vector<int32_t>>();
  const int64_t n = int64_t(prompt.size()), vocab = a.model.config().vocab_size;
  const float* la = a.model.forward(prompt.data(), n, 0);
  std::vector<float> prefill(la, la + vocab);
  const float* lb = nullptr;
  for (int64_t i = 0; i < n; ++i) lb = b.model.forward(&prompt[size_t(i)], 1, i);
  double worst = 0;
  for (int64_t v = 0; v < vocab; ++v) worst = std::max(worst, double(std::fabs(prefill[size_t(v)] - lb[v])));
  // Every variant's summation order depends only on the row length, never on how
  // many rows a call holds (docs/contracts.md), so prefill (M = n) and decode
  // (M = 1) give bitwise the same logits.
  EXPECT_EQ(worst, 0.0) << "largest logit difference between prefill and step-by-step decode";
  std::printf("prefill vs token-by-token: largest logit difference %.3g\n", worst);
}

// The CUDA path (weights, KV cache and activations on the GPU, decode steps replayed as
// one CUDA graph) gives the reference's greedy ids, its first-step logits match within
// the same tolerance, and they agree with the CPU path's logits. Skipped without a device.
TEST(Model, CudaGreedyIdsAndLogitsMatchTransformersAndCpu) {
  if (!have_model()) GTEST_SKIP() << "set KS_MODEL_PATH (make test does)";
  if (!ks_backend_available(KS_BACKEND_CUDA)) GTEST_SKIP() << "no CUDA device";
  Fixture gpu(ks::Backend::Cuda), cpu;
  const nlohmann::json ref = reference();
  double worst = 0, worst_cpu = 0;
  for (const auto& c : ref["cases"]) {
    const auto prompt = c["prompt_ids"].get<std::vector<int32_t>>();
    const size_t n = c["greedy_ids"].size();
    std::vector<float> first;
    const auto got = greedy(gpu, prompt, n, &first);
    compare_ids(got, c, "cuda: " + c["prompt"].get<std::string>());
    const auto ids = c["first_step_top5"]["ids"].get<std::vector<int32_t>>();
    const auto vals = c["first_step_top5"]["logits"].get<std::vector<double>>();
    for (size_t i = 0; i < ids.size(); ++i) {
      const double d = std::fabs(first[size_t(ids[i])] - vals[i]);
      worst = std::max(worst, d);
      EXPECT_LE(d, kLogitAtol) << "cuda logit of id " << ids[i];
    }
    const float* lc = cpu.model.forward(prompt.data(), int64_t(prompt.size()), 0);
    for (int64_t v = 0; v < cpu.model.config().vocab_size; ++v)
      worst_cpu = std::max(worst_cpu, double(std::fabs(first[size_t(v)] - lc[v])));
  }
  EXPECT_LE(worst_cpu, kLogitAtol) << "largest first-step logit difference between CUDA and CPU";
  std::printf("cuda: largest first-step logit difference vs transformers %.3g, vs the CPU path %.3g\n", worst,
              worst_cpu);
}

// KS_MODEL_ABLATE (timing experiments): an unknown or misspelt part stops the model from loading,
// naming it (no silently unablated timing run); an empty list ablates nothing (the same logits
// as without it); "head" leaves the output head out of the one-token step, so its logits stay
// what the buffer held (here the prefill's) instead of the step's.
TEST(Model, AblationSwitchIsCheckedAndLeavesPartsOut) {
  if (!have_model()) GTEST_SKIP() << "set KS_MODEL_PATH (make test does)";
  for (const char* bad : {"bogus", "head, attention", "Head"}) {
    kstest::ScopedEnv e("KS_MODEL_ABLATE", bad);
    try {
      Fixture fx;
      ADD_FAILURE() << "KS_MODEL_ABLATE=" << bad << " accepted";
    } catch (const ks::InvalidArgument& err) {
      EXPECT_NE(std::string(err.what()).find("KS_MODEL_ABLATE names"), std::string::npos) << err.what();
    }
  }
  const std::vector<int32_t> ids = {1, 2, 3, 4};
  Fixture plain;
  std::unique_ptr<Fixture> empty, head;
  {
    kstest::ScopedEnv e("KS_MODEL_ABLATE", ",,");
    empty = std::make_unique<Fixture>();
  }
  {
    kstest::ScopedEnv e("KS_MODEL_ABLATE", "head");
    head = std::make_unique<Fixture>();
  }
  const int64_t V = plain.model.config().vocab_size;
  (void)plain.model.forward(ids.data(), 3, 0);
  (void)empty->model.forward(ids.data(), 3, 0);
  const float* lh_prefill = head->model.forward(ids.data(), 3, 0);  // prefill: not the one-token step
  const std::vector<float> before(lh_prefill, lh_prefill + V);
  const float* lp = plain.model.forward(&ids[3], 1, 3);
  const std::vector<float> p(lp, lp + V);
  const float* le = empty->model.forward(&ids[3], 1, 3);
  EXPECT_EQ(std::memcmp(le, p.data(), size_t(V) * sizeof(float)), 0) << "an empty list changed the logits";
  const float* lh = head->model.forward(&ids[3], 1, 3);
  EXPECT_EQ(std::memcmp(lh, before.data(), size_t(V) * sizeof(float)), 0) << "the head ran in the one-token step";
  EXPECT_NE(std::memcmp(lh, p.data(), size_t(V) * sizeof(float)), 0);
}

// One-token steps run the fused decode (ks::fused_add_rms_norm_quant_matmul,
// ks::silu_and_mul_quant_matmul and ks::rotary_embedding_kv_append: 6 kernels per layer);
// KS_MODEL_FUSE=0 runs the unfused sequence. Fed the same tokens one at a time, both CUDA paths' logits agree with each other
// and with the CPU path's within the logit tolerance at every step (the CUDA fusions change
// only the sum-of-squares order and where the normalized row is rounded).
TEST(Model, CudaFusedDecodeStepsMatchUnfusedAndCpu) {
  if (!have_model()) GTEST_SKIP() << "set KS_MODEL_PATH (make test does)";
  if (!ks_backend_available(KS_BACKEND_CUDA)) GTEST_SKIP() << "no CUDA device";
  Fixture fused(ks::Backend::Cuda), cpu;
  // (each switch is read when the model is built)
  auto with_env = [](const char* name, const char* value) {
    kstest::ScopedEnv e(name, value);
    return std::make_unique<Fixture>(ks::Backend::Cuda);
  };
  const auto plain_p = with_env("KS_MODEL_FUSE", "0");
  const auto split_p = with_env("KS_MODEL_SPLIT_HEAD", "1");  // the fused step with the output head split off
  // the 6-kernel step (RoPE + append in a kernel of their own) against the default 5 (in the q/k/v
  // matmul's epilogue): the same bits
  const auto rope_p = with_env("KS_MODEL_FUSE_ROPE", "0");
  Fixture &plain = *plain_p, &split = *split_p, &rope_apart = *rope_p;
  const nlohmann::json ref = reference();
  const auto prompt = ref["cases"][0]["prompt_ids"].get<std::vector<int32_t>>();
  const int64_t V = cpu.model.config().vocab_size;
  double worst_plain = 0, worst_cpu = 0, worst_split = 0;
  for (size_t i = 0; i < prompt.size(); ++i) {
    const float* lf = fused.model.forward(&prompt[i], 1, int64_t(i));
    const std::vector<float> a(lf, lf + V);
    const float* lp = plain.model.forward(&prompt[i], 1, int64_t(i));
    const std::vector<float> b(lp, lp + V);
    const float* ls = split.model.forward(&prompt[i], 1, int64_t(i));
    const std::vector<float> d(ls, ls + V);
    const float* lr = rope_apart.model.forward(&prompt[i], 1, int64_t(i));
    ASSERT_EQ(std::memcmp(a.data(), lr, size_t(V) * sizeof(float)), 0)
        << "step " << i << ": KS_MODEL_FUSE_ROPE=0 (RoPE + append apart from the q/k/v matmul) changed the logits' bits";
    const float* lc = cpu.model.forward(&prompt[i], 1, int64_t(i));
    for (int64_t v = 0; v < V; ++v) {
      worst_plain = std::max(worst_plain, double(std::fabs(a[size_t(v)] - b[size_t(v)])));
      worst_split = std::max(worst_split, double(std::fabs(a[size_t(v)] - d[size_t(v)])));
      worst_cpu = std::max(worst_cpu, double(std::fabs(a[size_t(v)] - lc[v])));
    }
  }
  EXPECT_LE(worst_plain, kLogitAtol) << "fused vs unfused CUDA decode steps";
  EXPECT_LE(worst_split, kLogitAtol) << "fused vs KS_MODEL_SPLIT_HEAD=1 CUDA decode steps";
  EXPECT_LE(worst_cpu, kLogitAtol) << "fused CUDA vs CPU decode steps";
  std::printf("cuda split output head: largest logit difference vs the fused step %.3g\n", worst_split);
  std::printf("cuda fused decode over %zu one-token steps: largest logit difference vs unfused %.3g, vs the CPU %.3g\n",
              prompt.size(), worst_plain, worst_cpu);
}

// A prefill of at least LlamaModel::kDenseRows tokens takes the CUDA path's dense route
// (ks::gemm through cuBLASLt on FP32 weights) instead of quant_matmul: its logits agree with
// the CPU path's (quantized dot products) within the same tolerance, both with the FP32
// copies held from load (the default budget) and dequantized per step into one scratch
// buffer (KS_DENSE_WEIGHTS_MB=0).
namespace {
// The reference prompts' ids one after another, cyclically, until at least n (whole prompts)
std::vector<int32_t> prompts_joined(const nlohmann::json& ref, size_t n) {
  std::vector<int32_t> ids;
  for (size_t i = 0; ids.size() < n; ++i)
    for (int32_t id : ref["cases"][i % ref["cases"].size()]["prompt_ids"].get<std::vector<int32_t>>()) ids.push_back(id);
  return ids;
}
}  // namespace

TEST(Model, CudaLongPrefillMatchesCpu) {
  if (!have_model()) GTEST_SKIP() << "set KS_MODEL_PATH (make test does)";
  if (!ks_backend_available(KS_BACKEND_CUDA)) GTEST_SKIP() << "no CUDA device";
  Fixture cpu;
  const nlohmann::json ref = reference();
  // long enough for the per-step scratch path as well (KS_DENSE_WEIGHTS_MB=0: prefill of at
  // least kScratchDenseRows rows), not only for the held copies (kDenseRows)
  using LM = ks::model::LlamaModel;
  const std::vector<int32_t> prompt = prompts_joined(ref, size_t(std::max(LM::kDenseRows, LM::kScratchDenseRows)) + 7);
  const float* lc = cpu.model.forward(prompt.data(), int64_t(prompt.size()), 0);
  const std::vector<float> want(lc, lc + cpu.model.config().vocab_size);
  for (const char* budget : {"1024", "0"}) {
    SCOPED_TRACE(std::string("KS_DENSE_WEIGHTS_MB=") + budget);
    const auto gpu_p = [&] {
      kstest::ScopedEnv e("KS_DENSE_WEIGHTS_MB", budget);  // read when the model is built
      return std::make_unique<Fixture>(ks::Backend::Cuda);
    }();
    Fixture& gpu = *gpu_p;
    const float* lg = gpu.model.forward(prompt.data(), int64_t(prompt.size()), 0);
    double worst = 0;
    for (int64_t v = 0; v < cpu.model.config().vocab_size; ++v)
      worst = std::max(worst, double(std::fabs(lg[v] - want[size_t(v)])));
    EXPECT_LE(worst, kLogitAtol) << "prefill of " << prompt.size() << " tokens: CUDA (dense) vs CPU logits";
    std::printf("cuda dense prefill of %zu tokens (KS_DENSE_WEIGHTS_MB=%s): largest logit difference vs the CPU path %.3g\n",
                prompt.size(), budget, worst);
  }
}

namespace {
// B sequences (the reference prompts, cyclically) decoded `steps` tokens at once with
// decode_batch (one row per sequence, each at its own position, with its own cache blocks)
// give the ids each gets decoded alone.
void expect_batched_ids_equal_alone(ks::Backend be, int64_t B, int64_t steps) {
  const nlohmann::json ref = reference();
  ks::model::GgufFile file = ks::model::GgufFile::open(model_path());
  ks::model::LlamaModel batched(file, 256, be, B), alone(file, 256, be, 1);
  std::vector<std::vector<int32_t>> prompts, want(static_cast<size_t>(B));
  const size_t cases = ref["cases"].size();
  for (int64_t s = 0; s < B; ++s)
    prompts.push_back(ref["cases"][size_t(s) % cases]["prompt_ids"].get<std::vector<int32_t>>());
  for (int64_t s = 0; s < B; ++s) {  // each alone
    const auto& p = prompts[size_t(s)];
    int32_t next = alone.forward_argmax(p.data(), int64_t(p.size()), 0);
    for (int64_t i = 0; i < steps; ++i) {
      want[size_t(s)].push_back(next);
      next = alone.forward_argmax(&next, 1, int64_t(p.size()) + i);
    }
  }
  std::vector<int32_t> tokens(static_cast<size_t>(B));
  std::vector<int64_t> positions(static_cast<size_t>(B));
  for (int64_t s = 0; s < B; ++s) {
    const auto& p = prompts[size_t(s)];
    tokens[size_t(s)] = batched.forward_argmax_seq(s, p.data(), int64_t(p.size()), 0);
    positions[size_t(s)] = int64_t(p.size());
  }
  std::vector<std::vector<int32_t>> got(static_cast<size_t>(B));
  for (int64_t i = 0; i < steps; ++i) {
    for (int64_t s = 0; s < B; ++s) got[size_t(s)].push_back(tokens[size_t(s)]);
    std::vector<int32_t> next(static_cast<size_t>(B));
    batched.decode_batch(tokens.data(), positions.data(), B, next.data());
    tokens = next;
    for (auto& p : positions) ++p;
  }
  for (int64_t s = 0; s < B; ++s) EXPECT_EQ(got[size_t(s)], want[size_t(s)]) << "sequence " << s;
  EXPECT_THROW(batched.forward_seq(B, tokens.data(), 1, 0), ks::InvalidArgument);
  EXPECT_THROW(batched.decode_batch(tokens.data(), positions.data(), B + 1, tokens.data()), ks::InvalidArgument);
}
}  // namespace

// Below LlamaModel::kTensorCoreDecodeRows sequences every op of the step is batch-invariant and
// gives the one-token kernels' bits: the rows are bit-identical to one-token steps, so the ids
// are too (CPU, and CUDA with a graph per b; 3 sequences take the routed cuda_staged_x). On
// CUDA, 9 sequences take the routed cuda_mma_rows on sm_90 (the same values up to FP32 rounding:
// the greedy ids still match over 10 steps) and stay on quant_matmul (below kDenseDecodeRows).
TEST(Model, BatchedDecodeEqualsEachSequenceAlone) {
  if (!have_model()) GTEST_SKIP() << "set KS_MODEL_PATH (make test does)";
  static_assert(ks::model::LlamaModel::kTensorCoreDecodeRows > 3, "3 sequences must take the per-column kernels");
  static_assert(ks::model::LlamaModel::kDenseDecodeRows > 9, "9 sequences must stay on quant_matmul");
  expect_batched_ids_equal_alone(ks::Backend::Cpu, 3, 10);
  if (ks_backend_available(KS_BACKEND_CUDA)) {
    SCOPED_TRACE("cuda");
    expect_batched_ids_equal_alone(ks::Backend::Cuda, 3, 10);
    expect_batched_ids_equal_alone(ks::Backend::Cuda, 9, 10);
  }
}

// From kDenseDecodeRows sequences on, CUDA decode steps multiply on quant_matmul's routed
// cuda_mma_rows (sm_90: the block sums on the tensor cores), or with KS_MODEL_DENSE_DECODE=1
// through the FP32 weight copies (ks::gemm): the same products summed in another order either
// way. The greedy ids still match each sequence decoded alone (one-token steps) over 10 steps of
// 17 sequences, on both paths, and with SiLU fused into the down projection's cuda_mma_rows
// (KS_MODEL_BATCH_SILU_FUSE=1: the same bits as the default path's two calls).
TEST(Model, CudaBatchedDecodeThroughGemmGivesTheSameIds) {
  if (!have_model()) GTEST_SKIP() << "set KS_MODEL_PATH (make test does)";
  if (!ks_backend_available(KS_BACKEND_CUDA)) GTEST_SKIP() << "no CUDA device";
  static_assert(ks::model::LlamaModel::kDenseDecodeRows <= 17, "17 sequences must reach the batched path");
  expect_batched_ids_equal_alone(ks::Backend::Cuda, 17, 10);
  {
    SCOPED_TRACE("KS_MODEL_BATCH_SILU_FUSE=1");
    kstest::ScopedEnv fuse("KS_MODEL_BATCH_SILU_FUSE", "1");
    expect_batched_ids_equal_alone(ks::Backend::Cuda, 17, 10);
  }
  SCOPED_TRACE("KS_MODEL_DENSE_DECODE=1");
  kstest::ScopedEnv dense("KS_MODEL_DENSE_DECODE", "1");
  expect_batched_ids_equal_alone(ks::Backend::Cuda, 17, 10);
}

// KS_MODEL_BATCH_INVARIANT=1 keeps decode steps of any batch size on quant_matmul's per-column
// kernels (rows bit-identical to one-token steps; cuda_staged_x pinned from 4 rows, where the
// routing would take cuda_mma_rows for the output head, and from 8 for every matrix): 9 and 17 sequences give each one's ids.
TEST(Model, CudaBatchInvariantModeAtSeventeenSequences) {
  if (!have_model()) GTEST_SKIP() << "set KS_MODEL_PATH (make test does)";
  if (!ks_backend_available(KS_BACKEND_CUDA)) GTEST_SKIP() << "no CUDA device";
  kstest::ScopedEnv invariant("KS_MODEL_BATCH_INVARIANT", "1");
  expect_batched_ids_equal_alone(ks::Backend::Cuda, 9, 10);
  expect_batched_ids_equal_alone(ks::Backend::Cuda, 17, 10);
}

TEST(Model, RejectsPositionsPastTheContext) {
  if (!have_model()) GTEST_SKIP() << "set KS_MODEL_PATH (make test does)";
  Fixture fx;
  const int32_t tok = 1;
  EXPECT_THROW(fx.model.forward(&tok, 1, 512), ks::InvalidArgument);
  EXPECT_THROW(fx.model.forward(&tok, 0, 0), ks::InvalidArgument);
}

namespace {
// decode_greedy against one forward_argmax per step on the same backend (the same kernels on the
// same inputs: the ids bit for bit), at KS_MODEL_DECODE_STEPS = `steps` (read at construction; an
// empty string: the default). Covers a count that ends in single steps after whole graphs,
// stopping early and resuming at the stop (the steps already run past the stop wrote K/V at the
// positions the resumed steps then overwrite), and the calls that must throw before anything runs.
// bucket (KS_MODEL_ATTN_BUCKET, read at construction; "": the default): 16 tokens puts table
// boundaries at 16, 32, 64 and 128 tokens, inside the steps decoded here, so graphs of chained
// steps that would cross one go a step at a time.
void expect_decode_greedy_equals_steps(ks::Backend be, const char* steps, const char* bucket = "") {
  SCOPED_TRACE(std::string(be == ks::Backend::Cuda ? "cuda" : "cpu") + ", KS_MODEL_DECODE_STEPS=" + steps +
               ", KS_MODEL_ATTN_BUCKET=" + bucket);
  std::unique_ptr<kstest::ScopedEnv> bucket_env;
  if (*bucket) bucket_env = std::make_unique<kstest::ScopedEnv>("KS_MODEL_ATTN_BUCKET", bucket);
  const nlohmann::json ref = reference();
  const auto prompt = ref["cases"][0]["prompt_ids"].get<std::vector<int32_t>>(),
             prompt1 = ref["cases"][1]["prompt_ids"].get<std::vector<int32_t>>();  // (sequence 1's)
  const int64_t P = int64_t(prompt.size()), P1 = int64_t(prompt1.size()), n = 11, ctx = std::max(P, P1) + 2 * n;
  ks::model::GgufFile file = ks::model::GgufFile::open(model_path());
  auto steps_of = [&](const std::vector<int32_t>& p) {  // n ids, one forward_argmax per step
    ks::model::LlamaModel m(file, ctx, be);
    std::vector<int32_t> ids;
    int32_t id = m.forward_argmax(p.data(), int64_t(p.size()), 0);
    for (int64_t i = 0; i < n; ++i) ids.push_back(id = m.forward_argmax(&id, 1, int64_t(p.size()) + i));
    return ids;
  };
  const std::vector<int32_t> want = steps_of(prompt), want1 = steps_of(prompt1);
  ASSERT_NE(want, want1) << "the two prompts must give different ids";
  if (*steps) setenv("KS_MODEL_DECODE_STEPS", steps, 1);
  ks::model::LlamaModel m(file, ctx, be, 2);
  unsetenv("KS_MODEL_DECODE_STEPS");
  // the graphs made before the prompt at 3 steps (ksctl generate's order: sized for the prompt,
  // they outlive its prefill), else by the first call
  const bool early = std::string(steps) == "3";
  if (early) m.prepare_decode_greedy(P);
  const int32_t first = m.forward_argmax(prompt.data(), P, 0);
  if (early) EXPECT_TRUE(m.decode_greedy_prepared()) << "the prefill replaced the prepared graphs";
  EXPECT_EQ(m.decode_greedy_prepared(), early);
  if (be == ks::Backend::Cpu || std::string(steps) == "0") {
    m.prepare_decode_greedy(P);  // (nothing to make)
    EXPECT_FALSE(m.decode_greedy_prepared());
  }
  std::vector<int32_t> got;
  auto take = [&](int32_t id) {
    got.push_back(id);
    return true;
  };
  EXPECT_EQ(m.decode_greedy(0, first, P, n, take), n);
  EXPECT_EQ(got, want);
  // twice more (graphs already captured on CUDA): stop after 5 ids, then resume from the 5th
  for (int round = 0; round < 2; ++round) {
    got.clear();
    EXPECT_EQ(m.decode_greedy(0, first, P, n, [&](int32_t id) {
      got.push_back(id);
      return got.size() < 5;
    }), 5);
    ASSERT_EQ(got.size(), 5u);
    EXPECT_EQ(m.decode_greedy(0, got.back(), P + 5, n - 5, take), n - 5);
    EXPECT_EQ(got, want) << "round " << round;
  }
  // nothing runs for these (and the model is still usable after them)
  int calls = 0;
  auto count = [&](int32_t) { return ++calls > 0; };
  EXPECT_EQ(m.decode_greedy(0, first, P, 0, count), 0);
  EXPECT_THROW(m.decode_greedy(0, first, P, ctx - P + 1, count), ks::InvalidArgument);
  EXPECT_THROW(m.decode_greedy(2, first, P, 1, count), ks::InvalidArgument);
  EXPECT_THROW(m.decode_greedy(-1, first, P, 1, count), ks::InvalidArgument);
  EXPECT_THROW(m.decode_greedy(0, first, -1, 1, count), ks::InvalidArgument);
  EXPECT_EQ(calls, 0);
  got.clear();
  EXPECT_EQ(m.decode_greedy(0, first, P, n, take), n);
  EXPECT_EQ(got, want) << "after the rejected calls";
  // fewer steps than a graph holds (single steps only), and on_token throwing after 2 ids: the
  // exception comes out, and the next call still gives the same ids
  got.clear();
  EXPECT_EQ(m.decode_greedy(0, first, P, 3, take), 3);
  EXPECT_EQ(got, std::vector<int32_t>(want.begin(), want.begin() + 3));
  got.clear();
  EXPECT_THROW(m.decode_greedy(0, first, P, n, [&](int32_t id) {
    got.push_back(id);
    if (got.size() == 2) throw std::runtime_error("stop here");
    return true;
  }), std::runtime_error);
  got.clear();
  EXPECT_EQ(m.decode_greedy(0, first, P, n, take), n);
  EXPECT_EQ(got, want) << "after on_token threw";
  // sequence 1 (its own cache blocks and slots) with another prompt: its own ids, and sequence
  // 0's cache untouched by its steps
  got.clear();
  const int32_t first1 = m.forward_argmax_seq(1, prompt1.data(), P1, 0);
  EXPECT_EQ(m.decode_greedy(1, first1, P1, n, take), n);
  EXPECT_EQ(got, want1) << "sequence 1";
  got.clear();
  EXPECT_EQ(m.decode_greedy(0, first, P, n, take), n);
  EXPECT_EQ(got, want) << "sequence 0 after sequence 1";
}
}  // namespace

TEST(Model, DecodeGreedyEqualsOneStepAtATime) {
  if (!have_model()) GTEST_SKIP() << "set KS_MODEL_PATH (make test does)";
  {  // a value of KS_MODEL_DECODE_STEPS that is not a whole number of steps in range
    ks::model::GgufFile file = ks::model::GgufFile::open(model_path());
    for (const char* bad : {"x", "4x", "-1", "33", "4 "}) {
      setenv("KS_MODEL_DECODE_STEPS", bad, 1);
      EXPECT_THROW(ks::model::LlamaModel(file, 64, ks::Backend::Cpu), ks::InvalidArgument) << "'" << bad << "'";
    }
    unsetenv("KS_MODEL_DECODE_STEPS");
    for (const char* bad : {"abc", "1.5", "-1", "64 "}) {  // KS_DENSE_WEIGHTS_MB: whole MB, on every backend
      setenv("KS_DENSE_WEIGHTS_MB", bad, 1);
      EXPECT_THROW(ks::model::LlamaModel(file, 64, ks::Backend::Cpu), ks::InvalidArgument) << "'" << bad << "'";
    }
    unsetenv("KS_DENSE_WEIGHTS_MB");
  }
  expect_decode_greedy_equals_steps(ks::Backend::Cpu, "");
  expect_decode_greedy_equals_steps(ks::Backend::Cpu, "", "16");
  if (ks_backend_available(KS_BACKEND_CUDA)) {
    for (const char* steps : {"", "1", "3", "0"}) expect_decode_greedy_equals_steps(ks::Backend::Cuda, steps);
    for (const char* steps : {"", "3"}) expect_decode_greedy_equals_steps(ks::Backend::Cuda, steps, "16");
  }
}

// The attention tables' capacities (attention_capacity): the bucket, doubled while below the
// context, then the context; a step takes the narrowest of at least headroom times its context
// (default 1), else the widest; KS_MODEL_ATTN_BUCKET=0 one table of the whole context.
TEST(Model, AttentionTablesByCapacityBucket) {
  if (!have_model()) GTEST_SKIP() << "set KS_MODEL_PATH (make test does)";
  ks::model::GgufFile file = ks::model::GgufFile::open(model_path());
  using LM = ks::model::LlamaModel;
  static_assert(LM::kAttnBucket == 256 && LM::kAttnHeadroom == 1, "the cases below assume these defaults");
  {
    kstest::ScopedEnv e("KS_MODEL_ATTN_HEADROOM", "2");
    LM m(file, 2048, ks::Backend::Cpu);
    const std::pair<int64_t, int64_t> cases[] = {{1, 256}, {128, 256}, {129, 512}, {256, 512}, {257, 1024},
                                                 {513, 2048}, {1025, 2048}, {2048, 2048}};
    for (auto [len, cap] : cases) EXPECT_EQ(m.attention_capacity(len), cap) << "len " << len;
  }
  {
    LM m(file, 2048, ks::Backend::Cpu);
    const std::pair<int64_t, int64_t> cases[] = {{1, 256}, {256, 256}, {257, 512}, {512, 512}, {513, 1024},
                                                 {1025, 2048}, {2048, 2048}};
    for (auto [len, cap] : cases) EXPECT_EQ(m.attention_capacity(len), cap) << "len " << len;
  }
  {
    kstest::ScopedEnv e("KS_MODEL_ATTN_HEADROOM", "1");
    LM m(file, 600, ks::Backend::Cpu);  // the last table is the whole cache: 38 blocks, 608 tokens
    EXPECT_EQ(m.attention_capacity(300), 512);
    EXPECT_EQ(m.attention_capacity(513), 608);
    EXPECT_EQ(m.attention_capacity(600), 608);
  }
  {
    LM m(file, 200, ks::Backend::Cpu);  // a context below the bucket: one table (13 blocks)
    EXPECT_EQ(m.attention_capacity(1), 208);
  }
  {
    kstest::ScopedEnv e("KS_MODEL_ATTN_BUCKET", "1"), h("KS_MODEL_ATTN_HEADROOM", "1");
    LM m(file, 100, ks::Backend::Cpu);  // tables of whole blocks: 16, 32, 64, then 112 (7 blocks)
    const std::pair<int64_t, int64_t> cases[] = {{1, 16}, {3, 16}, {16, 16}, {17, 32}, {65, 112}, {100, 112}};
    for (auto [len, cap] : cases) EXPECT_EQ(m.attention_capacity(len), cap) << "len " << len;
  }
  {
    kstest::ScopedEnv e("KS_MODEL_ATTN_BUCKET", "0");
    LM m(file, 2048, ks::Backend::Cpu);
    EXPECT_EQ(m.attention_capacity(1), 2048);
  }
  {
    kstest::ScopedEnv e("KS_MODEL_ATTN_BUCKET", "100"), h("KS_MODEL_ATTN_HEADROOM", "1");
    LM m(file, 2048, ks::Backend::Cpu);
    const std::pair<int64_t, int64_t> cases[] = {{1, 112}, {112, 112}, {113, 208}, {700, 800}, {1601, 2048}};
    for (auto [len, cap] : cases) EXPECT_EQ(m.attention_capacity(len), cap) << "len " << len;
  }
  for (const char* name : {"KS_MODEL_ATTN_BUCKET", "KS_MODEL_ATTN_HEADROOM"})
    for (const char* bad : {"x", "-1", "16k", " 16", "99999999999999999999"}) {
      kstest::ScopedEnv e(name, bad);
      EXPECT_THROW(LM(file, 64, ks::Backend::Cpu), ks::InvalidArgument) << name << "='" << bad << "'";
    }
}

// On CUDA the decode attention splits a context over more CTAs the wider its table (clusters sized
// by the capacity), so the steps before and after a table boundary run different splits. Chained
// graphs (default and 3 steps) give the ids of a step at a time across the 512-token boundary, and
// a batch of two sequences on either side of it (the batch's table is its longest context's)
// gives, for each, the ids of that sequence alone at the batch's table. (Headroom 1, so the
// boundary falls at 512 live tokens; run on the H200 at 5ff2190, passed.)
TEST(Model, CudaDecodeAcrossAttentionTables) {
  if (!have_model()) GTEST_SKIP() << "set KS_MODEL_PATH (make test does)";
  if (!ks_backend_available(KS_BACKEND_CUDA)) GTEST_SKIP() << "no CUDA device";
  kstest::ScopedEnv headroom("KS_MODEL_ATTN_HEADROOM", "1");
  const nlohmann::json ref = reference();
  std::vector<int32_t> prompt = prompts_joined(ref, 505);
  prompt.resize(505);
  const int64_t P = 505, n = 16, ctx = 1024;  // lengths 506..521: tables of 512 and 1024 tokens
  ks::model::GgufFile file = ks::model::GgufFile::open(model_path());
  ks::model::LlamaModel alone(file, ctx, ks::Backend::Cuda);
  ASSERT_EQ(alone.attention_capacity(P + 1), 512);
  ASSERT_EQ(alone.attention_capacity(P + n), 1024);
  std::vector<int32_t> want;
  int32_t id = alone.forward_argmax(prompt.data(), P, 0);
  const int32_t first = id;
  for (int64_t i = 0; i < n; ++i) want.push_back(id = alone.forward_argmax(&id, 1, P + i));
  for (const char* steps : {"", "3"}) {
    SCOPED_TRACE(std::string("KS_MODEL_DECODE_STEPS=") + steps);
    std::unique_ptr<kstest::ScopedEnv> e;
    if (*steps) e = std::make_unique<kstest::ScopedEnv>("KS_MODEL_DECODE_STEPS", steps);
    ks::model::LlamaModel m(file, ctx, ks::Backend::Cuda);
    // the first table's graphs only (the second's made when reached), or both tables' beforehand
    m.prepare_decode_greedy(P, *steps ? n : 1);
    EXPECT_EQ(m.forward_argmax(prompt.data(), P, 0), first);
    std::vector<int32_t> got;
    EXPECT_EQ(m.decode_greedy(0, first, P, n, [&](int32_t i) {
      got.push_back(i);
      return true;
    }), n);
    EXPECT_EQ(got, want);
  }
  // sequence 0 at lengths 506.. (table 512 alone) beside sequence 1 at 1000.. (table 1024): the
  // batch runs at 1024, and sequence 0's ids equal its own steps at 1024 (KS_MODEL_ATTN_BUCKET=1024)
  std::vector<int32_t> want0;
  {
    kstest::ScopedEnv e("KS_MODEL_ATTN_BUCKET", "1024");
    ks::model::LlamaModel wide(file, ctx, ks::Backend::Cuda);
    ASSERT_EQ(wide.attention_capacity(P + 1), 1024);
    int32_t t = wide.forward_argmax(prompt.data(), P, 0);
    for (int64_t i = 0; i < 4; ++i) want0.push_back(t = wide.forward_argmax(&t, 1, P + i));
  }
  ks::model::LlamaModel batched(file, ctx, ks::Backend::Cuda, 2);
  std::vector<int32_t> long_prompt = prompts_joined(ref, 999);
  long_prompt.resize(999);
  int32_t tokens[2] = {batched.forward_argmax_seq(0, prompt.data(), P, 0),
                       batched.forward_argmax_seq(1, long_prompt.data(), 999, 0)};
  int64_t positions[2] = {P, 999};
  std::vector<int32_t> got0;
  for (int64_t i = 0; i < 4; ++i) {
    int32_t next[2];
    batched.decode_batch(tokens, positions, 2, next);
    got0.push_back(next[0]);
    std::copy(next, next + 2, tokens);
    ++positions[0], ++positions[1];
  }
  EXPECT_EQ(got0, want0);
}

// generate's sampler: temperature 0 is the argmax (lowest index among ties); otherwise kernscope's
// sample op keyed by (seed, step): the same (seed, step) gives the same id, the draws over many
// steps follow softmax(logits / T), top_k = 1 and a small top_p keep the largest logit only, a
// top_k of 2 never draws the two smallest, a row of NaN is refused naming the step, and a
// temperature so small that logits / T overflows is refused naming it.
TEST(Model, SamplingTemperatureZeroIsArgmaxAndSeeded) {
  using ks::model::SamplingParams;
  using ks::model::sample_token;
  std::vector<float> logits{0.5f, 3.0f, 3.0f, -1.0f};
  EXPECT_EQ(sample_token(logits.data(), 4, SamplingParams{0.0f, 0, 1.0, 1}, 0), 1);  // tie: lowest index
  const SamplingParams warm{0.8f, 0, 1.0, 42};
  for (uint64_t step = 0; step < 20; ++step)
    EXPECT_EQ(sample_token(logits.data(), 4, warm, step), sample_token(logits.data(), 4, warm, step));
  // Draws follow softmax(logits / T): id 3 (p ~ 0.003 at T=1) is rare, ids 1/2 common.
  int counts[4] = {}, other_seed_differs = 0;
  const SamplingParams t1{1.0f, 0, 1.0, 7}, t1b{1.0f, 0, 1.0, 8};
  for (uint64_t step = 0; step < 4000; ++step) {
    const int32_t id = sample_token(logits.data(), 4, t1, step);
    ++counts[id];
    other_seed_differs += id != sample_token(logits.data(), 4, t1b, step);
  }
  EXPECT_GT(counts[1], 1500);
  EXPECT_GT(counts[2], 1500);
  EXPECT_LT(counts[3], 60);
  EXPECT_GT(other_seed_differs, 1000);  // (two ids near 1/2 each: about half the steps differ)
  std::vector<float> spread{0.1f, 2.0f, 1.0f, 1.5f, -3.0f};
  for (uint64_t step = 0; step < 200; ++step) {
    EXPECT_EQ(sample_token(spread.data(), 5, SamplingParams{1.0f, 1, 1.0, 3}, step), 1);
    EXPECT_EQ(sample_token(spread.data(), 5, SamplingParams{1.0f, 0, 0.05, 3}, step), 1);
    const int32_t id = sample_token(spread.data(), 5, SamplingParams{2.0f, 2, 1.0, 3}, step);
    EXPECT_TRUE(id == 1 || id == 3) << id;
  }
  std::vector<float> bad{0.f, std::nanf(""), 1.f};
  try {
    sample_token(bad.data(), 3, SamplingParams{1.0f, 0, 1.0, 3}, 17);
    ADD_FAILURE() << "a NaN row was sampled";
  } catch (const ks::InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("step 17"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("hold NaN"), std::string::npos) << e.what();
  }
  // finite logits that a tiny temperature scales past FP32 (an adversarial review: --temperature
  // 1e-38 was reported as NaN logits): the message names the temperature
  std::vector<float> large{100.f, 10.f, -5.f};  // 100 / 1e-37 = 1e39 > FLT_MAX
  try {
    sample_token(large.data(), 3, SamplingParams{1e-37f, 0, 1.0, 3}, 4);
    ADD_FAILURE() << "logits / 1e-37 were sampled";
  } catch (const ks::InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("step 4 divided by the temperature (1e-37) overflow FP32"), std::string::npos)
        << e.what();
  }
}

}  // namespace
