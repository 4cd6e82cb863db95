// ks_quant_matmul: out[M, N] = x[M, K] @ dequant(W)^T from packed GGUF blocks, against an
// FP64 reference built from a test-side encoder and an independent FP64 decoder.
// Tolerance: the seed's per-dtype rtol/atol plus the larger of the allowance in
// docs/contracts.md for sums in an unspecified order, 8 sqrt(K) u sum_k |p_k|, and the
// first-order bound of a left-to-right FP32 sum, u (sum_k |p_k| + sum_k |s_k|), u = 2^-24
// (the dequantized weights are exact in FP32: products and sums are the only roundings).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "validation_harness.hpp"
#include "gguf_blocks_fp64.hpp"

namespace {

using namespace kstest::harness;
using namespace kstest::gguf;

const char* kOp = "quant_matmul";

ks_status_t run_qmm(Buf& out, Buf& x, Buf& w, ks_qtype_t q, ks_backend_t be = KS_BACKEND_AUTO) {
  DLTensor o = out.dl(), a = x.dl(), b = w.dl();
  return ks_quant_matmul(&o, &a, &b, q, be, nullptr);
}

::testing::AssertionResult matches_reference(const Buf& out, const Buf& x, const std::vector<double>& w, int64_t M,
                                             int64_t N, int64_t K) {
  const kstest::MatmulRef r = kstest::matmul_nt_ref(x.values(), w, M, N, K);
  const double t = kstest::tol(out.dtype);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      const double s = r.val[size_t(m * N + n)];
      const double got = out.get(m * N + n);
      const double lim = t + t * std::fabs(s) + (1 + t) * kU32 * r.mag[size_t(m * N + n)];
      if (!(std::fabs(got - s) <= lim))
        return ::testing::AssertionFailure() << "out[" << m << ", " << n << "]: got " << got << ", want " << s
                                             << " (|diff| " << std::fabs(got - s) << " > " << lim << ")";
    }
  return ::testing::AssertionSuccess();
}

void check_case(ks_qtype_t q, DType dt, int64_t M, int64_t N, int64_t K, size_t off_o, size_t off_x, size_t off_w) {
  Buf w = make_packed(q, N, K, nullptr, off_w);
  const auto wd = decode_all(q, w, K);
  Buf x(dt, {M, K}, off_x);
  kstest::fill_normal(x);
  Buf out(dt, {M, N}, off_o);
  out.poison();
  Snap in{&x, &w};
  KS_RUN_OR_SKIP(run_qmm(out, x, w, q));
  EXPECT_TRUE(matches_reference(out, x, wd, M, N, K))
      << qfmt(q).name << " x " << dt_name(dt) << " M " << M << " N " << N << " K " << K;
  EXPECT_TRUE(out.guards_intact()) << "wrote outside out";
  EXPECT_TRUE(in.same()) << "inputs modified";
}

TEST(QuantMatmul, AllFormatsShapesDtypes) {
  const int64_t Ms[] = {1, 3, 17};
  const int64_t Ks[] = {32, 64, 576, 1536};
  const int64_t Ns[] = {1, 7, 13};
  FOR_EACH_VARIANT(kOp) {
    int idx = 0;
    for (const auto& f : all_qfmts())
      for (DType dt : kFloatTypes())
        for (int64_t M : Ms)
          for (int64_t K : Ks) {
            const int64_t N = Ns[idx % 3];
            ++idx;
            const size_t off = size_t(idx % 4);  // every fourth case aligned, the rest misaligned
            check_case(f.q, dt, M, N, K, off, (off * 3) % 4, (off + 1) % 3);
          }
  }
}

TEST(QuantMatmul, TileAndPanelEdges) {
  // Row counts around register tiles (1..3 decode rows, 4-row tiles and their remainders)
  // and weight-row counts around 4/8-row panels.
  FOR_EACH_VARIANT(kOp) {
    for (ks_qtype_t q : {KS_QTYPE_Q4_0, KS_QTYPE_Q4_1, KS_QTYPE_Q8_0})
      for (int64_t M : {2, 4, 5, 8, 9})
        for (int64_t N : {3, 4, 8, 9, 17}) check_case(q, DType::F32, M, N, 64, size_t(M % 3), size_t(N % 4), 1);
  }
}

