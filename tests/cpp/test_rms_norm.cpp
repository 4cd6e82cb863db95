// ks_rms_norm: contract against an FP64 reference, shapes, views, validation,
// aliasing, fp16 overflow, batch invariance.
//
// Contract (kernscope.h, seed README):
//   out = round(fp32(x) * rsqrt(mean(fp32(x)^2) + fp32(eps)) * fp32(weight))
// The reference below computes the same thing in double from the rounded inputs
// and is compared with the seed's tolerances (fp16 1e-3, bf16 1e-2, fp32 1e-6).
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

constexpr const char* kOp = "rms_norm";
const RejectionCheck rejected{kOp};

// ---------------------------------------------------------------- helpers --

// FP64 reference from the rounded inputs.
std::vector<double> rms_ref(const Buf& x, const Buf& w, double eps) {
  const int64_t H = w.numel();
  const int64_t rows = H ? x.numel() / H : 0;
  const double e = double(float(eps));  // the contract rounds eps to fp32
  const std::vector<double> xv = x.values(), wv = w.values();
  std::vector<double> out(xv.size());
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t i = 0; i < H; ++i) ss += xv[r * H + i] * xv[r * H + i];
    const double scale = 1.0 / std::sqrt(ss / double(H) + e);
    for (int64_t i = 0; i < H; ++i) out[r * H + i] = xv[r * H + i] * scale * wv[i];
  }
  return out;
}

ks_status_t run(Buf& out, Buf& x, Buf& w, double eps = 1e-6, ks_backend_t be = KS_BACKEND_AUTO) {
  DLTensor o = out.dl(), a = x.dl(), b = w.dl();
  return ks_rms_norm(&o, &a, &b, eps, be, nullptr);
}

// One out-of-place call with poisoned output, guard checks and an FP64 comparison.
void check_contract(DType dt, const std::vector<int64_t>& shape, double eps = 1e-6, double xstd = 1.0,
                    size_t ox = 0, size_t ow = 0, size_t oo = 0) {
  const int64_t H = shape.back();
  Buf x(dt, shape, ox), w(dt, {H}, ow), out(dt, shape, oo);
  fill_normal(x, xstd);
  fill_uniform(w, -2.0, 2.0);
  const auto x0 = x.raw, w0 = w.raw;
  out.poison();
  ASSERT_TRUE(ok(run(out, x, w, eps)));
  EXPECT_TRUE(x.guards_intact());
  EXPECT_TRUE(w.guards_intact());
  EXPECT_TRUE(out.guards_intact());
  EXPECT_EQ(x.raw, x0) << "x was modified";
  EXPECT_EQ(w.raw, w0) << "weight was modified";
  EXPECT_TRUE(allclose(out.values(), rms_ref(x, w, eps), tol(dt), tol(dt)))
      << ks::dtype_name(dt) << " shape last=" << H << " eps=" << eps;
}

class RmsNorm : public ::testing::TestWithParam<DType> {};

// ---------------------------------------------------------------- contract --

TEST_P(RmsNorm, OddAndNonVectorWidths) {
  for (int64_t H : {1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 33, 127, 128, 129, 1000, 3420, 4097}) {
    SCOPED_TRACE("H=" + std::to_string(H));
    check_contract(GetParam(), {5, H});
  }
}

TEST_P(RmsNorm, SingleRowOneDimensionalX) {
  for (int64_t H : {1, 3, 7, 127, 3420, 4097}) check_contract(GetParam(), {H});
}

TEST_P(RmsNorm, MultiDimLeadingShapes) {
  check_contract(GetParam(), {2, 3, 5, 33});
  check_contract(GetParam(), {1, 1, 1, 7});
  check_contract(GetParam(), {3, 1, 4, 1, 127});
}

