// ks_rotary_embedding (in place on q and optionally k) against an FP64 reference of the
// documented formula: inv_freq[i] = fp32(theta^(-2i/rotary_dim)); angle = fp32(fp32(pos) *
// inv_freq[i]) computed in float exactly as the contract says; cos/sin of that angle in
// double; (a, b) -> (a*c - b*s, b*c + a*s). NeoX pairs (i, i + rotary_dim/2), interleaved
// pairs (2i, 2i+1). Features past rotary_dim must be untouched bit for bit.
// Tolerance: the seed's rtol/atol plus 4u(|a| + |b|) (u = 2^-24), the first-order FP32
// rounding of cos, sin, two products and a sum.
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

namespace {

using namespace kstest::harness;

const char* kOp = "rotary_embedding";

struct RopeCase {
  DType dt = DType::F32;
  DType pos_dt = DType::I64;
  int64_t T = 3, H = 4, KVH = 2, D = 64, rd = 64;
  double theta = 10000.0;
  bool neox = true;
  bool with_k = true;
  size_t off_q = 0, off_k = 0, off_p = 0;
  std::vector<int64_t> positions;  // empty: random in [0, 4096)
};

std::vector<float> inv_freq(int64_t rd, double theta) {
  std::vector<float> f(size_t(rd / 2));
  for (int64_t i = 0; i < rd / 2; ++i) f[size_t(i)] = float(std::pow(theta, -double(2 * i) / double(rd)));
  return f;
}

// FP64 reference on the stored values of one [T, heads, D] tensor; also returns bounds.
void rope_ref(const std::vector<double>& x, int64_t T, int64_t heads, int64_t D, int64_t rd, double theta, bool neox,
              const std::vector<int64_t>& pos, std::vector<double>& y, std::vector<double>& bound) {
  y = x;
  bound.assign(x.size(), 0.0);
  const auto f = inv_freq(rd, theta);
  const int64_t half = rd / 2;
  for (int64_t t = 0; t < T; ++t) {
    const float p = float(pos[size_t(t)]);
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t base = (t * heads + h) * D;
      for (int64_t i = 0; i < half; ++i) {
        const float ang = p * f[size_t(i)];  // one FP32 product, as documented
        const double c = std::cos(double(ang)), s = std::sin(double(ang));
        const int64_t i0 = neox ? base + i : base + 2 * i;
        const int64_t i1 = neox ? base + i + half : base + 2 * i + 1;
        const double a = x[size_t(i0)], b = x[size_t(i1)];
        y[size_t(i0)] = a * c - b * s;
        y[size_t(i1)] = b * c + a * s;
        bound[size_t(i0)] = bound[size_t(i1)] = 4 * kU32 * (std::fabs(a) + std::fabs(b));
      }
    }
  }
}

ks_status_t run_rope(Buf& q, Buf* k, Buf& pos, int64_t rd, double theta, int neox, ks_backend_t be = KS_BACKEND_AUTO) {
  DLTensor qq = q.dl(), p = pos.dl();
  DLTensor kk{};
  if (k) kk = k->dl();
  return ks_rotary_embedding(&qq, k ? &kk : nullptr, &p, rd, theta, neox, be, nullptr);
}

::testing::AssertionResult check_tensor(const Buf& got, const std::vector<double>& before, const std::vector<uint8_t>& before_bytes,
                                        const RopeCase& c, int64_t heads, const std::vector<int64_t>& pos) {
  std::vector<double> y, bound;
  rope_ref(before, c.T, heads, c.D, c.rd, c.theta, c.neox, pos, y, bound);
  const double t = kstest::tol(got.dtype);
  const size_t es = ks::dtype_size(got.dtype);
  for (int64_t i = 0; i < got.numel(); ++i) {
    const int64_t f = i % c.D;
    if (f >= c.rd) {  // pass-through tail: bitwise
      if (std::memcmp(static_cast<const uint8_t*>(got.data()) + size_t(i) * es, before_bytes.data() + size_t(i) * es, es))
        return ::testing::AssertionFailure() << "tail feature " << f << " of element " << i << " changed";
      continue;
    }
    const double g = got.get(i), w = y[size_t(i)];
    const double lim = t + t * std::fabs(w) + (1 + t) * bound[size_t(i)];
    if (!(std::fabs(g - w) <= lim))
      return ::testing::AssertionFailure() << "element " << i << " (token " << i / (heads * c.D) << ", head "
                                           << (i / c.D) % heads << ", feature " << f << ", pos "
                                           << pos[size_t(i / (heads * c.D))] << "): got " << g << ", want " << w
                                           << " (|diff| " << std::fabs(g - w) << " > " << lim << ")";
  }
  return ::testing::AssertionSuccess();
}

std::vector<uint8_t> data_bytes(const Buf& b) {
  const auto* p = static_cast<const uint8_t*>(b.data());
  return std::vector<uint8_t>(p, p + b.nbytes());
}

