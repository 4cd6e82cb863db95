// ks_quant_matmul_a8: quant_matmul with x quantized per block of 32 to int8 (docs/contracts.md,
// quant_matmul_a8). The test quantizes x itself from the contract's text (FP32 operations, ties to
// even), then checks the op against
//  - an FP64 reference of sum_k w_k * (d_b q_k) (the weights by the independent FP64 decoder),
//    within the FP32 roundings the contract allows: each block value takes at most 4 roundings of
//    its terms and the sum of nb values at most nb - 1 + 5 (lane sums, butterfly), so
//    |out - ref| <= tol(dtype) (1 + |ref|) + (nb + 10) u sum |w_k d_b q_k|; a code off by one
//    moves the result by |w_k| d_b, far above that;
//  - a test-side FP32 emulation of the contract's block values and summation order, bit for bit
//    (the contract fixes the order, so every backend gives these bits).
#include <algorithm>
#include <array>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gguf_blocks_fp64.hpp"
#include "validation_harness.hpp"

namespace {

using namespace kstest::harness;
using namespace kstest::gguf;

const char* kOp = "quant_matmul_a8";

ks_status_t run_a8(Buf& out, Buf& x, Buf& w, ks_qtype_t q, ks_backend_t be = KS_BACKEND_AUTO) {
  DLTensor o = out.dl(), a = x.dl(), b = w.dl();
  return ks_quant_matmul_a8(&o, &a, &b, q, be, nullptr);
}

// x's quantization by the contract's text: per block of 32, d and the codes.
struct XQ {
  std::vector<float> d;   // [M, nb]
  std::vector<int> code;  // [M, K]
};
XQ quantize_x(const Buf& x, int64_t M, int64_t K) {
  const int64_t nb = K / 32;
  XQ r{std::vector<float>(size_t(M * nb)), std::vector<int>(size_t(M * K))};
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < nb; ++b) {
      float amax = 0.f;
      bool bad = false;
      for (int i = 0; i < 32; ++i) {
        const float v = float(x.get(m * K + b * 32 + i));
        if (std::isnan(v) || std::isinf(v)) bad = true;
        else amax = std::max(amax, std::fabs(v));
      }
      float d = amax / 127.f;
      float inv = 127.f / amax;
      if (bad) d = std::numeric_limits<float>::quiet_NaN(), inv = 0.f;
      else if (!(d >= FLT_MIN)) d = 0.f, inv = 0.f;
      r.d[size_t(m * nb + b)] = d;
      for (int i = 0; i < 32; ++i) {
        int c = 0;
        if (!bad && inv != 0.f) {
          const float t = std::nearbyint(float(x.get(m * K + b * 32 + i)) * inv);
          c = int(std::min(std::max(t, -127.f), 127.f));
        }
        r.code[size_t(m * K + b * 32 + i)] = c;
      }
    }
  return r;
}

// The FP64 value and magnitude of sum_k w_k d q_k.
void fp64_ref(const std::vector<double>& w, const XQ& xq, int64_t M, int64_t N, int64_t K, std::vector<double>& val,
              std::vector<double>& mag) {
  val.assign(size_t(M * N), 0.0);
  mag.assign(size_t(M * N), 0.0);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double s = 0, a = 0;
      for (int64_t k = 0; k < K; ++k) {
        const double p = w[size_t(n * K + k)] * double(xq.d[size_t(m * (K / 32) + k / 32)]) * xq.code[size_t(m * K + k)];
        s += p;
        a += std::fabs(p);
      }
      val[size_t(m * N + n)] = s;
      mag[size_t(m * N + n)] = a;
    }
}

