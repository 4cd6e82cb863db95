// The routing table decides the per-call selection (end to end, through the public API):
// run under ctest twice, with the compiled-in tables (KS_EXPECT_FIRST=cpu_avx512) and with
// KS_ROUTING_TABLE=tests/data/routing_reference_first.json (KS_EXPECT_FIRST=cpu_reference).
// quant_matmul fp32 on the CPU has both variants; their FP32 sums are ordered differently, so
// the automatic call's bits tell which one ran.
#include <gtest/gtest.h>

#include <kernscope/kernscope.hpp>

#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {

struct Pin {  // pins quant_matmul for its lifetime (nullptr: automatic selection)
  explicit Pin(const char* variant) { ks::force_variant("quant_matmul", variant ? variant : ""); }
  ~Pin() { ks_force_variant("quant_matmul", nullptr); }
};

// The call's block bytes: Q8_0 34, Q4_1 20
int64_t block_bytes(ks::QType q) { return q == ks::QType::Q4_1 ? 20 : 34; }

std::vector<float> run(const std::vector<float>& x, const std::vector<uint8_t>& w, int64_t m, int64_t n, int64_t k,
                       const char* pin, ks::QType q = ks::QType::Q8_0) {
  Pin p(pin);
  std::vector<float> out(size_t(m * n), std::nanf(""));
  ks::quant_matmul(ks::TensorView(out.data(), ks::DType::F32, {m, n}),
                   ks::TensorView(const_cast<float*>(x.data()), ks::DType::F32, {m, k}),
                   ks::TensorView(const_cast<uint8_t*>(w.data()), ks::DType::U8, {n, k / 32 * block_bytes(q)}), q,
                   ks::Backend::Cpu);
  return out;
}

// x [m, k] from N(0, 1); Q8_0 (or Q4_1) weights [n, k] with fp16 scales ~0.1 (Q4_1: minimum
// ~-0.1) and random codes
void random_inputs(std::mt19937& rng, int64_t m, int64_t n, int64_t k, std::vector<float>* x,
                   std::vector<uint8_t>* wq, ks::QType q = ks::QType::Q8_0) {
  std::normal_distribution<float> nd;
  x->resize(size_t(m * k));
  for (auto& e : *x) e = nd(rng);
  const int64_t bb = block_bytes(q);
  wq->assign(size_t(n * (k / 32) * bb), 0);
  for (size_t b = 0; b < wq->size(); b += size_t(bb)) {
    (*wq)[b] = 0x66, (*wq)[b + 1] = 0x2e;  // fp16 scale ~0.1
    int i = 2;
    if (q == ks::QType::Q4_1) (*wq)[b + 2] = 0x66, (*wq)[b + 3] = 0xae, i = 4;  // fp16 minimum ~-0.1
    for (; i < bb; ++i) (*wq)[b + i] = uint8_t(rng());
  }
}

TEST(RoutingSelect, TheTablesFirstVariantRunsTheCall) {
  const char* expect = std::getenv("KS_EXPECT_FIRST");
  ASSERT_NE(expect, nullptr) << "run through ctest (KS_EXPECT_FIRST names the variant the table puts first)";
  // which() skips variants this CPU cannot run; the AVX-512 one is registered on every x86 build
  // (neither table here puts another variant first for every shape, so which() names it when it can run)
  if (ks::which("quant_matmul", "fp32", ks::Backend::Cpu).variant != "cpu_avx512")
    GTEST_SKIP() << "no AVX-512 on this CPU: one runnable variant only";
  const int64_t m = 3, n = 19, k = 4096;
  std::mt19937 rng(7);
  std::vector<float> x;
  std::vector<uint8_t> wq;
  random_inputs(rng, m, n, k, &x, &wq);
  const auto ref = run(x, wq, m, n, k, "cpu_reference"), fast = run(x, wq, m, n, k, "cpu_avx512");
  ASSERT_NE(std::memcmp(ref.data(), fast.data(), ref.size() * 4), 0)
      << "the two variants agree bitwise here: this test cannot tell them apart";
  const auto got = run(x, wq, m, n, k, nullptr);
  const auto& want = std::string(expect) == "cpu_reference" ? ref : fast;
  EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * 4), 0) << "the automatic call did not run " << expect;
}

// quant_matmul is routed by (M, N x K): with tests/data/routing_quant_key.json (one cell at
// M = 3, cols = 19 x 4096 = 77824, the reference first) the call 3 x 19 x 4096 runs the
// reference, and 3 x 19 x 2048 (cols 38912: no cell) the registry's first, AVX-512. Keyed by
// N alone (cols 19) neither call would match the cell.
TEST(RoutingSelect, QuantMatmulIsKeyedByTheWeightsElements) {
  if (!std::getenv("KS_EXPECT_KEY_CELL")) GTEST_SKIP() << "run through ctest (routing_select_quant_key)";
  // (the table puts the reference first at one shape only, so which() names AVX-512 when it can run)
  if (ks::which("quant_matmul", "fp32", ks::Backend::Cpu).variant != "cpu_avx512")
    GTEST_SKIP() << "no AVX-512 on this CPU: one runnable variant only";
  std::mt19937 rng(11);
  for (int64_t k : {int64_t(4096), int64_t(2048)}) {
    SCOPED_TRACE("k = " + std::to_string(k));
    const int64_t m = 3, n = 19;
    std::vector<float> x;
    std::vector<uint8_t> wq;
    random_inputs(rng, m, n, k, &x, &wq);
    const auto ref = run(x, wq, m, n, k, "cpu_reference"), fast = run(x, wq, m, n, k, "cpu_avx512"),
               got = run(x, wq, m, n, k, nullptr);
    ASSERT_NE(std::memcmp(ref.data(), fast.data(), ref.size() * 4), 0) << "the variants agree: cannot tell them apart";
    const auto& want = k == 4096 ? ref : fast;
    EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * 4), 0)
        << "the automatic call did not run " << (k == 4096 ? "the cell's cpu_reference" : "cpu_avx512");
  }
}