TEST_P(RmsNorm, EpsIsUsedAndRoundedToFp32) {
  // Tiny inputs: mean(x^2) ~ 1e-6, so eps = 1e-2 or 0.5 dominates the scale; a
  // misplaced eps (added to rms instead of mean, dropped, ...) is far off.
  for (double eps : {1e-6, 1e-5, 1e-2, 0.5, 3.0}) check_contract(GetParam(), {4, 127}, eps, 1e-3);
  // Smallest positive fp32 (denormal): valid, behaves as ~0.
  check_contract(GetParam(), {4, 127}, 1e-45);
  // Large but finite after fp32 rounding: valid.
  check_contract(GetParam(), {2, 7}, 3e38);
  // Scales far from 1.
  check_contract(GetParam(), {3, 129}, 1e-6, 100.0);
  check_contract(GetParam(), {3, 129}, 1e-6, 0.05);
}

TEST_P(RmsNorm, ExplicitCpuBackendMatchesAuto) {
  const DType dt = GetParam();
  Buf x(dt, {6, 333}), w(dt, {333}), o1(dt, {6, 333}), o2(dt, {6, 333});
  fill_normal(x);
  fill_normal(w);
  o1.poison();
  o2.poison();
  ASSERT_TRUE(ok(run(o1, x, w, 1e-6, KS_BACKEND_AUTO)));
  ASSERT_TRUE(ok(run(o2, x, w, 1e-6, KS_BACKEND_CPU)));
  EXPECT_TRUE(same_bytes(o1, o2));
}

TEST_P(RmsNorm, HugeRow) {
  // >= 131072 elements per row (a row that cannot live in one block of shared memory).
  // docs/contracts.md: the FP32 sum of squares must still meet the seed tolerance here
  // (rms_norm gets no long-row allowance), so the plain seed tolerance is used.
  const DType dt = GetParam();
  const int64_t H = 131072 + 5;
  Buf x(dt, {2, H}), w(dt, {H}), out(dt, {2, H});
  fill_normal(x);
  fill_uniform(w, -2.0, 2.0);
  out.poison();
  ASSERT_TRUE(ok(run(out, x, w)));
  EXPECT_TRUE(out.guards_intact());
  EXPECT_TRUE(x.guards_intact());
  EXPECT_TRUE(allclose(out.values(), rms_ref(x, w, 1e-6), tol(dt), tol(dt)));
}

TEST_P(RmsNorm, HugeRowPositiveMeanIsTheHardCaseForSums) {
  // All squares are of similar size, so a left-to-right FP32 sum drifts by ~u*sqrt(H)
  // relative; values ~N(3, 1) make every partial sum large. Same tolerance.
  const DType dt = GetParam();
  const int64_t H = 262144 + 3;
  Buf x(dt, {1, H}), w(dt, {H}), out(dt, {1, H});
  fill_normal(x, 1.0, 3.0);
  fill_uniform(w, 0.5, 1.5);
  out.poison();
  ASSERT_TRUE(ok(run(out, x, w)));
  EXPECT_TRUE(allclose(out.values(), rms_ref(x, w, 1e-6), tol(dt), tol(dt)));
}

TEST_P(RmsNorm, ZeroRowsIsANoOp) {
  const DType dt = GetParam();
  for (std::vector<int64_t> shape : {std::vector<int64_t>{0, 16}, {2, 0, 16}, {0, 0, 16}}) {
    Buf x(dt, shape), w(dt, {16}), out(dt, shape);
    fill_normal(w);
    out.poison();
    const auto before = out.raw;
    ASSERT_TRUE(ok(run(out, x, w)));
    EXPECT_EQ(out.raw, before);
    EXPECT_TRUE(out.guards_intact());
  }
  // Zero rows with NULL data pointers: nothing to read or write, still valid.
  std::vector<int64_t> s0{0, 16};
  Buf w(dt, {16});
  fill_normal(w);
  DLTensor o = make_dl(nullptr, dt, s0), a = make_dl(nullptr, dt, s0), b = w.dl();
  EXPECT_TRUE(ok(ks_rms_norm(&o, &a, &b, 1e-6, KS_BACKEND_AUTO, nullptr)));
}

