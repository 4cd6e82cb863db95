// ks_silu_and_mul: contract against an FP64 reference, odd D, extreme and
// non-finite gates, shapes, views, validation, aliasing, batch invariance.
//
// Contract (kernscope.h, src/ops/elementwise_ops.cpp, seed README):
//   g = fp32(x[..., :D]), u = fp32(x[..., D:]);
//   out = round(g * sigmoid(g) * u),  sigmoid(g) = 1 / (1 + exp(-g)) in FP32.
#include <cmath>
#include <deque>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "call_checks.hpp"

namespace {

using namespace kstest::checks;

constexpr const char* kOp = "silu_and_mul";
const RejectionCheck rejected{kOp};

// ---------------------------------------------------------------- helpers --

// The contract's formula evaluated in double: g * (1 / (1 + exp(-g))) * u.
// (Note the literal product form: for g = -inf it gives -inf * 0 = NaN, exactly as
// the FP32 formula does; see ExtremeAndNonFiniteGates.)
double silu_mul(double g, double u) { return g * (1.0 / (1.0 + std::exp(-g))) * u; }

std::vector<double> silu_ref(const Buf& x) {
  const int64_t D = x.shape.back() / 2, rows = x.numel() / (2 * D);
  const auto v = x.values();
  std::vector<double> out(size_t(rows * D));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < D; ++i) out[r * D + i] = silu_mul(v[r * 2 * D + i], v[r * 2 * D + D + i]);
  return out;
}

std::vector<int64_t> half_last(std::vector<int64_t> s) {
  s.back() /= 2;
  return s;
}

ks_status_t run(Buf& out, Buf& x, ks_backend_t be = KS_BACKEND_AUTO) {
  DLTensor o = out.dl(), a = x.dl();
  return ks_silu_and_mul(&o, &a, be, nullptr);
}

void check_contract(DType dt, const std::vector<int64_t>& xshape, double gstd = 2.0, size_t ox = 0, size_t oo = 0) {
  Buf x(dt, xshape, ox), out(dt, half_last(xshape), oo);
  fill_normal(x, gstd);
  const auto x0 = x.raw;
  out.poison();
  ASSERT_TRUE(ok(run(out, x)));
  EXPECT_TRUE(x.guards_intact());
  EXPECT_TRUE(out.guards_intact());
  EXPECT_EQ(x.raw, x0) << "x was modified";
  EXPECT_TRUE(allclose(out.values(), silu_ref(x), tol(dt), tol(dt))) << ks::dtype_name(dt) << " 2D=" << xshape.back();
}

class SiluAndMul : public ::testing::TestWithParam<DType> {};

// ---------------------------------------------------------------- contract --

TEST_P(SiluAndMul, OddAndNonVectorWidths) {
  for (int64_t D : {1, 2, 3, 7, 8, 9, 15, 16, 17, 127, 128, 129, 1000, 3420, 4097}) {
    SCOPED_TRACE("D=" + std::to_string(D));
    check_contract(GetParam(), {5, 2 * D});
  }
}

TEST_P(SiluAndMul, MultiDimLeadingShapes) {
  check_contract(GetParam(), {14});
  check_contract(GetParam(), {2, 3, 2 * 33});
  check_contract(GetParam(), {3, 1, 4, 1, 2 * 127});
}

TEST_P(SiluAndMul, LongRows) {
  check_contract(GetParam(), {2, 2 * 131075});
  check_contract(GetParam(), {257, 2 * 129}, 6.0);
}

