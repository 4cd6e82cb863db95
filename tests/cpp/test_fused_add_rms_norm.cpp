// ks_fused_add_rms_norm: contract against an FP64 reference, the unrounded-sum
// rule, shapes, views, validation, aliasing, fp16 overflow, batch invariance.
//
// Contract (kernscope.h, seed README):
//   s = fp32(x) + fp32(residual)                 (FP32, not rounded to the dtype)
//   residual = round(s)
//   x = round(s * rsqrt(mean(s^2) + fp32(eps)) * fp32(weight))
// x and residual are updated in place, so they cannot be poisoned before a call;
// instead both are checked completely (residual bitwise, x against FP64) and the
// guard bytes around every buffer are checked after every call.
#include <cfloat>
#include <cmath>
#include <deque>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "call_checks.hpp"

namespace {

using namespace kstest::checks;

constexpr const char* kOp = "fused_add_rms_norm";
const RejectionCheck rejected{kOp};

// ---------------------------------------------------------------- helpers --

bool same_value(double a, double b) { return (std::isnan(a) && std::isnan(b)) || a == b; }

struct Ref {
  std::vector<double> x;         // FP64 normalized output (from the exact, unrounded sum)
  std::vector<double> residual;  // round(fp32 sum): exact expected values
};

Ref fused_ref(const Buf& x, const Buf& res, const Buf& w, double eps) {
  const int64_t H = w.numel();
  const int64_t rows = x.numel() / H;
  const double e = double(float(eps));
  const auto xv = x.values(), rv = res.values(), wv = w.values();
  Ref out;
  out.x.resize(xv.size());
  out.residual.resize(xv.size());
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t i = 0; i < H; ++i) {
      const double s = xv[r * H + i] + rv[r * H + i];
      ss += s * s;
      // The residual is a single FP32 add followed by one rounding: no freedom.
      const float sf = float(xv[r * H + i]) + float(rv[r * H + i]);
      out.residual[r * H + i] = round_to(double(sf), x.dtype);
    }
    const double scale = 1.0 / std::sqrt(ss / double(H) + e);
    for (int64_t i = 0; i < H; ++i) out.x[r * H + i] = (xv[r * H + i] + rv[r * H + i]) * scale * wv[i];
  }
  return out;
}

::testing::AssertionResult residual_exact(const Buf& res, const std::vector<double>& want) {
  for (int64_t i = 0; i < res.numel(); ++i)
    if (!same_value(res.get(i), want[i]))
      return ::testing::AssertionFailure() << "residual[" << i << "] = " << res.get(i) << ", want round(x + residual) = "
                                           << want[i];
  return ::testing::AssertionSuccess();
}

ks_status_t run(Buf& x, Buf& res, Buf& w, double eps = 1e-6, ks_backend_t be = KS_BACKEND_AUTO) {
  DLTensor a = x.dl(), r = res.dl(), b = w.dl();
  return ks_fused_add_rms_norm(&a, &r, &b, eps, be, nullptr);
}

void check_contract(DType dt, const std::vector<int64_t>& shape, double eps = 1e-6, double std_ = 1.0, size_t ox = 0,
                    size_t orr = 0, size_t ow = 0) {
  const int64_t H = shape.back();
  Buf x(dt, shape, ox), res(dt, shape, orr), w(dt, {H}, ow);
  fill_normal(x, std_);
  fill_normal(res, std_);
  fill_uniform(w, -2.0, 2.0);
  const Ref ref = fused_ref(x, res, w, eps);
  const auto w0 = w.raw;
  ASSERT_TRUE(ok(run(x, res, w, eps)));
  EXPECT_TRUE(x.guards_intact());
  EXPECT_TRUE(res.guards_intact());
  EXPECT_TRUE(w.guards_intact());
  EXPECT_EQ(w.raw, w0) << "weight was modified";
  EXPECT_TRUE(residual_exact(res, ref.residual)) << ks::dtype_name(dt) << " H=" << H;
  EXPECT_TRUE(allclose(x.values(), ref.x, tol(dt), tol(dt))) << ks::dtype_name(dt) << " H=" << H;
}