TEST_P(RmsNorm, ZeroRowsStillValidates) {
  const DType dt = GetParam();
  Buf x(dt, {0, 16}), w(dt, {16}), wbad(dt, {15}), wdt(other_float(dt), {16}), out(dt, {0, 16});
  fill_normal(w);
  fill_normal(wbad);
  fill_normal(wdt);
  auto before = snap({&x, &w, &wbad, &wdt, &out});
  EXPECT_TRUE(rejected(run(out, x, wbad), KS_ERROR_INVALID_ARGUMENT, {"weight"}, {&x, &w, &wbad, &wdt, &out}, before));
  EXPECT_TRUE(
      rejected(run(out, x, wdt), KS_ERROR_UNSUPPORTED_DTYPE, {"weight"}, {&x, &w, &wbad, &wdt, &out}, before));
  EXPECT_TRUE(rejected(run(out, x, w, 0.0), KS_ERROR_INVALID_ARGUMENT, {"eps"}, {&x, &w, &wbad, &wdt, &out}, before));
}

TEST_P(RmsNorm, OffsetAndMisalignedViews) {
  const DType dt = GetParam();
  for (size_t o : {2u, 6u, 10u}) {
    SCOPED_TRACE("offset " + std::to_string(o));
    check_contract(dt, {3, 127}, 1e-6, 1.0, o, o, o);
    check_contract(dt, {3, 4097}, 1e-6, 1.0, o, (o + 4) % 12, (o + 8) % 12);
    check_contract(dt, {2, 7}, 1e-6, 1.0, 0, o, 2);
  }
}

TEST_P(RmsNorm, DLTensorByteOffsetIsHonoured) {
  const DType dt = GetParam();
  const int64_t H = 37;
  const size_t es = ks::dtype_size(dt);
  for (size_t boff : {size_t(2), size_t(6), size_t(10), 3 * es}) {
    // Each tensor's data pointer is the buffer start minus boff; byte_offset adds it back.
    Buf x(dt, {3, H}), w(dt, {H}), out(dt, {3, H});
    fill_normal(x);
    fill_normal(w);
    out.poison();
    DLTensor o = out.dl(), a = x.dl(), b = w.dl();
    for (DLTensor* t : {&o, &a, &b}) {
      t->data = static_cast<char*>(t->data) - boff;
      t->byte_offset = boff;
    }
    ASSERT_TRUE(ok(ks_rms_norm(&o, &a, &b, 1e-6, KS_BACKEND_AUTO, nullptr)));
    EXPECT_TRUE(out.guards_intact());
    EXPECT_TRUE(allclose(out.values(), rms_ref(x, w, 1e-6), tol(dt), tol(dt)));
  }
}

TEST_P(RmsNorm, Fp16RangeSumOfSquaresDoesNotOverflow) {
  // Values near the fp16 maximum: x^2 ~ 4.3e9 overflows fp16 (and so would a
  // sum of squares kept in fp16); the FP32 accumulation must stay finite.
  const DType dt = GetParam();
  const int64_t H = 4097;
  Buf x(dt, {3, H}), w(dt, {H}), out(dt, {3, H});
  fill_uniform(x, 60000.0, 65504.0);
  for (int64_t i = 0; i < x.numel(); i += 3) x.set(i, -x.get(i));
  for (int64_t i = 0; i < H; ++i) x.set(2 * H + i, 65504.0);  // row 2: all at the maximum
  fill_uniform(w, -2.0, 2.0);
  out.poison();
  ASSERT_TRUE(ok(run(out, x, w)));
  EXPECT_TRUE(out.guards_intact());
  const auto got = out.values();
  for (double g : got) ASSERT_TRUE(std::isfinite(g));
  EXPECT_TRUE(allclose(got, rms_ref(x, w, 1e-6), tol(dt), tol(dt)));
  // Row of identical values: out == weight (up to rounding).
  for (int64_t i = 0; i < H; ++i) EXPECT_NEAR(got[2 * H + i], w.get(i), tol(dt) * (1 + std::fabs(w.get(i))));
}

// ---------------------------------------------------------------- aliasing --

TEST_P(RmsNorm, InPlaceEqualsOutOfPlaceBitwise) {
  const DType dt = GetParam();
  for (int64_t H : {1, 7, 127, 4097}) {
    Buf x(dt, {9, H}), w(dt, {H}), out(dt, {9, H});
    fill_normal(x);
    fill_normal(w);
    out.poison();
    ASSERT_TRUE(ok(run(out, x, w)));
    Buf y = x;  // same bytes, separate storage
    ASSERT_TRUE(ok(run(y, y, w)));
    EXPECT_TRUE(same_bytes(y, out)) << "H=" << H;
    EXPECT_TRUE(y.guards_intact());
  }
}

