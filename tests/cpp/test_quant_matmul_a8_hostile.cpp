// Adversarial tests of ks_quant_matmul_a8 (docs/contracts.md#quant_matmul_a8), written from the
// contract's text only: the reference below reimplements every FP32 step itself (its own fp16 /
// bf16 decoders and encoders, its own ties-to-even rounding, its own block decoding and the
// contract's lane-then-butterfly order), without the library's a8_quant.hpp or half.hpp, and checks
// the op bit for bit (NaN against NaN). Extra FP64 checks bound it where a contract statement
// claims something about the real numbers.
//
// Covered: the d = 0 threshold at a / 127 = FLT_MIN (in fp32 and bf16), subnormal x that still
// get codes, FP32 products that land exactly on .5 where the real product does not (and the
// reverse), mixed NaN / inf / subnormal / -0 blocks, inf / NaN / subnormal fp16 weight scales
// and minimums, Q8_0's -128 code against +-127 x codes (the largest |S|), huge blocks whose
// block values overflow, byte offsets 1..3 of every tensor, rows counts that take the threaded
// path, K = 32 with many rows, every aliasing form (rejected with nothing written; x and weight
// sharing bytes is fine), non-compact strides (rejected) and a size-1 dim's stride (ignored),
// zero-size dims. The > 2^31 index tests (weights of > 2^31 bytes, x of > 2^31 elements, one row
// with K > 2^31) need about 8.5 GB and 3 minutes and run only with KS_A8_HOSTILE_BIG=1.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gguf_blocks_fp64.hpp"
#include "validation_harness.hpp"

namespace {

using namespace kstest::harness;

const char* kOp = "quant_matmul_a8";
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

// ---- independent bit-level helpers ------------------------------------------------------------
float f32_from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
// fp16 -> fp32 by arithmetic on the fields (exact)
float my_h2f(uint16_t h) {
  const int s = h >> 15, e = (h >> 10) & 31, m = h & 1023;
  double v;
  if (e == 31) v = m ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  else if (e == 0) v = std::ldexp(double(m), -24);
  else v = std::ldexp(double(m + 1024), e - 25);
  return float(s ? -v : v);
}
float my_bf2f(uint16_t h) { return f32_from_bits(uint32_t(h) << 16); }
// ties-to-even of a double that is a float value (x * inv as FP32), by floor and the fraction
double my_rint(double t) {
  const double f = std::floor(t), r = t - f;
  if (r > 0.5) return f + 1;
  if (r < 0.5) return f;
  return std::fmod(f, 2.0) == 0 ? f : f + 1;
}
// fp32 -> fp16 / bf16, round to nearest even, by scaling (independent of the library's bit code)
uint16_t my_f2h(float f) {
  if (std::isnan(f)) return 0x7E00;
  const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  double a = std::fabs(double(f));
  if (a == 0) return sign;
  int e;
  std::frexp(a, &e);                 // a = m 2^e, m in [0.5, 1)
  int ue = std::max(e - 11, -24);    // unit of the last place: 2^-24 in the subnormal range
  double q = my_rint(std::ldexp(a, -ue));
  double v = std::ldexp(q, ue);
  if (v >= 65520.0 || !std::isfinite(a)) return uint16_t(sign | 0x7C00);
  if (v >= 65504.0) return uint16_t(sign | 0x7BFF);
  // re-encode v (exact in fp16)
  if (v < std::ldexp(1.0, -14)) return uint16_t(sign | uint16_t(std::ldexp(v, 24)));
  std::frexp(v, &e);
  const int E = e - 1 + 15;  // biased exponent
  const int m = int(std::ldexp(v, -(e - 1)) * 1024.0) - 1024;
  return uint16_t(sign | (E << 10) | m);
}
uint16_t my_f2bf(float f) {
  if (std::isnan(f)) return 0x7FC0;
  if (std::isinf(f)) return std::signbit(f) ? 0xFF80 : 0x7F80;
  const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  double a = std::fabs(double(f));
  if (a == 0) return sign;
  int e;
  std::frexp(a, &e);
  const int ue = std::max(e - 8, -133);  // bf16: 8 significant bits, subnormal unit 2^-133
  const double v = std::ldexp(my_rint(std::ldexp(a, -ue)), ue);
  const float vf = float(v);             // exact (or inf on overflow)
  return uint16_t(sign | (bits_of(vf) >> 16 & 0x7FFF));
}
double out_value(DType dt, float s) {
  if (dt == DType::F16) return my_h2f(my_f2h(s));
  if (dt == DType::BF16) return my_bf2f(my_f2bf(s));
  return s;
}

// ---- the contract, as written -----------------------------------------------------------------
int blk_bytes(ks_qtype_t q) { return q == KS_QTYPE_Q4_0 ? 18 : q == KS_QTYPE_Q4_1 ? 20 : 34; }

struct XBlock {
  float d;
  int q[32];
  int Q;
};
// a / 127 < FLT_MIN: d = 0; bad: d = NaN; else d = a / 127, q = rint(x * (127 / a)) (each one FP32 op)
XBlock quantize_block(const float* x) {
  XBlock r{};
  bool bad = false;
  float a = 0;
  for (int i = 0; i < 32; ++i) {
    if (std::isnan(x[i]) || std::isinf(x[i])) bad = true;
    else a = std::max(a, std::fabs(x[i]));
  }
  if (bad) {
    r.d = kNaN;
    return r;
  }
  volatile float d = a / 127.0f;  // volatile: one FP32 rounding, no excess precision
  if (!(d >= FLT_MIN)) {
    r.d = 0;
    return r;
  }
  volatile float inv = 127.0f / a;
  r.d = d;
  for (int i = 0; i < 32; ++i) {
    volatile float t = x[i] * inv;
    int c = int(my_rint(double(t)));
    c = std::min(127, std::max(-127, c));
    r.q[i] = c;
    r.Q += c;
  }
  return r;
}
float block_value(ks_qtype_t qt, const uint8_t* blk, const XBlock& xb) {
  const float dw = my_h2f(uint16_t(blk[0] | blk[1] << 8));
  int S = 0;
  if (qt == KS_QTYPE_Q8_0) {
    for (int i = 0; i < 32; ++i) S += int(int8_t(blk[2 + i])) * xb.q[i];
    volatile float p = dw * xb.d;
    volatile float v = p * float(S);
    return v;
  }
  const uint8_t* qs = blk + (qt == KS_QTYPE_Q4_1 ? 4 : 2);
  for (int j = 0; j < 16; ++j) S += (qs[j] & 15) * xb.q[j] + (qs[j] >> 4) * xb.q[j + 16];
  volatile float p = dw * xb.d;
  if (qt == KS_QTYPE_Q4_0) {
    volatile float v = p * float(S - 8 * xb.Q);
    return v;
  }
  const float mw = my_h2f(uint16_t(blk[2] | blk[3] << 8));
  volatile float dq = xb.d * float(xb.Q);
  volatile float m = mw * dq;
  return std::fma(float(p), float(S), float(m));
}
float row_sum(const std::vector<float>& v) {
  const int64_t nb = int64_t(v.size());
  float s[32];
  for (int l = 0; l < 32; ++l) {
    volatile float acc = 0.0f;
    for (int64_t b = l; b < nb; b += 32) acc = acc + v[size_t(b)];
    s[l] = acc;
  }
  for (int o = 16; o > 0; o >>= 1) {
    float t[32];
    for (int l = 0; l < 32; ++l) {
      volatile float u = s[l] + s[l ^ o];
      t[l] = u;
    }
    std::memcpy(s, t, sizeof s);
  }
  return s[0];
}

float load_x(DType dt, const uint8_t* p, int64_t i) {
  if (dt == DType::F32) {
    float f;
    std::memcpy(&f, p + 4 * i, 4);
    return f;
  }
  const uint16_t h = uint16_t(p[2 * i] | p[2 * i + 1] << 8);
  return dt == DType::F16 ? my_h2f(h) : my_bf2f(h);
}
double load_out(DType dt, const uint8_t* p, int64_t i) { return double(load_x(dt, p, i)); }

// Reference of out[m, n], x and w as raw bytes (each block of x quantized once per row, the block
// values kept per output column: N * nb floats).
std::vector<float> reference(ks_qtype_t qt, DType dt, const uint8_t* x, const uint8_t* w, int64_t M, int64_t N,
                             int64_t K) {
  const int64_t nb = K / 32, RB = nb * blk_bytes(qt);
  std::vector<float> out(size_t(M * N));
  std::vector<float> v(static_cast<size_t>(N * nb)), row(static_cast<size_t>(nb));
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < nb; ++b) {
      float xs[32];
      for (int i = 0; i < 32; ++i) xs[i] = load_x(dt, x, m * K + b * 32 + i);
      const XBlock xb = quantize_block(xs);
      for (int64_t n = 0; n < N; ++n) v[size_t(n * nb + b)] = block_value(qt, w + n * RB + b * blk_bytes(qt), xb);
    }
    for (int64_t n = 0; n < N; ++n) {
      std::copy(v.begin() + n * nb, v.begin() + (n + 1) * nb, row.begin());
      out[size_t(m * N + n)] = row_sum(row);
    }
  }
  return out;
}

