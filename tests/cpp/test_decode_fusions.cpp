// The decode-step fusions. ks_rotary_embedding_kv_append: bit for bit ks_rotary_embedding then
// ks_kv_cache_append (whose own tests compare with FP64), on every variant; its argument rules.
// ks_rotary_embedding_kv_append_paged_attention: bit for bit ks_rotary_embedding_kv_append then
// ks_paged_attention (FP64-tested in test_paged_attention.cpp); its argument rules.
// ks_fused_add_rms_norm_quant_matmul and ks_silu_and_mul_quant_matmul
// against an FP64 reference (an independent FP64 block decoder, norm and SiLU in FP64), and,
// on the CPU, bit for bit against the unfused sequence (fused_add_rms_norm / rms_norm /
// silu_and_mul, then quant_matmul) that the model's prefill runs.
// Tolerance: quant_matmul's (the seed's per-dtype rtol/atol plus the FP32 sum bound) plus the
// rounding of the normalized / activated row h to the dtype: u_T sum_k |w_k h_k| (u_T = 2^-8
// bf16, 2^-11 fp16, 2^-24 fp32) and the FP32 error of computing h, 8 u32 sum_k |w_k h_k|.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "validation_harness.hpp"
#include "gguf_blocks_fp64.hpp"
#include "rope_attention_case.hpp"

namespace {

using namespace kstest::harness;
using namespace kstest::gguf;

const char* kNorm = "fused_add_rms_norm_quant_matmul";
const char* kSilu = "silu_and_mul_quant_matmul";

double unit(DType d) { return d == DType::BF16 ? 0x1p-8 : d == DType::F16 ? 0x1p-11 : 0x1p-24; }

// out[m, n] against sum_k h[m, k] w[n, k] in FP64
::testing::AssertionResult close_to(const Buf& out, const std::vector<double>& h, const std::vector<double>& w, int64_t M,
                                    int64_t N, int64_t K) {
  const double t = kstest::tol(out.dtype), uT = unit(out.dtype);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double s = 0, mag = 0;
      for (int64_t k = 0; k < K; ++k) {
        const double p = h[size_t(m * K + k)] * w[size_t(n * K + k)];
        s += p;
        mag += std::fabs(p);
      }
      const double got = out.get(m * N + n);
      const double lim = t + t * std::fabs(s) + (uT + 8 * kU32) * mag + (1 + t) * 2 * kU32 * mag;
      if (!(std::fabs(got - s) <= lim))
        return ::testing::AssertionFailure() << "out[" << m << ", " << n << "]: got " << got << ", want " << s
                                             << " (|diff| " << std::fabs(got - s) << " > " << lim << ")";
    }
  return ::testing::AssertionSuccess();
}

ks_status_t run_norm(Buf& out, Buf* res_out, Buf* x, Buf& res, Buf& nw, double eps, Buf& w, ks_qtype_t q,
                     ks_backend_t be = KS_BACKEND_AUTO) {
  DLTensor o = out.dl(), r = res.dl(), n = nw.dl(), ww = w.dl(), ro{}, xx{};
  if (res_out) ro = res_out->dl();
  if (x) xx = x->dl();
  return ks_fused_add_rms_norm_quant_matmul(&o, res_out ? &ro : nullptr, x ? &xx : nullptr, &r, &n, eps, &ww, q, be,
                                            nullptr);
}

ks_status_t run_silu(Buf& out, Buf& gu, Buf& w, ks_qtype_t q, ks_backend_t be = KS_BACKEND_AUTO) {
  DLTensor o = out.dl(), g = gu.dl(), ww = w.dl();
  return ks_silu_and_mul_quant_matmul(&o, &g, &ww, q, be, nullptr);
}

void norm_case(ks_qtype_t q, DType dt, int64_t M, int64_t N, int64_t K, bool with_x, size_t off, double scale = 1.0) {
  Buf w = make_packed(q, N, K, nullptr, off);
  const auto wd = decode_all(q, w, K);
  Buf res(dt, {M, K}, off), x(dt, {M, K}, off), nw(dt, {K}, off), out(dt, {M, N}, off), res_out(dt, {M, K}, off);
  kstest::fill_normal(res, scale);
  kstest::fill_normal(x, scale);
  kstest::fill_normal(nw, 1.0, 1.0);
  out.poison();
  res_out.poison();
  const double eps = 1e-5;
  Snap in{&res, &x, &nw, &w};
  KS_RUN_OR_SKIP(run_norm(out, with_x ? &res_out : nullptr, with_x ? &x : nullptr, res, nw, eps, w, q));
  // FP64: s = x + residual; h = s / sqrt(mean(s^2) + eps) * weight
  std::vector<double> h(size_t(M * K));
  for (int64_t m = 0; m < M; ++m) {
    double ss = 0;
    for (int64_t k = 0; k < K; ++k) {
      const double s = res.get(m * K + k) + (with_x ? x.get(m * K + k) : 0.0);
      h[size_t(m * K + k)] = s;
      ss += s * s;
    }
    const double r = 1.0 / std::sqrt(ss / double(K) + eps);
    for (int64_t k = 0; k < K; ++k) {
      const double s = h[size_t(m * K + k)];
      if (with_x) {  // residual_out = round(s): within half a unit of the dtype
        const double got = res_out.get(m * K + k);
        ASSERT_LE(std::fabs(got - s), unit(dt) * std::fabs(s) * (1 + 1e-9) + 1e-300)
            << "residual_out[" << m << ", " << k << "]";
      }
      h[size_t(m * K + k)] = s * r * nw.get(k);
    }
  }
  EXPECT_TRUE(close_to(out, h, wd, M, N, K)) << qfmt(q).name << " " << dt_name(dt) << " M " << M << " N " << N << " K "
                                             << K << (with_x ? " with x" : " residual only") << " offset " << off;
  EXPECT_TRUE(out.guards_intact()) << "wrote outside out";
  EXPECT_TRUE(res_out.guards_intact()) << "wrote outside residual_out";
  if (!with_x) {
    std::vector<uint8_t> poisoned(res_out.nbytes(), 0xFF);
    EXPECT_EQ(std::memcmp(res_out.data(), poisoned.data(), poisoned.size()), 0) << "residual_out touched without x";
  }
  EXPECT_TRUE(in.same()) << "inputs modified";
}

void silu_case(ks_qtype_t q, DType dt, int64_t M, int64_t N, int64_t K, size_t off) {
  Buf w = make_packed(q, N, K, nullptr, off);
  const auto wd = decode_all(q, w, K);
  Buf gu(dt, {M, 2 * K}, off), out(dt, {M, N}, off);
  kstest::fill_normal(gu, 2.0);
  out.poison();
  Snap in{&gu, &w};
  KS_RUN_OR_SKIP(run_silu(out, gu, w, q));
  std::vector<double> h(size_t(M * K));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) {
      const double g = gu.get(m * 2 * K + k), u = gu.get(m * 2 * K + K + k);
      h[size_t(m * K + k)] = g / (1.0 + std::exp(-g)) * u;
    }
  EXPECT_TRUE(close_to(out, h, wd, M, N, K)) << qfmt(q).name << " " << dt_name(dt) << " M " << M << " N " << N << " K "
                                             << K << " offset " << off;
  EXPECT_TRUE(out.guards_intact()) << "wrote outside out";
  EXPECT_TRUE(in.same()) << "inputs modified";
}

const ks_qtype_t kFormats[] = {KS_QTYPE_Q4_0, KS_QTYPE_Q4_1, KS_QTYPE_Q8_0};