TEST_P(RmsNorm, InPlaceThroughByteOffsetIsStillInPlace) {
  // out.data + out.byte_offset == x.data: the same region, so in-place is allowed.
  const DType dt = GetParam();
  Buf x(dt, {4, 33}), w(dt, {33}), ref(dt, {4, 33});
  fill_normal(x);
  fill_normal(w);
  ASSERT_TRUE(ok(run(ref, x, w)));
  DLTensor o = x.dl(), a = x.dl(), b = w.dl();
  o.data = static_cast<char*>(o.data) - 6;
  o.byte_offset = 6;
  ASSERT_TRUE(ok(ks_rms_norm(&o, &a, &b, 1e-6, KS_BACKEND_AUTO, nullptr)));
  EXPECT_TRUE(same_bytes(x, ref));
  EXPECT_TRUE(x.guards_intact());
}

TEST_P(RmsNorm, PartialOverlapOutXRejected) {
  const DType dt = GetParam();
  const int64_t R = 4, H = 33;
  const size_t es = ks::dtype_size(dt);
  for (int64_t shift : std::vector<int64_t>{1, H, -1, -H, (R - 1) * H}) {
    SCOPED_TRACE("shift " + std::to_string(shift));
    Buf arena(dt, {3 * R * H}), w(dt, {H});  // room for every shift, so a bug cannot write out of bounds
    fill_normal(arena);
    fill_normal(w);
    std::vector<int64_t> s{R, H};
    char* base = static_cast<char*>(arena.data()) + R * H * es;
    DLTensor a = make_dl(base, dt, s), o = make_dl(base + shift * int64_t(es), dt, s), b = w.dl();
    auto before = snap({&arena, &w});
    EXPECT_TRUE(rejected(ks_rms_norm(&o, &a, &b, 1e-6, KS_BACKEND_AUTO, nullptr), KS_ERROR_INVALID_ARGUMENT,
                         {"out", "x"}, {&arena, &w}, before));
  }
  // Same start, different extent (out is a prefix of x): not "x itself".
  Buf arena(dt, {R * H}), w(dt, {H});
  fill_normal(arena);
  fill_normal(w);
  std::vector<int64_t> sx{R, H}, so{R - 1, H};
  DLTensor a = make_dl(arena.data(), dt, sx), o = make_dl(arena.data(), dt, so), b = w.dl();
  auto before = snap({&arena, &w});
  const ks_status_t st = ks_rms_norm(&o, &a, &b, 1e-6, KS_BACKEND_AUTO, nullptr);
  EXPECT_TRUE(rejected(st, KS_ERROR_INVALID_ARGUMENT, {"out"}, {&arena, &w}, before));
}

TEST_P(RmsNorm, OutOverlappingWeightRejected) {
  const DType dt = GetParam();
  const int64_t H = 16;
  // weight is the first row of out.
  Buf x(dt, {3, H}), out(dt, {3, H});
  fill_normal(x);
  fill_normal(out);
  std::vector<int64_t> sw{H};
  DLTensor o = out.dl(), a = x.dl(), b = make_dl(out.data(), dt, sw);
  auto before = snap({&x, &out});
  EXPECT_TRUE(rejected(ks_rms_norm(&o, &a, &b, 1e-6, KS_BACKEND_AUTO, nullptr), KS_ERROR_INVALID_ARGUMENT,
                       {"out", "weight"}, {&x, &out}, before));
  // In place on x while weight is a row of x: out (== x) overlaps weight.
  DLTensor o2 = x.dl(), a2 = x.dl(), b2 = make_dl(static_cast<char*>(x.data()) + H * ks::dtype_size(dt), dt, sw);
  EXPECT_TRUE(rejected(ks_rms_norm(&o2, &a2, &b2, 1e-6, KS_BACKEND_AUTO, nullptr), KS_ERROR_INVALID_ARGUMENT,
                       {"out", "weight"}, {&x, &out}, before));
}

