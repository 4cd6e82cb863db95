// The linear ops take x [..., K] (any leading dims, M = their product, as
// torch.nn.functional.linear): gemm, quant_matmul and quant_matmul_a8 give out [..., N], each row
// bit for bit its row of the 2-D reshape, under every CPU variant; a 1-D x gives out [N]; out of
// the reshape's [M, N] shape is refused, naming out, and nothing is written. The same for the two
// fused quant forms (residual / x / residual_out [..., K], gate_up [..., 2K]); the RoPE fusion
// stays 2-D.
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

// fused_add_rms_norm_quant_matmul (with and without x) and silu_and_mul_quant_matmul on
// [2, 3, ...] inputs equal their 2-D reshape bit for bit (out and residual_out), a 1-D row gives
// out [N], out of the reshape's shape is refused naming out with nothing written, zero leading
// dims are a no-op, and the RoPE fusion refuses a 3-D residual, naming it.
ks_status_t run_norm(Buf& out, Buf* ro, Buf* x, Buf& res, Buf& nw, Buf& w, ks_qtype_t q) {
  DLTensor o = out.dl(), r = res.dl(), n = nw.dl(), b = w.dl();
  DLTensor rod = ro ? ro->dl() : DLTensor{}, xd = x ? x->dl() : DLTensor{};
  return ks_fused_add_rms_norm_quant_matmul(&o, ro ? &rod : nullptr, x ? &xd : nullptr, &r, &n, 1e-5, &b, q,
                                            KS_BACKEND_AUTO, nullptr);
}
ks_status_t run_silu(Buf& out, Buf& gu, Buf& w, ks_qtype_t q) {
  DLTensor o = out.dl(), g = gu.dl(), b = w.dl();
  return ks_silu_and_mul_quant_matmul(&o, &g, &b, q, KS_BACKEND_AUTO, nullptr);
}