TEST(FusedNormQuantMatmul, AgainstFp64EveryVariant) {
  FOR_EACH_VARIANT(kNorm) {
    for (ks_qtype_t q : kFormats)
      for (DType dt : kFloatTypes())
        for (bool with_x : {true, false}) {
          norm_case(q, dt, 1, 37, 576, with_x, 0);
          norm_case(q, dt, 5, 9, 96, with_x, 2);  // misaligned views, 5 rows (not a multiple of 4)
          norm_case(q, dt, 33, 3, 32, with_x, 0);
        }
  }
}

TEST(FusedNormQuantMatmul, Fp16SumOfSquaresPastItsRange) {
  // |s| ~ 3000: s^2 ~ 1e7 overflows fp16 (max 65504); the FP32 sum of squares does not
  FOR_EACH_VARIANT(kNorm) {
    for (bool with_x : {true, false}) norm_case(KS_QTYPE_Q8_0, DType::F16, 3, 17, 256, with_x, 0, 1500.0);
  }
}

TEST(FusedNormQuantMatmul, CpuEqualsTheUnfusedSequenceBitForBit) {
  for (ks_qtype_t q : kFormats)
    for (DType dt : kFloatTypes())
      for (bool with_x : {true, false}) {
        const int64_t M = 3, N = 21, K = 192;
        Buf w = make_packed(q, N, K);
        Buf res(dt, {M, K}), x(dt, {M, K}), nw(dt, {K}), out(dt, {M, N}), res_out(dt, {M, K});
        kstest::fill_normal(res);
        kstest::fill_normal(x);
        kstest::fill_normal(nw, 1.0, 1.0);
        ASSERT_EQ(run_norm(out, with_x ? &res_out : nullptr, with_x ? &x : nullptr, res, nw, 1e-6, w, q, KS_BACKEND_CPU),
                  KS_SUCCESS)
            << ks_last_error();
        // the unfused steps on copies
        Buf h(dt, {M, K}), r2(dt, {M, K}), o2(dt, {M, N});
        std::memcpy(r2.data(), res.data(), res.nbytes());
        DLTensor hd = h.dl(), rd = r2.dl(), nd = nw.dl(), od = o2.dl(), wd = w.dl();
        if (with_x) {
          std::memcpy(h.data(), x.data(), x.nbytes());
          ASSERT_EQ(ks_fused_add_rms_norm(&hd, &rd, &nd, 1e-6, KS_BACKEND_CPU, nullptr), KS_SUCCESS);
        } else {
          ASSERT_EQ(ks_rms_norm(&hd, &rd, &nd, 1e-6, KS_BACKEND_CPU, nullptr), KS_SUCCESS);
        }
        ASSERT_EQ(ks_quant_matmul(&od, &hd, &wd, q, KS_BACKEND_CPU, nullptr), KS_SUCCESS);
        EXPECT_EQ(std::memcmp(out.data(), o2.data(), out.nbytes()), 0) << qfmt(q).name << " " << dt_name(dt);
        if (with_x) EXPECT_EQ(std::memcmp(res_out.data(), r2.data(), r2.nbytes()), 0) << "residual_out";
      }
}

TEST(FusedNormQuantMatmul, RowsAreIndependentOfTheBatch) {
  FOR_EACH_VARIANT(kNorm) {
    const int64_t N = 40, K = 128;
    for (DType dt : kFloatTypes()) {
      Buf w = make_packed(KS_QTYPE_Q4_1, N, K);
      Buf res(dt, {9, K}), x(dt, {9, K}), nw(dt, {K});
      kstest::fill_normal(res);
      kstest::fill_normal(x);
      kstest::fill_normal(nw, 1.0, 1.0);
      Buf out(dt, {9, N}), ro(dt, {9, K});
      KS_RUN_OR_SKIP(run_norm(out, &ro, &x, res, nw, 1e-5, w, KS_QTYPE_Q4_1));
      const size_t es = ks::dtype_size(dt);
      for (int64_t row : {0, 4, 8}) {  // the same row alone
        Buf r1(dt, {1, K}), x1(dt, {1, K}), o1(dt, {1, N}), ro1(dt, {1, K});
        std::memcpy(r1.data(), static_cast<char*>(res.data()) + row * K * es, K * es);
        std::memcpy(x1.data(), static_cast<char*>(x.data()) + row * K * es, K * es);
        KS_RUN_OR_SKIP(run_norm(o1, &ro1, &x1, r1, nw, 1e-5, w, KS_QTYPE_Q4_1));
        EXPECT_EQ(std::memcmp(o1.data(), static_cast<char*>(out.data()) + row * N * es, N * es), 0)
            << dt_name(dt) << " row " << row;
        EXPECT_EQ(std::memcmp(ro1.data(), static_cast<char*>(ro.data()) + row * K * es, K * es), 0)
            << dt_name(dt) << " residual_out row " << row;
      }
    }
  }
}

TEST(FusedNormQuantMatmul, NoOutputColumnsStillWritesResidualOut) {
  FOR_EACH_VARIANT(kNorm) {
    const int64_t M = 2, K = 64;
    Buf w(DType::U8, {0, q_row_bytes(KS_QTYPE_Q8_0, K)});
    Buf res(DType::F32, {M, K}), x(DType::F32, {M, K}), nw(DType::F32, {K}), out(DType::F32, {M, 0}),
        ro(DType::F32, {M, K});
    kstest::fill_normal(res);
    kstest::fill_normal(x);
    kstest::fill_normal(nw);
    ro.poison();
    KS_RUN_OR_SKIP(run_norm(out, &ro, &x, res, nw, 1e-5, w, KS_QTYPE_Q8_0));
    for (int64_t i = 0; i < M * K; ++i) ASSERT_EQ(float(ro.get(i)), float(float(res.get(i)) + float(x.get(i)))) << i;
  }
}

TEST(FusedNormQuantMatmul, ZeroRowsWriteNothing) {
  Buf w = make_packed(KS_QTYPE_Q4_0, 4, 32);
  Buf res(DType::F32, {0, 32}), x(DType::F32, {0, 32}), nw(DType::F32, {32}), out(DType::F32, {0, 4}),
      ro(DType::F32, {0, 32});
  kstest::fill_normal(nw);
  Snap s{&out, &ro};
  EXPECT_EQ(run_norm(out, &ro, &x, res, nw, 1e-5, w, KS_QTYPE_Q4_0), KS_SUCCESS) << ks_last_error();
  EXPECT_TRUE(s.same());
}