TEST(QuantMatmul, ThreadedSizes) {
  // Work above the threading thresholds, for decode-sized and prefill-sized M.
  FOR_EACH_VARIANT(kOp) {
    for (ks_qtype_t q : {KS_QTYPE_Q4_0, KS_QTYPE_Q8_0}) {
      check_case(q, DType::F32, 2, 67, 1536, 1, 0, 2);
      check_case(q, DType::F32, 19, 29, 576, 0, 3, 1);
    }
    check_case(KS_QTYPE_Q4_1, DType::BF16, 5, 41, 1536, 2, 2, 0);
  }
}

TEST(QuantMatmul, DenseFormatsOddK) {
  // F32 / F16 / BF16 "blocks" hold one element: K need not be a multiple of 32.
  FOR_EACH_VARIANT(kOp) {
    for (ks_qtype_t q : {KS_QTYPE_F32, KS_QTYPE_F16, KS_QTYPE_BF16})
      for (DType dt : kFloatTypes())
        for (int64_t K : {1, 3, 33, 255}) check_case(q, dt, 3, 5, K, 1, 2, 1);
  }
}

void known_q4_0_case(DType dt) {
  // W row n: one Q4_0 block with d = 0.5 (0x3800) and all nibbles = n + 1 -> w = 0.5 * (n - 7).
  // x = 1..32 -> out[m, n] = 0.5 * (n - 7) * 528 * (m + 1) exactly.
  const int64_t N = 5, M = 2, K = 32;
  Buf w(DType::U8, {N, 18}, 1);
  auto* p = static_cast<uint8_t*>(w.data());
  for (int64_t n = 0; n < N; ++n) {
    p[18 * n] = 0x00;
    p[18 * n + 1] = 0x38;
    for (int j = 0; j < 16; ++j) p[18 * n + 2 + j] = uint8_t((n + 1) | ((n + 1) << 4));
  }
  Buf x(dt, {M, K});
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) x.set(m * K + k, double((k + 1) * (m + 1)));
  Buf out(dt, {M, N}, 3);
  out.poison();
  KS_RUN_OR_SKIP(run_qmm(out, x, w, KS_QTYPE_Q4_0));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n)
      EXPECT_EQ(out.get(m * N + n), round_to(dt, 0.5 * double(n - 7) * 528.0 * double(m + 1)))
          << dt_name(dt) << " out[" << m << ", " << n << "]";
}

TEST(QuantMatmul, KnownQ4_0Weights) {
  FOR_EACH_VARIANT(kOp) {
    for (DType dt : kFloatTypes()) known_q4_0_case(dt);
  }
}

void fp16_range_case(ks_qtype_t q, DType dt) {
  // x = (300, 300, -300, -300, 1, 0...) against a row (300, 300, 300, 300, 7, 0...): partial
  // sums reach 180000, the result is exactly 7 (FP32 accumulation).
  const int64_t K = 32;
  std::vector<double> wv(K, 0.0);
  for (int k = 0; k < 4; ++k) wv[size_t(k)] = 300;
  wv[4] = 7;
  Buf w(DType::U8, {1, q_row_bytes(q, K)});
  encode_row(q, wv.data(), K, static_cast<uint8_t*>(w.data()));
  Buf x(dt, {1, K}), out(dt, {1, 1});
  for (int k = 0; k < K; ++k) x.set(k, k < 2 ? 300.0 : k < 4 ? -300.0 : k == 4 ? 1.0 : 0.0);
  out.poison();
  KS_RUN_OR_SKIP(run_qmm(out, x, w, q));
  EXPECT_EQ(out.get(0), 7.0) << qfmt(q).name << " x " << dt_name(dt);
}

TEST(QuantMatmul, IntermediateSumsPastFp16Range) {
  FOR_EACH_VARIANT(kOp) {
    for (ks_qtype_t q : {KS_QTYPE_F16, KS_QTYPE_BF16, KS_QTYPE_F32})
      for (DType dt : kFloatTypes()) fp16_range_case(q, dt);
  }
}