// The contract's FP32 arithmetic, emulated: block values, lane sums, butterfly.
float emulate_row(ks_qtype_t q, const uint8_t* row, const XQ& xq, int64_t m, int64_t K) {
  const int64_t nb = K / 32, BB = qfmt(q).bytes;
  std::vector<float> v(static_cast<size_t>(nb));
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * BB;
    const float dw = float(f16_to_double(get16(blk)));
    const float mw = q == KS_QTYPE_Q4_1 ? float(f16_to_double(get16(blk + 2))) : 0.f;
    const float d = xq.d[size_t(m * nb + b)];
    const int* c = xq.code.data() + m * K + b * 32;
    int S = 0, Qs = 0;
    for (int i = 0; i < 32; ++i) Qs += c[i];
    if (q == KS_QTYPE_Q8_0) {
      for (int i = 0; i < 32; ++i) S += int(int8_t(blk[2 + i])) * c[i];
      v[size_t(b)] = (dw * d) * float(S);
    } else {
      const uint8_t* qs = blk + (q == KS_QTYPE_Q4_1 ? 4 : 2);
      for (int i = 0; i < 16; ++i) S += int(qs[i] & 15) * c[i] + int(qs[i] >> 4) * c[i + 16];
      v[size_t(b)] = q == KS_QTYPE_Q4_1 ? std::fma(dw * d, float(S), mw * (d * float(Qs)))
                                        : (dw * d) * float(S - 8 * Qs);
    }
  }
  float s[32];
  for (int l = 0; l < 32; ++l) {
    s[l] = 0.f;
    for (int64_t b = l; b < nb; b += 32) s[l] = s[l] + v[size_t(b)];
  }
  for (int o = 16; o > 0; o >>= 1) {
    float t[32];
    for (int l = 0; l < 32; ++l) t[l] = s[l] + s[l ^ o];
    std::memcpy(s, t, sizeof s);
  }
  return s[0];
}

::testing::AssertionResult check_out(ks_qtype_t q, const Buf& out, const Buf& x, const Buf& w, int64_t M, int64_t N,
                                     int64_t K) {
  const XQ xq = quantize_x(x, M, K);
  std::vector<double> val, mag;
  fp64_ref(decode_all(q, w, K), xq, M, N, K, val, mag);
  const double t = kstest::tol(out.dtype), nb = double(K / 32);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      const double got = out.get(m * N + n), want = val[size_t(m * N + n)];
      const float emu = emulate_row(q, static_cast<const uint8_t*>(w.data()) + n * w.shape[1], xq, m, K);
      const double emu_out = round_to(out.dtype, double(emu));
      const bool nan_row = std::isnan(want);
      if (nan_row ? !std::isnan(got) : !(std::fabs(got - want) <= t * (1 + std::fabs(want)) + (nb + 10) * kU32 * mag[size_t(m * N + n)]))
        return ::testing::AssertionFailure() << "out[" << m << ", " << n << "]: got " << got << ", FP64 " << want;
      if (!(got == emu_out || (std::isnan(got) && std::isnan(emu_out))))
        return ::testing::AssertionFailure() << "out[" << m << ", " << n << "]: got " << got
                                             << ", the contract's FP32 arithmetic gives " << emu_out;
    }
  return ::testing::AssertionSuccess();
}

void check_case(ks_qtype_t q, DType dt, int64_t M, int64_t N, int64_t K, size_t off_o, size_t off_x, size_t off_w) {
  Buf w = make_packed(q, N, K, nullptr, off_w);
  Buf x(dt, {M, K}, off_x);
  kstest::fill_normal(x);
  Buf out(dt, {M, N}, off_o);
  out.poison();
  Snap in{&x, &w};
  KS_RUN_OR_SKIP(run_a8(out, x, w, q));
  EXPECT_TRUE(check_out(q, out, x, w, M, N, K)) << qfmt(q).name << " x " << dt_name(dt) << " M " << M << " N " << N
                                                << " K " << K << " offsets " << off_o << "/" << off_x << "/" << off_w;
  EXPECT_TRUE(out.guards_intact()) << "wrote outside out";
  EXPECT_TRUE(in.same()) << "inputs modified";
}