// ---- raw buffers with guard bytes and DLTensors at any byte offset ----------------------------
struct Raw {
  std::vector<uint8_t> b;
  explicit Raw(size_t n, uint8_t fill = 0xA5) : b(n + 128, fill) {}
  uint8_t* at(size_t off) { return b.data() + 64 + off; }
};
DLTensor dl(void* p, DType dt, std::vector<int64_t>& shape) {
  DLTensor t{};
  t.data = p;
  t.device = {kDLCPU, 0};
  t.ndim = int(shape.size());
  t.dtype = ks::to_dl(dt);
  t.shape = shape.data();
  return t;
}
size_t esz(DType dt) { return dt == DType::F32 ? 4 : 2; }
void put_x(DType dt, uint8_t* p, int64_t i, float v) {
  if (dt == DType::F32) {
    std::memcpy(p + 4 * i, &v, 4);
    return;
  }
  const uint16_t h = dt == DType::F16 ? my_f2h(v) : my_f2bf(v);
  p[2 * i] = uint8_t(h);
  p[2 * i + 1] = uint8_t(h >> 8);
}

// Random weights: fp16 scales from `scales` (or random finite ones), random code bytes.
void fill_weights(ks_qtype_t qt, uint8_t* w, int64_t N, int64_t K, std::mt19937& g) {
  const int64_t nb = K / 32, BB = blk_bytes(qt);
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> sc(-0.05f, 0.05f);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t* blk = w + (n * nb + b) * BB;
      for (int i = 0; i < BB; ++i) blk[i] = uint8_t(byte(g));
      const uint16_t dh = my_f2h(sc(g));
      blk[0] = uint8_t(dh), blk[1] = uint8_t(dh >> 8);
      if (qt == KS_QTYPE_Q4_1) {
        const uint16_t mh = my_f2h(sc(g) * 8);
        blk[2] = uint8_t(mh), blk[3] = uint8_t(mh >> 8);
      }
    }
}

// Runs the op on x / w bytes (at the given byte offsets) and compares with the reference bit for
// bit; returns the first mismatch.
::testing::AssertionResult run_and_compare(ks_qtype_t qt, DType dt, const std::vector<float>& xv, const uint8_t* wsrc,
                                           int64_t M, int64_t N, int64_t K, size_t off_x = 0, size_t off_w = 0,
                                           size_t off_o = 0) {
  const int64_t RB = K / 32 * blk_bytes(qt);
  Raw X(size_t(M * K) * esz(dt) + off_x), W(size_t(N * RB) + off_w), O(size_t(M * N) * esz(dt) + off_o, 0xFF);
  for (int64_t i = 0; i < M * K; ++i) put_x(dt, X.at(off_x), i, xv[size_t(i)]);
  std::memcpy(W.at(off_w), wsrc, size_t(N * RB));
  const std::vector<uint8_t> x0 = X.b, w0 = W.b, o0 = O.b;
  std::vector<int64_t> xs{M, K}, ws{N, RB}, os{M, N};
  DLTensor tx = dl(X.at(off_x), dt, xs), tw = dl(W.at(off_w), DType::U8, ws), to = dl(O.at(off_o), dt, os);
  const ks_status_t st = ks_quant_matmul_a8(&to, &tx, &tw, qt, KS_BACKEND_CPU, nullptr);
  if (st != KS_SUCCESS) return ::testing::AssertionFailure() << "status " << ks_status_name(st) << ": " << ks_last_error();
  if (X.b != x0 || W.b != w0) return ::testing::AssertionFailure() << "an input was modified";
  for (size_t i = 0; i < 64 + off_o; ++i)
    if (O.b[i] != 0xFF) return ::testing::AssertionFailure() << "wrote before out";
  for (size_t i = 64 + off_o + size_t(M * N) * esz(dt); i < O.b.size(); ++i)
    if (O.b[i] != 0xFF) return ::testing::AssertionFailure() << "wrote past out";
  const std::vector<float> ref = reference(qt, dt, X.at(off_x), W.at(off_w), M, N, K);
  for (int64_t i = 0; i < M * N; ++i) {
    const double got = load_out(dt, O.at(off_o), i), want = out_value(dt, ref[size_t(i)]);
    const bool ok = (std::isnan(got) && std::isnan(want)) || (got == want && std::signbit(got) == std::signbit(want));
    if (!ok)
      return ::testing::AssertionFailure() << "out[" << i / N << ", " << i % N << "] = " << got << " (bits of fp32 "
                                           << std::hexfloat << got << "), the contract gives " << want
                                           << std::defaultfloat << " (qtype " << int(qt) << ", dtype " << dt_name(dt)
                                           << ", M " << M << " N " << N << " K " << K << ")";
  }
  return ::testing::AssertionSuccess();
}

