// The linear ops take x [..., K] (any leading dims, M = their product, as
// torch.nn.functional.linear): gemm, quant_matmul and quant_matmul_a8 give out [..., N], each row
// bit for bit its row of the 2-D reshape, under every CPU variant; a 1-D x gives out [N]; out of
// the reshape's [M, N] shape is refused, naming out, and nothing is written.
#include <cstring>
#include <string>
#include <vector>

#include "gguf_blocks_fp64.hpp"
#include "validation_harness.hpp"

namespace {

using namespace kstest::harness;
using namespace kstest::gguf;

// op(out, x, weight) through the C ABI: gemm (weight dense [N, K]) or the quant ops (packed)
ks_status_t run(const std::string& op, Buf& out, Buf& x, Buf& w, ks_qtype_t q) {
  DLTensor o = out.dl(), a = x.dl(), b = w.dl();
  if (op == "gemm") return ks_gemm(&o, &a, &b, KS_BACKEND_AUTO, nullptr);
  if (op == "quant_matmul") return ks_quant_matmul(&o, &a, &b, q, KS_BACKEND_AUTO, nullptr);
  return ks_quant_matmul_a8(&o, &a, &b, q, KS_BACKEND_AUTO, nullptr);
}

TEST(LinearLeadingDims, RowsEqualTheTwoDimReshapeBitForBit) {
  const int64_t K = 96, N = 7;
  for (const std::string op : {"gemm", "quant_matmul", "quant_matmul_a8"})
    for (DType dt : kFloatTypes()) {
      SCOPED_TRACE(op + " " + dt_name(dt));
      const ks_qtype_t q = KS_QTYPE_Q4_1;
      Buf w = op == "gemm" ? Buf(dt, {N, K}) : make_packed(q, N, K);
      if (op == "gemm") kstest::fill_normal(w);
      Buf x(dt, {2, 3, K}, 2), x2(dt, {6, K});
      kstest::fill_normal(x);
      std::memcpy(x2.data(), x.data(), x.nbytes());
      FOR_EACH_VARIANT(op.c_str()) {
        Buf out(dt, {2, 3, N}, 1), ref(dt, {6, N});
        out.poison();
        ref.poison();
        Snap in{&x, &w};
        KS_RUN_OR_SKIP(run(op, ref, x2, w, q));
        ASSERT_EQ(run(op, out, x, w, q), KS_SUCCESS) << ks_last_error();
        EXPECT_EQ(std::memcmp(out.data(), ref.data(), ref.nbytes()), 0);
        EXPECT_TRUE(out.guards_intact());
        EXPECT_TRUE(in.same());
        // one row: x [K] -> out [N], row 4's values
        Buf x1(dt, {K}), o1(dt, {N});
        std::memcpy(x1.data(), static_cast<char*>(x2.data()) + 4 * K * int64_t(x2.nbytes() / size_t(6 * K)), x1.nbytes());
        o1.poison();
        ASSERT_EQ(run(op, o1, x1, w, q), KS_SUCCESS) << ks_last_error();
        EXPECT_EQ(std::memcmp(o1.data(), static_cast<char*>(ref.data()) + 4 * N * int64_t(ref.nbytes() / size_t(6 * N)), o1.nbytes()), 0);
      }
      // the reshape's [6, N] is not out's shape; a zero leading dim is a no-op
      Buf bad(dt, {6, N});
      bad.poison();
      Snap s{&bad, &x, &w};
      EXPECT_TRUE(fails_cleanly(run(op, bad, x, w, q), KS_ERROR_INVALID_ARGUMENT, op.c_str(), "out", s));
      Buf x0(dt, {4, 0, K}), o0(dt, {4, 0, N});
      EXPECT_EQ(run(op, o0, x0, w, q), KS_SUCCESS) << ks_last_error();
    }
}

// The C ABI takes at most 16 dims per tensor: 16 are taken (15 leading ones), a 17-dim x is
// refused naming x and the limit, and nothing is written.
TEST(LinearLeadingDims, SixteenDimsAtMost) {
  const int64_t K = 64, N = 3;
  Buf w(DType::F32, {N, K});
  kstest::fill_normal(w);
  std::vector<int64_t> xs(16, 1), os(16, 1);
  xs[15] = K;
  os[15] = N;
  Buf x(DType::F32, xs), out(DType::F32, os);
  kstest::fill_normal(x);
  EXPECT_EQ(run("gemm", out, x, w, KS_QTYPE_Q4_1), KS_SUCCESS) << ks_last_error();
  int64_t shape17[17], oshape17[17];
  for (int i = 0; i < 17; ++i) shape17[i] = oshape17[i] = 1;
  shape17[16] = K;
  oshape17[16] = N;
  DLTensor a = x.dl(), b = w.dl(), o = out.dl();
  a.ndim = 17;
  a.shape = shape17;
  a.strides = nullptr;
  o.ndim = 17;
  o.shape = oshape17;
  o.strides = nullptr;
  out.poison();
  Snap s{&out, &x, &w};
  const ks_status_t st = ks_gemm(&o, &a, &b, KS_BACKEND_AUTO, nullptr);
  EXPECT_EQ(st, KS_ERROR_INVALID_ARGUMENT);
  const std::string err = ks_last_error();
  EXPECT_NE(err.find("has 17 dims; kernscope takes 0 to 16"), std::string::npos) << err;
  EXPECT_TRUE(err.find("out has") != std::string::npos || err.find("a has") != std::string::npos) << err;
  EXPECT_TRUE(s.same());
}

}  // namespace