TEST_P(RmsNorm, XAndWeightMayShareStorage) {
  // Both are read-only; only overlap with out is forbidden.
  const DType dt = GetParam();
  const int64_t H = 65;
  Buf x(dt, {3, H}), out(dt, {3, H});
  fill_normal(x);
  out.poison();
  std::vector<int64_t> sw{H};
  Buf wcopy(dt, {H});
  std::memcpy(wcopy.data(), static_cast<char*>(x.data()) + H * ks::dtype_size(dt), wcopy.nbytes());
  DLTensor o = out.dl(), a = x.dl(), b = make_dl(static_cast<char*>(x.data()) + H * ks::dtype_size(dt), dt, sw);
  ASSERT_TRUE(ok(ks_rms_norm(&o, &a, &b, 1e-6, KS_BACKEND_AUTO, nullptr)));
  EXPECT_TRUE(allclose(out.values(), rms_ref(x, wcopy, 1e-6), tol(dt), tol(dt)));
  EXPECT_TRUE(out.guards_intact());
}

// ------------------------------------------------------------ batch invariance --

TEST_P(RmsNorm, RowAloneEqualsRowInBatchBitwise) {
  const DType dt = GetParam();
  for (int64_t H : {7, 4097}) {  // 257 x 4097 is large enough for a multi-threaded path
    const int64_t R = 257;
    Buf x(dt, {R, H}), w(dt, {H}), out(dt, {R, H});
    fill_normal(x);
    fill_normal(w);
    out.poison();
    ASSERT_TRUE(ok(run(out, x, w)));
    const size_t row_bytes = size_t(H) * ks::dtype_size(dt);
    for (int64_t r : {int64_t(0), int64_t(1), int64_t(128), int64_t(255), int64_t(256)}) {
      Buf x1(dt, {1, H}), o1(dt, {1, H});
      std::memcpy(x1.data(), static_cast<char*>(x.data()) + r * row_bytes, row_bytes);
      o1.poison();
      ASSERT_TRUE(ok(run(o1, x1, w)));
      EXPECT_EQ(0, std::memcmp(o1.data(), static_cast<char*>(out.data()) + r * row_bytes, row_bytes))
          << "H=" << H << " row " << r;
    }
  }
}

// -------------------------------------------------------------- validation --

// Builds a valid call, lets `mutate` break one thing, and checks the rejection.
struct Call : XWeightOutCall {
  double eps = 1e-6;
  explicit Call(DType dt, int64_t R = 4, int64_t H = 24) : XWeightOutCall(dt, {R, H}, {H}, {R, H}) {}
  ks_status_t call() { return ks_rms_norm(pout, px, pw, eps, be, nullptr); }
};

const ExpectReject<Call> expect_reject{rejected};

TEST_P(RmsNorm, ValidCallBaseline) {
  Call c(GetParam());
  EXPECT_TRUE(ok(c.call()));  // the harness' unmodified call is valid
}

TEST_P(RmsNorm, RejectsEmptyLastDim) {
  const DType dt = GetParam();
  Buf x(dt, {3, 0}), w(dt, {0}), out(dt, {3, 0});
  auto before = snap({&x, &w, &out});
  EXPECT_TRUE(rejected(run(out, x, w), KS_ERROR_INVALID_ARGUMENT, {"x"}, {&x, &w, &out}, before));
  Buf x1(dt, {0}), w1(dt, {0}), o1(dt, {0});
  before = snap({&x1, &w1, &o1});
  EXPECT_TRUE(rejected(run(o1, x1, w1), KS_ERROR_INVALID_ARGUMENT, {"x"}, {&x1, &w1, &o1}, before));
}

TEST_P(RmsNorm, RejectsZeroDimX) {
  const DType dt = GetParam();
  expect_reject(dt, [](Call& c) { c.tx.ndim = 0; c.tout.ndim = 0; }, KS_ERROR_INVALID_ARGUMENT, {"x"});
}