TEST_P(SiluAndMul, ZeroRowsIsANoOp) {
  const DType dt = GetParam();
  for (std::vector<int64_t> shape : {std::vector<int64_t>{0, 18}, {2, 0, 18}}) {
    Buf x(dt, shape), out(dt, half_last(shape));
    out.poison();
    const auto before = out.raw;
    ASSERT_TRUE(ok(run(out, x)));
    EXPECT_EQ(out.raw, before);
  }
  std::vector<int64_t> sx{0, 18}, so{0, 9};
  DLTensor o = make_dl(nullptr, dt, so), a = make_dl(nullptr, dt, sx);
  EXPECT_TRUE(ok(ks_silu_and_mul(&o, &a, KS_BACKEND_AUTO, nullptr)));
  // Zero rows still validate: odd last dim, wrong out shape, dtype mismatch.
  Buf x(dt, {0, 17}), o1(dt, {0, 8}), x2(dt, {0, 18}), o2(dt, {0, 8}), o3(other_float(dt), {0, 9});
  auto before = snap({&x, &o1, &x2, &o2, &o3});
  EXPECT_TRUE(rejected(run(o1, x), KS_ERROR_INVALID_ARGUMENT, {"x"}, {&x, &o1, &x2, &o2, &o3}, before));
  EXPECT_TRUE(rejected(run(o2, x2), KS_ERROR_INVALID_ARGUMENT, {"out"}, {&x, &o1, &x2, &o2, &o3}, before));
  EXPECT_TRUE(rejected(run(o3, x2), KS_ERROR_UNSUPPORTED_DTYPE, {"out"}, {&x, &o1, &x2, &o2, &o3}, before));
}

TEST_P(SiluAndMul, OffsetAndMisalignedViews) {
  for (size_t o : {2u, 6u, 10u}) {
    SCOPED_TRACE("offset " + std::to_string(o));
    check_contract(GetParam(), {3, 2 * 127}, 2.0, o, o);
    check_contract(GetParam(), {2, 2 * 4097}, 2.0, o, (o + 4) % 12);
    check_contract(GetParam(), {4, 2 * 7}, 2.0, 0, o);
  }
}

TEST_P(SiluAndMul, DLTensorByteOffsetIsHonoured) {
  const DType dt = GetParam();
  Buf x(dt, {3, 2 * 19}), out(dt, {3, 19});
  fill_normal(x, 2.0);
  out.poison();
  DLTensor o = out.dl(), a = x.dl();
  o.data = static_cast<char*>(o.data) - 6;
  o.byte_offset = 6;
  a.data = static_cast<char*>(a.data) - 10;
  a.byte_offset = 10;
  ASSERT_TRUE(ok(ks_silu_and_mul(&o, &a, KS_BACKEND_AUTO, nullptr)));
  EXPECT_TRUE(allclose(out.values(), silu_ref(x), tol(dt), tol(dt)));
  EXPECT_TRUE(out.guards_intact());
}

TEST_P(SiluAndMul, ExplicitCpuBackendMatchesAuto) {
  const DType dt = GetParam();
  Buf x(dt, {6, 2 * 333}), o1(dt, {6, 333}), o2(dt, {6, 333});
  fill_normal(x, 3.0);
  o1.poison();
  o2.poison();
  ASSERT_TRUE(ok(run(o1, x, KS_BACKEND_AUTO)));
  ASSERT_TRUE(ok(run(o2, x, KS_BACKEND_CPU)));
  EXPECT_TRUE(same_bytes(o1, o2));
}