void run_case_one(const RopeCase& c, int neox_flag) {
  Buf q(c.dt, {c.T, c.H, c.D}, c.off_q);
  Buf k(c.dt, {c.T, c.KVH, c.D}, c.off_k);
  Buf pos(c.pos_dt, {c.T}, c.off_p);
  kstest::fill_normal(q);
  kstest::fill_normal(k, 2.0);
  std::vector<int64_t> pv = c.positions;
  if (pv.empty()) {
    std::uniform_int_distribution<int64_t> d(0, 4095);
    for (int64_t t = 0; t < c.T; ++t) pv.push_back(d(rng()));
  }
  ASSERT_EQ(int64_t(pv.size()), c.T);
  for (int64_t t = 0; t < c.T; ++t) set_i(pos, t, pv[size_t(t)]);
  const auto q0 = q.values(), k0 = k.values();
  const auto qb = data_bytes(q), kb = data_bytes(k);
  Snap ps{&pos};
  Snap ks_{&k};
  const int flag = neox_flag != -2 ? neox_flag : (c.neox ? 1 : 0);
  KS_RUN_OR_SKIP(run_rope(q, c.with_k ? &k : nullptr, pos, c.rd, c.theta, flag));
  const std::string what = dt_name(c.dt) + (c.neox ? " neox" : " interleaved") + " T " + std::to_string(c.T) + " H " +
                           std::to_string(c.H) + " KVH " + std::to_string(c.KVH) + " D " + std::to_string(c.D) +
                           " rd " + std::to_string(c.rd) + " theta " + std::to_string(c.theta);
  EXPECT_TRUE(check_tensor(q, q0, qb, c, c.H, pv)) << "q: " << what;
  if (c.with_k)
    EXPECT_TRUE(check_tensor(k, k0, kb, c, c.KVH, pv)) << "k: " << what;
  else
    EXPECT_TRUE(ks_.same()) << "k was not passed but its buffer changed";
  EXPECT_TRUE(q.guards_intact() && k.guards_intact()) << what;
  EXPECT_TRUE(ps.same()) << "positions modified: " << what;
}

// Every case runs under each CPU variant (automatic choice first).
void run_case(const RopeCase& c, int neox_flag = -2) {
  FOR_EACH_VARIANT(kOp) run_case_one(c, neox_flag);
}

TEST(Rotary, NeoxAndInterleavedAllDtypes) {
  for (DType dt : kFloatTypes())
    for (bool neox : {true, false})
      for (DType pdt : {DType::I32, DType::I64}) {
        RopeCase c;
        c.dt = dt;
        c.neox = neox;
        c.pos_dt = pdt;
        run_case(c);
      }
}

TEST(Rotary, PartialRotaryDimLeavesTailBitwise) {
  const int64_t dims[][2] = {{64, 32}, {128, 64}, {8, 2}, {10, 6}, {9, 8}, {80, 40}, {3, 2}};
  for (DType dt : kFloatTypes())
    for (bool neox : {true, false})
      for (auto& d : dims) {
        RopeCase c;
        c.dt = dt;
        c.neox = neox;
        c.D = d[0];
        c.rd = d[1];
        c.T = 4;
        run_case(c);
      }
}

TEST(Rotary, GqaHeadsAndNullK) {
  for (DType dt : kFloatTypes())
    for (bool neox : {true, false}) {
      RopeCase c;
      c.dt = dt;
      c.neox = neox;
      c.H = 9;
      c.KVH = 3;
      c.D = 128;
      c.rd = 128;
      c.T = 5;
      run_case(c);
      c.with_k = false;  // q only
      run_case(c);
    }
}

TEST(Rotary, LargePositions) {
  // Angles far past 2*pi: the FP32 angle must be formed as fp32(pos) * inv_freq in FP32.
  // 16777217 is not an fp32 (rounds to 2^24); 2^31 + 5 does not fit int32 (int64 only).
  for (DType dt : kFloatTypes())
    for (bool neox : {true, false}) {
      RopeCase c;
      c.dt = dt;
      c.neox = neox;
      c.T = 6;
      c.D = 128;
      c.rd = 128;
      c.theta = 500000.0;
      c.positions = {100000, 0, 65535, 131071, 16777217, (int64_t(1) << 31) + 5};
      run_case(c);
      c.pos_dt = DType::I32;
      c.positions = {100000, 99999, 1, 262143, 16777217, 2147483647};
      run_case(c);
      // Any value is valid (no precomputed table): negative positions rotate backwards.
      c.positions = {-1, -100000, -16777217, std::numeric_limits<int32_t>::min(), 3, -7};
      run_case(c);
      c.pos_dt = DType::I64;
      c.positions = {-1, -100000, -(int64_t(1) << 40), std::numeric_limits<int64_t>::min(), 0, 12345};
      run_case(c);
    }
}