TEST(FusedNormQuantMatmul, RejectsBadArgumentsAndWritesNothing) {
  const ks_status_t INV = KS_ERROR_INVALID_ARGUMENT;
  const int64_t M = 3, N = 5, K = 64;
  Buf w = make_packed(KS_QTYPE_Q8_0, N, K);
  Buf res(DType::F32, {M, K}), x(DType::F32, {M, K}), nw(DType::F32, {K}), out(DType::F32, {M, N}),
      ro(DType::F32, {M, K});
  kstest::fill_normal(res);
  kstest::fill_normal(x);
  kstest::fill_normal(nw);
  out.poison();
  ro.poison();
  auto expect = [&](ks_status_t st, ks_status_t want, const char* arg, const std::string& what, Snap s) {
    EXPECT_TRUE(fails_cleanly(st, want, kNorm, arg, s)) << what;
  };
  expect(run_norm(out, &ro, nullptr, res, nw, 1e-5, w, KS_QTYPE_Q8_0), INV, "residual_out", "residual_out without x",
         Snap{&out, &ro, &res});
  expect(run_norm(out, nullptr, &x, res, nw, 1e-5, w, KS_QTYPE_Q8_0), INV, "residual_out", "x without residual_out",
         Snap{&out, &res});
  {
    Buf x2(DType::F32, {M, K + 32});
    expect(run_norm(out, &ro, &x2, res, nw, 1e-5, w, KS_QTYPE_Q8_0), INV, "x", "x shape", Snap{&out, &ro});
    Buf ro2(DType::F32, {M + 1, K});
    expect(run_norm(out, &ro2, &x, res, nw, 1e-5, w, KS_QTYPE_Q8_0), INV, "residual_out", "residual_out shape",
           Snap{&out, &ro2});
    Buf nw2(DType::F32, {K - 1});
    expect(run_norm(out, &ro, &x, res, nw2, 1e-5, w, KS_QTYPE_Q8_0), INV, "norm_weight", "norm_weight shape",
           Snap{&out, &ro});
    Buf o2(DType::F32, {M, N + 1});
    expect(run_norm(o2, &ro, &x, res, nw, 1e-5, w, KS_QTYPE_Q8_0), INV, "out", "out shape", Snap{&o2, &ro});
    Buf w2 = make_packed(KS_QTYPE_Q8_0, N, K + 32);
    expect(run_norm(out, &ro, &x, res, nw, 1e-5, w2, KS_QTYPE_Q8_0), INV, "weight", "weight K", Snap{&out, &ro});
    expect(run_norm(out, &ro, &x, res, nw, 1e-5, w, KS_QTYPE_Q4_1), INV, "weight", "weight bytes for Q4_1",
           Snap{&out, &ro});
    expect(run_norm(out, &ro, &x, res, nw, -1.0, w, KS_QTYPE_Q8_0), INV, "eps", "negative eps", Snap{&out, &ro});
    Buf xh(DType::F16, {M, K});
    expect(run_norm(out, &ro, &xh, res, nw, 1e-5, w, KS_QTYPE_Q8_0), KS_ERROR_UNSUPPORTED_DTYPE, "x", "x dtype",
           Snap{&out, &ro});
  }
  // residual_out must be a second buffer: in place on residual (or on x) is refused
  {
    DLTensor o = out.dl(), r = res.dl(), n = nw.dl(), ww = w.dl(), xx = x.dl();
    Snap s{&out, &res, &x};
    expect(ks_fused_add_rms_norm_quant_matmul(&o, &r, &xx, &r, &n, 1e-5, &ww, KS_QTYPE_Q8_0, KS_BACKEND_AUTO, nullptr),
           INV, "residual_out", "residual_out aliasing residual", s);
    expect(ks_fused_add_rms_norm_quant_matmul(&o, &xx, &xx, &r, &n, 1e-5, &ww, KS_QTYPE_Q8_0, KS_BACKEND_AUTO, nullptr),
           INV, "residual_out", "residual_out aliasing x", s);
  }
  // out overlapping an input
  {
    Buf big(DType::F32, {M, K});
    kstest::fill_normal(big);
    DLTensor o = big.dl(), r = big.dl(), n = nw.dl(), ww = w.dl();
    o.shape = out.shape.data();  // [M, N] over the first elements of residual
    Snap s{&big};
    expect(ks_fused_add_rms_norm_quant_matmul(&o, nullptr, nullptr, &r, &n, 1e-5, &ww, KS_QTYPE_Q8_0, KS_BACKEND_AUTO,
                                              nullptr),
           INV, "out", "out overlapping residual", s);
  }
}

// A step that cannot run fails the whole call before anything is written: quant_matmul pinned
// to its AVX-512 variant, which takes fp32 only (or is absent on this CPU), under an fp16 call.
TEST(FusedNormQuantMatmul, AStepThatCannotRunWritesNothingAndNamesTheOp) {
  const int64_t M = 2, N = 5, K = 64;
  Buf w = make_packed(KS_QTYPE_Q8_0, N, K);
  Buf res(DType::F16, {M, K}), x(DType::F16, {M, K}), nw(DType::F16, {K}), out(DType::F16, {M, N}),
      ro(DType::F16, {M, K}), gu(DType::F16, {M, 2 * K});
  kstest::fill_normal(res);
  kstest::fill_normal(x);
  kstest::fill_normal(nw);
  kstest::fill_normal(gu);
  out.poison();
  ro.poison();
  ASSERT_EQ(ks_force_variant("quant_matmul", "cpu_avx512"), KS_SUCCESS) << ks_last_error();
  const ks_status_t a = run_norm(out, &ro, &x, res, nw, 1e-5, w, KS_QTYPE_Q8_0, KS_BACKEND_CPU);
  const std::string msg_a = ks_last_error();
  const ks_status_t b = run_silu(out, gu, w, KS_QTYPE_Q8_0, KS_BACKEND_CPU);
  const std::string msg_b = ks_last_error();
  ks_force_variant("quant_matmul", nullptr);
  EXPECT_EQ(a, KS_ERROR_BACKEND_UNAVAILABLE);
  EXPECT_NE(msg_a.find(kNorm), std::string::npos) << msg_a;
  EXPECT_NE(msg_a.find("quant_matmul step"), std::string::npos) << msg_a;
  EXPECT_EQ(b, KS_ERROR_BACKEND_UNAVAILABLE);
  EXPECT_NE(msg_b.find(kSilu), std::string::npos) << msg_b;
  std::vector<uint8_t> poisoned(ro.nbytes(), 0xFF);
  EXPECT_EQ(std::memcmp(ro.data(), poisoned.data(), poisoned.size()), 0) << "residual_out written";
  EXPECT_EQ(std::memcmp(out.data(), poisoned.data(), out.nbytes()), 0) << "out written";
}

TEST(SiluQuantMatmul, AgainstFp64EveryVariant) {
  FOR_EACH_VARIANT(kSilu) {
    for (ks_qtype_t q : kFormats)
      for (DType dt : kFloatTypes()) {
        silu_case(q, dt, 1, 29, 1536, 0);
        silu_case(q, dt, 6, 7, 96, 2);
        silu_case(q, dt, 17, 3, 32, 0);
      }
  }
}

TEST(SiluQuantMatmul, CpuEqualsTheUnfusedSequenceBitForBit) {
  for (ks_qtype_t q : kFormats)
    for (DType dt : kFloatTypes()) {
      const int64_t M = 4, N = 13, K = 160;
      Buf w = make_packed(q, N, K);
      Buf gu(dt, {M, 2 * K}), out(dt, {M, N}), h(dt, {M, K}), o2(dt, {M, N});
      kstest::fill_normal(gu, 3.0);
      ASSERT_EQ(run_silu(out, gu, w, q, KS_BACKEND_CPU), KS_SUCCESS) << ks_last_error();
      DLTensor hd = h.dl(), gd = gu.dl(), od = o2.dl(), wd = w.dl();
      ASSERT_EQ(ks_silu_and_mul(&hd, &gd, KS_BACKEND_CPU, nullptr), KS_SUCCESS);
      ASSERT_EQ(ks_quant_matmul(&od, &hd, &wd, q, KS_BACKEND_CPU, nullptr), KS_SUCCESS);
      EXPECT_EQ(std::memcmp(out.data(), o2.data(), out.nbytes()), 0) << qfmt(q).name << " " << dt_name(dt);
    }
}

