// ks_softmax: contract against an FP64 reference, non-finite rows, large logits,
// wide rows (FP32 denominator), shapes, views, validation, aliasing, batch invariance.
//
// Contract (kernscope.h, src/ops/elementwise_ops.cpp, seed README):
//   as torch.softmax(x.float(), -1): z = x - max(x); out = round(exp(z) / sum(exp(z))).
//   A row with NaN or +inf, or all -inf, is all NaN; -inf entries of a row with a
//   finite maximum give exactly 0.
#include <cmath>
#include <deque>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "call_checks.hpp"

namespace {

using namespace kstest::checks;

constexpr const char* kOp = "softmax";
const RejectionCheck rejected{kOp};

// ---------------------------------------------------------------- helpers --

// Relative half-ulp of the output dtype (its rounding), and an absolute floor for
// subnormal outputs (half the smallest subnormal for fp16; a few units of the
// smallest subnormal for bf16/fp32, where exp(z < -87) is itself an FP32 denormal).
double half_ulp(DType d) { return d == DType::F16 ? 0x1p-11 : d == DType::BF16 ? 0x1p-8 : 0.0; }
double floor_abs(DType d) { return d == DType::F16 ? 0x1p-25 : d == DType::BF16 ? 0x1p-130 : 0x1p-140; }

// FP64 reference with a per-element relative bound for a strict check.
//
// Why a strict check on top of the seed's allclose: softmax outputs of wide rows are
// ~1/H, far below the seed's atol (1e-3 for fp16), so allclose alone would accept
// almost anything there. The outputs have no cancellation, so a relative bound is
// meaningful:
//   rel = half_ulp(dtype)                      (final rounding)
//       + 1e-6                                 (a few FP32 ulp in exp and the division)
//       + 2u|z|                                (rounding of z = x - max, amplified by exp)
//       + 6u sqrt(sum_k S_k^2) / S + 2u        (FP32 sum of the exps; see below)
// Sum term: the FP32 denominator's first-order error is sum_k d_k S_k (|d_k| <= u) plus
// u per rounded exp. Modelling the d_k as independent zero-mean (Higham & Mary 2019)
// gives a standard deviation of at most u sqrt(sum_k S_k^2) for left-to-right order;
// blocked, SIMD-lane or pairwise orders have smaller partial sums. 6 sigma is allowed.
// For a 131077-wide random row that is ~6e-5 relative; an fp16 denominator would be off
// by more than 1e-2 (and overflows past 65504).
struct Ref {
  std::vector<double> out, rel;
  std::vector<double> row_sum_err;  // allowed |sum(out) - 1| per row (NaN rows: NaN)
};

Ref softmax_ref(const std::vector<double>& x, int64_t H, DType dt) {
  const int64_t rows = int64_t(x.size()) / H;
  Ref r;
  r.out.resize(x.size());
  r.rel.resize(x.size());
  r.row_sum_err.resize(size_t(rows));
  for (int64_t row = 0; row < rows; ++row) {
    const double* v = &x[size_t(row * H)];
    bool bad = false, all_ninf = true;
    double mx = -kInf;
    for (int64_t i = 0; i < H; ++i) {
      if (std::isnan(v[i]) || v[i] == kInf) bad = true;
      if (v[i] != -kInf) all_ninf = false;
      if (!std::isnan(v[i])) mx = std::max(mx, v[i]);
    }
    if (bad || all_ninf) {
      for (int64_t i = 0; i < H; ++i) r.out[row * H + i] = kNaN;
      r.row_sum_err[row] = kNaN;
      continue;
    }
    double S = 0, q = 0;
    for (int64_t i = 0; i < H; ++i) {
      S += std::exp(v[i] - mx);
      q += S * S;
    }
    const double sum_rel = 6 * kU32 * std::sqrt(q) / S + 2 * kU32;
    for (int64_t i = 0; i < H; ++i) {
      const double z = v[i] - mx;
      r.out[row * H + i] = std::exp(z) / S;
      r.rel[row * H + i] = half_ulp(dt) + 1e-6 + (std::isfinite(z) ? 2 * kU32 * std::fabs(z) : 0.0) + sum_rel;
    }
    r.row_sum_err[row] = half_ulp(dt) + 1e-6 + sum_rel + double(H) * floor_abs(dt);
  }
  return r;
}

::testing::AssertionResult strict(const std::vector<double>& got, const Ref& ref, DType dt) {
  if (got.size() != ref.out.size()) return ::testing::AssertionFailure() << "size mismatch";
  for (size_t i = 0; i < got.size(); ++i) {
    const double g = got[i], r = ref.out[i];
    if (std::isnan(r)) {
      if (!std::isnan(g)) return ::testing::AssertionFailure() << "at " << i << ": got " << g << ", want NaN";
      continue;
    }
    if (r == 0.0) {
      if (g != 0.0) return ::testing::AssertionFailure() << "at " << i << ": got " << g << ", want exactly 0";
      continue;
    }
    const double bound = ref.rel[i] * r + floor_abs(dt);
    if (!(std::fabs(g - r) <= bound))
      return ::testing::AssertionFailure() << "at " << i << ": got " << g << ", want " << r << " (rel err "
                                           << std::fabs(g - r) / r << ", allowed " << bound / r << ")";
  }
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult rows_sum_to_one(const std::vector<double>& got, const Ref& ref, int64_t H) {
  for (size_t row = 0; row < ref.row_sum_err.size(); ++row) {
    if (std::isnan(ref.row_sum_err[row])) continue;
    double s = 0;
    for (int64_t i = 0; i < H; ++i) s += got[row * H + i];
    if (!(std::fabs(s - 1.0) <= ref.row_sum_err[row]))
      return ::testing::AssertionFailure() << "row " << row << " sums to " << s << " (allowed |s-1| <= "
                                           << ref.row_sum_err[row] << ")";
  }
  return ::testing::AssertionSuccess();
}

ks_status_t run(Buf& out, Buf& x, ks_backend_t be = KS_BACKEND_AUTO) {
  DLTensor o = out.dl(), a = x.dl();
  return ks_softmax(&o, &a, be, nullptr);
}

// Runs out-of-place with a poisoned output and applies every check.
void check_all(Buf& x, Buf& out) {
  const DType dt = x.dtype;
  const int64_t H = x.shape.back();
  const auto x0 = x.raw;
  out.poison();
  ASSERT_TRUE(ok(run(out, x)));
  EXPECT_TRUE(x.guards_intact());
  EXPECT_TRUE(out.guards_intact());
  EXPECT_EQ(x.raw, x0) << "x was modified";
  const auto got = out.values();
  const Ref ref = softmax_ref(x.values(), H, dt);
  EXPECT_TRUE(allclose(got, ref.out, tol(dt), tol(dt))) << ks::dtype_name(dt) << " H=" << H;
  EXPECT_TRUE(strict(got, ref, dt)) << ks::dtype_name(dt) << " H=" << H;
  EXPECT_TRUE(rows_sum_to_one(got, ref, H)) << ks::dtype_name(dt) << " H=" << H;
}

void check_random(DType dt, const std::vector<int64_t>& shape, double stddev = 3.0, size_t ox = 0, size_t oo = 0) {
  Buf x(dt, shape, ox), out(dt, shape, oo);
  fill_normal(x, stddev);
  check_all(x, out);
}

class Softmax : public ::testing::TestWithParam<DType> {};

// ---------------------------------------------------------------- contract --

TEST_P(Softmax, OddAndNonVectorWidths) {
  for (int64_t H : {1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 33, 127, 128, 129, 255, 256, 257, 1000, 1023, 1024, 3420, 4097}) {
    SCOPED_TRACE("H=" + std::to_string(H));
    check_random(GetParam(), {5, H});
  }
}

TEST_P(Softmax, ScalesOfLogits) {
  for (double sd : {1e-3, 0.1, 1.0, 10.0, 30.0}) check_random(GetParam(), {4, 129}, sd);
}

TEST_P(Softmax, MultiDimLeadingShapes) {
  check_random(GetParam(), {33});
  check_random(GetParam(), {2, 3, 4, 33});
  check_random(GetParam(), {3, 1, 2, 1, 127});
}

TEST_P(Softmax, WidthOneIsExactlyOne) {
  const DType dt = GetParam();
  Buf x(dt, {9, 1}), out(dt, {9, 1});
  fill_normal(x, 100.0);
  out.poison();
  ASSERT_TRUE(ok(run(out, x)));
  for (int64_t i = 0; i < 9; ++i) EXPECT_EQ(out.get(i), 1.0);
}

TEST_P(Softmax, UniformRowsGiveOneOverH) {
  const DType dt = GetParam();
  for (int64_t H : {3, 7, 127, 3420, 4097}) {
    Buf x(dt, {2, H}), out(dt, {2, H});
    const double c = std::normal_distribution<double>(0, 5)(kstest::rng());
    for (int64_t i = 0; i < 2 * H; ++i) x.set(i, c);
    out.poison();
    ASSERT_TRUE(ok(run(out, x)));
    // exp(0) = 1 exactly and sum = H exactly in FP32: out = round(1/H), up to one
    // FP32 ulp before the final rounding.
    const double want = 1.0 / double(H);
    for (int64_t i = 0; i < 2 * H; ++i)
      ASSERT_NEAR(out.get(i), want, (half_ulp(dt) + 0x1p-23) * want + floor_abs(dt)) << "H=" << H << " i=" << i;
  }
}

TEST_P(Softmax, HugeRow) {
  // >= 131072 columns: a row much larger than any on-chip tile.
  check_random(GetParam(), {2, 131072 + 5}, 2.0);
}

TEST_P(Softmax, Width65536NeedsAnFp32Denominator) {
  // 65536 nearly equal logits: every exp is ~1, so the denominator is ~65536. In fp16
  // that overflows (max 65504) and any fp16/bf16 running sum stalls long before it
  // (spacing 32/512 at 2^15); only an FP32 denominator gives outputs ~1/65536.
  const DType dt = GetParam();
  const int64_t H = 65536;
  Buf x(dt, {2, H}), out(dt, {2, H});
  fill_normal(x, 0.05);
  check_all(x, out);
  // Discrimination: with an fp16 running sum, the result would be far off.
  double acc = 0;
  for (int64_t i = 0; i < H; ++i) acc = double(ks::half_to_float(ks::float_to_half(float(acc + std::exp(x.get(i))))));
  EXPECT_TRUE(std::isinf(acc) || std::fabs(acc - 65536) > 1000) << acc;
}

TEST_P(Softmax, LargeLogitsDoNotOverflow) {
  // exp(1e4) overflows any float format; the max subtraction must keep everything finite.
  const DType dt = GetParam();
  const int64_t H = 257;
  Buf x(dt, {4, H}), out(dt, {4, H});
  std::normal_distribution<double> nd(0, 20);
  for (int64_t i = 0; i < H; ++i) {
    x.set(0 * H + i, 1e4 + nd(kstest::rng()));   // all large positive
    x.set(1 * H + i, -1e4 + nd(kstest::rng()));  // all large negative (exp underflows to 0 without the shift)
    x.set(2 * H + i, (i % 2 ? 1e4 : -1e4) + nd(kstest::rng()));  // both: -1e4 entries are exactly 0
    x.set(3 * H + i, (i % 3 ? 3e4 : -3e4));                      // fp16-representable extremes
  }
  check_all(x, out);
  const auto got = out.values();
  for (double g : got) ASSERT_TRUE(std::isfinite(g));
  for (int64_t i = 0; i < H; i += 2) EXPECT_EQ(got[2 * H + i], 0.0) << i;
}

TEST_P(Softmax, NonFiniteRows) {
  const DType dt = GetParam();
  for (int64_t H : {1, 7, 130}) {
    SCOPED_TRACE("H=" + std::to_string(H));
    const int64_t R = 10;
    Buf x(dt, {R, H}), out(dt, {R, H});
    fill_normal(x, 2.0);
    const int64_t j = H / 2, k = H - 1;
    for (int64_t i = 0; i < H; ++i) x.set(0 * H + i, -kInf);  // row 0: all -inf -> NaN
    x.set(1 * H + j, kNaN);                                    // row 1: one NaN -> NaN
    x.set(2 * H + j, kInf);                                    // row 2: one +inf -> NaN
    x.set(3 * H + 0, kInf);                                    // row 3: +inf and -inf -> NaN
    x.set(3 * H + k, -kInf);
    for (int64_t i = 0; i < H; i += 2) x.set(4 * H + i, -kInf);  // row 4: -inf mixed with finite
    if (H == 1) x.set(4 * H, 1.5);  // (keep row 4 finite when H == 1)
    // row 5: untouched random.
    for (int64_t i = 0; i < H; ++i) x.set(6 * H + i, -kInf);  // row 6: one finite among -inf -> 1 there
    x.set(6 * H + j, -3.0);
    x.set(7 * H + j, kNaN);  // row 7: NaN and -inf -> NaN
    x.set(7 * H + 0, -kInf);
    for (int64_t i = 0; i < H; ++i) x.set(8 * H + i, kNaN);  // row 8: all NaN
    x.set(9 * H + k, kInf);                                  // row 9: +inf last (after the finite ones)
    // A finite poison, so an unwritten NaN row cannot pass as "NaN".
    std::memset(out.data(), 0x5A, out.nbytes());
    ASSERT_TRUE(ok(run(out, x)));
    EXPECT_TRUE(out.guards_intact());
    const auto got = out.values();
    const Ref ref = softmax_ref(x.values(), H, dt);
    EXPECT_TRUE(strict(got, ref, dt));
    EXPECT_TRUE(allclose(got, ref.out, tol(dt), tol(dt)));
    for (int64_t row : {0, 1, 2, 3, 7, 8, 9})
      for (int64_t i = 0; i < H; ++i) EXPECT_TRUE(std::isnan(got[row * H + i])) << "row " << row << " i " << i;
    if (H > 1) {
      for (int64_t i = 0; i < H; i += 2) EXPECT_EQ(got[4 * H + i], 0.0) << "row 4, -inf entry " << i;
    }
    for (int64_t i = 0; i < H; ++i) EXPECT_EQ(got[6 * H + i], i == j ? 1.0 : 0.0) << "row 6 i " << i;
    EXPECT_TRUE(rows_sum_to_one(got, ref, H));
  }
}

TEST_P(Softmax, ZeroRowsIsANoOp) {
  const DType dt = GetParam();
  for (std::vector<int64_t> shape : {std::vector<int64_t>{0, 16}, {2, 0, 16}}) {
    Buf x(dt, shape), out(dt, shape);
    out.poison();
    const auto before = out.raw;
    ASSERT_TRUE(ok(run(out, x)));
    EXPECT_EQ(out.raw, before);
  }
  std::vector<int64_t> s0{0, 16};
  DLTensor o = make_dl(nullptr, dt, s0), a = make_dl(nullptr, dt, s0);
  EXPECT_TRUE(ok(ks_softmax(&o, &a, KS_BACKEND_AUTO, nullptr)));
  // Zero rows still validate.
  Buf x(dt, {0, 16}), o1(dt, {0, 15}), o2(other_float(dt), {0, 16});
  auto before = snap({&x, &o1, &o2});
  EXPECT_TRUE(rejected(run(o1, x), KS_ERROR_INVALID_ARGUMENT, {"out"}, {&x, &o1, &o2}, before));
  EXPECT_TRUE(rejected(run(o2, x), KS_ERROR_UNSUPPORTED_DTYPE, {"out"}, {&x, &o1, &o2}, before));
}

TEST_P(Softmax, OffsetAndMisalignedViews) {
  for (size_t o : {2u, 6u, 10u}) {
    SCOPED_TRACE("offset " + std::to_string(o));
    check_random(GetParam(), {3, 127}, 3.0, o, o);
    check_random(GetParam(), {2, 4097}, 3.0, o, (o + 4) % 12);
    check_random(GetParam(), {5, 7}, 3.0, 0, o);
  }
}

TEST_P(Softmax, DLTensorByteOffsetIsHonoured) {
  const DType dt = GetParam();
  Buf x(dt, {3, 37}), out(dt, {3, 37});
  fill_normal(x, 3.0);
  out.poison();
  DLTensor o = out.dl(), a = x.dl();
  o.data = static_cast<char*>(o.data) - 10;
  o.byte_offset = 10;
  a.data = static_cast<char*>(a.data) - 6;
  a.byte_offset = 6;
  ASSERT_TRUE(ok(ks_softmax(&o, &a, KS_BACKEND_AUTO, nullptr)));
  const Ref ref = softmax_ref(x.values(), 37, dt);
  EXPECT_TRUE(strict(out.values(), ref, dt));
  EXPECT_TRUE(out.guards_intact());
}

TEST_P(Softmax, ExplicitCpuBackendMatchesAuto) {
  const DType dt = GetParam();
  Buf x(dt, {6, 333}), o1(dt, {6, 333}), o2(dt, {6, 333});
  fill_normal(x, 3.0);
  ASSERT_TRUE(ok(run(o1, x, KS_BACKEND_AUTO)));
  ASSERT_TRUE(ok(run(o2, x, KS_BACKEND_CPU)));
  EXPECT_TRUE(same_bytes(o1, o2));
}

// ---------------------------------------------------------------- aliasing --

TEST_P(Softmax, InPlaceEqualsOutOfPlaceBitwise) {
  const DType dt = GetParam();
  for (int64_t H : {1, 7, 127, 4097}) {
    Buf x(dt, {9, H}), out(dt, {9, H});
    fill_normal(x, 3.0);
    x.set(H, -kInf);  // some non-finite rows as well
    x.set(2 * H, kNaN);
    out.poison();
    ASSERT_TRUE(ok(run(out, x)));
    Buf y = x;
    ASSERT_TRUE(ok(run(y, y)));
    EXPECT_TRUE(same_bytes(y, out)) << "H=" << H;
    EXPECT_TRUE(y.guards_intact());
  }
  // In place on a huge row too (a backend may make several passes over it).
  Buf x(dt, {1, 131075}), out(dt, {1, 131075});
  fill_normal(x, 3.0);
  ASSERT_TRUE(ok(run(out, x)));
  ASSERT_TRUE(ok(run(x, x)));
  EXPECT_TRUE(same_bytes(x, out));
}

TEST_P(Softmax, PartialOverlapRejected) {
  const DType dt = GetParam();
  const int64_t R = 4, H = 33;
  const int64_t es = int64_t(ks::dtype_size(dt));
  Buf arena(dt, {3 * R * H});  // room for every shift, so a bug cannot write out of bounds
  fill_normal(arena);
  char* base = static_cast<char*>(arena.data()) + R * H * es;
  std::vector<int64_t> s{R, H}, sp{R - 1, H};
  const auto before = snap({&arena});
  for (int64_t shift : std::vector<int64_t>{1, -1, H, -H, (R - 1) * H}) {
    DLTensor a = make_dl(base, dt, s), o = make_dl(base + shift * es, dt, s);
    EXPECT_TRUE(rejected(ks_softmax(&o, &a, KS_BACKEND_AUTO, nullptr), KS_ERROR_INVALID_ARGUMENT, {"out", "x"},
                         {&arena}, before))
        << "shift " << shift;
  }
  // Same start but a different extent is not "x itself" (out has fewer rows: also a
  // shape error; either way it must be rejected without writing).
  DLTensor a = make_dl(base, dt, s), o = make_dl(base, dt, sp);
  EXPECT_TRUE(rejected(ks_softmax(&o, &a, KS_BACKEND_AUTO, nullptr), KS_ERROR_INVALID_ARGUMENT, {"out"}, {&arena},
                       before));
}

// ------------------------------------------------------------ batch invariance --

TEST_P(Softmax, RowAloneEqualsRowInBatchBitwise) {
  const DType dt = GetParam();
  for (int64_t H : {7, 4097}) {
    const int64_t R = 257;
    Buf x(dt, {R, H}), out(dt, {R, H});
    fill_normal(x, 3.0);
    out.poison();
    ASSERT_TRUE(ok(run(out, x)));
    const size_t rb = size_t(H) * ks::dtype_size(dt);
    for (int64_t r : {int64_t(0), int64_t(1), int64_t(128), int64_t(255), int64_t(256)}) {
      Buf x1(dt, {1, H}), o1(dt, {1, H});
      std::memcpy(x1.data(), static_cast<char*>(x.data()) + r * rb, rb);
      o1.poison();
      ASSERT_TRUE(ok(run(o1, x1)));
      EXPECT_EQ(0, std::memcmp(o1.data(), static_cast<char*>(out.data()) + r * rb, rb)) << "H=" << H << " row " << r;
    }
  }
}

// -------------------------------------------------------------- validation --

struct Call : XOutCall {
  explicit Call(DType dt, int64_t R = 4, int64_t H = 24) : XOutCall(dt, {R, H}, {R, H}) {}
  ks_status_t call() { return ks_softmax(pout, px, be, nullptr); }
};

const ExpectReject<Call> expect_reject{rejected};

TEST_P(Softmax, ValidCallBaseline) {
  Call c(GetParam());
  EXPECT_TRUE(ok(c.call()));
}

TEST_P(Softmax, RejectsEmptyLastDimAndZeroDim) {
  const DType dt = GetParam();
  Buf x(dt, {3, 0}), out(dt, {3, 0});
  auto before = snap({&x, &out});
  EXPECT_TRUE(rejected(run(out, x), KS_ERROR_INVALID_ARGUMENT, {"x"}, {&x, &out}, before));
  Buf x1(dt, {0}), o1(dt, {0});
  before = snap({&x1, &o1});
  EXPECT_TRUE(rejected(run(o1, x1), KS_ERROR_INVALID_ARGUMENT, {"x"}, {&x1, &o1}, before));
  expect_reject(dt, [](Call& c) { c.tx.ndim = c.tout.ndim = 0; }, KS_ERROR_INVALID_ARGUMENT, {"x"});
}

TEST_P(Softmax, RejectsNonContiguousStrides) {
  const DType dt = GetParam();
  expect_reject(dt, [](Call& c) { c.tx.strides = c.vec({48, 1}); }, KS_ERROR_INVALID_ARGUMENT, {"x"});
  expect_reject(dt, [](Call& c) { c.tx.strides = c.vec({1, 4}); }, KS_ERROR_INVALID_ARGUMENT, {"x"});
  expect_reject(dt, [](Call& c) { c.tout.strides = c.vec({24, 2}); }, KS_ERROR_INVALID_ARGUMENT, {"out"});
  expect_reject(dt, [](Call& c) { c.tout.strides = c.vec({0, 1}); }, KS_ERROR_INVALID_ARGUMENT, {"out"});
}

TEST_P(Softmax, AcceptsCompactExplicitStridesAndIgnoresSize1Strides) {
  const DType dt = GetParam();
  Call c(dt);
  c.tx.strides = c.vec({24, 1});
  c.tout.strides = c.vec({24, 1});
  ASSERT_TRUE(ok(c.call()));
  EXPECT_TRUE(strict(c.out.values(), softmax_ref(c.x.values(), 24, dt), dt));
  Call d(dt, 1, 24);
  d.tx.strides = d.vec({999, 1});
  ASSERT_TRUE(ok(d.call()));
  EXPECT_TRUE(strict(d.out.values(), softmax_ref(d.x.values(), 24, dt), dt));
}

TEST_P(Softmax, RejectsDtypeMismatchAndUnsupportedDtypes) {
  const DType dt = GetParam();
  const DLDataType other = ks::to_dl(other_float(dt)), i32{kDLInt, 32, 1}, f64{kDLFloat, 64, 1};
  expect_reject(dt, [&](Call& c) { c.tout.dtype = other; }, KS_ERROR_UNSUPPORTED_DTYPE, {"out"});
  expect_reject(dt, [&](Call& c) { c.tx.dtype = other; }, KS_ERROR_UNSUPPORTED_DTYPE, {"x"});
  expect_reject(dt, [&](Call& c) { c.tx.dtype = c.tout.dtype = i32; }, KS_ERROR_UNSUPPORTED_DTYPE, {"x"});
  expect_reject(dt, [&](Call& c) { c.tx.dtype = c.tout.dtype = f64; }, KS_ERROR_UNSUPPORTED_DTYPE, {"x"});
  expect_reject(dt, [&](Call& c) { c.tout.dtype = i32; }, KS_ERROR_UNSUPPORTED_DTYPE, {"out"});
}

TEST_P(Softmax, RejectsDeviceMismatchAndBadBackend) {
  const DType dt = GetParam();
  expect_reject(dt, [](Call& c) { c.tout.device = {kDLCUDA, 0}; }, KS_ERROR_UNSUPPORTED_DEVICE, {"out"});
  expect_reject(dt, [](Call& c) { c.tx.device = {kDLCUDA, 0}; }, KS_ERROR_UNSUPPORTED_DEVICE, {"x"});
  // CUDA backend with host tensors: UNSUPPORTED_DEVICE (device checked before availability).
  expect_reject(dt, [](Call& c) { c.be = KS_BACKEND_CUDA; }, KS_ERROR_UNSUPPORTED_DEVICE, {"backend"});
  expect_reject(dt, [](Call& c) { c.be = static_cast<ks_backend_t>(3); }, KS_ERROR_INVALID_ARGUMENT, {"backend"});
  expect_reject(dt, [](Call& c) {
    c.be = KS_BACKEND_CPU;
    c.tx.device = c.tout.device = {kDLCUDA, 0};
  }, KS_ERROR_UNSUPPORTED_DEVICE, {"backend"});
  if (ks_backend_available(KS_BACKEND_CUDA)) GTEST_SKIP() << "CUDA available: not faking device pointers";
  expect_reject(dt, [](Call& c) { c.tx.device = c.tout.device = {kDLCUDA, 0}; }, KS_ERROR_BACKEND_UNAVAILABLE, {});
}

TEST_P(Softmax, RejectsWrongShapes) {
  const DType dt = GetParam();
  expect_reject(dt, [](Call& c) { set_shape(c.tout, c, {4, 23}); }, KS_ERROR_INVALID_ARGUMENT, {"out"});
  expect_reject(dt, [](Call& c) { set_shape(c.tout, c, {3, 24}); }, KS_ERROR_INVALID_ARGUMENT, {"out"});
  expect_reject(dt, [](Call& c) { set_shape(c.tout, c, {24, 4}); }, KS_ERROR_INVALID_ARGUMENT, {"out"});
  expect_reject(dt, [](Call& c) { set_shape(c.tout, c, {96}); }, KS_ERROR_INVALID_ARGUMENT, {"out"});
  expect_reject(dt, [](Call& c) { set_shape(c.tout, c, {1, 4, 24}); }, KS_ERROR_INVALID_ARGUMENT, {"out"});
  expect_reject(dt, [](Call& c) {
    set_shape(c.tx, c, {4, -24});
    set_shape(c.tout, c, {4, -24});
  }, KS_ERROR_INVALID_ARGUMENT, {"x"});
}

TEST_P(Softmax, RejectsNullTensorsAndData) {
  const DType dt = GetParam();
  expect_reject(dt, [](Call& c) { c.px = nullptr; }, KS_ERROR_INVALID_ARGUMENT, {"x"});
  expect_reject(dt, [](Call& c) { c.pout = nullptr; }, KS_ERROR_INVALID_ARGUMENT, {"out"});
  expect_reject(dt, [](Call& c) { c.tx.data = nullptr; }, KS_ERROR_INVALID_ARGUMENT, {"x"});
  expect_reject(dt, [](Call& c) { c.tout.data = nullptr; }, KS_ERROR_INVALID_ARGUMENT, {"out"});
  expect_reject(dt, [](Call& c) { c.tx.shape = nullptr; }, KS_ERROR_INVALID_ARGUMENT, {"x"});
}

// Index math beyond 2^31 elements: the output must be written in full (> 4 GiB
// resident); covered by the GPU suite, deliberately not faked here.

INSTANTIATE_TEST_SUITE_P(AllDtypes, Softmax, ::testing::ValuesIn(kstest::float_dtypes()), dt_param_name);

}  // namespace