class FusedAddRmsNorm : public ::testing::TestWithParam<DType> {};

// ---------------------------------------------------------------- contract --

TEST_P(FusedAddRmsNorm, OddAndNonVectorWidths) {
  for (int64_t H : {1, 2, 3, 7, 8, 9, 16, 17, 33, 127, 128, 129, 1000, 3420, 4097}) {
    SCOPED_TRACE("H=" + std::to_string(H));
    check_contract(GetParam(), {5, H});
  }
}

TEST_P(FusedAddRmsNorm, MultiDimLeadingShapes) {
  check_contract(GetParam(), {7});
  check_contract(GetParam(), {2, 3, 5, 33});
  check_contract(GetParam(), {3, 1, 4, 1, 127});
}

TEST_P(FusedAddRmsNorm, EpsIsUsed) {
  for (double eps : {1e-6, 1e-2, 0.5}) check_contract(GetParam(), {4, 127}, eps, 1e-3);
  check_contract(GetParam(), {4, 127}, 1e-45);  // smallest positive fp32: valid
}

TEST_P(FusedAddRmsNorm, HugeRow) {
  // One 131077-wide row pair (cheap on the CPU).
  const DType dt = GetParam();
  const int64_t H = 131077;
  Buf x(dt, {1, H}), res(dt, {1, H}), w(dt, {H});
  fill_normal(x);
  fill_normal(res);
  fill_uniform(w, 0.5, 1.5);
  const Ref ref = fused_ref(x, res, w, 1e-6);
  ASSERT_TRUE(ok(run(x, res, w)));
  EXPECT_TRUE(residual_exact(res, ref.residual));
  // docs/contracts.md: no long-row allowance for the norms; the seed tolerance holds.
  EXPECT_TRUE(allclose(x.values(), ref.x, tol(dt), tol(dt)));
  EXPECT_TRUE(x.guards_intact());
  EXPECT_TRUE(res.guards_intact());
}

TEST_P(FusedAddRmsNorm, ZeroRowsIsANoOp) {
  const DType dt = GetParam();
  for (std::vector<int64_t> shape : {std::vector<int64_t>{0, 16}, {2, 0, 16}}) {
    Buf x(dt, shape), res(dt, shape), w(dt, {16});
    fill_normal(w);
    const auto before = snap({&x, &res, &w});
    ASSERT_TRUE(ok(run(x, res, w)));
    EXPECT_EQ(x.raw, before[0]);
    EXPECT_EQ(res.raw, before[1]);
    EXPECT_EQ(w.raw, before[2]);
  }
  // Zero rows still validate.
  Buf x(dt, {0, 16}), res(dt, {0, 16}), w(dt, {15}), wdt(other_float(dt), {16});
  fill_normal(w);
  fill_normal(wdt);
  auto before = snap({&x, &res, &w, &wdt});
  EXPECT_TRUE(rejected(run(x, res, w), KS_ERROR_INVALID_ARGUMENT, {"weight"}, {&x, &res, &w, &wdt}, before));
  EXPECT_TRUE(rejected(run(x, res, wdt), KS_ERROR_UNSUPPORTED_DTYPE, {"weight"}, {&x, &res, &w, &wdt}, before));
  Buf w16(dt, {16});
  fill_normal(w16);
  before = snap({&x, &res, &w16});
  EXPECT_TRUE(rejected(run(x, res, w16, -1.0), KS_ERROR_INVALID_ARGUMENT, {"eps"}, {&x, &res, &w16}, before));
}

TEST_P(FusedAddRmsNorm, OffsetAndMisalignedViews) {
  for (size_t o : {2u, 6u, 10u}) {
    SCOPED_TRACE("offset " + std::to_string(o));
    check_contract(GetParam(), {3, 127}, 1e-6, 1.0, o, o, o);
    check_contract(GetParam(), {2, 4097}, 1e-6, 1.0, o, (o + 4) % 12, (o + 8) % 12);
  }
}

