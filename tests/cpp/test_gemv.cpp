// ks_gemv: contract against an FP64 reference, FP32 accumulation, shapes, N = 0,
// H = 1, views, validation, aliasing, batch invariance, > 2^31-element weights.
//
// Contract (kernscope.h, src/ops/matmul_ops.cpp, seed README):
//   out[n] = round(sum_h fp32(weight[n, h]) * fp32(x[h]))   (FP32 products and sums)
// x: [H] (H > 0); weight: [N, H]; out: [N] (N may be 0). x and weight may share
// storage (read-only); out must not overlap either.
#include <sys/mman.h>

#include <cmath>
#include <deque>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "call_checks.hpp"

namespace {

using namespace kstest::checks;

constexpr const char* kOp = "gemv";
const RejectionCheck rejected{kOp};

// ---------------------------------------------------------------- helpers --

// FP64 reference, plus the per-output allowance docs/contracts.md grants ops that
// sum K products in an unspecified order: 8 * sqrt(K) * 2^-24 * sum_k |a_k b_k|.
//
// Justification: an FP32 sum of K terms in any order has a first-order error of
// sum_k d_k S_k with |d_k| <= u = 2^-24 and |S_k| <= sum|p|; modelling the d_k as
// independent and zero-mean (Higham & Mary, "A new approach to probabilistic rounding
// error analysis", 2019) turns the worst-case K * u * sum|p| into ~sqrt(K) * u * sum|p|
// with overwhelming probability; the factor 8 covers the constant and the product
// roundings (products of fp16/bf16 values are exact in FP32). The bound is what the
// library documents, so a variant with any summation order may be held to it. It is
// still far below the error of an fp16/bf16 accumulator (see Fp32Accumulation, which
// checks that such an accumulator would miss the bound by > 10x).
struct Ref {
  std::vector<double> out, allow;
};
Ref gemv_ref(const Buf& x, const Buf& w) {
  const int64_t H = x.numel(), N = H ? w.numel() / H : 0;
  const auto xv = x.values(), wv = w.values();
  Ref r;
  r.out.resize(size_t(N));
  r.allow.resize(size_t(N));
  for (int64_t n = 0; n < N; ++n) {
    double S = 0, a = 0;
    for (int64_t h = 0; h < H; ++h) {
      const double p = wv[n * H + h] * xv[h];
      S += p;
      a += std::fabs(p);
    }
    r.out[n] = S;
    r.allow[n] = 8 * std::sqrt(double(H)) * kU32 * a;
  }
  return r;
}

::testing::AssertionResult close(const Buf& got, const Ref& ref, DType dt) {
  for (int64_t i = 0; i < got.numel(); ++i) {
    const double g = got.get(i), r = ref.out[i];
    const double bound = tol(dt) + tol(dt) * std::fabs(r) + ref.allow[i];
    if (!std::isfinite(g) || std::fabs(g - r) > bound)
      return ::testing::AssertionFailure() << "out[" << i << "] = " << g << ", want " << r << " (bound " << bound
                                           << ")";
  }
  return ::testing::AssertionSuccess();
}

ks_status_t run(Buf& out, Buf& x, Buf& w, ks_backend_t be = KS_BACKEND_AUTO) {
  DLTensor o = out.dl(), a = x.dl(), b = w.dl();
  return ks_gemv(&o, &a, &b, be, nullptr);
}

void check_contract(DType dt, int64_t N, int64_t H, size_t ox = 0, size_t ow = 0, size_t oo = 0) {
  Buf x(dt, {H}, ox), w(dt, {N, H}, ow), out(dt, {N}, oo);
  fill_normal(x);
  fill_normal(w);
  const auto x0 = x.raw, w0 = w.raw;
  out.poison();
  ASSERT_TRUE(ok(run(out, x, w)));
  EXPECT_TRUE(x.guards_intact());
  EXPECT_TRUE(w.guards_intact());
  EXPECT_TRUE(out.guards_intact());
  EXPECT_EQ(x.raw, x0) << "x was modified";
  EXPECT_EQ(w.raw, w0) << "weight was modified";
  EXPECT_TRUE(close(out, gemv_ref(x, w), dt)) << ks::dtype_name(dt) << " N=" << N << " H=" << H;
}

class Gemv : public ::testing::TestWithParam<DType> {};

// ---------------------------------------------------------------- contract --

TEST_P(Gemv, OddAndNonVectorWidths) {
  for (int64_t H : {1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 33, 127, 128, 129, 1000, 1024, 2048, 3420, 4097})
    for (int64_t N : {1, 3, 7, 33}) {
      SCOPED_TRACE("N=" + std::to_string(N) + " H=" + std::to_string(H));
      check_contract(GetParam(), N, H);
    }
}

TEST_P(Gemv, ManyRows) {
  check_contract(GetParam(), 257, 129);
  check_contract(GetParam(), 512, 1024);
  check_contract(GetParam(), 1031, 7);
}

TEST_P(Gemv, HugeRow) {
  check_contract(GetParam(), 5, 131072 + 3);
}

TEST_P(Gemv, HEqualsOneIsASingleRoundedProduct) {
  // H = 1: out[n] = round(fp32(w[n]) * fp32(x[0])), one product, one rounding: exact.
  const DType dt = GetParam();
  Buf x(dt, {1}), w(dt, {37, 1}), out(dt, {37});
  fill_normal(x, 3.0);
  fill_normal(w, 3.0);
  out.poison();
  ASSERT_TRUE(ok(run(out, x, w)));
  for (int64_t n = 0; n < 37; ++n) {
    const double want = round_to(double(float(w.get(n)) * float(x.get(0))), dt);
    EXPECT_EQ(out.get(n), want) << "n=" << n;
  }
  EXPECT_TRUE(out.guards_intact());
}

TEST_P(Gemv, NEqualsZeroIsASuccessfulNoOp) {
  const DType dt = GetParam();
  for (int64_t H : {1, 7, 4097}) {
    Buf x(dt, {H}), w(dt, {0, H}), out(dt, {0});
    fill_normal(x);
    const auto before = snap({&x, &w, &out});
    ASSERT_TRUE(ok(run(out, x, w)));
    EXPECT_EQ(x.raw, before[0]);
    EXPECT_EQ(w.raw, before[1]);
    EXPECT_EQ(out.raw, before[2]);
  }
  // Empty weight and out with NULL data pointers.
  Buf x(dt, {5});
  fill_normal(x);
  std::vector<int64_t> sw{0, 5}, so{0};
  DLTensor o = make_dl(nullptr, dt, so), a = x.dl(), b = make_dl(nullptr, dt, sw);
  EXPECT_TRUE(ok(ks_gemv(&o, &a, &b, KS_BACKEND_AUTO, nullptr)));
  // N = 0 still validates.
  Buf w(dt, {0, 6}), out(dt, {0}), out1(dt, {1}), wd(other_float(dt), {0, 5});
  auto before = snap({&x, &w, &out, &out1, &wd});
  EXPECT_TRUE(rejected(run(out, x, w), KS_ERROR_INVALID_ARGUMENT, {"weight"}, {&x, &w, &out, &out1, &wd}, before));
  EXPECT_TRUE(rejected(run(out, x, wd), KS_ERROR_UNSUPPORTED_DTYPE, {"weight"}, {&x, &w, &out, &out1, &wd}, before));
  Buf w5(dt, {0, 5});
  before = snap({&x, &w5, &out1});
  EXPECT_TRUE(rejected(run(out1, x, w5), KS_ERROR_INVALID_ARGUMENT, {"out"}, {&x, &w5, &out1}, before));
}

TEST_P(Gemv, Fp32Accumulation) {
  // Each row is [B, p1, p2, ...] . x with B = 2048 (fp16/fp32 inputs) or 256 (bf16)
  // first and every other product p in (0, 1). An accumulator in the input's 16-bit
  // format (or fp16 for fp32 inputs) has spacing 2 at B, so B + p rounds back to B
  // and the sum stays at B; FP32 (spacing 2^-13 or finer there) keeps every term.
  const DType dt = GetParam();
  const DType low = dt == DType::BF16 ? DType::BF16 : DType::F16;
  const double B = dt == DType::BF16 ? 256.0 : 2048.0;
  for (int64_t H : {1025, 4097}) {
    const int64_t N = 8;
    Buf x(dt, {H}), w(dt, {N, H}), out(dt, {N});
    fill_uniform(x, 0.9, 1.1);
    fill_uniform(w, 0.2, 0.45);
    x.set(0, 1.0);
    for (int64_t n = 0; n < N; ++n) w.set(n * H, B);
    out.poison();
    ASSERT_TRUE(ok(run(out, x, w)));
    const Ref ref = gemv_ref(x, w);
    EXPECT_TRUE(close(out, ref, dt)) << "H=" << H;
    // The case must discriminate: a low-precision accumulator would fail the same check.
    for (int64_t n = 0; n < N; ++n) {
      double acc = 0;
      for (int64_t h = 0; h < H; ++h) acc = round_to(acc + round_to(w.get(n * H + h) * x.get(h), low), low);
      const double bound = tol(dt) + tol(dt) * std::fabs(ref.out[n]) + ref.allow[n];
      EXPECT_GT(std::fabs(acc - ref.out[n]), 10 * bound) << "n=" << n << " does not discriminate";
    }
  }
}

TEST_P(Gemv, CancellationAndNonFinite) {
  const DType dt = GetParam();
  const int64_t H = 64;
  Buf x(dt, {H}), w(dt, {4, H}), out(dt, {4});
  fill_normal(x);
  fill_normal(w);
  x.set(4, 0.0);
  // Row 0: w = [a, -a, b, -b, ...] with x[2k] == x[2k+1]: the exact sum is 0, so the
  // result must be 0 up to the FP32 summation allowance (no atol-sized garbage).
  for (int64_t h = 0; h < H; h += 2) {
    x.set(h + 1, x.get(h));
    w.set(h + 1, -w.get(h));
  }
  // Row 1: an inf weight times x[3] != 0: +-inf. Row 2: a NaN weight: NaN.
  // Row 3: inf * x[5] (== 0): NaN.
  w.set(H + 3, std::numeric_limits<double>::infinity());
  w.set(2 * H + 7, std::numeric_limits<double>::quiet_NaN());
  w.set(3 * H + 5, std::numeric_limits<double>::infinity());
  ASSERT_EQ(x.get(5), 0.0);
  ASSERT_NE(x.get(3), 0.0);
  std::memset(out.data(), 0x5A, out.nbytes());  // finite poison: NaN results must be written
  ASSERT_TRUE(ok(run(out, x, w)));
  Buf w0(dt, {1, H}), o0(dt, {1});
  std::memcpy(w0.data(), w.data(), w0.nbytes());
  const Ref r0 = gemv_ref(x, w0);
  ASSERT_EQ(r0.out[0], 0.0);
  o0.set(0, out.get(0));
  EXPECT_TRUE(close(o0, r0, dt));
  EXPECT_LT(std::fabs(out.get(0)), 1e-5) << "cancellation left " << out.get(0);
  EXPECT_TRUE(std::isinf(out.get(1)));
  EXPECT_EQ(std::signbit(out.get(1)), std::signbit(x.get(3)));
  EXPECT_TRUE(std::isnan(out.get(2)));
  EXPECT_TRUE(std::isnan(out.get(3)));
}

TEST_P(Gemv, OffsetAndMisalignedViews) {
  for (size_t o : {2u, 6u, 10u}) {
    SCOPED_TRACE("offset " + std::to_string(o));
    check_contract(GetParam(), 7, 127, o, o, o);
    check_contract(GetParam(), 5, 4097, o, (o + 4) % 12, (o + 8) % 12);
    check_contract(GetParam(), 33, 3, 0, o, 2);
  }
}

TEST_P(Gemv, DLTensorByteOffsetIsHonoured) {
  const DType dt = GetParam();
  Buf x(dt, {37}), w(dt, {5, 37}), out(dt, {5});
  fill_normal(x);
  fill_normal(w);
  out.poison();
  DLTensor o = out.dl(), a = x.dl(), b = w.dl();
  size_t boff = 2;
  for (DLTensor* t : {&o, &a, &b}) {
    t->data = static_cast<char*>(t->data) - boff;
    t->byte_offset = boff;
    boff += 4;
  }
  ASSERT_TRUE(ok(ks_gemv(&o, &a, &b, KS_BACKEND_AUTO, nullptr)));
  EXPECT_TRUE(close(out, gemv_ref(x, w), dt));
  EXPECT_TRUE(out.guards_intact());
}

TEST_P(Gemv, ExplicitCpuBackendMatchesAuto) {
  const DType dt = GetParam();
  Buf x(dt, {333}), w(dt, {17, 333}), o1(dt, {17}), o2(dt, {17});
  fill_normal(x);
  fill_normal(w);
  ASSERT_TRUE(ok(run(o1, x, w, KS_BACKEND_AUTO)));
  ASSERT_TRUE(ok(run(o2, x, w, KS_BACKEND_CPU)));
  EXPECT_TRUE(same_bytes(o1, o2));
}

// ---------------------------------------------------------------- aliasing --

TEST_P(Gemv, XMayBeARowOfWeight) {
  const DType dt = GetParam();
  const int64_t N = 9, H = 65;
  const int64_t es = int64_t(ks::dtype_size(dt));
  for (int64_t row : {int64_t(0), int64_t(4), N - 1}) {
    Buf w(dt, {N, H}), out(dt, {N});
    fill_normal(w);
    out.poison();
    Buf xcopy(dt, {H});
    std::memcpy(xcopy.data(), static_cast<char*>(w.data()) + row * H * es, xcopy.nbytes());
    std::vector<int64_t> sx{H};
    const auto w0 = w.raw;
    DLTensor o = out.dl(), a = make_dl(static_cast<char*>(w.data()) + row * H * es, dt, sx), b = w.dl();
    ASSERT_TRUE(ok(ks_gemv(&o, &a, &b, KS_BACKEND_AUTO, nullptr)));
    EXPECT_EQ(w.raw, w0) << "weight modified";
    const Ref ref = gemv_ref(xcopy, w);
    EXPECT_TRUE(close(out, ref, dt));
    // The result does not depend on the aliasing: same bytes as with a separate x.
    Buf out2(dt, {N});
    ASSERT_TRUE(ok(run(out2, xcopy, w)));
    EXPECT_TRUE(same_bytes(out, out2));
  }
  // x overlapping two rows of weight at a misaligned position, and x == weight exactly ([1, H]).
  Buf w(dt, {N, H}), out(dt, {N});
  fill_normal(w);
  std::vector<int64_t> sx{H}, s1{1, H}, so1{1};
  Buf xcopy(dt, {H});
  std::memcpy(xcopy.data(), static_cast<char*>(w.data()) + (H / 2) * es, xcopy.nbytes());
  DLTensor o = out.dl(), a = make_dl(static_cast<char*>(w.data()) + (H / 2) * es, dt, sx), b = w.dl();
  ASSERT_TRUE(ok(ks_gemv(&o, &a, &b, KS_BACKEND_AUTO, nullptr)));
  EXPECT_TRUE(close(out, gemv_ref(xcopy, w), dt));
  Buf o1(dt, {1});
  DLTensor oo = o1.dl(), aa = make_dl(w.data(), dt, sx), bb = make_dl(w.data(), dt, s1);
  ASSERT_TRUE(ok(ks_gemv(&oo, &aa, &bb, KS_BACKEND_AUTO, nullptr)));
  Buf x0(dt, {H}), w0(dt, {1, H});
  std::memcpy(x0.data(), w.data(), x0.nbytes());
  std::memcpy(w0.data(), w.data(), w0.nbytes());
  EXPECT_TRUE(close(o1, gemv_ref(x0, w0), dt));
}

TEST_P(Gemv, RejectsOutOverlappingInputs) {
  const DType dt = GetParam();
  const int64_t N = 6, H = 6;
  const int64_t es = int64_t(ks::dtype_size(dt));
  Buf arena(dt, {4 * N * H}), x(dt, {H}), w(dt, {N, H}), out(dt, {N});
  fill_normal(arena);
  fill_normal(x);
  fill_normal(w);
  char* base = static_cast<char*>(arena.data()) + N * H * es;
  std::vector<int64_t> sx{H}, sw{N, H}, so{N};
  const std::vector<Buf*> all{&arena, &x, &w, &out};
  const auto before = snap(all);
  // out == x exactly (N == H): gemv has no in-place form.
  {
    DLTensor o = make_dl(base, dt, so), a = make_dl(base, dt, sx), b = w.dl();
    EXPECT_TRUE(rejected(ks_gemv(&o, &a, &b, KS_BACKEND_AUTO, nullptr), KS_ERROR_INVALID_ARGUMENT, {"out", "x"}, all,
                         before));
  }
  // out partially over x (both ends).
  for (int64_t off : std::vector<int64_t>{1, -1, H - 1, -(N - 1)}) {
    DLTensor o = make_dl(base + off * es, dt, so), a = make_dl(base, dt, sx), b = w.dl();
    EXPECT_TRUE(rejected(ks_gemv(&o, &a, &b, KS_BACKEND_AUTO, nullptr), KS_ERROR_INVALID_ARGUMENT, {"out", "x"}, all,
                         before))
        << "off " << off;
  }
  // out inside weight, at its start, straddling its start or end.
  for (int64_t off : std::vector<int64_t>{0, H, 1, N * H - 1, -(N - 1)}) {
    DLTensor o = make_dl(base + off * es, dt, so), a = x.dl(), b = make_dl(base, dt, sw);
    EXPECT_TRUE(rejected(ks_gemv(&o, &a, &b, KS_BACKEND_AUTO, nullptr), KS_ERROR_INVALID_ARGUMENT,
                         {"out", "weight"}, all, before))
        << "off " << off;
  }
  // Adjacent on both sides: accepted.
  for (int64_t off : std::vector<int64_t>{-N, N * H}) {
    Buf wcopy(dt, {N, H});
    std::memcpy(wcopy.data(), base, wcopy.nbytes());
    DLTensor o = make_dl(base + off * es, dt, so), a = x.dl(), b = make_dl(base, dt, sw);
    ASSERT_TRUE(ok(ks_gemv(&o, &a, &b, KS_BACKEND_AUTO, nullptr)));
    Buf got(dt, {N});
    std::memcpy(got.data(), base + off * es, got.nbytes());
    EXPECT_TRUE(close(got, gemv_ref(x, wcopy), dt));
    EXPECT_EQ(0, std::memcmp(wcopy.data(), base, wcopy.nbytes()));
  }
}

// ------------------------------------------------------------ batch invariance --

TEST_P(Gemv, RowAloneEqualsRowInBatchBitwise) {
  const DType dt = GetParam();
  for (int64_t H : {7, 4097}) {
    const int64_t N = 257;
    Buf x(dt, {H}), w(dt, {N, H}), out(dt, {N});
    fill_normal(x);
    fill_normal(w);
    out.poison();
    ASSERT_TRUE(ok(run(out, x, w)));
    const size_t es = ks::dtype_size(dt);
    for (int64_t n : {int64_t(0), int64_t(1), int64_t(128), int64_t(256)}) {
      Buf w1(dt, {1, H}), o1(dt, {1});
      std::memcpy(w1.data(), static_cast<char*>(w.data()) + n * H * es, w1.nbytes());
      o1.poison();
      ASSERT_TRUE(ok(run(o1, x, w1)));
      EXPECT_EQ(0, std::memcmp(o1.data(), static_cast<char*>(out.data()) + n * es, es)) << "H=" << H << " n=" << n;
    }
  }
}

// ---------------------------------------------------------- 64-bit indexing --

// weight with N * H > 2^31 elements (4.3 GB of fp16), at almost no memory cost:
// an anonymous private mapping reads as zeros and, while untouched, is backed by the
// shared zero page. Only the rows around the element-2^31 boundary and the last rows
// hold random data (a few KiB resident). A 32-bit row * H + h wraps at those rows and
// would read other rows' (zero or random) data instead.
TEST(GemvLargeIndex, WeightBeyond2Pow31Elements) {
  const DType dt = DType::F16;
  const int64_t H = 4099;                      // odd, so a row straddles element 2^31
  const int64_t lim = int64_t(1) << 31;
  const int64_t N = lim / H + 4;               // N * H = 2^31 + ~12k
  ASSERT_GT(N * H, lim);
  const size_t bytes = size_t(N * H) * 2;
  void* map = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (map == MAP_FAILED) GTEST_SKIP() << "cannot reserve " << bytes << " bytes of address space";
  madvise(map, bytes, MADV_HUGEPAGE);  // read faults may then map the huge zero page
  auto* wp = static_cast<uint16_t*>(map);
  Buf x(dt, {H});
  fill_normal(x);
  const int64_t straddle = lim / H;  // rows [straddle-1, straddle+1] and the last 3
  std::vector<int64_t> hot{0, straddle - 1, straddle, straddle + 1, N - 3, N - 2, N - 1};
  std::normal_distribution<double> nd(0, 1);
  for (int64_t r : hot)
    for (int64_t h = 0; h < H; ++h) wp[r * H + h] = ks::float_to_half(float(nd(kstest::rng())));
  Buf out(dt, {N});
  out.poison();
  std::vector<int64_t> sw{N, H};
  DLTensor o = out.dl(), a = x.dl(), b = make_dl(map, dt, sw);
  const ks_status_t st = ks_gemv(&o, &a, &b, KS_BACKEND_AUTO, nullptr);
  EXPECT_TRUE(ok(st));
  if (st == KS_SUCCESS) {
    EXPECT_TRUE(out.guards_intact());
    std::vector<double> xv = x.values();
    for (int64_t r : hot) {
      double s = 0, a2 = 0;
      for (int64_t h = 0; h < H; ++h) {
        const double p = double(ks::half_to_float(wp[r * H + h])) * xv[h];
        s += p;
        a2 += std::fabs(p);
      }
      const double bound = tol(dt) + tol(dt) * std::fabs(s) + 8 * std::sqrt(double(H)) * kU32 * a2;
      EXPECT_NEAR(out.get(r), s, bound) << "row " << r << " (element offset " << r * H << ")";
    }
    // Every other row is all zeros: exactly 0.
    int64_t bad = 0;
    for (int64_t r = 0; r < N; ++r) {
      if (std::find(hot.begin(), hot.end(), r) != hot.end()) continue;
      if (out.get(r) != 0.0) ++bad;
    }
    EXPECT_EQ(bad, 0) << "zero rows with a nonzero result";
  }
  munmap(map, bytes);
}

// -------------------------------------------------------------- validation --

struct Call : XWeightOutCall {
  explicit Call(DType dt, int64_t N = 5, int64_t H = 24) : XWeightOutCall(dt, {H}, {N, H}, {N}) {}
  ks_status_t call() { return ks_gemv(pout, px, pw, be, nullptr); }
};

const ExpectReject<Call> expect_reject{rejected};

TEST_P(Gemv, ValidCallBaseline) {
  Call c(GetParam());
  EXPECT_TRUE(ok(c.call()));
}

TEST_P(Gemv, RejectsEmptyX) {
  const DType dt = GetParam();
  Buf x(dt, {0}), w(dt, {3, 0}), out(dt, {3});
  out.poison();
  auto before = snap({&x, &w, &out});
  EXPECT_TRUE(rejected(run(out, x, w), KS_ERROR_INVALID_ARGUMENT, {"x"}, {&x, &w, &out}, before));
}

TEST_P(Gemv, RejectsWrongRanksAndShapes) {
  const DType dt = GetParam();
  // x must be 1-D: no leading dims, not 0-d.
  expect_reject(dt, [](Call& c) { set_shape(c.tx, c, {1, 24}); }, KS_ERROR_INVALID_ARGUMENT, {"x"});
  expect_reject(dt, [](Call& c) { set_shape(c.tx, c, {2, 12}); }, KS_ERROR_INVALID_ARGUMENT, {"x"});
  expect_reject(dt, [](Call& c) { set_shape(c.tx, c, {}); }, KS_ERROR_INVALID_ARGUMENT, {"x"});
  // weight must be 2-D [N, H].
  expect_reject(dt, [](Call& c) { set_shape(c.tw, c, {120}); }, KS_ERROR_INVALID_ARGUMENT, {"weight"});
  expect_reject(dt, [](Call& c) { set_shape(c.tw, c, {1, 5, 24}); }, KS_ERROR_INVALID_ARGUMENT, {"weight"});
  expect_reject(dt, [](Call& c) { set_shape(c.tw, c, {4, 23}); }, KS_ERROR_INVALID_ARGUMENT, {"weight"});
  expect_reject(dt, [](Call& c) { set_shape(c.tw, c, {24, 5}); }, KS_ERROR_INVALID_ARGUMENT, {"weight"});
  // out must be [N].
  expect_reject(dt, [](Call& c) { set_shape(c.tout, c, {4}); }, KS_ERROR_INVALID_ARGUMENT, {"out"});
  expect_reject(dt, [](Call& c) { set_shape(c.tout, c, {5, 1}); }, KS_ERROR_INVALID_ARGUMENT, {"out"});
  expect_reject(dt, [](Call& c) { set_shape(c.tout, c, {1, 5}); }, KS_ERROR_INVALID_ARGUMENT, {"out"});
  expect_reject(dt, [](Call& c) { set_shape(c.tout, c, {}); }, KS_ERROR_INVALID_ARGUMENT, {"out"});
  expect_reject(dt, [](Call& c) { set_shape(c.tout, c, {24}); }, KS_ERROR_INVALID_ARGUMENT, {"out"});
  // Negative dim and element-count overflow.
  expect_reject(dt, [](Call& c) { set_shape(c.tw, c, {-5, 24}); }, KS_ERROR_INVALID_ARGUMENT, {"weight"});
  expect_reject(dt, [](Call& c) { set_shape(c.tw, c, {int64_t(1) << 60, 24}); }, KS_ERROR_INVALID_ARGUMENT,
                {"weight"});
}

TEST_P(Gemv, RejectsNonContiguousStrides) {
  const DType dt = GetParam();
  expect_reject(dt, [](Call& c) { c.tw.strides = c.vec({48, 1}); }, KS_ERROR_INVALID_ARGUMENT, {"weight"});
  expect_reject(dt, [](Call& c) { c.tw.strides = c.vec({1, 5}); }, KS_ERROR_INVALID_ARGUMENT, {"weight"});
  expect_reject(dt, [](Call& c) { c.tx.strides = c.vec({2}); }, KS_ERROR_INVALID_ARGUMENT, {"x"});
  expect_reject(dt, [](Call& c) { c.tout.strides = c.vec({3}); }, KS_ERROR_INVALID_ARGUMENT, {"out"});
  expect_reject(dt, [](Call& c) { c.tx.strides = c.vec({0}); }, KS_ERROR_INVALID_ARGUMENT, {"x"});
}

TEST_P(Gemv, AcceptsCompactExplicitStrides) {
  const DType dt = GetParam();
  Call c(dt);
  c.tw.strides = c.vec({24, 1});
  c.tx.strides = c.vec({1});
  c.tout.strides = c.vec({1});
  ASSERT_TRUE(ok(c.call()));
  EXPECT_TRUE(close(c.out, gemv_ref(c.x, c.w), dt));
}

TEST_P(Gemv, RejectsDtypeMismatchOfEachArgument) {
  const DType dt = GetParam();
  const DLDataType other = ks::to_dl(other_float(dt));
  expect_reject(dt, [&](Call& c) { c.tw.dtype = other; }, KS_ERROR_UNSUPPORTED_DTYPE, {"weight"});
  expect_reject(dt, [&](Call& c) { c.tout.dtype = other; }, KS_ERROR_UNSUPPORTED_DTYPE, {"out"});
  expect_reject(dt, [&](Call& c) { c.tx.dtype = other; }, KS_ERROR_UNSUPPORTED_DTYPE, {"x"});
}

TEST_P(Gemv, RejectsUnsupportedDtypes) {
  const DType dt = GetParam();
  const DLDataType i32{kDLInt, 32, 1}, f64{kDLFloat, 64, 1}, u8{kDLUInt, 8, 1};
  expect_reject(dt, [&](Call& c) { c.tx.dtype = c.tw.dtype = c.tout.dtype = i32; }, KS_ERROR_UNSUPPORTED_DTYPE, {"x"});
  expect_reject(dt, [&](Call& c) { c.tx.dtype = c.tw.dtype = c.tout.dtype = f64; }, KS_ERROR_UNSUPPORTED_DTYPE, {"x"});
  // A packed uint8 weight is quant_matmul's business, not gemv's.
  expect_reject(dt, [&](Call& c) { c.tw.dtype = u8; }, KS_ERROR_UNSUPPORTED_DTYPE, {"weight"});
  expect_reject(dt, [&](Call& c) { c.tout.dtype = f64; }, KS_ERROR_UNSUPPORTED_DTYPE, {"out"});
}

TEST_P(Gemv, RejectsDeviceMismatchAndBadBackend) {
  const DType dt = GetParam();
  expect_reject(dt, [](Call& c) { c.tw.device = {kDLCUDA, 0}; }, KS_ERROR_UNSUPPORTED_DEVICE, {"weight"});
  expect_reject(dt, [](Call& c) { c.tout.device = {kDLCUDA, 0}; }, KS_ERROR_UNSUPPORTED_DEVICE, {"out"});
  expect_reject(dt, [](Call& c) { c.tx.device = {kDLCUDA, 0}; }, KS_ERROR_UNSUPPORTED_DEVICE, {"x"});
  // CUDA backend with host tensors: UNSUPPORTED_DEVICE (device checked before availability).
  expect_reject(dt, [](Call& c) { c.be = KS_BACKEND_CUDA; }, KS_ERROR_UNSUPPORTED_DEVICE, {"backend"});
  expect_reject(dt, [](Call& c) { c.be = static_cast<ks_backend_t>(3); }, KS_ERROR_INVALID_ARGUMENT, {"backend"});
  expect_reject(dt, [](Call& c) {
    c.be = KS_BACKEND_CPU;
    c.tx.device = c.tw.device = c.tout.device = {kDLCUDA, 0};
  }, KS_ERROR_UNSUPPORTED_DEVICE, {"backend"});
  if (ks_backend_available(KS_BACKEND_CUDA)) GTEST_SKIP() << "CUDA available: not faking device pointers";
  expect_reject(dt, [](Call& c) { c.tx.device = c.tw.device = c.tout.device = {kDLCUDA, 0}; },
                KS_ERROR_BACKEND_UNAVAILABLE, {});
}

TEST_P(Gemv, RejectsNullTensorsAndData) {
  const DType dt = GetParam();
  expect_reject(dt, [](Call& c) { c.px = nullptr; }, KS_ERROR_INVALID_ARGUMENT, {"x"});
  expect_reject(dt, [](Call& c) { c.pw = nullptr; }, KS_ERROR_INVALID_ARGUMENT, {"weight"});
  expect_reject(dt, [](Call& c) { c.pout = nullptr; }, KS_ERROR_INVALID_ARGUMENT, {"out"});
  expect_reject(dt, [](Call& c) { c.tw.data = nullptr; }, KS_ERROR_INVALID_ARGUMENT, {"weight"});
  expect_reject(dt, [](Call& c) { c.tx.data = nullptr; }, KS_ERROR_INVALID_ARGUMENT, {"x"});
  expect_reject(dt, [](Call& c) { c.tout.data = nullptr; }, KS_ERROR_INVALID_ARGUMENT, {"out"});
  expect_reject(dt, [](Call& c) { c.tw.shape = nullptr; }, KS_ERROR_INVALID_ARGUMENT, {"weight"});
}

INSTANTIATE_TEST_SUITE_P(AllDtypes, Gemv, ::testing::ValuesIn(kstest::float_dtypes()), dt_param_name);

}  // namespace