// Extreme and non-finite gates. What the FP32 contract gives, evaluated in double
// with the same formula g * (1 / (1 + exp(-g))) * u:
//   g = -inf: exp(inf) = inf, sigmoid = 1/inf = 0, and -inf * 0 = NaN: out is NaN for
//             every u (also for the g / (1 + exp(-g)) form: -inf / inf = NaN).
//   g = +inf: sigmoid = 1, out = inf * u: +-inf for u != 0, NaN for u = 0 or NaN.
//   g = NaN or u = NaN: NaN.
//   finite g, u = +-inf: +-inf with the sign of g*u; g = 0 gives 0 * inf = NaN.
//   g = +-80: finite; silu(80) = 80, silu(-80) = -80 * e^-80 = -1.4e-33 (a normal fp32).
//   g <= -88.8: FP32 exp(-g) overflows, so sigmoid = 0 and silu = -0 in FP32 while the
//             true value is ~-1e-37: a difference far below every atol, so finite u is
//             compared as usual. With u = +-inf such gates are formulation-dependent
//             (FP32 0 * inf = NaN vs a denormal sigmoid * inf = inf) and not asserted.
// The double evaluation agrees with the FP32 formula on every asserted case (checked
// below against an FP32 evaluation of the same formula).
TEST_P(SiluAndMul, ExtremeAndNonFiniteGates) {
  const DType dt = GetParam();
  std::vector<double> gates{-kInf, -65504, -1000, -100, -89, -88, -87, -80, -40, -20, -1,   -0.0, 0.0,
                            1,     20,     40,    80,   87,  89,  100, 1000, 65504, kInf, kNaN};
  std::vector<double> ups{0.0, -0.0, 1.0, -1.0, 0.75, -3.5, 100.0, kInf, -kInf, kNaN};
  // Random ups too.
  for (int i = 0; i < 6; ++i) ups.push_back(std::normal_distribution<double>(0, 2)(kstest::rng()));
  const int64_t D = int64_t(gates.size() * ups.size());
  Buf x(dt, {1, 2 * D}), out(dt, {1, D});
  int64_t k = 0;
  for (double g : gates)
    for (double u : ups) {
      x.set(k, g);
      x.set(D + k, u);
      ++k;
    }
  // A finite, non-NaN poison so a skipped NaN/inf store cannot go unnoticed.
  std::memset(out.data(), 0x5A, out.nbytes());
  ASSERT_TRUE(ok(run(out, x)));
  EXPECT_TRUE(out.guards_intact());
  int checked = 0;
  for (int64_t i = 0; i < D; ++i) {
    const double g = x.get(i), u = x.get(D + i), got = out.get(i);
    const double want = silu_mul(g, u);
    // The same formula in FP32, for the documented consistency claim.
    const float gf = float(g), uf = float(u);
    const float want32 = gf * (1.0f / (1.0f + std::exp(-gf))) * uf;
    const bool formulation_dependent = std::isinf(u) && std::isfinite(g) && g < -88.5;
    if (formulation_dependent) continue;
    ++checked;
    SCOPED_TRACE("g=" + std::to_string(g) + " u=" + std::to_string(u));
    if (std::isnan(want) || std::isnan(double(want32))) {
      EXPECT_TRUE(std::isnan(want) && std::isnan(double(want32))) << "double and FP32 contract disagree";
      EXPECT_TRUE(std::isnan(got)) << "got " << got;
      continue;
    }
    const double want_rounded = round_to(want, dt);  // may overflow to inf in fp16/bf16
    if (std::isinf(want_rounded) || std::isinf(double(want32))) {
      EXPECT_EQ(got, want_rounded);
      if (dt == DType::F32) {
        EXPECT_EQ(double(want32), want_rounded);
      }
      continue;
    }
    EXPECT_TRUE(std::isfinite(got)) << "got " << got;
    EXPECT_NEAR(got, want, tol(dt) + tol(dt) * std::fabs(want));
    if (u == 0.0 || g == 0.0) {
      EXPECT_EQ(got, 0.0);
    }
  }
  EXPECT_GT(checked, 200);
  // Named spot checks.
  auto at = [&](double g, double u) {
    for (int64_t i = 0; i < D; ++i)
      if (x.get(i) == round_to(g, dt) && (x.get(D + i) == u || (std::isnan(u) && std::isnan(x.get(D + i)))))
        return out.get(i);
    ADD_FAILURE() << "pair not found";
    return 0.0;
  };
  EXPECT_TRUE(std::isnan(at(-kInf, 1.0)));
  EXPECT_TRUE(std::isnan(at(-kInf, 0.0)));
  EXPECT_TRUE(std::isnan(at(-kInf, kInf)));
  EXPECT_EQ(at(kInf, 1.0), kInf);
  EXPECT_EQ(at(kInf, -1.0), -kInf);
  EXPECT_TRUE(std::isnan(at(kInf, 0.0)));
  EXPECT_EQ(at(80, 1.0), 80.0);
  EXPECT_EQ(at(1, kInf), kInf);
  EXPECT_EQ(at(-1, kInf), -kInf);
  EXPECT_TRUE(std::isnan(at(0.0, kInf)));
  EXPECT_TRUE(std::isnan(at(1, kNaN)));
  // silu(-80) * 1: -1.44e-33, representable in fp32 and bf16; require it to the relative
  // tolerance there (not flushed to zero). fp16 rounds it to -0.
  const double s80 = at(-80, 1.0);
  if (dt == DType::F16) {
    EXPECT_EQ(s80, 0.0);
  } else {
    EXPECT_NEAR(s80, silu_mul(-80, 1.0), tol(dt) * std::fabs(silu_mul(-80, 1.0)));
  }
}