TEST(SiluQuantMatmul, RejectsBadArgumentsAndWritesNothing) {
  const ks_status_t INV = KS_ERROR_INVALID_ARGUMENT;
  const int64_t M = 2, N = 4, K = 64;
  Buf w = make_packed(KS_QTYPE_Q4_1, N, K);
  Buf gu(DType::F32, {M, 2 * K}), out(DType::F32, {M, N});
  kstest::fill_normal(gu);
  out.poison();
  {
    Buf odd(DType::F32, {M, 2 * K + 1});
    EXPECT_TRUE(fails_cleanly(run_silu(out, odd, w, KS_QTYPE_Q4_1), INV, kSilu, "gate_up", Snap{&out}));
  }
  {
    Buf g2(DType::F32, {M, 4 * K});  // K = 128 does not match the weight's 64 columns
    EXPECT_TRUE(fails_cleanly(run_silu(out, g2, w, KS_QTYPE_Q4_1), INV, kSilu, "weight", Snap{&out}));
  }
  {
    Buf o2(DType::F32, {M + 1, N});
    EXPECT_TRUE(fails_cleanly(run_silu(o2, gu, w, KS_QTYPE_Q4_1), INV, kSilu, "out", Snap{&o2}));
  }
  {
    Buf oh(DType::F16, {M, N});
    EXPECT_TRUE(fails_cleanly(run_silu(oh, gu, w, KS_QTYPE_Q4_1), KS_ERROR_UNSUPPORTED_DTYPE, kSilu, "out", Snap{&oh}));
  }
  {  // out over gate_up
    DLTensor o = gu.dl(), g = gu.dl(), ww = w.dl();
    o.shape = out.shape.data();
    Snap s{&gu};
    EXPECT_TRUE(fails_cleanly(ks_silu_and_mul_quant_matmul(&o, &g, &ww, KS_QTYPE_Q4_1, KS_BACKEND_AUTO, nullptr), INV,
                              kSilu, "out", s));
  }
}

// ---- rotary_embedding_kv_append ----------------------------------------------------

const char* kRope = "rotary_embedding_kv_append";

struct RopeCase {
  int64_t T, H, KVH, D, rotary_dim, blocks, block_size;
  bool neox;
};

// The fused call on (q, k, caches) and the two-call sequence on copies: every byte equal.
void rope_append_case(DType dt, const RopeCase& c, size_t off) {
  Buf q(dt, {c.T, c.H, c.D}, off), k(dt, {c.T, c.KVH, c.D}, off), v(dt, {c.T, c.KVH, c.D}, off),
      pos(DType::I64, {c.T}, 0), slots(DType::I32, {c.T}, 0), kc(dt, {c.blocks, c.block_size, c.KVH, c.D}, off),
      vc(dt, {c.blocks, c.block_size, c.KVH, c.D}, off);
  kstest::fill_normal(q);
  kstest::fill_normal(k);
  kstest::fill_normal(v);
  kc.poison();
  vc.poison();
  std::vector<int64_t> free_slots(size_t(c.blocks * c.block_size));
  for (size_t i = 0; i < free_slots.size(); ++i) free_slots[i] = int64_t(i);
  std::shuffle(free_slots.begin(), free_slots.end(), rng());
  for (int64_t t = 0; t < c.T; ++t) {
    set_i(pos, t, (t * 7919 + 3) % 100000);
    set_i(slots, t, t % 5 == 3 ? -1 : free_slots[size_t(t)]);  // some tokens skipped (-1)
  }
  Buf q2 = q, k2 = k, kc2 = kc, vc2 = vc;
  Snap in{&v, &pos, &slots};
  {
    DLTensor qd = q.dl(), kd = k.dl(), vd = v.dl(), pd = pos.dl(), kcd = kc.dl(), vcd = vc.dl(), sd = slots.dl();
    KS_RUN_OR_SKIP(ks_rotary_embedding_kv_append(&qd, &kd, &vd, &pd, c.rotary_dim, 10000.0, c.neox, &kcd, &vcd, &sd,
                                                 KS_BACKEND_AUTO, nullptr));
  }
  {
    DLTensor qd = q2.dl(), kd = k2.dl(), vd = v.dl(), pd = pos.dl(), kcd = kc2.dl(), vcd = vc2.dl(), sd = slots.dl();
    ASSERT_EQ(ks_rotary_embedding(&qd, &kd, &pd, c.rotary_dim, 10000.0, c.neox, KS_BACKEND_CPU, nullptr), KS_SUCCESS);
    ASSERT_EQ(ks_kv_cache_append(&kcd, &vcd, &kd, &vd, &sd, KS_BACKEND_CPU, nullptr), KS_SUCCESS);
  }
  const std::string what = dt_name(dt) + (c.neox ? " neox" : " interleaved") + " T " + std::to_string(c.T) +
                           " rotary_dim " + std::to_string(c.rotary_dim) + " of " + std::to_string(c.D);
  EXPECT_EQ(q.raw, q2.raw) << "q, " << what;
  EXPECT_EQ(k.raw, k2.raw) << "k, " << what;
  EXPECT_EQ(kc.raw, kc2.raw) << "k_cache, " << what;
  EXPECT_EQ(vc.raw, vc2.raw) << "v_cache, " << what;
  EXPECT_TRUE(in.same()) << "inputs modified, " << what;
}

TEST(RopeKvAppend, EqualsRotaryThenAppendEveryVariant) {
  FOR_EACH_VARIANT(kRope) {
    for (DType dt : kFloatTypes())
      for (bool neox : {false, true}) {
        rope_append_case(dt, {1, 9, 3, 64, 64, 4, 16, neox}, 0);
        rope_append_case(dt, {7, 4, 2, 66, 32, 3, 7, neox}, 2);  // rotary_dim < head_dim, odd block size, misaligned
        rope_append_case(dt, {33, 8, 1, 128, 128, 5, 16, neox}, 0);
      }
  }
}

TEST(RopeKvAppend, RejectsBadArgumentsAndWritesNothing) {
  const ks_status_t INV = KS_ERROR_INVALID_ARGUMENT;
  const int64_t T = 3, H = 4, KVH = 2, D = 32;
  Buf q(DType::F32, {T, H, D}), k(DType::F32, {T, KVH, D}), v(DType::F32, {T, KVH, D}), pos(DType::I32, {T}),
      slots(DType::I64, {T}), kc(DType::F32, {2, 4, KVH, D}), vc(DType::F32, {2, 4, KVH, D});
  kstest::fill_normal(q);
  kstest::fill_normal(k);
  kstest::fill_normal(v);
  for (int64_t t = 0; t < T; ++t) set_i(pos, t, t), set_i(slots, t, t);
  auto call = [&](DLTensor* qd, DLTensor* kd, DLTensor* vd, DLTensor* kcd, DLTensor* vcd, DLTensor* sd,
                  int64_t rotary_dim) {
    DLTensor pd = pos.dl();
    return ks_rotary_embedding_kv_append(qd, kd, vd, &pd, rotary_dim, 10000.0, 0, kcd, vcd, sd, KS_BACKEND_AUTO,
                                         nullptr);
  };
  DLTensor qd = q.dl(), kd = k.dl(), vd = v.dl(), kcd = kc.dl(), vcd = vc.dl(), sd = slots.dl();
  const Snap all{&q, &k, &v, &kc, &vc};
  EXPECT_TRUE(fails_cleanly(call(&qd, nullptr, &vd, &kcd, &vcd, &sd, D), INV, kRope, "k", all));
  EXPECT_TRUE(fails_cleanly(call(&qd, &kd, &vd, &kcd, &vcd, &sd, D + 2), INV, kRope, "rotary_dim", all));
  {
    Buf v2(DType::F32, {T, KVH, D + 1});
    DLTensor v2d = v2.dl();
    EXPECT_TRUE(fails_cleanly(call(&qd, &kd, &v2d, &kcd, &vcd, &sd, D), INV, kRope, "v", all));
  }
  {
    Buf s2(DType::I64, {T});
    for (int64_t t = 0; t < T; ++t) set_i(s2, t, t == 1 ? 8 : t);  // past the 8 slots
    DLTensor s2d = s2.dl();
    EXPECT_TRUE(fails_cleanly(call(&qd, &kd, &vd, &kcd, &vcd, &s2d, D), INV, kRope, "slot_mapping", all));
  }
  {  // v sharing memory with k: the one pass would copy half-rotated values
    EXPECT_TRUE(fails_cleanly(call(&qd, &kd, &kd, &kcd, &vcd, &sd, D), INV, kRope, "v", all));
  }
  {  // slot_mapping over q: the rotation would rewrite validated slots before they are read
    DLTensor sq = q.dl();
    sq.dtype = DLDataType{kDLInt, 32, 1};
    std::vector<int64_t> ss = {T};
    sq.shape = ss.data();
    sq.ndim = 1;
    float one_slot;
    const int32_t slot1 = 1;
    std::memcpy(&one_slot, &slot1, 4);
    for (int64_t t = 0; t < T; ++t) q.set(t, double(one_slot));  // valid slots 1, 1, 1 as int32
    const Snap s{&q, &k, &v, &kc, &vc};
    EXPECT_TRUE(fails_cleanly(call(&qd, &kd, &vd, &kcd, &vcd, &sq, D), INV, kRope, "slot_mapping", s));
  }
  {  // a cache over q
    Buf big(DType::F32, {2, 4, KVH, D});
    kstest::fill_normal(big);
    DLTensor bq = big.dl(), bc = big.dl();
    std::vector<int64_t> qs = {T, H, D};
    bq.shape = qs.data();
    bq.ndim = 3;  // q: the first T * H * D elements of the k_cache buffer
    const Snap s{&big, &k, &v, &vc};
    EXPECT_TRUE(fails_cleanly(call(&bq, &kd, &vd, &bc, &vcd, &sd, D), INV, kRope, "k_cache", s));
    EXPECT_NE(std::string(ks_last_error()).find("overlap"), std::string::npos) << ks_last_error();
  }
}