TEST_P(RmsNorm, RejectsNonContiguousStrides) {
  const DType dt = GetParam();
  // Row pitch larger than H (a column slice of a wider matrix).
  expect_reject(dt, [](Call& c) { c.tx.strides = c.vec({48, 1}); }, KS_ERROR_INVALID_ARGUMENT, {"x"});
  // Transposed layout.
  expect_reject(dt, [](Call& c) { c.tx.strides = c.vec({1, 4}); }, KS_ERROR_INVALID_ARGUMENT, {"x"});
  // Inner stride 2.
  expect_reject(dt, [](Call& c) { c.tout.strides = c.vec({48, 2}); }, KS_ERROR_INVALID_ARGUMENT, {"out"});
  expect_reject(dt, [](Call& c) { c.tw.strides = c.vec({2}); }, KS_ERROR_INVALID_ARGUMENT, {"weight"});
  // Zero (broadcast) stride.
  expect_reject(dt, [](Call& c) { c.tx.strides = c.vec({0, 1}); }, KS_ERROR_INVALID_ARGUMENT, {"x"});
}

TEST_P(RmsNorm, AcceptsCompactExplicitStridesAndIgnoresSize1Strides) {
  const DType dt = GetParam();
  {
    Call c(dt);
    c.tx.strides = c.vec({24, 1});
    c.tout.strides = c.vec({24, 1});
    c.tw.strides = c.vec({1});
    ASSERT_TRUE(ok(c.call()));
    EXPECT_TRUE(allclose(c.out.values(), rms_ref(c.x, c.w, 1e-6), tol(dt), tol(dt)));
  }
  {
    Call c(dt, 1, 24);  // [1, 24]: the stride of the size-1 dim is ignored
    c.tx.strides = c.vec({12345, 1});
    c.tout.strides = c.vec({-7, 1});
    ASSERT_TRUE(ok(c.call()));
    EXPECT_TRUE(allclose(c.out.values(), rms_ref(c.x, c.w, 1e-6), tol(dt), tol(dt)));
  }
}

TEST_P(RmsNorm, RejectsDtypeMismatchOfEachArgument) {
  const DType dt = GetParam();
  const DLDataType other = ks::to_dl(other_float(dt));
  expect_reject(dt, [&](Call& c) { c.tw.dtype = other; }, KS_ERROR_UNSUPPORTED_DTYPE, {"weight"});
  expect_reject(dt, [&](Call& c) { c.tout.dtype = other; }, KS_ERROR_UNSUPPORTED_DTYPE, {"out"});
  expect_reject(dt, [&](Call& c) { c.tx.dtype = other; }, KS_ERROR_UNSUPPORTED_DTYPE, {"x"});
  // bf16 vs fp16: same width, different code.
  const DLDataType sib = dt == DType::BF16 ? ks::to_dl(DType::F16) : ks::to_dl(DType::BF16);
  expect_reject(dt, [&](Call& c) { c.tw.dtype = sib; }, KS_ERROR_UNSUPPORTED_DTYPE, {"weight"});
}

TEST_P(RmsNorm, RejectsUnsupportedDtypes) {
  const DType dt = GetParam();
  const DLDataType i32{kDLInt, 32, 1}, f64{kDLFloat, 64, 1}, f16x2{kDLFloat, 16, 2}, f8{kDLFloat, 8, 1};
  // int32 x, weight and out (all the same unsupported dtype).
  expect_reject(dt, [&](Call& c) { c.tx.dtype = c.tw.dtype = c.tout.dtype = i32; }, KS_ERROR_UNSUPPORTED_DTYPE,
                {"x"});
  // (the message names the dtype and the ones kernscope takes)
  expect_reject(dt, [&](Call& c) { c.tx.dtype = c.tw.dtype = c.tout.dtype = f64; }, KS_ERROR_UNSUPPORTED_DTYPE,
                {"x", "float64", "float16", "bfloat16", "float32"});
  expect_reject(dt, [&](Call& c) { c.tx.dtype = i32; }, KS_ERROR_UNSUPPORTED_DTYPE, {"x"});
  expect_reject(dt, [&](Call& c) { c.tw.dtype = f64; }, KS_ERROR_UNSUPPORTED_DTYPE, {"weight"});
  expect_reject(dt, [&](Call& c) { c.tout.dtype = i32; }, KS_ERROR_UNSUPPORTED_DTYPE, {"out"});
  expect_reject(dt, [&](Call& c) { c.tx.dtype = c.tw.dtype = c.tout.dtype = f16x2; }, KS_ERROR_UNSUPPORTED_DTYPE,
                {"x"});
  expect_reject(dt, [&](Call& c) { c.tx.dtype = c.tw.dtype = c.tout.dtype = f8; }, KS_ERROR_UNSUPPORTED_DTYPE,
                {"x"});
}