TEST_P(FusedAddRmsNorm, DLTensorByteOffsetIsHonoured) {
  const DType dt = GetParam();
  const int64_t H = 37;
  Buf x(dt, {3, H}), res(dt, {3, H}), w(dt, {H});
  fill_normal(x);
  fill_normal(res);
  fill_normal(w);
  const Ref ref = fused_ref(x, res, w, 1e-6);
  DLTensor a = x.dl(), r = res.dl(), b = w.dl();
  size_t boff = 2;
  for (DLTensor* t : {&a, &r, &b}) {
    t->data = static_cast<char*>(t->data) - boff;
    t->byte_offset = boff;
    boff += 4;
  }
  ASSERT_TRUE(ok(ks_fused_add_rms_norm(&a, &r, &b, 1e-6, KS_BACKEND_AUTO, nullptr)));
  EXPECT_TRUE(residual_exact(res, ref.residual));
  EXPECT_TRUE(allclose(x.values(), ref.x, tol(dt), tol(dt)));
  EXPECT_TRUE(x.guards_intact() && res.guards_intact() && w.guards_intact());
}

// The normalization must use the unrounded FP32 sum s, not round(s) (what a
// separate add kernel followed by rms_norm would compute).
void check_unrounded_sum_rule(DType dt) {
  const int64_t R = 64, H = 8;
  Buf x(dt, {R, H}), res(dt, {R, H}), w(dt, {H});
  fill_normal(x);
  fill_normal(res);
  fill_uniform(w, 0.5, 2.0);
  const auto xv = x.values(), rv = res.values(), wv = w.values();
  const double eps = double(float(1e-6));
  // Expected outputs under both readings, from the same inputs, in double.
  std::vector<double> want_unrounded(size_t(R * H)), want_rounded(size_t(R * H));
  std::vector<bool> safe(size_t(R * H));
  for (int64_t r = 0; r < R; ++r) {
    double ss_u = 0, ss_r = 0;
    for (int64_t i = 0; i < H; ++i) {
      const double s = xv[r * H + i] + rv[r * H + i], sr = round_to(s, dt);
      ss_u += s * s;
      ss_r += sr * sr;
    }
    const double k_u = 1.0 / std::sqrt(ss_u / H + eps), k_r = 1.0 / std::sqrt(ss_r / H + eps);
    for (int64_t i = 0; i < H; ++i) {
      const double s = xv[r * H + i] + rv[r * H + i], sr = round_to(s, dt);
      const double y = s * k_u * wv[i];
      want_unrounded[r * H + i] = round_to(y, dt);
      want_rounded[r * H + i] = round_to(sr * k_r * wv[i], dt);
      // Far (1e-4 relative) from a rounding midpoint: FP32 arithmetic (error ~1e-6)
      // must then land on exactly this value.
      safe[r * H + i] = round_to(y * (1 + 1e-4), dt) == want_unrounded[r * H + i] &&
                        round_to(y * (1 - 1e-4), dt) == want_unrounded[r * H + i];
    }
  }
  ASSERT_TRUE(ok(run(x, res, w)));
  int discriminating = 0;
  for (int64_t i = 0; i < R * H; ++i) {
    if (!safe[i]) continue;
    EXPECT_EQ(x.get(i), want_unrounded[i]) << "element " << i << " (normalizing round(s) would give "
                                           << want_rounded[i] << ")";
    if (want_rounded[i] != want_unrounded[i]) ++discriminating;
  }
  // The case must actually separate the two readings.
  EXPECT_GE(discriminating, 20) << "test data does not discriminate rounded from unrounded sums";
}

TEST(FusedAddRmsNormUnroundedSum, Bf16) { check_unrounded_sum_rule(DType::BF16); }
TEST(FusedAddRmsNormUnroundedSum, Fp16) { check_unrounded_sum_rule(DType::F16); }