const char* kNormRope = "fused_add_rms_norm_quant_matmul_rope_kv_append";

ks_status_t run_norm_rope(Buf& out, Buf* res_out, Buf* x, Buf& res, Buf& nw, Buf& w, ks_qtype_t q, int64_t H,
                          int64_t KVH, Buf& pos, int64_t rotary_dim, bool neox, Buf& kc, Buf& vc, Buf& slots,
                          ks_backend_t be = KS_BACKEND_AUTO) {
  DLTensor o = out.dl(), r = res.dl(), n = nw.dl(), ww = w.dl(), ro{}, xx{}, p = pos.dl(), kcd = kc.dl(),
           vcd = vc.dl(), sd = slots.dl();
  if (res_out) ro = res_out->dl();
  if (x) xx = x->dl();
  return ks_fused_add_rms_norm_quant_matmul_rope_kv_append(&o, res_out ? &ro : nullptr, x ? &xx : nullptr, &r, &n,
                                                           1e-5, &ww, q, H, KVH, &p, rotary_dim, 10000.0, neox, &kcd,
                                                           &vcd, &sd, be, nullptr);
}

// The fusion against the two calls it stands for, on copies: out (q and k rotated), residual_out
// and both caches equal byte for byte (every CPU variant of the steps: FOR_EACH_VARIANT pins
// quant_matmul's). GQA heads, rotary_dim below head_dim, NeoX and interleaved pairs, a skipped
// slot (-1), no slot (slot_mapping of 0 entries), misaligned tensors.
void norm_rope_case(DType dt, ks_qtype_t q, int64_t H, int64_t KVH, int64_t D, int64_t rd, int64_t K, bool neox,
                    bool with_x, int slot_case, size_t off) {
  const int64_t N = (H + 2 * KVH) * D;
  Buf w = make_packed(q, N, K, nullptr, off);
  Buf res(dt, {1, K}, off), x(dt, {1, K}, off), nw(dt, {K}, off), out(dt, {1, N}, off), ro(dt, {1, K}, off),
      pos(DType::I64, {1}), slots(DType::I32, {slot_case == 2 ? int64_t(0) : int64_t(1)}),
      kc(dt, {3, 8, KVH, D}, off), vc(dt, {3, 8, KVH, D}, off);
  kstest::fill_normal(res);
  kstest::fill_normal(x);
  kstest::fill_normal(nw, 1.0, 1.0);
  out.poison();
  ro.poison();
  kc.poison();
  vc.poison();
  set_i(pos, 0, 77777);
  if (slot_case != 2) set_i(slots, 0, slot_case == 1 ? -1 : 13);
  Buf out2 = out, ro2 = ro, kc2 = kc, vc2 = vc;
  Snap in{&res, &x, &nw, &w, &pos, &slots};
  KS_RUN_OR_SKIP(run_norm_rope(out, with_x ? &ro : nullptr, with_x ? &x : nullptr, res, nw, w, q, H, KVH, pos, rd, neox,
                               kc, vc, slots));
  ASSERT_EQ(run_norm(out2, with_x ? &ro2 : nullptr, with_x ? &x : nullptr, res, nw, 1e-5, w, q, KS_BACKEND_CPU),
            KS_SUCCESS)
      << ks_last_error();
  {
    const size_t es = ks::dtype_size(dt);
    char* base = static_cast<char*>(out2.data());
    int64_t qs[3] = {1, H, D}, ks_[3] = {1, KVH, D}, vs[3] = {1, KVH, D};
    DLTensor qd = out2.dl(), kd = out2.dl(), vd = out2.dl(), pd = pos.dl(), kcd = kc2.dl(), vcd = vc2.dl(),
             sd = slots.dl();
    qd.ndim = kd.ndim = vd.ndim = 3;
    qd.shape = qs, kd.shape = ks_, vd.shape = vs;
    qd.data = base, kd.data = base + H * D * es, vd.data = base + (H + KVH) * D * es;
    qd.byte_offset = kd.byte_offset = vd.byte_offset = 0;
    ASSERT_EQ(ks_rotary_embedding_kv_append(&qd, &kd, &vd, &pd, rd, 10000.0, neox, &kcd, &vcd, &sd, KS_BACKEND_CPU,
                                            nullptr),
              KS_SUCCESS)
        << ks_last_error();
  }
  const std::string what = dt_name(dt) + " " + qfmt(q).name + (neox ? " neox" : " interleaved") + " H " +
                           std::to_string(H) + "/" + std::to_string(KVH) + " D " + std::to_string(D) + " rotary_dim " +
                           std::to_string(rd) + (with_x ? " with x" : " residual only") + " slot case " +
                           std::to_string(slot_case) + " offset " + std::to_string(off);
  EXPECT_EQ(out.raw, out2.raw) << "out, " << what;
  EXPECT_EQ(ro.raw, ro2.raw) << "residual_out, " << what;
  EXPECT_EQ(kc.raw, kc2.raw) << "k_cache, " << what;
  EXPECT_EQ(vc.raw, vc2.raw) << "v_cache, " << what;
  EXPECT_TRUE(in.same()) << "inputs modified, " << what;
  // the rotation did happen: q's first pair differs from the unrotated matmul value
  if (slot_case == 0) {
    Buf plain = out;
    ASSERT_EQ(run_norm(plain, with_x ? &ro2 : nullptr, with_x ? &x : nullptr, res, nw, 1e-5, w, q, KS_BACKEND_CPU),
              KS_SUCCESS);
    bool moved = false;
    for (int64_t i = 0; i < H * D; ++i) moved = moved || plain.get(i) != out.get(i);
    EXPECT_TRUE(moved) << "q was not rotated, " << what;
  }
}