TEST(Rotary, ThetaValues) {
  for (double theta : {10000.0, 500000.0, 1e6, 1.0001, 2.0, 1e30})
    for (bool neox : {true, false}) {
      RopeCase c;
      c.theta = theta;
      c.neox = neox;
      c.D = 32;
      c.rd = 32;
      run_case(c);
    }
}

TEST(Rotary, AnyNonzeroNeoxFlagIsNeox) {
  for (int flag : {7, -1, 2}) {
    RopeCase c;
    c.neox = true;
    c.T = 2;
    run_case(c, flag);
  }
}

TEST(Rotary, MisalignedViews) {
  for (DType dt : kFloatTypes())
    for (bool neox : {true, false}) {
      RopeCase c;
      c.dt = dt;
      c.neox = neox;
      c.off_q = 2;
      c.off_k = 1;
      c.off_p = 3;
      c.D = 96;
      c.rd = 64;
      c.T = 7;
      run_case(c);
    }
}

TEST(Rotary, ManyTokens) {
  // Large enough for threaded or vectorized fast paths.
  for (DType dt : kFloatTypes()) {
    RopeCase c;
    c.dt = dt;
    c.T = 257;
    c.H = 9;
    c.KVH = 3;
    c.D = 128;
    c.rd = 128;
    c.neox = dt != DType::BF16;
    run_case(c);
  }
}

TEST(Rotary, NoQueryHeadsStillRotatesK) {
  // q (T, 0, D) is empty (NULL data is fine); k still rotates.
  for (DType dt : kFloatTypes()) {
    RopeCase c;
    c.dt = dt;
    c.H = 0;
    c.KVH = 3;
    c.D = 16;
    c.rd = 16;
    run_case(c);
  }
}

TEST(Rotary, PositionZeroIsIdentity) {
  // angle 0: c = 1, s = 0 -> every value unchanged (exactly, after FP32 round trip).
  for (DType dt : kFloatTypes()) {
    Buf q(dt, {3, 2, 16});
    kstest::fill_normal(q);
    Buf pos(DType::I32, {3});
    for (int t = 0; t < 3; ++t) set_i(pos, t, 0);
    const auto before = data_bytes(q);
    ASSERT_EQ(run_rope(q, nullptr, pos, 16, 10000.0, 1), KS_SUCCESS) << ks_last_error();
    EXPECT_EQ(before, data_bytes(q)) << dt_name(dt);
  }
}

TEST(Rotary, ZeroTokensIsANoOpButValidates) {
  Buf q(DType::F16, {0, 4, 64}), k(DType::F16, {0, 2, 64}), pos(DType::I64, {0});
  Snap s{&q, &k, &pos};
  EXPECT_EQ(run_rope(q, &k, pos, 64, 10000.0, 1), KS_SUCCESS) << ks_last_error();
  EXPECT_TRUE(s.same());
  EXPECT_TRUE(fails_cleanly(run_rope(q, &k, pos, 63, 10000.0, 1), KS_ERROR_INVALID_ARGUMENT, kOp, "rotary_dim", s));
  EXPECT_TRUE(fails_cleanly(run_rope(q, &k, pos, 64, 1.0, 1), KS_ERROR_INVALID_ARGUMENT, kOp, "theta", s));
}

TEST(Rotary, CommonTensorRules) {
  for (DType dt : kFloatTypes()) {
    Buf q(dt, {3, 4, 16}), k(dt, {3, 2, 16}), pos(DType::I32, {3});
    kstest::fill_normal(q);
    kstest::fill_normal(k);
    for (int t = 0; t < 3; ++t) set_i(pos, t, 7 * t + 1);
    check_common_rules(kOp,
                       {{"q", &q, false, {kI32, kU8}},
                        {"k", &k, true, {other_float(dt), kI32}},
                        {"positions", &pos, false, {kF32, kU32t, kI16, kU8}}},
                       [&](std::vector<DLTensor*>& t, ks_backend_t be) {
                         return ks_rotary_embedding(t[0], t[1], t[2], 16, 10000.0, 1, be, nullptr);
                       });
  }
}

TEST(Rotary, RejectsBadRotaryDim) {
  Buf q(DType::F32, {2, 3, 16}), k(DType::F32, {2, 1, 16}), pos(DType::I64, {2});
  kstest::fill_normal(q);
  kstest::fill_normal(k);
  set_i(pos, 0, 3);
  set_i(pos, 1, 9);
  for (int64_t rd : {int64_t(0), int64_t(-2), int64_t(15), int64_t(1), int64_t(17), int64_t(18), int64_t(32),
                     std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max()}) {
    Snap s{&q, &k, &pos};
    EXPECT_TRUE(fails_cleanly(run_rope(q, &k, pos, rd, 10000.0, 1), KS_ERROR_INVALID_ARGUMENT, kOp, "rotary_dim", s))
        << "rotary_dim " << rd;
  }
}