TEST_P(RmsNorm, RejectsDeviceMismatchOfEachArgument) {
  const DType dt = GetParam();
  expect_reject(dt, [](Call& c) { c.tw.device = {kDLCUDA, 0}; }, KS_ERROR_UNSUPPORTED_DEVICE, {"weight"});
  expect_reject(dt, [](Call& c) { c.tout.device = {kDLCUDA, 0}; }, KS_ERROR_UNSUPPORTED_DEVICE, {"out"});
  expect_reject(dt, [](Call& c) { c.tx.device = {kDLCUDA, 0}; }, KS_ERROR_UNSUPPORTED_DEVICE, {"x"});
  // Same device type, different ordinal.
  expect_reject(dt, [](Call& c) {
    c.tx.device = c.tw.device = {kDLCUDA, 0};
    c.tout.device = {kDLCUDA, 1};
  }, KS_ERROR_UNSUPPORTED_DEVICE, {"out"});
}

TEST_P(RmsNorm, BackendAndDeviceSelection) {
  const DType dt = GetParam();
  // Explicit CUDA backend with host tensors: the tensors are on the wrong device
  // for that backend. This is UNSUPPORTED_DEVICE (device checked before availability),
  // whether or not a CUDA backend is built.
  expect_reject(dt, [](Call& c) { c.be = KS_BACKEND_CUDA; }, KS_ERROR_UNSUPPORTED_DEVICE, {"backend"});
  // Explicit CPU backend with CUDA tensors.
  expect_reject(dt, [](Call& c) {
    c.be = KS_BACKEND_CPU;
    c.tx.device = c.tw.device = c.tout.device = {kDLCUDA, 0};
  }, KS_ERROR_UNSUPPORTED_DEVICE, {"backend"});
  // Unknown backend value.
  expect_reject(dt, [](Call& c) { c.be = static_cast<ks_backend_t>(3); }, KS_ERROR_INVALID_ARGUMENT, {"backend"});
  // A device type no backend handles.
  expect_reject(dt, [](Call& c) { c.tx.device = c.tw.device = c.tout.device = {kDLOpenCL, 0}; },
                KS_ERROR_UNSUPPORTED_DEVICE, {});
  // CUDA tensors with no CUDA backend here: BACKEND_UNAVAILABLE. (With a usable CUDA
  // backend these fake device pointers would be dereferenced, so skip that case.)
  if (ks_backend_available(KS_BACKEND_CUDA)) GTEST_SKIP() << "CUDA available: not faking device pointers";
  for (ks_backend_t be : {KS_BACKEND_AUTO, KS_BACKEND_CUDA})
    expect_reject(dt, [be](Call& c) {
      c.be = be;
      c.tx.device = c.tw.device = c.tout.device = {kDLCUDA, 0};
    }, KS_ERROR_BACKEND_UNAVAILABLE, {});
}