TEST_P(SiluAndMul, NegativeGateTailKeepsRelativeAccuracy) {
  // silu(g) for large negative g is tiny but still a normal number of the dtype
  // (fp32/bf16: g in [-87, -20]; fp16: g in [-11, -5]); a flush to zero or a poor exp
  // would pass the absolute tolerance, so check relative accuracy there.
  const DType dt = GetParam();
  const bool f16 = dt == DType::F16;
  const int64_t D = f16 ? 7 : 68;
  Buf x(dt, {1, 2 * D}), out(dt, {1, D});
  for (int64_t i = 0; i < D; ++i) {
    x.set(i, (f16 ? -5.0 : -20.0) - double(i));
    x.set(D + i, std::uniform_real_distribution<double>(0.5, 2.0)(kstest::rng()));
  }
  out.poison();
  ASSERT_TRUE(ok(run(out, x)));
  // fp32: exp(-g) for g down to -87 is good to a few ulp (plus the rounding of -g),
  // so 1e-5 relative is generous; fp16/bf16: the seed's rtol.
  const double rt = dt == DType::F32 ? 1e-5 : tol(dt);
  for (int64_t i = 0; i < D; ++i) {
    const double want = silu_mul(x.get(i), x.get(D + i));
    EXPECT_NEAR(out.get(i), want, rt * std::fabs(want)) << "g=" << x.get(i);
  }
}

// ---------------------------------------------------------------- aliasing --

TEST_P(SiluAndMul, RejectsOutOverlappingX) {
  const DType dt = GetParam();
  const int64_t R = 4, D = 9;
  const int64_t es = int64_t(ks::dtype_size(dt));
  Buf arena(dt, {R * 2 * D + 2 * R * D}), sentinel(dt, {1});
  fill_normal(arena);
  char* xbase = static_cast<char*>(arena.data()) + R * D * es;  // room before and after x
  std::vector<int64_t> sx{R, 2 * D}, so{R, D};
  const auto before = snap({&arena});
  // out at x's start (the gate half of row 0), inside x, straddling x's start or end.
  for (int64_t off : std::vector<int64_t>{0, D, 1, 2 * D, R * 2 * D - 1, -(R * D - 1), R * D}) {
    DLTensor o = make_dl(xbase + off * es, dt, so), a = make_dl(xbase, dt, sx);
    EXPECT_TRUE(rejected(ks_silu_and_mul(&o, &a, KS_BACKEND_AUTO, nullptr), KS_ERROR_INVALID_ARGUMENT,
                         {"out", "x"}, {&arena}, before))
        << "off " << off;
  }
  // Immediately before and immediately after x: disjoint, accepted.
  for (int64_t off : std::vector<int64_t>{-R * D, R * 2 * D}) {
    Buf xs(dt, sx);
    std::memcpy(xs.data(), xbase, xs.nbytes());
    DLTensor o = make_dl(xbase + off * es, dt, so), a = make_dl(xbase, dt, sx);
    ASSERT_TRUE(ok(ks_silu_and_mul(&o, &a, KS_BACKEND_AUTO, nullptr))) << "off " << off;
    Buf os(dt, so);
    std::memcpy(os.data(), xbase + off * es, os.nbytes());
    EXPECT_TRUE(allclose(os.values(), silu_ref(xs), tol(dt), tol(dt)));
    EXPECT_EQ(0, std::memcmp(xs.data(), xbase, xs.nbytes())) << "x modified";
    EXPECT_TRUE(arena.guards_intact());
  }
}

// ------------------------------------------------------------ batch invariance --

TEST_P(SiluAndMul, RowAloneEqualsRowInBatchBitwise) {
  const DType dt = GetParam();
  for (int64_t D : {7, 4097}) {
    const int64_t R = 257;
    Buf x(dt, {R, 2 * D}), out(dt, {R, D});
    fill_normal(x, 3.0);
    out.poison();
    ASSERT_TRUE(ok(run(out, x)));
    const size_t es = ks::dtype_size(dt);
    for (int64_t r : {int64_t(0), int64_t(1), int64_t(128), int64_t(256)}) {
      Buf x1(dt, {1, 2 * D}), o1(dt, {1, D});
      std::memcpy(x1.data(), static_cast<char*>(x.data()) + r * 2 * D * es, x1.nbytes());
      o1.poison();
      ASSERT_TRUE(ok(run(o1, x1)));
      EXPECT_EQ(0, std::memcmp(o1.data(), static_cast<char*>(out.data()) + r * D * es, o1.nbytes()))
          << "D=" << D << " row " << r;
    }
  }
}