TEST(LinearLeadingDims, FusedQuantFormsEqualTheTwoDimReshape) {
  const int64_t K = 64, N = 5;
  const ks_qtype_t q = KS_QTYPE_Q8_0;
  Buf w = make_packed(q, N, K);
  for (DType dt : kFloatTypes()) {
    SCOPED_TRACE(dt_name(dt));
    Buf nw(dt, {K});
    kstest::fill_normal(nw, 1.0, 1.0);
    for (bool with_x : {true, false}) {
      SCOPED_TRACE(with_x ? "fused_add_rms_norm_quant_matmul with x" : "fused_add_rms_norm_quant_matmul, residual only");
      Buf res(dt, {2, 3, K}), x(dt, {2, 3, K}), res2(dt, {6, K}), x2(dt, {6, K});
      kstest::fill_normal(res);
      kstest::fill_normal(x);
      std::memcpy(res2.data(), res.data(), res.nbytes());
      std::memcpy(x2.data(), x.data(), x.nbytes());
      Buf out(dt, {2, 3, N}, 1), ro(dt, {2, 3, K}, 1), ref(dt, {6, N}), ref_ro(dt, {6, K});
      out.poison();
      ro.poison();
      ref.poison();
      ref_ro.poison();
      Snap in{&res, &x, &nw, &w};
      ASSERT_EQ(run_norm(ref, with_x ? &ref_ro : nullptr, with_x ? &x2 : nullptr, res2, nw, w, q), KS_SUCCESS)
          << ks_last_error();
      ASSERT_EQ(run_norm(out, with_x ? &ro : nullptr, with_x ? &x : nullptr, res, nw, w, q), KS_SUCCESS)
          << ks_last_error();
      EXPECT_EQ(std::memcmp(out.data(), ref.data(), ref.nbytes()), 0);
      if (with_x) EXPECT_EQ(std::memcmp(ro.data(), ref_ro.data(), ref_ro.nbytes()), 0) << "residual_out";
      EXPECT_TRUE(out.guards_intact());
      EXPECT_TRUE(ro.guards_intact());
      EXPECT_TRUE(in.same());
      if (!with_x) {  // one row: residual [K] -> out [N], row 4's values
        const size_t es = res2.nbytes() / size_t(6 * K);
        Buf r1(dt, {K}), o1(dt, {N});
        std::memcpy(r1.data(), static_cast<char*>(res2.data()) + 4 * K * es, r1.nbytes());
        o1.poison();
        ASSERT_EQ(run_norm(o1, nullptr, nullptr, r1, nw, w, q), KS_SUCCESS) << ks_last_error();
        EXPECT_EQ(std::memcmp(o1.data(), static_cast<char*>(ref.data()) + 4 * N * es, o1.nbytes()), 0);
      }
      Buf bad(dt, {6, N});
      bad.poison();
      Snap s{&bad, &res, &x, &nw, &w};
      EXPECT_TRUE(fails_cleanly(run_norm(bad, with_x ? &ro : nullptr, with_x ? &x : nullptr, res, nw, w, q),
                                KS_ERROR_INVALID_ARGUMENT, "fused_add_rms_norm_quant_matmul", "out", s));
      Buf r0(dt, {4, 0, K}), x0(dt, {4, 0, K}), ro0(dt, {4, 0, K}), o0(dt, {4, 0, N});
      EXPECT_EQ(run_norm(o0, with_x ? &ro0 : nullptr, with_x ? &x0 : nullptr, r0, nw, w, q), KS_SUCCESS)
          << ks_last_error();
    }
    {
      SCOPED_TRACE("silu_and_mul_quant_matmul");
      Buf gu(dt, {3, 2, 2 * K}), gu2(dt, {6, 2 * K});
      kstest::fill_normal(gu, 2.0);
      std::memcpy(gu2.data(), gu.data(), gu.nbytes());
      Buf out(dt, {3, 2, N}, 1), ref(dt, {6, N});
      out.poison();
      ref.poison();
      Snap in{&gu, &w};
      ASSERT_EQ(run_silu(ref, gu2, w, q), KS_SUCCESS) << ks_last_error();
      ASSERT_EQ(run_silu(out, gu, w, q), KS_SUCCESS) << ks_last_error();
      EXPECT_EQ(std::memcmp(out.data(), ref.data(), ref.nbytes()), 0);
      EXPECT_TRUE(out.guards_intact());
      EXPECT_TRUE(in.same());
      const size_t es = gu2.nbytes() / size_t(6 * 2 * K);
      Buf g1(dt, {2 * K}), o1(dt, {N});
      std::memcpy(g1.data(), static_cast<char*>(gu2.data()) + 5 * 2 * K * es, g1.nbytes());
      o1.poison();
      ASSERT_EQ(run_silu(o1, g1, w, q), KS_SUCCESS) << ks_last_error();
      EXPECT_EQ(std::memcmp(o1.data(), static_cast<char*>(ref.data()) + 5 * N * es, o1.nbytes()), 0);
      Buf bad(dt, {6, N});
      bad.poison();
      Snap s{&bad, &gu, &w};
      EXPECT_TRUE(fails_cleanly(run_silu(bad, gu, w, q), KS_ERROR_INVALID_ARGUMENT, "silu_and_mul_quant_matmul", "out", s));
      Buf g0(dt, {0, 3, 2 * K}), o0(dt, {0, 3, N});
      EXPECT_EQ(run_silu(o0, g0, w, q), KS_SUCCESS) << ks_last_error();
    }
  }
}

TEST(LinearLeadingDims, RopeFusionStaysTwoDim) {
  const int64_t K = 64, H = 2, KVH = 1, D = 8, N = (H + 2 * KVH) * D;
  Buf w = make_packed(KS_QTYPE_Q8_0, N, K);
  Buf res(DType::F32, {1, 1, K}), nw(DType::F32, {K}), out(DType::F32, {1, 1, N}), pos(DType::I64, {1}),
      kc(DType::F32, {4, 1, KVH, D}), vc(DType::F32, {4, 1, KVH, D}), slots(DType::I64, {1});
  kstest::fill_normal(res);
  kstest::fill_normal(nw, 1.0, 1.0);
  static_cast<int64_t*>(pos.data())[0] = 3;
  static_cast<int64_t*>(slots.data())[0] = 1;
  out.poison();
  kc.poison();
  vc.poison();
  Snap s{&out, &res, &nw, &w, &kc, &vc};
  DLTensor o = out.dl(), r = res.dl(), n = nw.dl(), b = w.dl(), p = pos.dl(), k = kc.dl(), v = vc.dl(), sl = slots.dl();
  const ks_status_t st = ks_fused_add_rms_norm_quant_matmul_rope_kv_append(
      &o, nullptr, nullptr, &r, &n, 1e-5, &b, KS_QTYPE_Q8_0, H, KVH, &p, D, 10000.0, 1, &k, &v, &sl, KS_BACKEND_AUTO,
      nullptr);
  EXPECT_TRUE(fails_cleanly(st, KS_ERROR_INVALID_ARGUMENT, "fused_add_rms_norm_quant_matmul_rope_kv_append", "residual", s));
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