const ks_qtype_t kFormats[] = {KS_QTYPE_Q4_0, KS_QTYPE_Q4_1, KS_QTYPE_Q8_0};
const DType kDts[] = {DType::F32, DType::F16, DType::BF16};

// A weight row n that picks x's element `pick` of block 0 (Q8_0, dw = 1, code 1 there, 0 elsewhere):
// out[n] = (1 * d) * q_pick, so a code shows in the output.
std::vector<uint8_t> picking_weights(int64_t N, int64_t K) {
  const int64_t nb = K / 32;
  std::vector<uint8_t> w(size_t(N * nb * 34), 0);
  for (int64_t n = 0; n < N; ++n) {
    uint8_t* row = w.data() + n * nb * 34;
    for (int64_t b = 0; b < nb; ++b) row[b * 34 + 1] = 0x3C;  // fp16 1.0 (0x3C00), little-endian
    row[2 + (n % 32)] = 1;
  }
  return w;
}

// ---- tests ------------------------------------------------------------------------------------

// The contract's reference (this file) against the library's test-independent spot values:
// max |x| = 127 gives d = 1 and codes equal to x rounded half to even.
TEST(QuantMatmulA8Hostile, ReferenceSelfCheck) {
  float x[32] = {};
  x[0] = 0.5f, x[1] = 1.5f, x[2] = 2.5f, x[3] = -2.5f, x[4] = -0.5f, x[5] = 127.f, x[6] = -126.5f;
  const XBlock b = quantize_block(x);
  EXPECT_EQ(b.d, 1.0f);
  EXPECT_EQ(b.q[0], 0);
  EXPECT_EQ(b.q[1], 2);
  EXPECT_EQ(b.q[2], 2);
  EXPECT_EQ(b.q[3], -2);
  EXPECT_EQ(b.q[4], 0);
  EXPECT_EQ(b.q[5], 127);
  EXPECT_EQ(b.q[6], -126);
  for (float f : {0.f, 1.f, -2.5f, 65504.f, 70000.f, 1e-5f, 6.1e-5f, 3e-8f, 1e-9f, 0.333333f})
    EXPECT_EQ(my_h2f(my_f2h(f)), ks::half_to_float(ks::float_to_half(f))) << f;
  for (float f : {0.f, 1.f, -2.5f, 3.3895e38f, 1e-39f, 1.00390625f, 1.01171875f, 1e-45f})
    EXPECT_EQ(my_bf2f(my_f2bf(f)), ks::bf16_to_float(ks::float_to_bf16(f))) << f;
}

// The d = 0 threshold: a / 127 (one FP32 division) against FLT_MIN. In FP32 this is exactly
// a < 127 FLT_MIN (= 1.49288e-36; the float just below divides to 0x1.fffffcp-127), so the
// contract's "(a < 1.5e-36)" is only approximate: a in [1.49288e-36, 1.5e-36) gives d > 0. Rows
// of x are one block each with max |x| = a a few ulps either side of 127 FLT_MIN (and 1.4e-36,
// 1.5e-36) and the other elements spread over [-a, a] (subnormals among them), picked by weights
// that show single codes.
TEST(QuantMatmulA8Hostile, ThresholdAtFltMinTimes127) {
  const float a0 = 127.0f * FLT_MIN;  // exact
  std::vector<float> as;
  float a = a0;
  for (int i = 0; i < 6; ++i) a = std::nextafter(a, 0.f);
  for (int i = 0; i < 13; ++i, a = std::nextafter(a, 1.f)) as.push_back(a);
  as.push_back(a0 * 2), as.push_back(a0 / 2), as.push_back(FLT_MIN), as.push_back(FLT_MIN * 1.5f);
  as.push_back(1.4e-36f), as.push_back(1.5e-36f);
  const int64_t M = int64_t(as.size()), K = 32, N = 32;
  std::vector<float> xv(size_t(M * K));
  std::mt19937 g(7);
  std::uniform_real_distribution<float> u(-1, 1);
  int zero_d = 0, nonzero_d = 0;
  for (int64_t m = 0; m < M; ++m) {
    const float am = as[size_t(m)];
    for (int i = 0; i < 32; ++i) xv[size_t(m * K + i)] = am * u(g);
    xv[size_t(m * K + (m % 32))] = (m & 1) ? -am : am;
    float blk[32];
    std::copy(xv.begin() + m * K, xv.begin() + m * K + 32, blk);
    (quantize_block(blk).d == 0 ? zero_d : nonzero_d)++;
  }
  EXPECT_GT(zero_d, 0);
  EXPECT_GT(nonzero_d, 0);
  const auto w = picking_weights(N, K);
  EXPECT_TRUE(run_and_compare(KS_QTYPE_Q8_0, DType::F32, xv, w.data(), M, N, K));
  // the same in bf16 (the values rounded to bf16 first: bf16 reaches FLT_MIN too)
  for (auto& v : xv) v = my_bf2f(my_f2bf(v));
  EXPECT_TRUE(run_and_compare(KS_QTYPE_Q8_0, DType::BF16, xv, w.data(), M, N, K));
  // and with large weight scales (fp16 65504: dw d normal, S products visible), every format
  for (ks_qtype_t q : kFormats) {
    std::vector<uint8_t> wq(size_t(N * blk_bytes(q)));
    std::mt19937 g2(11);
    fill_weights(q, wq.data(), N, K, g2);
    for (int64_t n = 0; n < N; ++n) wq[size_t(n * blk_bytes(q))] = 0xFF, wq[size_t(n * blk_bytes(q) + 1)] = 0x7B;
    EXPECT_TRUE(run_and_compare(q, DType::F32, xv, wq.data(), M, N, K));
  }
}