TEST(Rotary, RejectsBadTheta) {
  Buf q(DType::BF16, {2, 3, 16}), pos(DType::I32, {2});
  kstest::fill_normal(q);
  set_i(pos, 0, 3);
  set_i(pos, 1, 9);
  for (double theta : {1.0, 0.999, 0.5, 0.0, -0.0, -10000.0, std::nan(""), double(INFINITY), -double(INFINITY)}) {
    Snap s{&q, &pos};
    EXPECT_TRUE(fails_cleanly(run_rope(q, nullptr, pos, 16, theta, 0), KS_ERROR_INVALID_ARGUMENT, kOp, "theta", s))
        << "theta " << theta;
  }
}

TEST(Rotary, RejectsBadShapes) {
  const ks_status_t INV = KS_ERROR_INVALID_ARGUMENT;
  auto expect = [&](Buf& q, Buf* k, Buf& pos, const char* arg, const char* what) {
    Snap s{&q, &pos};
    if (k) s.add(k);
    EXPECT_TRUE(fails_cleanly(run_rope(q, k, pos, 8, 10000.0, 1), INV, kOp, arg, s)) << what;
  };
  Buf pos(DType::I64, {3});
  for (int t = 0; t < 3; ++t) set_i(pos, t, t + 1);
  Buf q(DType::F32, {3, 2, 8});
  kstest::fill_normal(q);
  {
    Buf q2(DType::F32, {3, 16});
    kstest::fill_normal(q2);
    expect(q2, nullptr, pos, "q", "q 2-D");
    Buf q4(DType::F32, {3, 2, 1, 8});
    kstest::fill_normal(q4);
    expect(q4, nullptr, pos, "q", "q 4-D");
    Buf q0(DType::F32, {3, 2, 0});
    expect(q0, nullptr, pos, "q", "head_dim 0");
  }
  {
    Buf p4(DType::I64, {4});
    expect(q, nullptr, p4, "positions", "4 positions for 3 tokens");
    Buf p2(DType::I64, {3, 1});
    expect(q, nullptr, p2, "positions", "positions 2-D");
    Buf p0(DType::I64, {});
    expect(q, nullptr, p0, "positions", "positions 0-d");
  }
  {
    Buf k1(DType::F32, {2, 2, 8});
    kstest::fill_normal(k1);
    expect(q, &k1, pos, "k", "k has 2 tokens");
    Buf k2(DType::F32, {3, 2, 10});
    kstest::fill_normal(k2);
    expect(q, &k2, pos, "k", "k head_dim 10");
    Buf k3(DType::F32, {3, 16});
    kstest::fill_normal(k3);
    expect(q, &k3, pos, "k", "k 2-D");
  }
  {
    Buf k(DType::F16, {3, 2, 8});
    kstest::fill_normal(k);
    Snap s{&q, &k, &pos};
    EXPECT_TRUE(fails_cleanly(run_rope(q, &k, pos, 8, 10000.0, 1), KS_ERROR_UNSUPPORTED_DTYPE, kOp, "k", s));
  }
}

// q and k as strided views into a fused qkv buffer [T, (H + 2 KVH) D] (token stride
// (H + 2 KVH) D, head stride D): rotated in place exactly as contiguous copies are, and
// the v part and every other byte untouched. Also a padded head stride (> D).
TEST(Rotary, StridedQkvViewsEqualContiguousCopies) {
  for (DType dt : kFloatTypes())
    for (int neox : {1, 0})
      for (int64_t pad : {int64_t(0), int64_t(8)}) {
        const int64_t T = 5, H = 4, KVH = 2, D = 16, HS = D + pad, W = (H + 2 * KVH) * HS;
        Buf qkv(dt, {T, W});
        kstest::fill_normal(qkv);
        Buf pos(DType::I64, {T});
        for (int t = 0; t < T; ++t) set_i(pos, t, 7 * t + 3);
        Buf qc(dt, {T, H, D}), kc(dt, {T, KVH, D});
        const size_t es = ks::dtype_size(dt);
        auto* base = static_cast<uint8_t*>(qkv.data());
        for (int64_t t = 0; t < T; ++t) {
          for (int64_t h = 0; h < H; ++h)
            std::memcpy(static_cast<uint8_t*>(qc.data()) + size_t((t * H + h) * D) * es, base + size_t(t * W + h * HS) * es,
                        size_t(D) * es);
          for (int64_t h = 0; h < KVH; ++h)
            std::memcpy(static_cast<uint8_t*>(kc.data()) + size_t((t * KVH + h) * D) * es,
                        base + size_t(t * W + (H + h) * HS) * es, size_t(D) * es);
        }
        const auto before = data_bytes(qkv);
        Dl q(qkv), k(qkv);
        q.set_shape({T, H, D});
        q.set_strides({W, HS, 1});
        k.set_shape({T, KVH, D});
        k.set_strides({W, HS, 1});
        k.t.data = base + size_t(H * HS) * es;
        DLTensor p = pos.dl();
        ASSERT_EQ(ks_rotary_embedding(q.p(), k.p(), &p, D, 10000.0, neox, KS_BACKEND_AUTO, nullptr), KS_SUCCESS)
            << ks_last_error();
        ASSERT_EQ(run_rope(qc, &kc, pos, D, 10000.0, neox), KS_SUCCESS) << ks_last_error();
        const auto after = data_bytes(qkv);
        for (int64_t t = 0; t < T; ++t)
          for (int64_t j = 0; j < W; ++j) {
            const int64_t h = j / HS, f = j % HS;
            const uint8_t* got = after.data() + size_t(t * W + j) * es;
            const uint8_t* want = before.data() + size_t(t * W + j) * es;  // untouched unless q/k feature
            if (f < D && h < H) want = static_cast<const uint8_t*>(qc.data()) + size_t((t * H + h) * D + f) * es;
            if (f < D && h >= H && h < H + KVH)
              want = static_cast<const uint8_t*>(kc.data()) + size_t((t * KVH + h - H) * D + f) * es;
            ASSERT_EQ(0, std::memcmp(got, want, es)) << dt_name(dt) << " neox " << neox << " pad " << pad << " token " << t
                                                     << " column " << j;
          }
        EXPECT_TRUE(qkv.guards_intact());
      }
}