TEST_P(RmsNorm, RejectsWrongShapes) {
  const DType dt = GetParam();
  // weight: wrong length, 2-D, 0-d.
  expect_reject(dt, [&](Call& c) { set_shape(c.tw, c, {23}); }, KS_ERROR_INVALID_ARGUMENT, {"weight"});
  expect_reject(dt, [&](Call& c) { set_shape(c.tw, c, {1, 24}); }, KS_ERROR_INVALID_ARGUMENT, {"weight"});
  expect_reject(dt, [&](Call& c) { set_shape(c.tw, c, {}); }, KS_ERROR_INVALID_ARGUMENT, {"weight"});
  // out: wrong last dim, wrong rows, flattened, transposed (same numel), extra dim.
  expect_reject(dt, [&](Call& c) { set_shape(c.tout, c, {4, 23}); }, KS_ERROR_INVALID_ARGUMENT, {"out"});
  expect_reject(dt, [&](Call& c) { set_shape(c.tout, c, {3, 24}); }, KS_ERROR_INVALID_ARGUMENT, {"out"});
  expect_reject(dt, [&](Call& c) { set_shape(c.tout, c, {96}); }, KS_ERROR_INVALID_ARGUMENT, {"out"});
  expect_reject(dt, [&](Call& c) { set_shape(c.tout, c, {24, 4}); }, KS_ERROR_INVALID_ARGUMENT, {"out"});
  expect_reject(dt, [&](Call& c) { set_shape(c.tout, c, {1, 4, 24}); }, KS_ERROR_INVALID_ARGUMENT, {"out"});
  // Negative dimension, and a shape whose element count overflows int64.
  expect_reject(dt, [&](Call& c) {
    set_shape(c.tx, c, {-4, 24});
    set_shape(c.tout, c, {-4, 24});
  }, KS_ERROR_INVALID_ARGUMENT, {"x"});
  expect_reject(dt, [&](Call& c) {
    set_shape(c.tx, c, {int64_t(1) << 62, 24});
    set_shape(c.tout, c, {int64_t(1) << 62, 24});
  }, KS_ERROR_INVALID_ARGUMENT, {"x"});
}

TEST_P(RmsNorm, RejectsBadEps) {
  const DType dt = GetParam();
  const double inf = std::numeric_limits<double>::infinity(), nan = std::numeric_limits<double>::quiet_NaN();
  // 1e-50 and 1e-46 are positive doubles that round to 0 in fp32; 1e39 and DBL_MAX round to inf.
  for (double eps : {0.0, -0.0, -1e-6, -1.0, nan, -nan, inf, -inf, 1e-50, 1e-46, 1e39, DBL_MAX}) {
    SCOPED_TRACE("eps=" + std::to_string(eps));
    expect_reject(dt, [eps](Call& c) { c.eps = eps; }, KS_ERROR_INVALID_ARGUMENT, {"eps"});
  }
}

TEST_P(RmsNorm, RejectsNullTensorsShapesAndData) {
  const DType dt = GetParam();
  expect_reject(dt, [](Call& c) { c.px = nullptr; }, KS_ERROR_INVALID_ARGUMENT, {"x"});
  expect_reject(dt, [](Call& c) { c.pw = nullptr; }, KS_ERROR_INVALID_ARGUMENT, {"weight"});
  expect_reject(dt, [](Call& c) { c.pout = nullptr; }, KS_ERROR_INVALID_ARGUMENT, {"out"});
  expect_reject(dt, [](Call& c) { c.tx.shape = nullptr; }, KS_ERROR_INVALID_ARGUMENT, {"x"});
  expect_reject(dt, [](Call& c) { c.tx.data = nullptr; }, KS_ERROR_INVALID_ARGUMENT, {"x"});
  expect_reject(dt, [](Call& c) { c.tw.data = nullptr; }, KS_ERROR_INVALID_ARGUMENT, {"weight"});
  expect_reject(dt, [](Call& c) { c.tout.data = nullptr; }, KS_ERROR_INVALID_ARGUMENT, {"out"});
}

TEST(RmsNormErrors, SuccessClearsLastError) {
  Buf x(DType::F32, {2, 8}), w(DType::F32, {8}), out(DType::F32, {2, 8});
  fill_normal(x);
  fill_normal(w);
  ASSERT_NE(run(out, x, w, 0.0), KS_SUCCESS);
  ASSERT_STRNE(ks_last_error(), "");
  ASSERT_TRUE(ok(run(out, x, w)));
  EXPECT_STREQ(ks_last_error(), "");
}

// Index math beyond 2^31 elements: an rms_norm output must be written in full, so
// a > 2^31-element case needs > 4 GiB of resident host memory, which this CPU suite
// cannot afford. It is covered by the GPU suite (and gemv's zero-page test covers
// 64-bit indexing of the shared CPU load path); it is deliberately not faked here.

INSTANTIATE_TEST_SUITE_P(AllDtypes, RmsNorm, ::testing::ValuesIn(kstest::float_dtypes()), dt_param_name);

}  // namespace