TEST(FusedAddRmsNormUnroundedSum, Bf16HandBuiltRow) {
  // H = 2: x = [1, 1.5], residual = [3/512, 0.5], weight = [1.25, 1]; all exact in bf16.
  // s = [1.005859375, 2] (exact in FP32). bf16 keeps 8 significant bits, so
  // round(s0) = 1.0078125 (+0.19%), while s1 = 2 is exact.
  //   unrounded contract: y0 = s0 * rsqrt((s0^2 + 4) / 2 + eps) * 1.25 = 0.794268...
  //                       -> bf16 0.79296875 (the rounding midpoint is 0.794921875)
  //   rounded-sum reading: y0 = 0.795499... -> bf16 0.796875
  Buf x(DType::BF16, {1, 2}), res(DType::BF16, {1, 2}), w(DType::BF16, {2});
  x.set(0, 1.0);
  res.set(0, 3.0 / 512);
  x.set(1, 1.5);
  res.set(1, 0.5);
  w.set(0, 1.25);
  w.set(1, 1.0);
  const double s0 = 1.0 + 3.0 / 512, s1 = 2.0, e = double(float(1e-6));
  const double k_u = 1.0 / std::sqrt((s0 * s0 + s1 * s1) / 2 + e);
  const double sr = round_to(s0, DType::BF16);
  const double k_r = 1.0 / std::sqrt((sr * sr + s1 * s1) / 2 + e);
  const double want = round_to(s0 * k_u * 1.25, DType::BF16), wrong = round_to(sr * k_r * 1.25, DType::BF16);
  ASSERT_EQ(sr, 1.0078125);
  ASSERT_EQ(want, 0.79296875);
  ASSERT_EQ(wrong, 0.796875);
  ASSERT_TRUE(ok(run(x, res, w)));
  EXPECT_EQ(res.get(0), 1.0078125);
  EXPECT_EQ(res.get(1), 2.0);
  EXPECT_EQ(x.get(0), want) << "normalizing round(s) would give " << wrong;
  EXPECT_EQ(x.get(1), round_to(s1 * k_u, DType::BF16));
}

TEST_P(FusedAddRmsNorm, Fp16RangeSumsAndSquares) {
  // |s| up to ~65400: s^2 ~ 4.3e9 overflows fp16 but not the FP32 accumulation.
  const DType dt = GetParam();
  const int64_t H = 1031;
  Buf x(dt, {3, H}), res(dt, {3, H}), w(dt, {H});
  fill_uniform(x, 30000.0, 32700.0);
  fill_uniform(res, 30000.0, 32700.0);
  for (int64_t i = 0; i < x.numel(); i += 2) {
    x.set(i, -x.get(i));
    res.set(i, -res.get(i));
  }
  fill_uniform(w, -2.0, 2.0);
  const Ref ref = fused_ref(x, res, w, 1e-6);
  ASSERT_TRUE(ok(run(x, res, w)));
  EXPECT_TRUE(residual_exact(res, ref.residual));
  const auto got = x.values();
  for (double g : got) ASSERT_TRUE(std::isfinite(g));
  EXPECT_TRUE(allclose(got, ref.x, tol(dt), tol(dt)));
}

TEST_P(FusedAddRmsNorm, SumBeyondFp16MaxStillNormalizesFromUnroundedSum) {
  // x + residual ~ 1.2e5: in fp16, round(s) = inf (>= 65520), so residual is inf by
  // the contract; x still comes from the finite FP32 s and must be finite and correct.
  // (bf16/fp32 represent s, so there the residual is finite.)
  const DType dt = GetParam();
  const int64_t H = 129;
  Buf x(dt, {2, H}), res(dt, {2, H}), w(dt, {H});
  fill_uniform(x, 55000.0, 65504.0);
  fill_uniform(res, 55000.0, 65504.0);
  for (int64_t i = 0; i < x.numel(); i += 3) {
    x.set(i, -x.get(i));
    res.set(i, -res.get(i));
  }
  fill_uniform(w, -2.0, 2.0);
  const Ref ref = fused_ref(x, res, w, 1e-6);
  ASSERT_TRUE(ok(run(x, res, w)));
  EXPECT_TRUE(residual_exact(res, ref.residual));
  if (dt == DType::F16) {
    for (int64_t i = 0; i < res.numel(); ++i) ASSERT_TRUE(std::isinf(res.get(i))) << i;
  }
  const auto got = x.values();
  for (double g : got) ASSERT_TRUE(std::isfinite(g));
  EXPECT_TRUE(allclose(got, ref.x, tol(dt), tol(dt)));
}