// A cell bound to a block format ("qtype") routes calls of that format only: with
// tests/data/routing_quant_qtype.json (one cell for Q4_1 weights at M = 3, N x K = 19 x 4096, the
// reference first) a Q4_1 call of that shape runs the reference and a Q8_0 call of the same shape
// the registry's first, AVX-512.
TEST(RoutingSelect, QuantMatmulCellsBoundToABlockFormat) {
  if (!std::getenv("KS_EXPECT_QTYPE_CELL")) GTEST_SKIP() << "run through ctest (routing_select_quant_qtype)";
  if (ks::which("quant_matmul", "fp32", ks::Backend::Cpu).variant != "cpu_avx512")
    GTEST_SKIP() << "no AVX-512 on this CPU: one runnable variant only";
  std::mt19937 rng(13);
  for (ks::QType q : {ks::QType::Q4_1, ks::QType::Q8_0}) {
    SCOPED_TRACE(q == ks::QType::Q4_1 ? "Q4_1" : "Q8_0");
    const int64_t m = 3, n = 19, k = 4096;
    std::vector<float> x;
    std::vector<uint8_t> wq;
    random_inputs(rng, m, n, k, &x, &wq, q);
    const auto ref = run(x, wq, m, n, k, "cpu_reference", q), fast = run(x, wq, m, n, k, "cpu_avx512", q),
               got = run(x, wq, m, n, k, nullptr, q);
    ASSERT_NE(std::memcmp(ref.data(), fast.data(), ref.size() * 4), 0) << "the variants agree: cannot tell them apart";
    const auto& want = q == ks::QType::Q4_1 ? ref : fast;
    EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * 4), 0)
        << "the automatic call did not run " << (q == ks::QType::Q4_1 ? "the Q4_1 cell's cpu_reference" : "cpu_avx512");
  }
  // which() names the same choices when told the block format ("fp32:q4_1"); without one, or with
  // another, the bound cell is skipped; a bad format is refused by name
  EXPECT_EQ(ks::which("quant_matmul", "fp32:q4_1", ks::Backend::Cpu, 3, 77824).variant, "cpu_reference");
  EXPECT_NE(ks::which("quant_matmul", "fp32:q4_1", ks::Backend::Cpu, 3, 77824).reason.find("routing cell 0"),
            std::string::npos);
  EXPECT_EQ(ks::which("quant_matmul", "fp32:q8_0", ks::Backend::Cpu, 3, 77824).variant, "cpu_avx512");
  EXPECT_EQ(ks::which("quant_matmul", "fp32", ks::Backend::Cpu, 3, 77824).variant, "cpu_avx512");
  EXPECT_EQ(ks::which("quant_matmul", "fp32:q4_1", ks::Backend::Cpu, 4, 77824).variant, "cpu_avx512");
  EXPECT_NE(ks::which("quant_matmul", "fp32:q4_1", ks::Backend::Cpu).reason.find("q4_1 weights, rows 3..3"),
            std::string::npos);
  EXPECT_EQ(ks::which("quant_matmul", "fp32:q8_0", ks::Backend::Cpu).reason.find("q4_1 weights"), std::string::npos);
  try {  // an op without packed weights has no block format
    (void)ks::which("rms_norm", "fp32:q4_1", ks::Backend::Cpu);
    ADD_FAILURE() << "rms_norm with a block format was accepted";
  } catch (const ks::Error& e) {
    EXPECT_NE(std::string(e.what()).find("packed weights only"), std::string::npos) << e.what();
  }
  // any case, and torch's names, as the canonical key (core/dtype_key.hpp)
  EXPECT_EQ(ks::which("quant_matmul", "Float32:Q4_1", ks::Backend::Cpu, 4, 77824).variant,
            ks::which("quant_matmul", "fp32:q4_1", ks::Backend::Cpu, 4, 77824).variant);
  EXPECT_EQ(ks::which("quant_matmul", "FP32:Q4_1", ks::Backend::Cpu).reason,
            ks::which("quant_matmul", "fp32:q4_1", ks::Backend::Cpu).reason);
  for (const char* bad : {"fp32:", "fp32:q4_k", "fp32:Q4_K", "fp32:q4_1:x"}) {
    try {
      (void)ks::which("quant_matmul", bad, ks::Backend::Cpu, 3, 77824);
      ADD_FAILURE() << bad << " was accepted";
    } catch (const ks::Error& e) {
      EXPECT_NE(std::string(e.what()).find("block format after ':'"), std::string::npos) << e.what();
    }
  }
}

}  // namespace