// -------------------------------------------------------------- validation --

struct Call : XOutCall {
  explicit Call(DType dt, int64_t R = 4, int64_t D = 12) : XOutCall(dt, {R, 2 * D}, {R, D}) {}
  ks_status_t call() { return ks_silu_and_mul(pout, px, be, nullptr); }
};

const ExpectReject<Call> expect_reject{rejected};

TEST_P(SiluAndMul, ValidCallBaseline) {
  Call c(GetParam());
  EXPECT_TRUE(ok(c.call()));
}

TEST_P(SiluAndMul, RejectsEmptyOddAndZeroDimLastDim) {
  const DType dt = GetParam();
  Buf x(dt, {3, 0}), out(dt, {3, 0});
  auto before = snap({&x, &out});
  EXPECT_TRUE(rejected(run(out, x), KS_ERROR_INVALID_ARGUMENT, {"x"}, {&x, &out}, before));
  for (int64_t w : {1, 3, 7, 4097}) {
    Buf xo(dt, {2, w}), oo(dt, {2, w / 2});
    fill_normal(xo);
    before = snap({&xo, &oo});
    EXPECT_TRUE(rejected(run(oo, xo), KS_ERROR_INVALID_ARGUMENT, {"x"}, {&xo, &oo}, before)) << "2D=" << w;
  }
  expect_reject(dt, [](Call& c) { c.tx.ndim = 0; c.tout.ndim = 0; }, KS_ERROR_INVALID_ARGUMENT, {"x"});
}

TEST_P(SiluAndMul, RejectsNonContiguousStrides) {
  const DType dt = GetParam();
  expect_reject(dt, [](Call& c) { c.tx.strides = c.vec({48, 1}); }, KS_ERROR_INVALID_ARGUMENT, {"x"});
  expect_reject(dt, [](Call& c) { c.tx.strides = c.vec({1, 4}); }, KS_ERROR_INVALID_ARGUMENT, {"x"});
  // out as a column slice of a wider [4, 24] buffer (row pitch 24, not 12).
  expect_reject(dt, [](Call& c) { c.tout.strides = c.vec({24, 1}); }, KS_ERROR_INVALID_ARGUMENT, {"out"});
  expect_reject(dt, [](Call& c) { c.tout.strides = c.vec({12, 2}); }, KS_ERROR_INVALID_ARGUMENT, {"out"});
}

TEST_P(SiluAndMul, AcceptsCompactExplicitStrides) {
  const DType dt = GetParam();
  Call c(dt);
  c.tx.strides = c.vec({24, 1});
  c.tout.strides = c.vec({12, 1});
  ASSERT_TRUE(ok(c.call()));
  EXPECT_TRUE(allclose(c.out.values(), silu_ref(c.x), tol(dt), tol(dt)));
}

TEST_P(SiluAndMul, RejectsDtypeMismatchAndUnsupportedDtypes) {
  const DType dt = GetParam();
  const DLDataType other = ks::to_dl(other_float(dt)), i32{kDLInt, 32, 1}, f64{kDLFloat, 64, 1};
  expect_reject(dt, [&](Call& c) { c.tout.dtype = other; }, KS_ERROR_UNSUPPORTED_DTYPE, {"out"});
  expect_reject(dt, [&](Call& c) { c.tx.dtype = other; }, KS_ERROR_UNSUPPORTED_DTYPE, {"x"});
  expect_reject(dt, [&](Call& c) { c.tx.dtype = c.tout.dtype = i32; }, KS_ERROR_UNSUPPORTED_DTYPE, {"x"});
  expect_reject(dt, [&](Call& c) { c.tx.dtype = c.tout.dtype = f64; }, KS_ERROR_UNSUPPORTED_DTYPE, {"x"});
  expect_reject(dt, [&](Call& c) { c.tout.dtype = f64; }, KS_ERROR_UNSUPPORTED_DTYPE, {"out"});
  expect_reject(dt, [&](Call& c) { c.tx.dtype.lanes = 2; }, KS_ERROR_UNSUPPORTED_DTYPE, {"x"});
}