TEST(FusedNormQkvRopeAppend, EqualsTheTwoCallsBitForBit) {
  FOR_EACH_VARIANT(kNorm) {
    for (DType dt : kFloatTypes())
      for (bool neox : {false, true})
        for (int slot_case = 0; slot_case < 3; ++slot_case) {
          norm_rope_case(dt, KS_QTYPE_Q4_1, 9, 3, 64, 64, 576, neox, true, slot_case, 0);
          norm_rope_case(dt, KS_QTYPE_Q8_0, 4, 2, 34, 16, 96, neox, false, slot_case, 2);
          norm_rope_case(dt, KS_QTYPE_Q4_0, 2, 1, 35, 16, 64, neox, true, slot_case, 0);  // odd head_dim, odd N
        }
  }
}

// One token's arguments for the fusion: H / KVH heads of D, K = 64, a Q8_0 weight, random
// x / residual / norm_weight, position 3 and slot 5 of a 2 x 4-slot cache; the outputs (out,
// residual_out and both caches) poisoned. run() calls the fusion with x and residual_out.
struct NormRopeArgs {
  int64_t H, KVH, D, K = 64, N = (H + 2 * KVH) * D;
  Buf w, res, x, nw, out, ro, pos, slots, kc, vc;
  NormRopeArgs(DType dt, int64_t h, int64_t kvh, int64_t d)
      : H(h), KVH(kvh), D(d), w(make_packed(KS_QTYPE_Q8_0, N, K)), res(dt, {1, K}), x(dt, {1, K}), nw(dt, {K}),
        out(dt, {1, N}), ro(dt, {1, K}), pos(DType::I64, {1}), slots(DType::I64, {1}), kc(dt, {2, 4, KVH, D}),
        vc(dt, {2, 4, KVH, D}) {
    kstest::fill_normal(res);
    kstest::fill_normal(x);
    kstest::fill_normal(nw);
    out.poison();
    ro.poison();
    kc.poison();
    vc.poison();
    set_i(pos, 0, 3);
    set_i(slots, 0, 5);
  }
  Snap outputs() { return Snap{&out, &ro, &kc, &vc}; }
  ks_status_t run(ks_backend_t be = KS_BACKEND_AUTO) {
    return run_norm_rope(out, &ro, &x, res, nw, w, KS_QTYPE_Q8_0, H, KVH, pos, D, false, kc, vc, slots, be);
  }
};

// A step that declines (quant_matmul pinned to its AVX-512 variant, fp32 only or absent, under
// an fp16 call) fails the fusion naming it and the step, before anything is written.
TEST(FusedNormQkvRopeAppend, AStepThatCannotRunNamesThisOpAndWritesNothing) {
  NormRopeArgs f(DType::F16, 2, 1, 16);
  const Snap all = f.outputs();
  ASSERT_EQ(ks_force_variant("quant_matmul", "cpu_avx512"), KS_SUCCESS) << ks_last_error();
  const ks_status_t st = f.run(KS_BACKEND_CPU);
  const std::string msg = ks_last_error();
  ks_force_variant("quant_matmul", nullptr);
  EXPECT_EQ(st, KS_ERROR_BACKEND_UNAVAILABLE) << msg;
  EXPECT_EQ(msg.rfind(kNormRope, 0), 0u) << msg;
  EXPECT_NE(msg.find("fused_add_rms_norm_quant_matmul step"), std::string::npos) << msg;
  EXPECT_TRUE(all.same()) << "written before the failure";
}