const ks_qtype_t kFormats[] = {KS_QTYPE_Q4_0, KS_QTYPE_Q4_1, KS_QTYPE_Q8_0};

TEST(QuantMatmulA8, FormatsShapesDtypes) {
  FOR_EACH_VARIANT(kOp) {
    for (ks_qtype_t q : kFormats)
      for (DType dt : kFloatTypes())
        for (auto s : std::vector<std::array<int64_t, 3>>{{1, 1, 32}, {1, 7, 64}, {3, 9, 576}, {2, 33, 1056}, {1, 5, 4096}})
          check_case(q, dt, s[0], s[1], s[2], 0, 0, 0);
  }
}

TEST(QuantMatmulA8, OffsetViews) {
  // x and out at element offsets; weights at 1, 2 and 3 bytes past an allocation's alignment.
  for (ks_qtype_t q : kFormats)
    for (size_t off_w : {1, 2, 3, 16})
      check_case(q, DType::BF16, 2, 7, 96, 2, 6, off_w);
}

TEST(QuantMatmulA8, ZeroTinyAndExtremeBlocks) {
  // Block 0 all zero, block 1 with max |x| under 127 FLT_MIN (counted as zero), block 2 of
  // subnormals only, block 3 of values near 1.6e35 (block sums near 1e38), the rest normal.
  for (ks_qtype_t q : kFormats) {
    const int64_t K = 192, N = 6;
    Buf w = make_packed(q, N, K);
    Buf x(DType::F32, {1, K});
    kstest::fill_normal(x);
    for (int i = 0; i < 32; ++i) {
      x.set(i, i % 2 ? 0.0 : -0.0);
      x.set(32 + i, (i - 16) * 1e-37);
      x.set(64 + i, (i - 16) * 1e-44);
      x.set(96 + i, (i - 16) * 1e34);
    }
    Buf out(DType::F32, {1, N});
    out.poison();
    ASSERT_EQ(run_a8(out, x, w, q), KS_SUCCESS) << ks_last_error();
    EXPECT_TRUE(check_out(q, out, x, w, 1, N, K)) << qfmt(q).name;
  }
}

TEST(QuantMatmulA8, NonFiniteXMakesItsRowNaN) {
  for (ks_qtype_t q : kFormats)
    for (double bad : {std::nan(""), double(INFINITY), -double(INFINITY)}) {
      const int64_t M = 3, N = 5, K = 128;
      Buf w = make_packed(q, N, K);
      Buf x(DType::F16, {M, K});
      kstest::fill_normal(x);
      x.set(1 * K + 77, bad);  // row 1 only
      Buf out(DType::F16, {M, N});
      out.poison();
      ASSERT_EQ(run_a8(out, x, w, q), KS_SUCCESS) << ks_last_error();
      for (int64_t n = 0; n < N; ++n) {
        EXPECT_TRUE(std::isnan(out.get(1 * N + n))) << qfmt(q).name << " n " << n;
        EXPECT_TRUE(std::isfinite(out.get(0 * N + n)) && std::isfinite(out.get(2 * N + n)));
      }
      EXPECT_TRUE(check_out(q, out, x, w, M, N, K)) << qfmt(q).name;
    }
}

TEST(QuantMatmulA8, CodesRoundHalfToEven) {
  // max |x| = 127 makes d = 1 and the factor 1, so x's half-integers are ties: 0.5 -> 0, 1.5 -> 2,
  // 2.5 -> 2, -2.5 -> -2, 3.5 -> 4. Q8_0 weights with d_w = 1 and code 1 at those elements only
  // (0 elsewhere) give out = 0 + 2 + 2 - 2 + 4 = 6 exactly.
  const int64_t K = 32;
  Buf w(DType::U8, {1, 34});
  auto* b = static_cast<uint8_t*>(w.data());
  std::memset(b, 0, 34);
  put16(b, 0x3C00);  // fp16 1.0
  const double xs[] = {0.5, 1.5, 2.5, -2.5, 3.5};
  Buf x(DType::F32, {1, K});
  for (int i = 0; i < 32; ++i) x.set(i, 0.0);
  x.set(31, 127.0);
  for (int i = 0; i < 5; ++i) {
    x.set(i, xs[i]);
    b[2 + i] = 1;
  }
  Buf out(DType::F32, {1, 1});
  FOR_EACH_VARIANT(kOp) {
    out.poison();
    ASSERT_EQ(run_a8(out, x, w, KS_QTYPE_Q8_0), KS_SUCCESS) << ks_last_error();
    EXPECT_EQ(out.get(0), 6.0);
  }
}