// ------------------------------------------------------------ batch invariance --

TEST_P(FusedAddRmsNorm, RowAloneEqualsRowInBatchBitwise) {
  const DType dt = GetParam();
  for (int64_t H : {7, 4097}) {
    const int64_t R = 257;
    Buf x(dt, {R, H}), res(dt, {R, H}), w(dt, {H});
    fill_normal(x);
    fill_normal(res);
    fill_normal(w);
    const Buf x0 = x, r0 = res;
    ASSERT_TRUE(ok(run(x, res, w)));
    const size_t rb = size_t(H) * ks::dtype_size(dt);
    for (int64_t r : {int64_t(0), int64_t(1), int64_t(128), int64_t(256)}) {
      Buf x1(dt, {1, H}), r1(dt, {1, H});
      std::memcpy(x1.data(), static_cast<const char*>(x0.data()) + r * rb, rb);
      std::memcpy(r1.data(), static_cast<const char*>(r0.data()) + r * rb, rb);
      ASSERT_TRUE(ok(run(x1, r1, w)));
      EXPECT_EQ(0, std::memcmp(x1.data(), static_cast<char*>(x.data()) + r * rb, rb)) << "x, H=" << H << " row " << r;
      EXPECT_EQ(0, std::memcmp(r1.data(), static_cast<char*>(res.data()) + r * rb, rb))
          << "residual, H=" << H << " row " << r;
    }
  }
}

// ---------------------------------------------------------------- aliasing --

TEST_P(FusedAddRmsNorm, RejectsOverlapBetweenXResidualAndWeight) {
  const DType dt = GetParam();
  const int64_t R = 4, H = 16;
  const int64_t es = int64_t(ks::dtype_size(dt));
  Buf arena(dt, {3 * R * H}), w(dt, {H}), res(dt, {R, H});  // room for every shift
  fill_normal(arena);
  fill_normal(w);
  fill_normal(res);
  char* base = static_cast<char*>(arena.data()) + R * H * es;
  std::vector<int64_t> s{R, H}, sh{H}, s1{1, H};
  const std::vector<Buf*> all{&arena, &w, &res};
  auto before = snap(all);
  // x and residual: exact, shifted by one element, shifted by one row.
  for (int64_t shift : std::vector<int64_t>{0, 1, -1, H, -(R - 1) * H}) {
    DLTensor a = make_dl(base, dt, s), r = make_dl(base + shift * es, dt, s), b = w.dl();
    EXPECT_TRUE(rejected(ks_fused_add_rms_norm(&a, &r, &b, 1e-6, KS_BACKEND_AUTO, nullptr),
                         KS_ERROR_INVALID_ARGUMENT, {"x", "residual"}, all, before))
        << "shift " << shift;
  }
  // x and weight: weight is exactly x (x is [1, H]); a row of x; a misaligned slice
  // inside x; one element shared at x's end.
  for (int64_t off : std::vector<int64_t>{0, H, 3, R * H - 1}) {
    Buf res1(dt, {off == 0 ? 1 : R, H});
    fill_normal(res1);
    const auto rb = res1.raw;
    DLTensor a = make_dl(base, dt, off == 0 ? s1 : s), r = res1.dl(), b = make_dl(base + off * es, dt, sh);
    EXPECT_TRUE(rejected(ks_fused_add_rms_norm(&a, &r, &b, 1e-6, KS_BACKEND_AUTO, nullptr),
                         KS_ERROR_INVALID_ARGUMENT, {"x", "weight"}, all, before))
        << "off " << off;
    EXPECT_EQ(res1.raw, rb);
  }
  // residual and weight: exact, a row, misaligned, one element shared at the end.
  for (int64_t off : std::vector<int64_t>{0, H, 3, R * H - 1}) {
    Buf x(dt, {off == 0 ? 1 : R, H});
    fill_normal(x);
    const auto xb = x.raw;
    DLTensor a = x.dl(), r = make_dl(base, dt, off == 0 ? s1 : s), b = make_dl(base + off * es, dt, sh);
    EXPECT_TRUE(rejected(ks_fused_add_rms_norm(&a, &r, &b, 1e-6, KS_BACKEND_AUTO, nullptr),
                         KS_ERROR_INVALID_ARGUMENT, {"residual", "weight"}, all, before))
        << "off " << off;
    EXPECT_EQ(x.raw, xb);
  }
}