void via_dequantize_case(ks_qtype_t q) {
  // Same result as ks_dequantize to fp32 followed by an FP64 product of the dequantized values.
  const int64_t M = 4, N = 9, K = 96;
  Buf w = make_packed(q, N, K);
  Buf wf(DType::F32, {N, K});
  DLTensor o = wf.dl(), pk = w.dl();
  ASSERT_EQ(ks_dequantize(&o, &pk, q, KS_BACKEND_AUTO, nullptr), KS_SUCCESS) << ks_last_error();
  Buf x(DType::F32, {M, K});
  kstest::fill_normal(x);
  Buf out(DType::F32, {M, N});
  out.poison();
  KS_RUN_OR_SKIP(run_qmm(out, x, w, q));
  EXPECT_TRUE(matches_reference(out, x, wf.values(), M, N, K)) << qfmt(q).name;
}

TEST(QuantMatmul, MatchesDequantizeThenGemm) {
  FOR_EACH_VARIANT(kOp) {
    for (ks_qtype_t q : {KS_QTYPE_Q4_0, KS_QTYPE_Q4_1, KS_QTYPE_Q8_0}) via_dequantize_case(q);
  }
}

void batch_invariance_case(ks_qtype_t q, DType dt) {
  // Row m of an M-row call equals the 1-row call on x[m], bit for bit.
  const int64_t M = 17, N = 11, K = 576;
  Buf w = make_packed(q, N, K);
  Buf x(dt, {M, K});
  kstest::fill_normal(x);
  Buf out(dt, {M, N});
  out.poison();
  KS_RUN_OR_SKIP(run_qmm(out, x, w, q));
  const size_t es = ks::dtype_size(dt);
  for (int64_t m : {int64_t(0), int64_t(8), M - 1}) {
    Buf x1(dt, {1, K}, 1), o1(dt, {1, N}, 2);
    std::memcpy(x1.data(), static_cast<uint8_t*>(x.data()) + size_t(m * K) * es, size_t(K) * es);
    o1.poison();
    KS_RUN_OR_SKIP(run_qmm(o1, x1, w, q));
    EXPECT_EQ(0, std::memcmp(o1.data(), static_cast<uint8_t*>(out.data()) + size_t(m * N) * es, size_t(N) * es))
        << qfmt(q).name << " " << dt_name(dt) << " row " << m;
  }
}

TEST(QuantMatmul, RowsAreIndependentOfBatch) {
  FOR_EACH_VARIANT(kOp) {
    for (ks_qtype_t q : {KS_QTYPE_Q4_1, KS_QTYPE_Q8_0})
      for (DType dt : kFloatTypes()) batch_invariance_case(q, dt);
  }
}

TEST(QuantMatmul, PinnedVariantThatCannotRunWritesNothing) {
  // ks_force_variant: a pinned variant that declines a call fails it with
  // BACKEND_UNAVAILABLE naming the op, and writes nothing; if it accepts, it is correct.
  for (const std::string& v : variants_of(kOp)) {
    if (v.empty() || v == "cpu_reference") continue;
    for (ks_qtype_t q : {KS_QTYPE_F16, KS_QTYPE_Q8_0})
      for (DType dt : {DType::F16, DType::BF16}) {
        Buf w = make_packed(q, 5, 64);
        const auto wd = decode_all(q, w, 64);
        Buf x(dt, {3, 64});
        kstest::fill_normal(x);
        Buf out(dt, {3, 5});
        out.poison();
        ASSERT_EQ(ks_force_variant(kOp, v.c_str()), KS_SUCCESS) << ks_last_error();
        Snap s{&out, &x, &w};
        const ks_status_t st = run_qmm(out, x, w, q);
        const std::string msg = ks_last_error();
        ks_force_variant(kOp, nullptr);
        if (st == KS_SUCCESS) {
          EXPECT_TRUE(matches_reference(out, x, wd, 3, 5, 64)) << v;
        } else {
          EXPECT_EQ(st, KS_ERROR_BACKEND_UNAVAILABLE) << v << ": " << msg;
          EXPECT_NE(msg.find(kOp), std::string::npos) << msg;
          EXPECT_TRUE(s.same()) << v << " declined but wrote";
        }
      }
  }
}