TEST_P(SiluAndMul, RejectsDeviceMismatchAndBadBackend) {
  const DType dt = GetParam();
  expect_reject(dt, [](Call& c) { c.tout.device = {kDLCUDA, 0}; }, KS_ERROR_UNSUPPORTED_DEVICE, {"out"});
  expect_reject(dt, [](Call& c) { c.tx.device = {kDLCUDA, 0}; }, KS_ERROR_UNSUPPORTED_DEVICE, {"x"});
  // CUDA backend with host tensors: UNSUPPORTED_DEVICE (device checked before availability).
  expect_reject(dt, [](Call& c) { c.be = KS_BACKEND_CUDA; }, KS_ERROR_UNSUPPORTED_DEVICE, {"backend"});
  expect_reject(dt, [](Call& c) { c.be = static_cast<ks_backend_t>(3); }, KS_ERROR_INVALID_ARGUMENT, {"backend"});
  expect_reject(dt, [](Call& c) { c.tx.device = c.tout.device = {kDLVulkan, 0}; }, KS_ERROR_UNSUPPORTED_DEVICE, {});
  if (ks_backend_available(KS_BACKEND_CUDA)) GTEST_SKIP() << "CUDA available: not faking device pointers";
  expect_reject(dt, [](Call& c) { c.tx.device = c.tout.device = {kDLCUDA, 0}; }, KS_ERROR_BACKEND_UNAVAILABLE, {});
}

TEST_P(SiluAndMul, RejectsWrongOutShapes) {
  const DType dt = GetParam();
  expect_reject(dt, [&](Call& c) { set_shape(c.tout, c, {4, 24}); }, KS_ERROR_INVALID_ARGUMENT, {"out"});
  expect_reject(dt, [&](Call& c) { set_shape(c.tout, c, {4, 11}); }, KS_ERROR_INVALID_ARGUMENT, {"out"});
  expect_reject(dt, [&](Call& c) { set_shape(c.tout, c, {3, 12}); }, KS_ERROR_INVALID_ARGUMENT, {"out"});
  expect_reject(dt, [&](Call& c) { set_shape(c.tout, c, {48}); }, KS_ERROR_INVALID_ARGUMENT, {"out"});
  expect_reject(dt, [&](Call& c) { set_shape(c.tout, c, {12, 4}); }, KS_ERROR_INVALID_ARGUMENT, {"out"});
  expect_reject(dt, [&](Call& c) { set_shape(c.tout, c, {4, 1, 12}); }, KS_ERROR_INVALID_ARGUMENT, {"out"});
  expect_reject(dt, [&](Call& c) { set_shape(c.tout, c, {4, 12, 1}); }, KS_ERROR_INVALID_ARGUMENT, {"out"});
}

TEST_P(SiluAndMul, RejectsNullTensorsAndData) {
  const DType dt = GetParam();
  expect_reject(dt, [](Call& c) { c.px = nullptr; }, KS_ERROR_INVALID_ARGUMENT, {"x"});
  expect_reject(dt, [](Call& c) { c.pout = nullptr; }, KS_ERROR_INVALID_ARGUMENT, {"out"});
  expect_reject(dt, [](Call& c) { c.tx.data = nullptr; }, KS_ERROR_INVALID_ARGUMENT, {"x"});
  expect_reject(dt, [](Call& c) { c.tout.data = nullptr; }, KS_ERROR_INVALID_ARGUMENT, {"out"});
  expect_reject(dt, [](Call& c) { c.tout.shape = nullptr; }, KS_ERROR_INVALID_ARGUMENT, {"out"});
}

// Index math beyond 2^31 elements: the output must be written in full (> 4 GiB
// resident); covered by the GPU suite, deliberately not faked here.

INSTANTIATE_TEST_SUITE_P(AllDtypes, SiluAndMul, ::testing::ValuesIn(kstest::float_dtypes()), dt_param_name);

}  // namespace