TEST_P(FusedAddRmsNorm, AdjacentButDisjointBuffersAreAccepted) {
  // x, residual and weight packed back to back in one allocation: no overlap.
  const DType dt = GetParam();
  const int64_t R = 3, H = 17;
  const int64_t es = int64_t(ks::dtype_size(dt));
  Buf arena(dt, {2 * R * H + H});
  fill_normal(arena);
  Buf xs(dt, {R, H}), rs(dt, {R, H}), ws(dt, {H});
  char* base = static_cast<char*>(arena.data());
  std::memcpy(xs.data(), base, xs.nbytes());
  std::memcpy(rs.data(), base + R * H * es, rs.nbytes());
  std::memcpy(ws.data(), base + 2 * R * H * es, ws.nbytes());
  const Ref ref = fused_ref(xs, rs, ws, 1e-6);
  std::vector<int64_t> s{R, H}, sh{H};
  DLTensor a = make_dl(base, dt, s), r = make_dl(base + R * H * es, dt, s), b = make_dl(base + 2 * R * H * es, dt, sh);
  ASSERT_TRUE(ok(ks_fused_add_rms_norm(&a, &r, &b, 1e-6, KS_BACKEND_AUTO, nullptr)));
  std::memcpy(xs.data(), base, xs.nbytes());
  std::memcpy(rs.data(), base + R * H * es, rs.nbytes());
  EXPECT_TRUE(residual_exact(rs, ref.residual));
  EXPECT_TRUE(allclose(xs.values(), ref.x, tol(dt), tol(dt)));
  EXPECT_EQ(0, std::memcmp(ws.data(), base + 2 * R * H * es, ws.nbytes())) << "weight modified";
  EXPECT_TRUE(arena.guards_intact());
}

// -------------------------------------------------------------- validation --

struct Call : ShapeStore {
  Buf x, res, w;
  DLTensor tx, tr, tw;
  DLTensor *px, *pr, *pw;
  double eps = 1e-6;
  ks_backend_t be = KS_BACKEND_AUTO;
  explicit Call(DType dt, int64_t R = 4, int64_t H = 24) : x(dt, {R, H}), res(dt, {R, H}), w(dt, {H}) {
    fill_normal(x);
    fill_normal(res);
    fill_normal(w);
    tx = x.dl();
    tr = res.dl();
    tw = w.dl();
    px = &tx;
    pr = &tr;
    pw = &tw;
  }
  std::vector<Buf*> bufs() { return {&x, &res, &w}; }
  ks_status_t call() { return ks_fused_add_rms_norm(px, pr, pw, eps, be, nullptr); }
};

const ExpectReject<Call> expect_reject{rejected};

TEST_P(FusedAddRmsNorm, ValidCallBaseline) {
  Call c(GetParam());
  EXPECT_TRUE(ok(c.call()));
}