TEST(QuantMatmul, ZeroMOrNIsANoOp) {
  {
    Buf w = make_packed(KS_QTYPE_Q8_0, 3, 64);
    Buf x(DType::F16, {0, 64}), out(DType::F16, {0, 3});
    Snap s{&out, &w, &x};
    EXPECT_EQ(run_qmm(out, x, w, KS_QTYPE_Q8_0), KS_SUCCESS) << ks_last_error();
    EXPECT_TRUE(s.same());
  }
  {
    Buf w(DType::U8, {0, 36});
    Buf x(DType::F32, {2, 64}), out(DType::F32, {2, 0});
    kstest::fill_normal(x);
    Snap s{&out, &w, &x};
    EXPECT_EQ(run_qmm(out, x, w, KS_QTYPE_Q4_0), KS_SUCCESS) << ks_last_error();
    EXPECT_TRUE(s.same());
    // Still validated with zero N: the wrong bytes per row (Q4_1 needs 40) is rejected.
    EXPECT_TRUE(fails_cleanly(run_qmm(out, x, w, KS_QTYPE_Q4_1), KS_ERROR_INVALID_ARGUMENT, kOp, "weight", s));
  }
  {
    // An empty x whose K makes a weight row more than 2^63 bytes (F32: 4 K; Q8_0: K / 32 * 34): the
    // bytes per row are not computed with a wrap (which had accepted a weight of 0 bytes per row,
    // or asked for a negative count); rejected naming x's K and the weight.
    for (const auto& [q, k] : {std::pair<ks_qtype_t, int64_t>{KS_QTYPE_F32, int64_t(1) << 62},
                               std::pair<ks_qtype_t, int64_t>{KS_QTYPE_Q8_0, INT64_MAX / 32 * 32}}) {
      Buf w(DType::U8, {5, 0});
      Buf x(DType::F16, {0, k}), out(DType::F16, {0, 5});
      Snap s{&out, &w, &x};
      EXPECT_TRUE(fails_cleanly(run_qmm(out, x, w, q), KS_ERROR_INVALID_ARGUMENT, kOp, "weight", s));
      EXPECT_NE(std::string(ks_last_error()).find("is too large"), std::string::npos) << ks_last_error();
    }
  }
}

TEST(QuantMatmul, CommonTensorRules) {
  for (DType dt : kFloatTypes()) {
    Buf w = make_packed(KS_QTYPE_Q4_0, 5, 64);
    Buf x(dt, {3, 64});
    kstest::fill_normal(x);
    Buf out(dt, {3, 5});
    out.poison();
    check_common_rules(kOp,
                       {{"out", &out, false, {other_float(dt), kI32}},
                        {"x", &x, false, {kI32, kU8, kI16}},
                        {"weight", &w, false, {DLDataType{kDLInt, 8, 1}, kF16}}},
                       [&](std::vector<DLTensor*>& t, ks_backend_t be) {
                         return ks_quant_matmul(t[0], t[1], t[2], KS_QTYPE_Q4_0, be, nullptr);
                       });
  }
}