// Strided views that are not usable are rejected by name, nothing written: overlapping
// heads, overlapping tokens, a non-contiguous last dimension, negative strides, and q/k
// views of one buffer that share elements.
TEST(Rotary, RejectsUnusableStridedViews) {
  const int64_t T = 3, H = 4, KVH = 2, D = 16, W = (H + 2 * KVH) * D;
  Buf qkv(DType::F16, {T, W});
  kstest::fill_normal(qkv);
  Buf pos(DType::I32, {T});
  for (int t = 0; t < T; ++t) set_i(pos, t, 5 * t);
  DLTensor p = pos.dl();
  Snap s{&qkv, &pos};
  auto try_q = [&](std::vector<int64_t> strides, const char* why) {
    Dl q(qkv);
    q.set_shape({T, H, D});
    q.set_strides(strides);
    EXPECT_TRUE(fails_cleanly(ks_rotary_embedding(q.p(), nullptr, &p, D, 10000.0, 1, KS_BACKEND_AUTO, nullptr),
                              KS_ERROR_INVALID_ARGUMENT, kOp, "q", s))
        << why;
  };
  try_q({W, D / 2, 1}, "heads overlap");
  try_q({D, D, 1}, "tokens overlap");
  try_q({W, D, 2}, "last dimension strided");
  try_q({-W, D, 1}, "negative token stride");
  // k overlapping q's last head (one buffer, same pitch): named as q and k
  Dl q(qkv), k(qkv);
  q.set_shape({T, H, D});
  q.set_strides({W, D, 1});
  k.set_shape({T, KVH, D});
  k.set_strides({W, D, 1});
  k.t.data = static_cast<uint16_t*>(qkv.data()) + (H - 1) * D;
  EXPECT_TRUE(fails_cleanly(ks_rotary_embedding(q.p(), k.p(), &p, D, 10000.0, 1, KS_BACKEND_AUTO, nullptr),
                            KS_ERROR_INVALID_ARGUMENT, kOp, "k", s));
  // k's rows wrapping into q's next row (k starts in the last columns of a row)
  k.t.data = static_cast<uint16_t*>(qkv.data()) + W - D;
  EXPECT_TRUE(fails_cleanly(ks_rotary_embedding(q.p(), k.p(), &p, D, 10000.0, 1, KS_BACKEND_AUTO, nullptr),
                            KS_ERROR_INVALID_ARGUMENT, kOp, "k", s));
  // Explicit compact strides for (T, H, D) are accepted and give the usual result.
  Buf q1(DType::F16, {T, H, D}), q2(DType::F16, {T, H, D});
  kstest::fill_normal(q1);
  q2.raw = q1.raw;
  Dl qs(q1);
  qs.set_strides({H * D, D, 1});
  DLTensor p2 = pos.dl(), qq2 = q2.dl();
  ASSERT_EQ(ks_rotary_embedding(qs.p(), nullptr, &p2, D, 10000.0, 0, KS_BACKEND_AUTO, nullptr), KS_SUCCESS)
      << ks_last_error();
  ASSERT_EQ(ks_rotary_embedding(&qq2, nullptr, &p2, D, 10000.0, 0, KS_BACKEND_AUTO, nullptr), KS_SUCCESS)
      << ks_last_error();
  EXPECT_EQ(q1.raw, q2.raw);
}