TEST_P(FusedAddRmsNorm, RejectsEmptyLastDimAndZeroDim) {
  const DType dt = GetParam();
  Buf x(dt, {3, 0}), res(dt, {3, 0}), w(dt, {0});
  auto before = snap({&x, &res, &w});
  EXPECT_TRUE(rejected(run(x, res, w), KS_ERROR_INVALID_ARGUMENT, {"x"}, {&x, &res, &w}, before));
  expect_reject(dt, [](Call& c) { c.tx.ndim = c.tr.ndim = 0; }, KS_ERROR_INVALID_ARGUMENT, {"x"});
}

TEST_P(FusedAddRmsNorm, RejectsNonContiguousStrides) {
  const DType dt = GetParam();
  expect_reject(dt, [](Call& c) { c.tx.strides = c.vec({48, 1}); }, KS_ERROR_INVALID_ARGUMENT, {"x"});
  expect_reject(dt, [](Call& c) { c.tr.strides = c.vec({1, 4}); }, KS_ERROR_INVALID_ARGUMENT, {"residual"});
  expect_reject(dt, [](Call& c) { c.tw.strides = c.vec({2}); }, KS_ERROR_INVALID_ARGUMENT, {"weight"});
  expect_reject(dt, [](Call& c) { c.tr.strides = c.vec({24, 0}); }, KS_ERROR_INVALID_ARGUMENT, {"residual"});
}

TEST_P(FusedAddRmsNorm, RejectsDtypeMismatchOfEachArgument) {
  const DType dt = GetParam();
  const DLDataType other = ks::to_dl(other_float(dt));
  expect_reject(dt, [&](Call& c) { c.tr.dtype = other; }, KS_ERROR_UNSUPPORTED_DTYPE, {"residual"});
  expect_reject(dt, [&](Call& c) { c.tw.dtype = other; }, KS_ERROR_UNSUPPORTED_DTYPE, {"weight"});
  expect_reject(dt, [&](Call& c) { c.tx.dtype = other; }, KS_ERROR_UNSUPPORTED_DTYPE, {"x"});
}

TEST_P(FusedAddRmsNorm, RejectsUnsupportedDtypes) {
  const DType dt = GetParam();
  const DLDataType i32{kDLInt, 32, 1}, f64{kDLFloat, 64, 1};
  expect_reject(dt, [&](Call& c) { c.tx.dtype = c.tr.dtype = c.tw.dtype = i32; }, KS_ERROR_UNSUPPORTED_DTYPE, {"x"});
  expect_reject(dt, [&](Call& c) { c.tx.dtype = c.tr.dtype = c.tw.dtype = f64; }, KS_ERROR_UNSUPPORTED_DTYPE, {"x"});
  expect_reject(dt, [&](Call& c) { c.tr.dtype = i32; }, KS_ERROR_UNSUPPORTED_DTYPE, {"residual"});
  expect_reject(dt, [&](Call& c) { c.tw.dtype = f64; }, KS_ERROR_UNSUPPORTED_DTYPE, {"weight"});
}

TEST_P(FusedAddRmsNorm, RejectsDeviceMismatchOfEachArgument) {
  const DType dt = GetParam();
  expect_reject(dt, [](Call& c) { c.tr.device = {kDLCUDA, 0}; }, KS_ERROR_UNSUPPORTED_DEVICE, {"residual"});
  expect_reject(dt, [](Call& c) { c.tw.device = {kDLCUDA, 0}; }, KS_ERROR_UNSUPPORTED_DEVICE, {"weight"});
  expect_reject(dt, [](Call& c) { c.tx.device = {kDLCUDA, 0}; }, KS_ERROR_UNSUPPORTED_DEVICE, {"x"});
}