TEST(QuantMatmul, RejectsBadArguments) {
  const ks_status_t INV = KS_ERROR_INVALID_ARGUMENT, DT = KS_ERROR_UNSUPPORTED_DTYPE;
  auto expect = [&](Buf& out, Buf& x, Buf& w, ks_qtype_t q, ks_status_t want, const char* arg, const std::string& what) {
    out.poison();
    Snap s{&out, &x, &w};
    EXPECT_TRUE(fails_cleanly(run_qmm(out, x, w, q), want, kOp, arg, s)) << what;
  };
  Buf x(DType::F32, {3, 64});
  kstest::fill_normal(x);
  Buf w = make_packed(KS_QTYPE_Q8_0, 5, 64);
  Buf out(DType::F32, {3, 5});
  for (int q : {0, 7, -3, 1000}) expect(out, x, w, static_cast<ks_qtype_t>(q), INV, "qtype", "qtype " + std::to_string(q));
  for (const auto& f : all_qfmts())
    for (int delta : {-2, 2}) {
      Buf wb(DType::U8, {5, q_row_bytes(f.q, 64) + delta});
      expect(out, x, wb, f.q, INV, "weight", std::string("bytes per row ") + f.name);
    }
  {
    Buf x48(DType::F32, {3, 48});
    kstest::fill_normal(x48);
    Buf w48(DType::U8, {5, 34});
    expect(out, x48, w48, KS_QTYPE_Q8_0, INV, "weight|x", "K 48 not a multiple of 32");
  }
  {
    Buf o2(DType::F32, {5, 3});
    expect(o2, x, w, KS_QTYPE_Q8_0, INV, "out", "out transposed");
    Buf o3(DType::F32, {15});
    expect(o3, x, w, KS_QTYPE_Q8_0, INV, "out", "out 1-D");
  }
  {
    // (x [..., K] is taken, out [..., N]: test_linear_leading_dims.cpp; a 0-d x is not, nor out
    // of the 2-D reshape's shape for a 3-D x)
    Buf x0(DType::F32, {});
    kstest::fill_normal(x0);
    Buf o1(DType::F32, {5});
    expect(o1, x0, w, KS_QTYPE_Q8_0, INV, "x", "x 0-d");
    Buf x3(DType::F32, {1, 3, 64});
    kstest::fill_normal(x3);
    Buf o3(DType::F32, {3, 5});
    expect(o3, x3, w, KS_QTYPE_Q8_0, INV, "out", "x 3-D, out the reshape's [3, 5]");
  }
  {
    Buf w1(DType::U8, {5 * 68});
    expect(out, x, w1, KS_QTYPE_Q8_0, INV, "weight", "weight 1-D");
  }
  {
    Buf x0(DType::F32, {3, 0});
    Buf w0(DType::U8, {5, 0});
    expect(out, x0, w0, KS_QTYPE_Q8_0, INV, "x", "K = 0");
  }
  for (DType a : kFloatTypes())
    for (DType b : kFloatTypes()) {
      if (a == b) continue;
      Buf xa(a, {3, 64});
      kstest::fill_normal(xa);
      Buf ob(b, {3, 5});
      expect(ob, xa, w, KS_QTYPE_Q8_0, DT, "out|x", "x " + dt_name(a) + " out " + dt_name(b));
    }
}

TEST(QuantMatmul, RejectsOverlap) {
  Buf store(DType::U8, {5 * 34 + 64});
  auto* base = static_cast<uint8_t*>(store.data());
  {
    std::vector<double> v(160);
    for (auto& e : v) e = std::sin(double(&e - v.data()));
    for (int r = 0; r < 5; ++r) encode_row(KS_QTYPE_Q8_0, v.data() + 32 * r, 32, base + 34 * r);
  }
  Buf x(DType::F32, {3, 32});
  kstest::fill_normal(x);
  int64_t ws[2] = {5, 34}, os[2] = {3, 5};
  DLTensor w = store.dl(), o = store.dl(), xx = x.dl();
  w.ndim = 2;
  w.shape = ws;
  o.ndim = 2;
  o.shape = os;
  o.dtype = kF32;
  o.data = base + 160;  // overlaps the last weight row
  Snap s{&store, &x};
  EXPECT_TRUE(fails_cleanly(ks_quant_matmul(&o, &xx, &w, KS_QTYPE_Q8_0, KS_BACKEND_AUTO, nullptr),
                            KS_ERROR_INVALID_ARGUMENT, kOp, "out|weight", s));
  o.data = base + 170;  // right after: fine
  EXPECT_EQ(ks_quant_matmul(&o, &xx, &w, KS_QTYPE_Q8_0, KS_BACKEND_AUTO, nullptr), KS_SUCCESS) << ks_last_error();
  // out overlapping x
  Buf xs(DType::F32, {3 * 32 + 15});
  kstest::fill_normal(xs);
  DLTensor x2 = xs.dl(), o2 = xs.dl();
  int64_t x2s[2] = {3, 32};
  x2.ndim = 2;
  x2.shape = x2s;
  o2.ndim = 2;
  o2.shape = os;
  o2.data = static_cast<float*>(xs.data()) + 90;
  Snap s2{&store, &xs};
  EXPECT_TRUE(fails_cleanly(ks_quant_matmul(&o2, &x2, &w, KS_QTYPE_Q8_0, KS_BACKEND_AUTO, nullptr),
                            KS_ERROR_INVALID_ARGUMENT, kOp, "out|x", s2));
}

}  // namespace