TEST(Rotary, RejectsOverlap) {
  // q and k sharing storage; positions inside q.
  Buf store(DType::F32, {2 * 4 * 8 + 16});
  kstest::fill_normal(store);
  Buf pos(DType::I32, {2});
  set_i(pos, 0, 1);
  set_i(pos, 1, 2);
  Dl q(store), k(store);
  q.set_shape({2, 4, 8});
  k.set_shape({2, 1, 8});
  k.t.data = static_cast<float*>(store.data()) + 60;  // inside q (64 floats)
  DLTensor p = pos.dl();
  Snap s{&store, &pos};
  EXPECT_TRUE(fails_cleanly(ks_rotary_embedding(q.p(), k.p(), &p, 8, 10000.0, 1, KS_BACKEND_AUTO, nullptr),
                            KS_ERROR_INVALID_ARGUMENT, kOp, "q|k", s));
  Dl k2(store);  // the very same storage for q and k
  k2.set_shape({2, 4, 8});
  EXPECT_TRUE(fails_cleanly(ks_rotary_embedding(q.p(), k2.p(), &p, 8, 10000.0, 1, KS_BACKEND_AUTO, nullptr),
                            KS_ERROR_INVALID_ARGUMENT, kOp, "q|k", s));
  // positions stored inside q
  Dl pin(store);
  pin.set_shape({2});
  pin.t.dtype = kI32;
  pin.t.data = static_cast<float*>(store.data()) + 10;
  EXPECT_TRUE(fails_cleanly(ks_rotary_embedding(q.p(), nullptr, pin.p(), 8, 10000.0, 1, KS_BACKEND_AUTO, nullptr),
                            KS_ERROR_INVALID_ARGUMENT, kOp, "q|positions", s));
  // positions stored inside k
  Dl kk(store);
  kk.set_shape({2, 1, 4});
  kk.t.data = static_cast<float*>(store.data()) + 64;
  Dl q4(store);
  q4.set_shape({2, 4, 4});
  Dl pk(store);
  pk.set_shape({2});
  pk.t.dtype = kI32;
  pk.t.data = static_cast<float*>(store.data()) + 66;
  EXPECT_TRUE(fails_cleanly(ks_rotary_embedding(q4.p(), kk.p(), pk.p(), 4, 10000.0, 1, KS_BACKEND_AUTO, nullptr),
                            KS_ERROR_INVALID_ARGUMENT, kOp, "k|positions", s));
}

}  // namespace