// Subnormal x elements still get codes when the block's max is just above 127 FLT_MIN (a code
// of 1 for x >= about a / 254 >= FLT_MIN / 2): flushing them to zero (FTZ / DAZ) would change
// the result. The reference says which codes are non-zero; the test makes sure there are some.
TEST(QuantMatmulA8Hostile, SubnormalElementsWithNonZeroCodes) {
  const int64_t K = 64, N = 32, M = 4;
  std::vector<float> xv(size_t(M * K), 0.f);
  int subnormal_with_code = 0;
  for (int64_t m = 0; m < M; ++m) {
    const float a = 127.0f * FLT_MIN * float(1 + m);  // block 0: the max, then subnormals
    xv[size_t(m * K + 31)] = -a;
    for (int i = 0; i < 31; ++i) xv[size_t(m * K + i)] = FLT_MIN * float(i + 1) / 32.f * ((i & 1) ? -1 : 1);
    for (int i = 0; i < 32; ++i) xv[size_t(m * K + 32 + i)] = float(i - 16) * 0.25f;  // block 1: ordinary
    float blk[32];
    std::copy(xv.begin() + m * K, xv.begin() + m * K + 32, blk);
    const XBlock b = quantize_block(blk);
    for (int i = 0; i < 31; ++i) subnormal_with_code += std::fpclassify(blk[i]) == FP_SUBNORMAL && b.q[i] != 0;
  }
  ASSERT_GT(subnormal_with_code, 5);
  const auto w = picking_weights(N, K);
  EXPECT_TRUE(run_and_compare(KS_QTYPE_Q8_0, DType::F32, xv, w.data(), M, N, K));
  for (auto& v : xv) v = my_bf2f(my_f2bf(v));
  EXPECT_TRUE(run_and_compare(KS_QTYPE_Q8_0, DType::BF16, xv, w.data(), M, N, K));
}

// x * (127 / a) rounded to FP32 lands exactly on k + 0.5 where the real product does not (the
// code must come from the FP32 product, ties to even), and real products that are exact ties.
// Found by search; at least a handful of each kind.
TEST(QuantMatmulA8Hostile, Fp32ProductsOnHalfIntegers) {
  std::mt19937 g(12345);
  std::uniform_real_distribution<float> ua(0.5f, 1000.f);
  std::uniform_int_distribution<int> uk(-126, 125);
  std::vector<float> xv;
  std::vector<std::pair<float, float>> hits;  // (a, x)
  int fp32_tie_real_not = 0, real_differs = 0;
  for (int it = 0; it < 2000000 && hits.size() < 64 * 31; ++it) {
    const float a = ua(g);
    const float inv = 127.0f / a;
    const float k = float(uk(g)) + 0.5f;
    // candidates near (k) / inv
    const float x0 = k / inv;
    for (const float x : {x0, std::nextafter(x0, -1e30f), std::nextafter(x0, 1e30f)}) {
      if (!(std::fabs(x) < a)) continue;
      const float t = x * inv;
      if (t != k) continue;
      const long double exact = (long double)x * 127.0L / (long double)a;
      const bool real_tie = exact == (long double)k;
      if (!real_tie) ++fp32_tie_real_not;
      const double code_fp32 = my_rint(t);
      const double code_real = real_tie ? code_fp32 : double(std::llroundl(exact));
      if (code_real != code_fp32) ++real_differs;
      hits.push_back({a, x});
    }
  }
  ASSERT_GT(fp32_tie_real_not, 8);
  ASSERT_GT(real_differs, 4);  // cases where exact arithmetic would give another code
  // rows of 32: element 31 the max a (one a per row), elements 0..30 the hits for that a? The
  // hits have different a; give each hit its own block: [x, a, 0, ...], 2 blocks per hit pair.
  const int64_t nblk = int64_t(hits.size());
  const int64_t K = 32 * 8, M = (nblk + 7) / 8, N = 32;
  xv.assign(size_t(M * K), 0.f);
  for (int64_t h = 0; h < nblk; ++h) {
    float* blk = xv.data() + h * 32;
    const int pos = int(h % 31);
    blk[31] = (h & 1) ? -hits[size_t(h)].first : hits[size_t(h)].first;
    blk[pos] = hits[size_t(h)].second;
  }
  // weights that pick element (n mod 32) of every block
  std::vector<uint8_t> w(size_t(N * (K / 32) * 34), 0);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t b = 0; b < K / 32; ++b) {
      uint8_t* blk = w.data() + (n * (K / 32) + b) * 34;
      blk[1] = 0x3C;
      blk[2 + n] = 1;
    }
  EXPECT_TRUE(run_and_compare(KS_QTYPE_Q8_0, DType::F32, xv, w.data(), M, N, K));
  // and against random weights of every format
  for (ks_qtype_t q : kFormats) {
    std::vector<uint8_t> wq(size_t(5 * (K / 32) * blk_bytes(q)));
    fill_weights(q, wq.data(), 5, K, g);
    EXPECT_TRUE(run_and_compare(q, DType::F32, xv, wq.data(), M, 5, K));
  }
}