TEST_P(FusedAddRmsNorm, BackendAndDeviceSelection) {
  const DType dt = GetParam();
  // CUDA backend with host tensors: UNSUPPORTED_DEVICE (device checked first).
  expect_reject(dt, [](Call& c) { c.be = KS_BACKEND_CUDA; }, KS_ERROR_UNSUPPORTED_DEVICE, {"backend"});
  expect_reject(dt, [](Call& c) { c.be = static_cast<ks_backend_t>(3); }, KS_ERROR_INVALID_ARGUMENT, {"backend"});
  expect_reject(dt, [](Call& c) {
    c.be = KS_BACKEND_CPU;
    c.tx.device = c.tr.device = c.tw.device = {kDLCUDA, 0};
  }, KS_ERROR_UNSUPPORTED_DEVICE, {"backend"});
  if (ks_backend_available(KS_BACKEND_CUDA)) GTEST_SKIP() << "CUDA available: not faking device pointers";
  expect_reject(dt, [](Call& c) { c.tx.device = c.tr.device = c.tw.device = {kDLCUDA, 0}; },
                KS_ERROR_BACKEND_UNAVAILABLE, {});
}

TEST_P(FusedAddRmsNorm, RejectsWrongShapes) {
  const DType dt = GetParam();
  expect_reject(dt, [&](Call& c) { set_shape(c.tr, c, {4, 23}); }, KS_ERROR_INVALID_ARGUMENT, {"residual"});
  expect_reject(dt, [&](Call& c) { set_shape(c.tr, c, {3, 24}); }, KS_ERROR_INVALID_ARGUMENT, {"residual"});
  expect_reject(dt, [&](Call& c) { set_shape(c.tr, c, {24, 4}); }, KS_ERROR_INVALID_ARGUMENT, {"residual"});
  expect_reject(dt, [&](Call& c) { set_shape(c.tr, c, {96}); }, KS_ERROR_INVALID_ARGUMENT, {"residual"});
  expect_reject(dt, [&](Call& c) { set_shape(c.tw, c, {25}); }, KS_ERROR_INVALID_ARGUMENT, {"weight"});
  expect_reject(dt, [&](Call& c) { set_shape(c.tw, c, {1, 24}); }, KS_ERROR_INVALID_ARGUMENT, {"weight"});
  expect_reject(dt, [&](Call& c) { set_shape(c.tw, c, {4, 24}); }, KS_ERROR_INVALID_ARGUMENT, {"weight"});
}

TEST_P(FusedAddRmsNorm, RejectsBadEps) {
  const DType dt = GetParam();
  const double inf = std::numeric_limits<double>::infinity(), nan = std::numeric_limits<double>::quiet_NaN();
  for (double eps : {0.0, -0.0, -1e-6, nan, inf, -inf, 1e-50, 1e39}) {
    SCOPED_TRACE("eps=" + std::to_string(eps));
    expect_reject(dt, [eps](Call& c) { c.eps = eps; }, KS_ERROR_INVALID_ARGUMENT, {"eps"});
  }
}

TEST_P(FusedAddRmsNorm, RejectsNullTensorsAndData) {
  const DType dt = GetParam();
  expect_reject(dt, [](Call& c) { c.px = nullptr; }, KS_ERROR_INVALID_ARGUMENT, {"x"});
  expect_reject(dt, [](Call& c) { c.pr = nullptr; }, KS_ERROR_INVALID_ARGUMENT, {"residual"});
  expect_reject(dt, [](Call& c) { c.pw = nullptr; }, KS_ERROR_INVALID_ARGUMENT, {"weight"});
  expect_reject(dt, [](Call& c) { c.tr.data = nullptr; }, KS_ERROR_INVALID_ARGUMENT, {"residual"});
  expect_reject(dt, [](Call& c) { c.tw.shape = nullptr; }, KS_ERROR_INVALID_ARGUMENT, {"weight"});
}

// Index math beyond 2^31 elements needs > 4 GiB of resident host memory for the
// in-place x and residual here; covered by the GPU suite, not faked on the CPU.

INSTANTIATE_TEST_SUITE_P(AllDtypes, FusedAddRmsNorm, ::testing::ValuesIn(kstest::float_dtypes()), dt_param_name);

}  // namespace