namespace {

// Strides whose byte offsets only fit after wrapping around 2^64 (UB in int64, and in
// practice the same addresses again): head h of a [1, 2, 4] fp32 view with head stride
// 2^62 elements lies 2^64 bytes past head 0, i.e. on top of it. Such views, and the
// rows / spans computed from them, must be rejected, not rotated twice in place.
TEST(Rotary, RejectsStridesThatOverflowTheSpan) {
  const int64_t P62 = int64_t(1) << 62;
  Buf store(DType::F32, {64});
  kstest::fill_normal(store);
  Buf pos(DType::I32, {2});
  set_i(pos, 0, 3);
  set_i(pos, 1, 4);
  DLTensor p = pos.dl();
  Snap s{&store, &pos};
  auto try_q = [&](std::vector<int64_t> shape, std::vector<int64_t> strides, const char* why) {
    Dl q(store);
    q.set_shape(shape);
    q.set_strides(strides);
    Dl pp(pos);
    pp.set_shape({shape[0]});
    EXPECT_TRUE(fails_cleanly(ks_rotary_embedding(q.p(), nullptr, pp.p(), 4, 10000.0, 1, KS_BACKEND_AUTO, nullptr),
                              KS_ERROR_INVALID_ARGUMENT, kOp, "q", s))
        << why;
  };
  // one token: no row-stride check, and (heads - 1) * head_stride wraps the byte span
  try_q({1, 2, 4}, {8, P62, 1}, "1 token, head 1 exactly on head 0 (2^64 bytes away)");
  try_q({1, 2, 4}, {8, P62 + 1, 1}, "1 token, head 1 4 bytes past head 0");
  try_q({1, 3, 4}, {12, P62, 1}, "1 token, (heads - 1) * head_stride overflows int64");
  // several tokens: the heads' extent (heads - 1) * head_stride + head_dim wraps to 4,
  // so a token stride of 4 passed as 'rows do not overlap'
  try_q({2, 5, 4}, {4, P62, 1}, "2 tokens, heads' extent overflows int64");
  try_q({2, 5, 4}, {4, std::numeric_limits<int64_t>::max(), 1}, "2 tokens, head stride INT64_MAX");
  try_q({2, 1, 4}, {std::numeric_limits<int64_t>::max(), 4, 1}, "2 tokens, token stride INT64_MAX");
  // k with a head stride of 2^62 - 2 fp32 elements: head 1 lies 8 bytes *before* head 0,
  // inside q; its span, 2^64 + 8 bytes, wrapped to 8 and looked disjoint from q.
  Dl q(store), k(store);
  q.set_shape({1, 2, 4});
  k.set_shape({1, 2, 4});
  k.set_strides({8, P62 - 2, 1});
  k.t.data = static_cast<float*>(store.data()) + 8;
  Dl p1(pos);
  p1.set_shape({1});
  EXPECT_TRUE(fails_cleanly(ks_rotary_embedding(q.p(), k.p(), p1.p(), 4, 10000.0, 1, KS_BACKEND_AUTO, nullptr),
                            KS_ERROR_INVALID_ARGUMENT, kOp, "k", s));
  EXPECT_TRUE(store.guards_intact());
}

// The same-pitch overlap test works on token extents (first head's first element to the
// last head's last), as documented: k in the padding after q's last head is accepted, k in
// the padding between two of q's heads is rejected (conservatively), and a k that wraps
// from the end of one token into the next token's q is rejected.
TEST(Rotary, SamePitchOverlapTestWorksOnTokenExtents) {
  const int64_t T = 3, D = 4, W = 32;  // q: 2 heads at columns 0 and 8; k: 1 head
  Buf store(DType::F32, {T + 1, W});  // room for a k that runs past q's last token
  kstest::fill_normal(store);
  Buf pos(DType::I64, {T});
  for (int t = 0; t < T; ++t) set_i(pos, t, 11 * t + 2);
  DLTensor p = pos.dl();
  auto* base = static_cast<float*>(store.data());
  Dl q(store), k(store);
  q.set_shape({T, 2, D});
  q.set_strides({W, 8, 1});
  k.set_shape({T, 1, D});
  k.set_strides({W, 1, 1});
  auto call = [&] { return ks_rotary_embedding(q.p(), k.p(), &p, D, 10000.0, 1, KS_BACKEND_CPU, nullptr); };
  for (int64_t col : {4, 6, 9, 30, 31}) {  // between q's heads, inside one, wrapping into the next token
    Snap s{&store, &pos};
    k.t.data = base + col;
    EXPECT_TRUE(fails_cleanly(call(), KS_ERROR_INVALID_ARGUMENT, kOp, "k", s)) << "k at column " << col;
  }
  for (int64_t col : {12, 20, 28}) {  // after q's last head, up to the end of the token
    k.t.data = base + col;
    EXPECT_EQ(call(), KS_SUCCESS) << "k at column " << col << ": " << ks_last_error();
  }
  EXPECT_TRUE(store.guards_intact());
}

// Random q and k views of one buffer: random head and token strides (padding, size-1
// dimensions with any stride), start offsets anywhere (also off element alignment, split
// between data and byte_offset). A call is accepted only when q and k share no byte, and
// then gives bit for bit what contiguous copies give, touching no other byte. With one
// token pitch for both (or a single token), views whose token extents (first to last
// head) are disjoint must be accepted.
TEST(Rotary, RandomStridedViewsOfOneBuffer) {
  std::mt19937_64 g(20240611);
  auto U = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(g); };
  int accepted = 0, rejected = 0;
  for (int iter = 0; iter < 4000; ++iter) {
    const DType dt = kFloatTypes()[size_t(U(0, int64_t(kFloatTypes().size()) - 1))];
    const int64_t es = int64_t(ks::dtype_size(dt));
    const int64_t T = U(1, 4), D = 2 * U(1, 3), rd = 2 * U(1, D / 2);
    struct V {
      int64_t heads, hs, rs, ext, span, off;  // ext, span in elements; off in bytes
    };
    auto make = [&](int64_t heads) {
      V v{};
      v.heads = heads;
      v.hs = heads > 1 ? D + U(0, 3) : U(-5, 20);  // a size-1 dimension's stride is ignored
      v.ext = (heads > 1 ? (heads - 1) * v.hs : 0) + D;
      v.rs = T > 1 ? v.ext + U(0, 12) : U(-30, 30);
      return v;
    };
    V qv = make(U(0, 3)), kv = make(U(0, 3));
    const bool same_pitch = T > 1 && U(0, 1) == 1;
    if (same_pitch) qv.rs = kv.rs = std::max(qv.rs, kv.rs);
    for (V* v : {&qv, &kv}) v->span = v->heads == 0 ? 0 : (T - 1) * (T > 1 ? v->rs : 0) + v->ext;
    const int64_t n_bytes = 2048;
    Buf store(DType::U8, {n_bytes});
    for (int64_t i = 0; i < n_bytes; ++i) static_cast<uint8_t*>(store.data())[i] = uint8_t(U(0, 255));
    if (dt != DType::F32)  // keep 16-bit values finite: clear the exponent's top bit of every high byte
      for (int64_t i = 1; i < n_bytes; i += 2) static_cast<uint8_t*>(store.data())[i] &= 0xBF;
    else
      for (int64_t i = 3; i < n_bytes; i += 4) static_cast<uint8_t*>(store.data())[i] &= 0xBF;
    qv.off = U(0, 200) * es + (U(0, 3) == 0 ? U(1, es - 1) : 0);
    // k near q: before, inside, just past, or in q's padding
    kv.off = qv.off + U(-kv.span - 2, qv.span + 2) * es + (U(0, 3) == 0 ? U(1, es - 1) : 0);
    if (kv.off < 0) kv.off = U(0, es);
    ASSERT_LE(qv.off + qv.span * es, n_bytes);
    ASSERT_LE(kv.off + kv.span * es, n_bytes);
    // which bytes each view owns, and each token's extent
    std::vector<int> owner(size_t(n_bytes), 0), row_owner(size_t(n_bytes), 0);
    bool overlap = false, rows_meet = false;
    auto mark = [&](const V& v, int who) {
      for (int64_t t = 0; t < T && v.heads > 0; ++t) {
        const int64_t r0 = v.off + t * (T > 1 ? v.rs : 0) * es;
        for (int64_t b = r0; b < r0 + v.ext * es; ++b) {
          if (row_owner[size_t(b)] && row_owner[size_t(b)] != who) rows_meet = true;
          row_owner[size_t(b)] = who;
        }
        for (int64_t h = 0; h < v.heads; ++h) {
          const int64_t h0 = r0 + h * (v.heads > 1 ? v.hs : 0) * es;
          for (int64_t b = h0; b < h0 + D * es; ++b) {
            if (owner[size_t(b)] && owner[size_t(b)] != who) overlap = true;
            owner[size_t(b)] = who;
          }
        }
      }
    };
    mark(qv, 1);
    mark(kv, 2);
    auto dl_of = [&](const V& v) {
      Dl d(store);
      d.t.dtype = ks::to_dl(dt);
      d.set_shape({T, v.heads, D});
      d.set_strides({v.rs, v.hs, 1});
      const int64_t split = U(0, v.off);
      d.t.data = static_cast<uint8_t*>(store.data()) + split;
      d.t.byte_offset = uint64_t(v.off - split);
      return d;
    };
    Dl q = dl_of(qv), k = dl_of(kv);
    Buf pos(DType::I64, {T});
    for (int64_t t = 0; t < T; ++t) set_i(pos, t, U(-50, 5000));
    DLTensor p = pos.dl();
    const auto before = store.raw;
    const int neox = int(U(0, 1));
    const ks_status_t st = ks_rotary_embedding(q.p(), k.p(), &p, rd, 10000.0, neox, KS_BACKEND_CPU, nullptr);
    const std::string what = dt_name(dt) + " T " + std::to_string(T) + " D " + std::to_string(D) + " q heads " +
                             std::to_string(qv.heads) + " strides (" + std::to_string(qv.rs) + ", " +
                             std::to_string(qv.hs) + ") at byte " + std::to_string(qv.off) + ", k heads " +
                             std::to_string(kv.heads) + " strides (" + std::to_string(kv.rs) + ", " +
                             std::to_string(kv.hs) + ") at byte " + std::to_string(kv.off);
    if (st != KS_SUCCESS) {
      ++rejected;
      ASSERT_EQ(st, KS_ERROR_INVALID_ARGUMENT) << ks_last_error() << "; " << what;
      ASSERT_NE(std::string(ks_last_error()).find("overlap"), std::string::npos) << ks_last_error() << "; " << what;
      const bool one_pitch = T == 1 || qv.rs == kv.rs;
      ASSERT_TRUE(overlap || rows_meet || !one_pitch)
          << "disjoint token extents of one pitch rejected: " << ks_last_error() << "; " << what;
      ASSERT_TRUE(store.raw == before) << what;
      continue;
    }
    ++accepted;
    ASSERT_FALSE(overlap) << "q and k share bytes but were accepted; " << what;
    // the same rotation on contiguous copies, then written back where the views are
    Buf qc(dt, {T, qv.heads, D}), kc(dt, {T, kv.heads, D});
    auto copy = [&](const V& v, Buf& c, bool to_view) {
      for (int64_t t = 0; t < T; ++t)
        for (int64_t h = 0; h < v.heads; ++h) {
          const int64_t at = v.off + (t * (T > 1 ? v.rs : 0) + h * (v.heads > 1 ? v.hs : 0)) * es;
          uint8_t* cp = static_cast<uint8_t*>(c.data()) + (t * v.heads + h) * D * es;
          if (to_view)
            std::memcpy(static_cast<uint8_t*>(store.data()) + at, cp, size_t(D * es));
          else
            std::memcpy(cp, before.data() + Buf::kPad + size_t(at), size_t(D * es));
        }
    };
    copy(qv, qc, false);
    copy(kv, kc, false);
    const auto after = store.raw;
    store.raw = before;
    ASSERT_EQ(run_rope(qc, &kc, pos, rd, 10000.0, neox, KS_BACKEND_CPU), KS_SUCCESS) << ks_last_error();
    copy(qv, qc, true);
    copy(kv, kc, true);
    ASSERT_TRUE(after == store.raw) << "strided result differs from the contiguous one; " << what;
  }
  EXPECT_GT(accepted, 500);
  EXPECT_GT(rejected, 500);
}

}  // namespace