// One row per kind of block mix: NaN, +inf, -inf with subnormal / -0 / huge blocks around, and
// finite rows of -0 blocks, subnormal blocks, huge blocks. Bad rows are NaN, the others exact.
TEST(QuantMatmulA8Hostile, MixedNonFiniteSubnormalAndNegativeZeroBlocks) {
  const int64_t K = 32 * 40, M = 9, N = 11;  // 40 blocks: two per lane for 8 lanes
  for (DType dt : kDts)
    for (ks_qtype_t q : kFormats) {
      std::mt19937 g(3 + int(q) * 7 + int(dt));
      std::normal_distribution<float> nd(0.f, 1.f);
      std::vector<float> xv(size_t(M * K));
      for (auto& v : xv) v = nd(g);
      auto block = [&](int64_t m, int64_t b) { return xv.data() + m * K + b * 32; };
      for (int64_t m = 0; m < M; ++m) {
        for (int i = 0; i < 32; ++i) block(m, 1)[i] = -0.0f;                          // all -0
        for (int i = 0; i < 32; ++i) block(m, 2)[i] = (i & 1) ? -0.0f : 0.0f;        // +-0
        for (int i = 0; i < 32; ++i) block(m, 3)[i] = float(i - 16) * 1e-41f;         // subnormal (d = 0)
        for (int i = 0; i < 32; ++i) block(m, 4)[i] = float(i - 16) * (dt == DType::F16 ? 4000.f : 2e36f);
        block(m, 5)[7] = -0.0f;
      }
      block(1, 0)[3] = kNaN;
      block(2, 39)[31] = kInf;
      block(3, 20)[0] = -kInf;
      block(4, 6)[5] = kNaN, block(4, 6)[6] = kInf;  // both kinds in one block
      block(5, 33)[0] = -kInf, block(5, 34)[0] = kInf;
      for (int i = 0; i < 32; ++i) block(6, 8)[i] = kNaN;  // a block of NaN only
      std::vector<uint8_t> w(size_t(N * (K / 32) * blk_bytes(q)));
      fill_weights(q, w.data(), N, K, g);
      std::vector<float> rounded = xv;
      for (auto& v : rounded)
        if (dt != DType::F32) v = dt == DType::F16 ? my_h2f(my_f2h(v)) : my_bf2f(my_f2bf(v));
      EXPECT_TRUE(run_and_compare(q, dt, rounded, w.data(), M, N, K));
      // independent of the reference: rows 1..6 NaN, rows 0, 7, 8 finite
      Raw X(size_t(M * K) * esz(dt)), W(w.size()), O(size_t(M * N) * esz(dt));
      for (int64_t i = 0; i < M * K; ++i) put_x(dt, X.at(0), i, rounded[size_t(i)]);
      std::memcpy(W.at(0), w.data(), w.size());
      std::vector<int64_t> xs{M, K}, ws{N, int64_t(w.size()) / N}, os{M, N};
      DLTensor tx = dl(X.at(0), dt, xs), tw = dl(W.at(0), DType::U8, ws), to = dl(O.at(0), dt, os);
      ASSERT_EQ(ks_quant_matmul_a8(&to, &tx, &tw, q, KS_BACKEND_CPU, nullptr), KS_SUCCESS) << ks_last_error();
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n) {
          const double v = load_out(dt, O.at(0), m * N + n);
          if (m >= 1 && m <= 6) EXPECT_TRUE(std::isnan(v)) << m << " " << n;
          else if (dt != DType::F16) EXPECT_FALSE(std::isnan(v)) << m << " " << n;
        }
    }
}

// Non-finite and subnormal fp16 weight scales / minimums: "propagate as in FP32 arithmetic".
// inf * 0 (a zero x block, or S = 0) is NaN; inf * S is +-inf; NaN anywhere is NaN; Q4_1's inf
// minimum meets d Q (0 for a zero block: NaN).
TEST(QuantMatmulA8Hostile, NonFiniteAndSubnormalWeightScales) {
  const int64_t K = 32 * 4, N = 24, M = 3;
  const uint16_t specials[] = {0x7C00, 0xFC00, 0x7E00, 0x7C01, 0xFE00, 0x0001, 0x8001, 0x03FF, 0x0000, 0x8000, 0x7BFF, 0xFBFF};
  for (DType dt : kDts)
    for (ks_qtype_t q : kFormats) {
      std::mt19937 g(99 + int(q));
      std::normal_distribution<float> nd(0.f, 1.f);
      std::vector<float> xv(size_t(M * K));
      for (auto& v : xv) v = nd(g);
      for (int i = 0; i < 32; ++i) xv[size_t(0 * K + 32 + i)] = 0.f;  // row 0 block 1: zero
      for (int i = 0; i < 32; ++i) xv[size_t(1 * K + 64 + i)] = float(i % 2);  // row 1 block 2: positive
      if (dt != DType::F32)
        for (auto& v : xv) v = dt == DType::F16 ? my_h2f(my_f2h(v)) : my_bf2f(my_f2bf(v));
      const int BB = blk_bytes(q);
      std::vector<uint8_t> w(size_t(N * (K / 32) * BB));
      fill_weights(q, w.data(), N, K, g);
      for (int64_t n = 0; n < N; ++n) {
        const uint16_t s = specials[n % 12];
        const int64_t b = (n / 12) % 4 + (n % 3 == 0);  // vary the block
        uint8_t* blk = w.data() + (n * (K / 32) + (b % 4)) * BB;
        const int at = (q == KS_QTYPE_Q4_1 && (n & 1)) ? 2 : 0;  // Q4_1: the scale or the minimum
        blk[at] = uint8_t(s), blk[at + 1] = uint8_t(s >> 8);
        if (n == 5)  // a block whose codes give S = 0 against row 1's block 2 (all codes zero)
          for (int i = 2 + 2 * (q == KS_QTYPE_Q4_1); i < BB; ++i) blk[i] = 0;
      }
      EXPECT_TRUE(run_and_compare(q, dt, xv, w.data(), M, N, K));
    }
}

// The largest |S| (Q8_0 codes -128 against x codes +-127), Q4 nibbles 0 and 15 against +-127,
// and huge blocks whose values overflow to +-inf (and inf - inf = NaN in the row sum).
TEST(QuantMatmulA8Hostile, ExtremeSumsAndOverflow) {
  const int64_t K = 32 * 33, N = 6, M = 4;
  for (ks_qtype_t q : kFormats) {
    const int BB = blk_bytes(q);
    std::vector<float> xv(size_t(M * K));
    for (int64_t i = 0; i < K; ++i) xv[size_t(i)] = -1.0f;                     // row 0: codes -127
    for (int64_t i = 0; i < K; ++i) xv[size_t(K + i)] = 1.0f;                  // row 1: codes 127
    for (int64_t i = 0; i < K; ++i) xv[size_t(2 * K + i)] = FLT_MAX * ((i & 1) ? -1 : 1);  // huge
    for (int64_t i = 0; i < K; ++i) xv[size_t(3 * K + i)] = (i / 32 % 2) ? 3e38f : -3e38f;
    std::vector<uint8_t> w(size_t(N * (K / 32) * BB));
    for (int64_t n = 0; n < N; ++n)
      for (int64_t b = 0; b < K / 32; ++b) {
        uint8_t* blk = w.data() + (n * (K / 32) + b) * BB;
        const uint16_t dh = n < 3 ? 0x7BFF : 0x3C00;  // 65504 or 1
        blk[0] = uint8_t(dh), blk[1] = uint8_t(dh >> 8);
        const int h = q == KS_QTYPE_Q4_1 ? 4 : 2;
        if (q == KS_QTYPE_Q4_1) blk[2] = 0xFF, blk[3] = uint8_t(n % 2 ? 0x7B : 0xFB);  // mw = +-65504
        for (int i = h; i < BB; ++i) blk[i] = q == KS_QTYPE_Q8_0 ? (n % 2 ? 0x80 : 0x7F) : (n % 2 ? 0xFF : 0x00);
      }
    for (DType dt : kDts)  // fp16 / bf16: x's FLT_MAX rounds to inf (a NaN row), outputs overflow to inf
      EXPECT_TRUE(run_and_compare(q, dt, xv, w.data(), M, N, K)) << dt_name(dt);
  }
}

