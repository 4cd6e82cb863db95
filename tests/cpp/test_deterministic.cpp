// Deterministic (batch-invariant) mode: ks_set_deterministic / KS_DETERMINISTIC=1.
// Bitwise: a row computed alone equals the same row inside batches of 1 to 4096 rows,
// wherever it sits, for every row-wise op and every CPU variant (docs/contracts.md,
// "Summation order"). The CUDA half of this check is tests/cuda/test_cuda_deterministic.cpp.
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "gguf_blocks_fp64.hpp"
#include "validation_harness.hpp"

namespace {

using namespace kstest::harness;

struct DeterministicMode {  // on for the scope of a test
  DeterministicMode() { ks_set_deterministic(1); }
  ~DeterministicMode() { ks_set_deterministic(0); }
};

const std::vector<int64_t> kBatches = {1, 2, 7, 64, 4096};

// run(rows, r) fills the output of a call over `rows` rows whose row r holds the probe
// row (every other row random) and returns row r's output bytes.
void expect_batch_invariant(const std::string& op, const std::function<std::vector<uint8_t>(int64_t, int64_t)>& run) {
  const std::vector<uint8_t> alone = run(1, 0);
  ASSERT_FALSE(alone.empty()) << op;
  for (int64_t rows : kBatches)
    for (int64_t r : {int64_t(0), rows / 2, rows - 1}) {
      const std::vector<uint8_t> got = run(rows, r);
      EXPECT_EQ(got, alone) << op << ": row " << r << " of " << rows << " differs from the row alone";
    }
}

std::vector<uint8_t> row_bytes(const Buf& b, int64_t r, int64_t cols) {
  const size_t es = ks::dtype_size(b.dtype);
  const auto* p = static_cast<const uint8_t*>(b.data()) + size_t(r * cols) * es;
  return std::vector<uint8_t>(p, p + size_t(cols) * es);
}

// rows x cols of random values with `probe` (cols values) at row r
Buf with_probe(DType dt, int64_t rows, int64_t cols, int64_t r, const Buf& probe) {
  Buf x(dt, {rows, cols});
  kstest::fill_normal(x);
  std::memcpy(static_cast<uint8_t*>(x.data()) + size_t(r * cols) * ks::dtype_size(dt), probe.data(), probe.nbytes());
  return x;
}

TEST(Deterministic, ApiRoundTrip) {
  const int before = ks_deterministic();
  EXPECT_EQ(ks_set_deterministic(1), KS_SUCCESS);
  EXPECT_EQ(ks_deterministic(), 1);
  EXPECT_EQ(ks_set_deterministic(0), KS_SUCCESS);
  EXPECT_EQ(ks_deterministic(), 0);
  ks_set_deterministic(before);
}

TEST(Deterministic, RowWiseOpsAreBatchInvariantOnEveryCpuVariant) {
  DeterministicMode on;
  for (DType dt : kFloatTypes()) {
    const int64_t H = 96;
    Buf probe(dt, {1, H}), w(dt, {H});
    kstest::fill_normal(probe, 3.0);
    kstest::fill_normal(w);
    FOR_EACH_VARIANT("rms_norm") expect_batch_invariant("rms_norm", [&](int64_t rows, int64_t r) {
      Buf x = with_probe(dt, rows, H, r, probe), out(dt, {rows, H});
      DLTensor o = out.dl(), xx = x.dl(), ww = w.dl();
      EXPECT_EQ(ks_rms_norm(&o, &xx, &ww, 1e-6, KS_BACKEND_CPU, nullptr), KS_SUCCESS) << ks_last_error();
      return row_bytes(out, r, H);
    });
    FOR_EACH_VARIANT("softmax") expect_batch_invariant("softmax", [&](int64_t rows, int64_t r) {
      Buf x = with_probe(dt, rows, H, r, probe), out(dt, {rows, H});
      DLTensor o = out.dl(), xx = x.dl();
      EXPECT_EQ(ks_softmax(&o, &xx, KS_BACKEND_CPU, nullptr), KS_SUCCESS) << ks_last_error();
      return row_bytes(out, r, H);
    });
    FOR_EACH_VARIANT("silu_and_mul") expect_batch_invariant("silu_and_mul", [&](int64_t rows, int64_t r) {
      Buf x = with_probe(dt, rows, H, r, probe), out(dt, {rows, H / 2});
      DLTensor o = out.dl(), xx = x.dl();
      EXPECT_EQ(ks_silu_and_mul(&o, &xx, KS_BACKEND_CPU, nullptr), KS_SUCCESS) << ks_last_error();
      return row_bytes(out, r, H / 2);
    });
    FOR_EACH_VARIANT("fused_add_rms_norm") expect_batch_invariant("fused_add_rms_norm", [&](int64_t rows, int64_t r) {
      Buf x = with_probe(dt, rows, H, r, probe), res = with_probe(dt, rows, H, r, probe);
      DLTensor xx = x.dl(), rr = res.dl(), ww = w.dl();
      EXPECT_EQ(ks_fused_add_rms_norm(&xx, &rr, &ww, 1e-6, KS_BACKEND_CPU, nullptr), KS_SUCCESS) << ks_last_error();
      std::vector<uint8_t> a = row_bytes(x, r, H), b = row_bytes(res, r, H);
      a.insert(a.end(), b.begin(), b.end());
      return a;
    });
    FOR_EACH_VARIANT("argmax") expect_batch_invariant("argmax", [&](int64_t rows, int64_t r) {
      Buf x = with_probe(dt, rows, H, r, probe), out(DType::I64, {rows});
      DLTensor o = out.dl(), xx = x.dl();
      EXPECT_EQ(ks_argmax(&o, &xx, KS_BACKEND_CPU, nullptr), KS_SUCCESS) << ks_last_error();
      return row_bytes(out, r, 1);
    });
    // gemm: row m of a against the same b; gemv: output element n of row n of weight
    Buf b(dt, {24, H});
    kstest::fill_normal(b);
    FOR_EACH_VARIANT("gemm") expect_batch_invariant("gemm", [&](int64_t rows, int64_t r) {
      Buf a = with_probe(dt, rows, H, r, probe), out(dt, {rows, 24});
      DLTensor o = out.dl(), aa = a.dl(), bb = b.dl();
      EXPECT_EQ(ks_gemm(&o, &aa, &bb, KS_BACKEND_CPU, nullptr), KS_SUCCESS) << ks_last_error();
      return row_bytes(out, r, 24);
    });
    Buf xv(dt, {H});
    kstest::fill_normal(xv);
    FOR_EACH_VARIANT("gemv") expect_batch_invariant("gemv", [&](int64_t rows, int64_t r) {
      Buf wt = with_probe(dt, rows, H, r, probe), out(dt, {rows});
      DLTensor o = out.dl(), xx = xv.dl(), ww = wt.dl();
      EXPECT_EQ(ks_gemv(&o, &xx, &ww, KS_BACKEND_CPU, nullptr), KS_SUCCESS) << ks_last_error();
      return row_bytes(out, r, 1);
    });
  }
}

TEST(Deterministic, QuantMatmulRowsAreBatchInvariant) {
  DeterministicMode on;
  using namespace kstest::gguf;
  const int64_t K = 128, N = 40;
  for (ks_qtype_t q : {KS_QTYPE_Q4_1, KS_QTYPE_Q8_0, KS_QTYPE_Q4_0}) {
    Buf wq = make_packed(q, N, K), probe(DType::F32, {1, K});
    kstest::fill_normal(probe);
    FOR_EACH_VARIANT("quant_matmul") expect_batch_invariant("quant_matmul", [&](int64_t rows, int64_t r) {
      Buf x = with_probe(DType::F32, std::min<int64_t>(rows, 512), K, std::min<int64_t>(r, std::min<int64_t>(rows, 512) - 1), probe);
      const int64_t m = x.shape[0], rr = std::min<int64_t>(r, m - 1);
      Buf out(DType::F32, {m, N});
      DLTensor o = out.dl(), xx = x.dl(), ww = wq.dl();
      EXPECT_EQ(ks_quant_matmul(&o, &xx, &ww, q, KS_BACKEND_CPU, nullptr), KS_SUCCESS) << ks_last_error();
      return row_bytes(out, rr, N);
    });
  }
}

}  // namespace