TEST(QuantMatmulA8, RejectsDenseFormatsAndBadArguments) {
  Buf x(DType::F32, {2, 64});
  kstest::fill_normal(x);
  Buf out(DType::F32, {2, 3});
  for (ks_qtype_t q : {KS_QTYPE_F32, KS_QTYPE_F16, KS_QTYPE_BF16, static_cast<ks_qtype_t>(1000)}) {
    Buf w = make_packed(q == static_cast<ks_qtype_t>(1000) ? KS_QTYPE_Q8_0 : q, 3, 64);
    out.poison();
    Snap s{&out, &x, &w};
    EXPECT_TRUE(fails_cleanly(run_a8(out, x, w, q), KS_ERROR_INVALID_ARGUMENT, kOp, "qtype", s)) << int(q);
    // the dense formats are named as such; an unknown code is given as its number, not as dense
    const std::string msg = ks_last_error();
    if (q == static_cast<ks_qtype_t>(1000))
      EXPECT_NE(msg.find("got 1000"), std::string::npos) << msg;
    else
      EXPECT_NE(msg.find("(a dense format: quant_matmul takes it)"), std::string::npos) << msg;
    EXPECT_EQ(msg.find("got 1000 (a dense"), std::string::npos) << msg;
  }
  {
    Buf w(DType::U8, {3, 40});  // Q4_1 wants 40, Q8_0 68
    Snap s{&out, &x, &w};
    EXPECT_TRUE(fails_cleanly(run_a8(out, x, w, KS_QTYPE_Q8_0), KS_ERROR_INVALID_ARGUMENT, kOp, "weight", s));
  }
  {
    Buf w = make_packed(KS_QTYPE_Q4_1, 3, 64);
    Buf o2(DType::F16, {2, 3});
    Snap s{&o2, &x, &w};
    EXPECT_TRUE(fails_cleanly(run_a8(o2, x, w, KS_QTYPE_Q4_1), KS_ERROR_UNSUPPORTED_DTYPE, kOp, "out", s));
  }
}

TEST(QuantMatmulA8, CommonTensorRules) {
  for (DType dt : kFloatTypes()) {
    Buf w = make_packed(KS_QTYPE_Q4_1, 5, 64);
    Buf x(dt, {3, 64});
    kstest::fill_normal(x);
    Buf out(dt, {3, 5});
    out.poison();
    check_common_rules(kOp,
                       {{"out", &out, false, {other_float(dt), kI32}},
                        {"x", &x, false, {kI32, kU8, kI16}},
                        {"weight", &w, false, {DLDataType{kDLInt, 8, 1}, kF16}}},
                       [&](std::vector<DLTensor*>& t, ks_backend_t be) {
                         return ks_quant_matmul_a8(t[0], t[1], t[2], KS_QTYPE_Q4_1, be, nullptr);
                       });
  }
}

TEST(QuantMatmulA8, ZeroMOrNIsANoOp) {
  Buf w = make_packed(KS_QTYPE_Q8_0, 3, 64);
  Buf x(DType::F16, {0, 64}), out(DType::F16, {0, 3});
  Snap s{&out, &w, &x};
  EXPECT_EQ(run_a8(out, x, w, KS_QTYPE_Q8_0), KS_SUCCESS) << ks_last_error();
  EXPECT_TRUE(s.same());
}

}  // namespace