// The two ops' rules speak of q, k and v; this op's errors say they are out's columns.
TEST(FusedNormQkvRopeAppend, ErrorsAboutSlicesSayWhichColumns) {
  NormRopeArgs f(DType::F32, 2, 1, 16);
  Buf slots(DType::I64, {2});  // two slots for the one token
  const ks_status_t st = run_norm_rope(f.out, nullptr, nullptr, f.res, f.nw, f.w, KS_QTYPE_Q8_0, f.H, f.KVH, f.pos,
                                       f.D, false, f.kc, f.vc, slots);
  const std::string msg = ks_last_error();
  EXPECT_EQ(st, KS_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(msg.find("slot_mapping"), std::string::npos) << msg;
  EXPECT_NE(msg.find("out's columns"), std::string::npos) << msg;
}

TEST(FusedNormQkvRopeAppend, ZeroRowsWriteNothing) {
  Buf w = make_packed(KS_QTYPE_Q8_0, 8 * 16, 64);
  Buf res(DType::F32, {0, 64}), nw(DType::F32, {64}), out(DType::F32, {0, 128}), pos(DType::I64, {0}),
      slots(DType::I64, {0}), kc(DType::F32, {2, 4, 2, 16}), vc(DType::F32, {2, 4, 2, 16});
  kstest::fill_normal(nw);
  kc.poison();
  vc.poison();
  Snap s{&kc, &vc};
  ASSERT_EQ(run_norm_rope(out, nullptr, nullptr, res, nw, w, KS_QTYPE_Q8_0, 4, 2, pos, 16, false, kc, vc, slots),
            KS_SUCCESS)
      << ks_last_error();
  EXPECT_TRUE(s.same());
}

TEST(FusedNormQkvRopeAppend, RejectsBadArgumentsAndWritesNothing) {
  const ks_status_t INV = KS_ERROR_INVALID_ARGUMENT;
  NormRopeArgs f(DType::F32, 4, 2, 16);
  const int64_t H = f.H, KVH = f.KVH, D = f.D, K = f.K, N = f.N;
  const Snap all = f.outputs();
  auto expect = [&](ks_status_t st, ks_status_t want, const char* arg, const std::string& what, const Snap& s) {
    EXPECT_TRUE(fails_cleanly(st, want, kNormRope, arg, s)) << what;
  };
  {  // two rows: a one-token step only
    Buf res2(DType::F32, {2, K}), x2(DType::F32, {2, K}), out2(DType::F32, {2, N}), ro2(DType::F32, {2, K});
    kstest::fill_normal(res2);
    kstest::fill_normal(x2);
    expect(run_norm_rope(out2, &ro2, &x2, res2, f.nw, f.w, KS_QTYPE_Q8_0, H, KVH, f.pos, D, false, f.kc, f.vc,
                         f.slots),
           INV, "residual", "two rows", Snap{&out2, &ro2, &f.kc, &f.vc});
  }
  // the fixture's call with residual_out, num_heads, rotary_dim, k_cache or slot_mapping replaced
  auto call = [&](Buf* ro, int64_t heads, int64_t rotary_dim, Buf& kc, Buf& slots) {
    return run_norm_rope(f.out, ro, &f.x, f.res, f.nw, f.w, KS_QTYPE_Q8_0, heads, KVH, f.pos, rotary_dim, false, kc,
                         f.vc, slots);
  };
  expect(call(&f.ro, 0, D, f.kc, f.slots), INV, "num_heads", "no heads", all);
  expect(call(&f.ro, H + 1, D, f.kc, f.slots), INV, "num_heads", "N not (H + 2 KVH) D", all);
  expect(call(&f.ro, H, D + 2, f.kc, f.slots), INV, "rotary_dim", "rotary_dim past head_dim", all);
  expect(call(nullptr, H, D, f.kc, f.slots), INV, "residual_out", "x without residual_out", all);
  {
    Buf kc2(DType::F32, {2, 4, KVH, D + 2});
    expect(call(&f.ro, H, D, kc2, f.slots), INV, "k_cache", "cache head_dim", all);
  }
  {
    Buf s2(DType::I64, {1});
    set_i(s2, 0, 8);  // the cache holds 8 slots
    expect(call(&f.ro, H, D, f.kc, s2), INV, "slot_mapping", "slot past the cache", all);
  }
  {  // positions inside out: read while out is written
    DLTensor o = f.out.dl(), r = f.res.dl(), n = f.nw.dl(), ww = f.w.dl(), rr = f.ro.dl(), xx = f.x.dl(),
             kcd = f.kc.dl(), vcd = f.vc.dl(), sd = f.slots.dl(), pd = f.out.dl();
    pd.dtype = DLDataType{kDLInt, 32, 1};
    std::vector<int64_t> ps = {1};
    pd.shape = ps.data();
    pd.ndim = 1;
    expect(ks_fused_add_rms_norm_quant_matmul_rope_kv_append(&o, &rr, &xx, &r, &n, 1e-5, &ww, KS_QTYPE_Q8_0, H, KVH,
                                                             &pd, D, 10000.0, 0, &kcd, &vcd, &sd, KS_BACKEND_AUTO,
                                                             nullptr),
           INV, "positions", "positions overlapping out", all);
  }
  {  // a cache over residual (read by the matmul while the cache is written)
    Buf big(DType::F32, {2, 4, KVH, D});
    kstest::fill_normal(big);
    DLTensor o = f.out.dl(), r = big.dl(), n = f.nw.dl(), ww = f.w.dl(), pd = f.pos.dl(), kcd = big.dl(),
             vcd = f.vc.dl(), sd = f.slots.dl();
    std::vector<int64_t> rs = {1, K};
    r.shape = rs.data();
    r.ndim = 2;
    expect(ks_fused_add_rms_norm_quant_matmul_rope_kv_append(&o, nullptr, nullptr, &r, &n, 1e-5, &ww, KS_QTYPE_Q8_0, H,
                                                             KVH, &pd, D, 10000.0, 0, &kcd, &vcd, &sd,
                                                             KS_BACKEND_AUTO, nullptr),
           INV, "k_cache", "k_cache overlapping residual", Snap{&f.out, &big, &f.vc});
  }
}

// ---- rotary_embedding_kv_append_paged_attention ------------------------------------

const char* kRopeAttn = "rotary_embedding_kv_append_paged_attention";

ks_status_t run_rope_attn(Buf& out, kstest::RopeAttnInputs& in, const kstest::RopeAttnCase& c, bool seq_ids,
                          ks_backend_t be = KS_BACKEND_AUTO) {
  DLTensor o = out.dl(), q = in.q.dl(), k = in.k.dl(), v = in.v.dl(), p = in.pos.dl(), kc = in.k_cache.dl(),
           vc = in.v_cache.dl(), sm = in.slots.dl(), bt = in.block_tables.dl(), si = in.seq_ids.dl(),
           cl = in.context_lens.dl();
  return ks_rotary_embedding_kv_append_paged_attention(&o, &q, &k, &v, &p, c.rotary_dim, 10000.0, c.neox, &kc, &vc, &sm,
                                                       &bt, seq_ids ? &si : nullptr, &cl, in.scale, be, nullptr);
}

// The fused call on one copy of the inputs and the two calls on another: out, q, k and both
// caches byte for byte, v, positions, slot_mapping and the table untouched.
void rope_attn_case(DType dt, const kstest::RopeAttnCase& c) {
  kstest::RopeAttnInputs in = kstest::make_rope_attn_inputs(dt, c), want = in;
  Buf out(dt, {c.T, c.H, c.D}, c.offset_bytes), want_out = out;
  out.poison();
  want_out.poison();
  Snap untouched{&in.v, &in.pos, &in.slots, &in.block_tables, &in.seq_ids, &in.context_lens};
  KS_RUN_OR_SKIP(run_rope_attn(out, in, c, c.with_seq_ids));
  {
    DLTensor q = want.q.dl(), k = want.k.dl(), v = want.v.dl(), p = want.pos.dl(), kc = want.k_cache.dl(),
             vc = want.v_cache.dl(), sm = want.slots.dl(), o = want_out.dl(), bt = want.block_tables.dl(),
             si = want.seq_ids.dl(), cl = want.context_lens.dl();
    ASSERT_EQ(ks_rotary_embedding_kv_append(&q, &k, &v, &p, c.rotary_dim, 10000.0, c.neox, &kc, &vc, &sm,
                                            KS_BACKEND_CPU, nullptr),
              KS_SUCCESS)
        << ks_last_error();
    ASSERT_EQ(ks_paged_attention(&o, &q, &kc, &vc, &bt, c.with_seq_ids ? &si : nullptr, &cl, want.scale,
                                 KS_BACKEND_CPU, nullptr),
              KS_SUCCESS)
        << ks_last_error();
  }
  const std::string what = c.name(dt);
  EXPECT_EQ(out.raw, want_out.raw) << "out, " << what;
  EXPECT_EQ(in.q.raw, want.q.raw) << "q, " << what;
  EXPECT_EQ(in.k.raw, want.k.raw) << "k, " << what;
  EXPECT_EQ(in.k_cache.raw, want.k_cache.raw) << "k_cache, " << what;
  EXPECT_EQ(in.v_cache.raw, want.v_cache.raw) << "v_cache, " << what;
  EXPECT_TRUE(untouched.same()) << "inputs modified, " << what;
  // the zero-length token's row is zeros; the full-context token's is not (it saw keys)
  if (c.T > 2)
    for (int64_t i = 0; i < c.H * c.D; ++i) ASSERT_EQ(out.get(2 * c.H * c.D + i), 0.0) << what;
}

TEST(RopeAppendAttention, EqualsRopeAppendThenAttentionEveryVariant) {
  FOR_EACH_VARIANT(kRopeAttn) {
    for (DType dt : kFloatTypes())
      for (bool neox : {false, true}) {
        rope_attn_case(dt, {1, 9, 3, 64, 64, 16, 4, neox, false});
        rope_attn_case(dt, {6, 6, 2, 66, 32, 7, 3, neox, true, 2});  // rotary_dim < head_dim, odd sizes, misaligned
        rope_attn_case(dt, {9, 8, 1, 128, 128, 16, 5, neox, true});
      }
  }
}

TEST(RopeAppendAttention, ZeroTokensWriteNothing) {
  const kstest::RopeAttnCase c{0, 4, 2, 32, 32, 4, 2, false, false};
  kstest::RopeAttnInputs in = kstest::make_rope_attn_inputs(DType::F32, c);
  Buf out(DType::F32, {0, 4, 32});
  Snap all{&in.k_cache, &in.v_cache, &in.q, &in.k};
  ASSERT_EQ(run_rope_attn(out, in, c, false), KS_SUCCESS) << ks_last_error();
  EXPECT_TRUE(all.same());
}

TEST(RopeAppendAttention, RejectsBadArgumentsAndWritesNothing) {
  const ks_status_t INV = KS_ERROR_INVALID_ARGUMENT;
  const kstest::RopeAttnCase c{4, 4, 2, 32, 32, 4, 3, false, true};
  kstest::RopeAttnInputs in = kstest::make_rope_attn_inputs(DType::F32, c);
  Buf out(DType::F32, {c.T, c.H, c.D});
  out.poison();
  const Snap all{&out, &in.q, &in.k, &in.k_cache, &in.v_cache};
  auto expect = [&](ks_status_t got, ks_status_t want, const char* arg, const char* what) {
    EXPECT_TRUE(fails_cleanly(got, want, kRopeAttn, arg, all)) << what;
  };
  DLTensor o = out.dl(), q = in.q.dl(), k = in.k.dl(), v = in.v.dl(), p = in.pos.dl(), kc = in.k_cache.dl(),
           vc = in.v_cache.dl(), sm = in.slots.dl(), bt = in.block_tables.dl(), si = in.seq_ids.dl(),
           cl = in.context_lens.dl();
  auto call = [&](DLTensor* oo, DLTensor* qq, DLTensor* kk, DLTensor* vv, DLTensor* ss, DLTensor* bb, DLTensor* ll,
                  int64_t rotary_dim, double scale) {
    return ks_rotary_embedding_kv_append_paged_attention(oo, qq, kk, vv, &p, rotary_dim, 10000.0, 0, &kc, &vc, ss, bb,
                                                         &si, ll, scale, KS_BACKEND_AUTO, nullptr);
  };
  expect(call(&o, &q, nullptr, &v, &sm, &bt, &cl, c.D, 0.5), INV, "k", "k NULL");
  expect(call(&o, &q, &k, &v, &sm, &bt, &cl, c.D + 2, 0.5), INV, "rotary_dim", "rotary_dim past head_dim");
  expect(call(&o, &q, &k, &v, &sm, &bt, &cl, c.D, std::nan("")), INV, "scale", "NaN scale");
  {
    Buf o2(DType::F32, {c.T, c.H, c.D + 1});
    DLTensor o2d = o2.dl();
    expect(call(&o2d, &q, &k, &v, &sm, &bt, &cl, c.D, 0.5), INV, "out", "out's shape");
  }
  {
    Buf o2(DType::F16, {c.T, c.H, c.D});
    DLTensor o2d = o2.dl();
    expect(call(&o2d, &q, &k, &v, &sm, &bt, &cl, c.D, 0.5), KS_ERROR_UNSUPPORTED_DTYPE, "out", "out's dtype");
  }
  {
    Buf l2(DType::I32, {c.T});
    for (int64_t t = 0; t < c.T; ++t) set_i(l2, t, t == 1 ? 1000 : 1);  // past the table's capacity
    DLTensor l2d = l2.dl();
    expect(call(&o, &q, &k, &v, &sm, &bt, &l2d, c.D, 0.5), INV, "context_lens", "a length past the capacity");
  }
  {
    Buf s2(DType::I64, {c.T});
    for (int64_t t = 0; t < c.T; ++t) set_i(s2, t, t == 2 ? in.k_cache.shape[0] * c.block_size : -1);
    DLTensor s2d = s2.dl();
    expect(call(&o, &q, &k, &v, &s2d, &bt, &cl, c.D, 0.5), INV, "slot_mapping", "a slot past the cache");
  }
  {  // out over v: the fused kernel writes out while it reads v
    Buf vbig(DType::F32, {c.T, c.H, c.D});
    kstest::fill_normal(vbig);
    DLTensor vo = vbig.dl(), vv = vbig.dl();
    std::vector<int64_t> vs = {c.T, c.KVH, c.D};
    vv.shape = vs.data();  // v: the first T KVH D elements of out's buffer
    EXPECT_TRUE(fails_cleanly(call(&vo, &q, &k, &vv, &sm, &bt, &cl, c.D, 0.5), INV, kRopeAttn, "out",
                              Snap{&vbig, &in.q, &in.k, &in.k_cache, &in.v_cache}));
    EXPECT_NE(std::string(ks_last_error()).find("overlap"), std::string::npos) << ks_last_error();
  }
  {  // out over k
    Buf kbig(DType::F32, {c.T, c.H, c.D});
    kstest::fill_normal(kbig);
    DLTensor ko = kbig.dl(), kk = kbig.dl();
    std::vector<int64_t> ks = {c.T, c.KVH, c.D};
    kk.shape = ks.data();
    EXPECT_TRUE(fails_cleanly(call(&ko, &q, &kk, &v, &sm, &bt, &cl, c.D, 0.5), INV, kRopeAttn, "out",
                              Snap{&kbig, &in.q, &in.k_cache, &in.v_cache}));
  }
}

// The attention's index tensors (block_tables, seq_ids, context_lens) are validated on the host
// before the first step writes q, k and the caches, and the second step (CPU) or the same kernel
// (CUDA) then reads them unchecked: none of them may share memory with what the first step writes
// (as slot_mapping may not share q or k in rotary_embedding_kv_append). Here each index tensor is
// an int32 view into q's or k's features past rotary_dim, or into a cache block that no table names
// and no slot appends to, holding the valid values, so the call cannot go out of bounds even when
// accepted. (Inside rows the first step rewrites, the accepted call reads the rewritten values:
// ASan reports a heap-buffer-overflow write into the attention's scratch, an out-of-bounds read of
// the cache and a wild read of block_tables.)
TEST(RopeAppendAttention, RejectsIndexTensorsInsideWhatTheFirstStepWrites) {
  const kstest::RopeAttnCase c{4, 4, 2, 32, 16, 4, 3, false, true};
  const int64_t rotary_dim = 16, S = c.T + 1;
  for (const char* writer : {"q", "k", "k_cache", "v_cache"})
    for (const char* index : {"block_tables", "seq_ids", "context_lens"}) {
      kstest::RopeAttnInputs in = kstest::make_rope_attn_inputs(DType::F32, c);
      Buf out(DType::F32, {c.T, c.H, c.D});
      out.poison();
      // where the index tensor goes: features [rotary_dim, D) of q's or k's first head, or the
      // first cache block that the block table does not name
      const std::string w = writer;
      Buf& wb = w == "q" ? in.q : w == "k" ? in.k : w == "k_cache" ? in.k_cache : in.v_cache;
      int64_t at = rotary_dim;  // in elements of wb
      if (w == "k_cache" || w == "v_cache") {
        std::vector<bool> named(size_t(in.k_cache.shape[0]), false);
        for (int64_t i = 0; i < S * c.blocks_per_seq; ++i) named[size_t(in.block_tables.get(i))] = true;
        int64_t spare = 0;
        while (named[size_t(spare)]) ++spare;
        at = spare * c.block_size * c.KVH * c.D;
      }
      const std::string ix = index;
      Buf& ib = ix == "block_tables" ? in.block_tables : ix == "seq_ids" ? in.seq_ids : in.context_lens;
      ASSERT_LE(ib.numel(), c.D - rotary_dim);
      int32_t* dst = reinterpret_cast<int32_t*>(static_cast<float*>(wb.data()) + at);
      for (int64_t i = 0; i < ib.numel(); ++i) dst[i] = int32_t(ib.get(i));
      DLTensor iv = ib.dl();
      iv.data = dst;
      DLTensor o = out.dl(), q = in.q.dl(), k = in.k.dl(), v = in.v.dl(), p = in.pos.dl(), kc = in.k_cache.dl(),
               vc = in.v_cache.dl(), sm = in.slots.dl(), bt = in.block_tables.dl(), si = in.seq_ids.dl(),
               cl = in.context_lens.dl();
      if (ix == "block_tables") bt = iv;
      if (ix == "seq_ids") si = iv;
      if (ix == "context_lens") cl = iv;
      const Snap all{&out, &in.q, &in.k, &in.k_cache, &in.v_cache};
      EXPECT_TRUE(fails_cleanly(ks_rotary_embedding_kv_append_paged_attention(
                                    &o, &q, &k, &v, &p, rotary_dim, 10000.0, 0, &kc, &vc, &sm, &bt, &si, &cl,
                                    in.scale, KS_BACKEND_CPU, nullptr),
                                KS_ERROR_INVALID_ARGUMENT, kRopeAttn, index, all))
          << index << " inside " << writer;
    }
}

}  // namespace