// Non-compact strides are rejected (nothing written); a size-1 dim's stride is ignored (the same
// result as the compact tensor).
TEST(QuantMatmulA8Hostile, StridesRejectedOrIgnored) {
  const int64_t M = 2, K = 64, N = 3, RB = 68;
  std::vector<float> xv(size_t(2 * M * K), 0.25f), out(size_t(2 * M * N), -7.f);
  std::vector<uint8_t> w(size_t(2 * N * RB));
  std::mt19937 g(8);
  fill_weights(KS_QTYPE_Q8_0, w.data(), 2 * N, K, g);
  std::vector<int64_t> xs{M, K}, ws{N, RB}, os{M, N};
  auto call = [&](int64_t* sx, int64_t* sw, int64_t* so) {
    DLTensor tx = dl(xv.data(), DType::F32, xs), tw = dl(w.data(), DType::U8, ws), to = dl(out.data(), DType::F32, os);
    tx.strides = sx, tw.strides = sw, to.strides = so;
    return ks_quant_matmul_a8(&to, &tx, &tw, KS_QTYPE_Q8_0, KS_BACKEND_CPU, nullptr);
  };
  int64_t xpad[2] = {2 * K, 1}, wpad[2] = {2 * RB, 1}, opad[2] = {2 * N, 1}, xcol[2] = {1, M}, ok_x[2] = {K, 1},
          ok_w[2] = {RB, 1}, ok_o[2] = {N, 1};
  const std::vector<float> o0 = out;
  EXPECT_EQ(call(xpad, nullptr, nullptr), KS_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(call(nullptr, wpad, nullptr), KS_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(call(nullptr, nullptr, opad), KS_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(call(xcol, nullptr, nullptr), KS_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(out == o0);
  EXPECT_EQ(call(ok_x, ok_w, ok_o), KS_SUCCESS) << ks_last_error();
  const std::vector<float> compact = out;
  // M = 1 with a huge stride on the size-1 dim: ignored
  xs = {1, K}, os = {1, N};
  int64_t x1[2] = {int64_t(1) << 40, 1}, o1[2] = {-5, 1};
  std::fill(out.begin(), out.end(), -7.f);
  EXPECT_EQ(call(x1, nullptr, o1), KS_SUCCESS) << ks_last_error();
  for (int64_t n = 0; n < N; ++n) EXPECT_EQ(bits_of(out[size_t(n)]), bits_of(compact[size_t(n)])) << n;
  EXPECT_EQ(out[size_t(N)], -7.f);
}

// Every tensor at byte offsets 1..3 (the CPU takes any alignment), random data, all dtypes.
TEST(QuantMatmulA8Hostile, MisalignedViews) {
  for (DType dt : kDts)
    for (ks_qtype_t q : kFormats)
      for (size_t off : {size_t(1), size_t(2), size_t(3), size_t(5)}) {
        const int64_t M = 3, N = 13, K = 32 * 7;
        std::mt19937 g(int(off) * 31 + int(q));
        std::normal_distribution<float> nd(0.f, 2.f);
        std::vector<float> xv(size_t(M * K));
        for (auto& v : xv) v = dt == DType::F16 ? my_h2f(my_f2h(nd(g))) : dt == DType::BF16 ? my_bf2f(my_f2bf(nd(g))) : nd(g);
        std::vector<uint8_t> w(size_t(N * (K / 32) * blk_bytes(q)));
        fill_weights(q, w.data(), N, K, g);
        EXPECT_TRUE(run_and_compare(q, dt, xv, w.data(), M, N, K, off, off + 1, 3 * off));
      }
}

// Shapes: K = 32 with many output rows, many x rows (the threaded path), nb just around multiples
// of 32 (the lane sums' wrap), fp16 x near its range limits.
TEST(QuantMatmulA8Hostile, ShapesAndThreadedPath) {
  struct S {
    int64_t M, N, K;
  };
  for (const S s : {S{1, 100003, 32}, S{600, 3, 32}, S{257, 65, 64}, S{2, 9, 32 * 31}, S{2, 9, 32 * 32},
                    S{2, 9, 32 * 33}, S{1, 5, 32 * 65}, S{70, 70, 32 * 17}})
    for (ks_qtype_t q : kFormats) {
      const DType dt = s.N > 1000 ? DType::F32 : kDts[(s.M + s.K / 32) % 3];
      std::mt19937 g(int(s.M * 7 + s.N * 3 + s.K));
      std::normal_distribution<float> nd(0.f, 1.f);
      std::vector<float> xv(size_t(s.M * s.K));
      for (auto& v : xv) {
        float f = nd(g) * (dt == DType::F16 ? 20000.f : 1.f);
        v = dt == DType::F16 ? my_h2f(my_f2h(f)) : dt == DType::BF16 ? my_bf2f(my_f2bf(f)) : f;
      }
      std::vector<uint8_t> w(size_t(s.N * (s.K / 32) * blk_bytes(q)));
      fill_weights(q, w.data(), s.N, s.K, g);
      EXPECT_TRUE(run_and_compare(q, dt, xv, w.data(), s.M, s.N, s.K)) << s.M << "x" << s.N << "x" << s.K;
    }
}

// The contract's FP64 claims: per element |x - d q| <= a / 254 (plus FP32 rounding) for an
// ordinary block. For a block under the threshold (a < 127 FLT_MIN) every x maps to 0, so
// |x - x^| reaches a itself: the contract's "per element" bound holds only for blocks with d > 0.
TEST(QuantMatmulA8Hostile, ApproximationBoundHoldsOnlyAboveTheThreshold) {
  float blk[32];
  for (int i = 0; i < 32; ++i) blk[i] = 1e-37f * float(i + 1) / 32.f;
  const XBlock b = quantize_block(blk);
  ASSERT_EQ(b.d, 0.f);
  const double a = 1e-37;
  EXPECT_GT(std::fabs(double(blk[31]) - 0.0), a / 254 * 1.001)
      << "the documented per-element bound a / 254 fails for a tiny block (documentation note)";
  std::mt19937 g(5);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (int t = 0; t < 2000; ++t) {
    for (auto& v : blk) v = nd(g) * std::ldexp(1.f, t % 200 - 100);
    const XBlock q = quantize_block(blk);
    double am = 0;
    for (float v : blk) am = std::max(am, std::fabs(double(v)));
    for (int i = 0; i < 32; ++i)
      ASSERT_LE(std::fabs(double(blk[i]) - double(q.d) * q.q[i]), am / 254 * (1 + 1e-4)) << t << " " << i;
  }
}

// Aliasing: out overlapping x or weight in any way is rejected, nothing written. x and weight
// sharing bytes (both read-only) is allowed and gives the result of separate copies.
TEST(QuantMatmulA8Hostile, AliasingRejectedWithNothingWritten) {
  const int64_t M = 2, K = 64, N = 3;
  const ks_qtype_t q = KS_QTYPE_Q8_0;
  const int64_t RB = K / 32 * 34;
  for (DType dt : kDts) {
    const size_t xb = size_t(M * K) * esz(dt), ob = size_t(M * N) * esz(dt), wb = size_t(N * RB);
    Raw pool(xb + wb + ob + 4096);
    std::mt19937 g(1);
    for (auto& c : pool.b) c = uint8_t(g());
    // keep the region's scales finite: the test is about the rejection
    std::vector<int64_t> xs{M, K}, ws{N, RB}, os{M, N};
    auto check = [&](size_t ox, size_t ow, size_t oo, const char* what) {
      const std::vector<uint8_t> before = pool.b;
      DLTensor tx = dl(pool.at(ox), dt, xs), tw = dl(pool.at(ow), DType::U8, ws), to = dl(pool.at(oo), dt, os);
      const ks_status_t st = ks_quant_matmul_a8(&to, &tx, &tw, q, KS_BACKEND_CPU, nullptr);
      EXPECT_EQ(st, KS_ERROR_INVALID_ARGUMENT) << what << " " << dt_name(dt) << ": " << ks_last_error();
      EXPECT_TRUE(pool.b == before) << what << ": bytes changed by a rejected call";
    };
    const size_t e = esz(dt);
    check(0, 2048, 0, "out == x (same pointer)");
    check(0, 2048, e, "out one element into x");
    check(0, 2048, xb - e, "out's first element on x's last");
    check(e * 3, 2048, 0, "x's first element on out's last-but");
    check(0, 2048, 2048 + wb - 1, "out's first byte on weight's last byte");
    check(0, 2048, 2048 - ob + 1, "out's last byte on weight's first byte");
    check(0, 2048, 2048 + 7, "out inside weight, misaligned");
    check(0, 2048, 1, "out one byte into x");
    // x inside the weight's bytes: allowed (inputs only), same result as copies
    {
      Raw X(std::max(xb, wb)), O(ob, 0xFF);
      std::vector<uint8_t> w(wb);
      fill_weights(q, w.data(), N, K, g);
      std::memcpy(X.at(0), w.data(), wb);  // x's bytes begin with the weight's
      // x = the weight bytes read as dt: may hold NaN / inf, fine: compared NaN-aware
      DLTensor tx = dl(X.at(0), dt, xs), tw = dl(X.at(0), DType::U8, ws), to = dl(O.at(0), dt, os);
      ASSERT_EQ(ks_quant_matmul_a8(&to, &tx, &tw, q, KS_BACKEND_CPU, nullptr), KS_SUCCESS) << ks_last_error();
      std::vector<float> xv(size_t(M * K));
      for (int64_t i = 0; i < M * K; ++i) xv[size_t(i)] = load_x(dt, X.at(0), i);
      EXPECT_TRUE(run_and_compare(q, dt, xv, w.data(), M, N, K));
      const std::vector<float> ref = reference(q, dt, X.at(0), X.at(0), M, N, K);
      for (int64_t i = 0; i < M * N; ++i) {
        const double got = load_out(dt, O.at(0), i), want = out_value(dt, ref[size_t(i)]);
        EXPECT_TRUE((std::isnan(got) && std::isnan(want)) || got == want) << i << " " << got << " " << want;
      }
    }
  }
}

// Zero-size dims: M = 0 and N = 0 succeed writing nothing (and still validate: a bad qtype or a
// wrong row size is rejected); K = 0 and a [N, 0] weight are rejected.
TEST(QuantMatmulA8Hostile, ZeroSizeDims) {
  Raw X(4096), W(4096), O(4096, 0xFF);
  auto call = [&](std::vector<int64_t> xs, std::vector<int64_t> ws, std::vector<int64_t> os, ks_qtype_t q) {
    DLTensor tx = dl(X.at(0), DType::F32, xs), tw = dl(W.at(0), DType::U8, ws), to = dl(O.at(0), DType::F32, os);
    return ks_quant_matmul_a8(&to, &tx, &tw, q, KS_BACKEND_CPU, nullptr);
  };
  const std::vector<uint8_t> o0 = O.b;
  EXPECT_EQ(call({0, 64}, {3, 68}, {0, 3}, KS_QTYPE_Q8_0), KS_SUCCESS) << ks_last_error();
  EXPECT_EQ(call({2, 64}, {0, 68}, {2, 0}, KS_QTYPE_Q8_0), KS_SUCCESS) << ks_last_error();
  EXPECT_EQ(call({0, 64}, {0, 40}, {0, 0}, KS_QTYPE_Q4_1), KS_SUCCESS) << ks_last_error();
  EXPECT_TRUE(O.b == o0);
  EXPECT_EQ(call({0, 64}, {3, 68}, {0, 3}, KS_QTYPE_F32), KS_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(call({0, 64}, {3, 40}, {0, 3}, KS_QTYPE_Q8_0), KS_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(call({2, 0}, {3, 0}, {2, 3}, KS_QTYPE_Q8_0), KS_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(call({2, 64}, {3, 0}, {2, 3}, KS_QTYPE_Q8_0), KS_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(call({2, 48}, {3, 51}, {2, 3}, KS_QTYPE_Q8_0), KS_ERROR_INVALID_ARGUMENT);  // K not a multiple of 32
  EXPECT_EQ(call({2, 64}, {3, 68}, {3, 2}, KS_QTYPE_Q8_0), KS_ERROR_INVALID_ARGUMENT);  // out transposed
  EXPECT_EQ(call({2, 64}, {3, 68}, {6}, KS_QTYPE_Q8_0), KS_ERROR_INVALID_ARGUMENT);     // out 1-D
  EXPECT_TRUE(O.b == o0);
}

// Index arithmetic past 2^31 (int64 throughout): weights of more than 2^31 bytes (N * row_bytes),
// and x of more than 2^31 elements (M * K, and a single row with K > 2^31). About 8.5 GB; run with
// KS_A8_HOSTILE_BIG=1.
TEST(QuantMatmulA8Hostile, BeyondTwoTo31) {
  if (!std::getenv("KS_A8_HOSTILE_BIG")) GTEST_SKIP() << "set KS_A8_HOSTILE_BIG=1 (needs about 8.5 GB and 3 minutes)";
  {  // N * row_bytes > 2^31: Q4_0, K = 32, N = 2^27 + 5 (2.4 GB of weights)
    const int64_t N = (int64_t(1) << 27) + 5, K = 32, RB = 18;
    std::vector<uint8_t> w(size_t(N * RB));
    for (int64_t n = 0; n < N; ++n) {
      uint8_t* b = w.data() + n * RB;
      const uint16_t dh = my_f2h(float(1 + (n % 1000)) / 1024.f);
      b[0] = uint8_t(dh), b[1] = uint8_t(dh >> 8);
      for (int i = 2; i < 18; ++i) b[i] = uint8_t((n * 131 + i * 7) & 0xFF);
    }
    std::vector<float> xv(32);
    for (int i = 0; i < 32; ++i) xv[size_t(i)] = float(i - 13) * 0.37f;
    std::vector<float> out(static_cast<size_t>(N));
    std::vector<int64_t> xs{1, K}, ws{N, RB}, os{1, N};
    DLTensor tx = dl(xv.data(), DType::F32, xs), tw = dl(w.data(), DType::U8, ws), to = dl(out.data(), DType::F32, os);
    ASSERT_EQ(ks_quant_matmul_a8(&to, &tx, &tw, KS_QTYPE_Q4_0, KS_BACKEND_CPU, nullptr), KS_SUCCESS) << ks_last_error();
    for (int64_t n : {int64_t(0), int64_t(1), (int64_t(1) << 31) / RB - 1, (int64_t(1) << 31) / RB,
                      (int64_t(1) << 31) / RB + 1, N / 2 + 3, N - 2, N - 1}) {
      const std::vector<float> ref = reference(KS_QTYPE_Q4_0, DType::F32, reinterpret_cast<const uint8_t*>(xv.data()),
                                               w.data() + n * RB, 1, 1, K);
      EXPECT_EQ(bits_of(out[size_t(n)]), bits_of(ref[0])) << "row " << n;
    }
  }
  {  // M * K > 2^31 (x of 2^31 + 2^26 bf16 elements, 4.1 GB), M = 2^26 + 2^21 rows of K = 32
    const int64_t K = 32, M = (int64_t(1) << 26) + (int64_t(1) << 21), N = 2;
    std::vector<uint16_t> x(size_t(M * K));
    for (int64_t i = 0; i < M * K; ++i) x[size_t(i)] = my_f2bf(float((i * 2654435761u) % 2001) / 1000.f - 1.f);
    std::vector<uint8_t> w(size_t(N * 34));
    std::mt19937 g(2);
    fill_weights(KS_QTYPE_Q8_0, w.data(), N, K, g);
    std::vector<uint16_t> out(size_t(M * N), 0xFFFF);
    std::vector<int64_t> xs{M, K}, ws{N, 34}, os{M, N};
    DLTensor tx = dl(x.data(), DType::BF16, xs), tw = dl(w.data(), DType::U8, ws), to = dl(out.data(), DType::BF16, os);
    ASSERT_EQ(ks_quant_matmul_a8(&to, &tx, &tw, KS_QTYPE_Q8_0, KS_BACKEND_CPU, nullptr), KS_SUCCESS) << ks_last_error();
    for (int64_t m : {int64_t(0), (int64_t(1) << 26) - 1, int64_t(1) << 26, M - 1}) {
      const std::vector<float> ref =
          reference(KS_QTYPE_Q8_0, DType::BF16, reinterpret_cast<const uint8_t*>(x.data() + m * K), w.data(), 1, N, K);
      for (int64_t n = 0; n < N; ++n)
        EXPECT_EQ(out[size_t(m * N + n)], my_f2bf(ref[size_t(n)])) << "row " << m << " col " << n;
    }
  }
  {  // one row with K > 2^31: x bf16 [1, 2^31 + 64], Q4_1 weights [1, (2^26 + 2) * 20]
    const int64_t K = (int64_t(1) << 31) + 64, nb = K / 32, RB = nb * 20;
    std::vector<uint16_t> x(static_cast<size_t>(K));
    for (int64_t i = 0; i < K; ++i) x[size_t(i)] = my_f2bf(float(int64_t(i * 40503u) % 255 - 127) / 64.f);
    std::vector<uint8_t> w(static_cast<size_t>(RB));
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t* blk = w.data() + b * 20;
      const uint16_t dh = my_f2h(float(1 + b % 7) / 4096.f), mh = my_f2h(-float(b % 5) / 1024.f);
      blk[0] = uint8_t(dh), blk[1] = uint8_t(dh >> 8), blk[2] = uint8_t(mh), blk[3] = uint8_t(mh >> 8);
      for (int i = 4; i < 20; ++i) blk[i] = uint8_t((b * 17 + i) & 0xFF);
    }
    uint16_t out = 0xFFFF;
    std::vector<int64_t> xs{1, K}, ws{1, RB}, os{1, 1};
    DLTensor tx = dl(x.data(), DType::BF16, xs), tw = dl(w.data(), DType::U8, ws), to = dl(&out, DType::BF16, os);
    ASSERT_EQ(ks_quant_matmul_a8(&to, &tx, &tw, KS_QTYPE_Q4_1, KS_BACKEND_CPU, nullptr), KS_SUCCESS) << ks_last_error();
    const std::vector<float> ref =
        reference(KS_QTYPE_Q4_1, DType::BF16, reinterpret_cast<const uint8_t*>(x.data()), w.data(), 1, 1, K);
    EXPECT_EQ(out, my_f2bf(ref[0]));
  }
}

}  // namespace
