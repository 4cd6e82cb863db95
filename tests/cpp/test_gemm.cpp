// ks_gemm: out[M, N] = a[M, K] @ b[N, K]^T with FP32 accumulation, against an FP64
// reference. Tolerance: the seed's per-dtype rtol/atol plus the larger of the allowance in
// docs/contracts.md for sums in an unspecified order, 8 sqrt(K) u sum_k |p_k|, and the
// first-order bound of a left-to-right FP32 sum, u (sum_k |p_k| + sum_k |s_k|) (p_k the
// products, s_k the running partial sums, u = 2^-24).
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

const char* kOp = "gemm";

ks_status_t run_gemm(Buf& out, Buf& a, Buf& b, ks_backend_t be = KS_BACKEND_AUTO) {
  DLTensor o = out.dl(), x = a.dl(), y = b.dl();
  return ks_gemm(&o, &x, &y, be, nullptr);
}

struct Ref {
  std::vector<double> val, bound;
};

// FP64 a @ b^T from the stored (already rounded) inputs, with the FP32 accumulation bound.
Ref reference(const Buf& a, const Buf& b, int64_t M, int64_t N, int64_t K) {
  const kstest::MatmulRef m = kstest::matmul_nt_ref(a.values(), b.values(), M, N, K);
  Ref r{m.val, m.mag};
  for (double& e : r.bound) e = kU32 * e;
  return r;
}

::testing::AssertionResult close(const Buf& out, const Ref& r) {
  const double t = kstest::tol(out.dtype);
  for (int64_t i = 0; i < out.numel(); ++i) {
    const double got = out.get(i), want = r.val[size_t(i)];
    const double lim = t + t * std::fabs(want) + (1 + t) * r.bound[size_t(i)];
    if (!(std::fabs(got - want) <= lim))
      return ::testing::AssertionFailure() << "element " << i << ": got " << got << ", want " << want << " (|diff| "
                                           << std::fabs(got - want) << " > " << lim << ", " << dt_name(out.dtype)
                                           << ")";
  }
  return ::testing::AssertionSuccess();
}

void check_case(DType dt, int64_t M, int64_t N, int64_t K, size_t off_o, size_t off_a, size_t off_b,
                double mean = 0.0) {
  Buf a(dt, {M, K}, off_a), b(dt, {N, K}, off_b), out(dt, {M, N}, off_o);
  kstest::fill_normal(a, 1.0, mean);
  kstest::fill_normal(b, 1.0, mean);
  out.poison();
  Snap in{&a, &b};
  KS_RUN_OR_SKIP(run_gemm(out, a, b));
  EXPECT_TRUE(close(out, reference(a, b, M, N, K))) << dt_name(dt) << " M " << M << " N " << N << " K " << K;
  EXPECT_TRUE(out.guards_intact()) << "wrote outside out";
  EXPECT_TRUE(in.same()) << "inputs modified";
}

TEST(Gemm, OddShapesAllDtypes) {
  const int64_t shapes[][3] = {{1, 1, 1},   {3, 5, 1},    {1, 7, 3},     {7, 13, 33},  {17, 9, 127},
                               {5, 3, 8},   {16, 16, 16}, {33, 17, 65},  {1, 31, 1536}, {2, 3, 4097},
                               {65, 1, 7},  {1, 129, 64}, {31, 33, 576}};
  FOR_EACH_VARIANT(kOp) {
    int idx = 0;
    for (DType dt : kFloatTypes())
      for (auto& s : shapes) {
        ++idx;
        check_case(dt, s[0], s[1], s[2], 0, 0, 0);
        check_case(dt, s[0], s[1], s[2], size_t(idx % 4 + 1), size_t(idx % 3 + 1), size_t(idx % 2 + 1));  // misaligned
      }
  }
}

TEST(Gemm, KOneIsOneRoundedProduct) {
  // With K = 1 each output is a single product: exactly round(a*b) for every dtype.
  FOR_EACH_VARIANT(kOp) {
    for (DType dt : kFloatTypes()) [&] {
      Buf a(dt, {9, 1}, 1), b(dt, {11, 1}, 3), out(dt, {9, 11}, 2);
      kstest::fill_normal(a, 3.0);
      kstest::fill_normal(b, 3.0);
      out.poison();
      KS_RUN_OR_SKIP(run_gemm(out, a, b));
      for (int64_t m = 0; m < 9; ++m)
        for (int64_t n = 0; n < 11; ++n)
          EXPECT_EQ(out.get(m * 11 + n), round_to(dt, a.get(m) * b.get(n))) << dt_name(dt) << " " << m << "," << n;
      EXPECT_TRUE(out.guards_intact());
    }();
  }
}

TEST(Gemm, NonZeroMeanLongK) {
  // Large positive sums: accumulation must be FP32 (an fp16 accumulator would lose or overflow).
  FOR_EACH_VARIANT(kOp) {
    for (DType dt : kFloatTypes()) check_case(dt, 3, 5, 1536, 1, 0, 2, 1.5);
  }
}

TEST(Gemm, Fp16OutputOverflowsToInf) {
  // 64 * 40 * 40 = 102400 > 65504: the FP32 sum is fine, the fp16 output is +inf.
  FOR_EACH_VARIANT(kOp)[&] {
    Buf a(DType::F16, {1, 64}), b(DType::F16, {2, 64}), out(DType::F16, {1, 2});
    for (int k = 0; k < 64; ++k) {
      a.set(k, 40.0);
      b.set(k, 40.0);
      b.set(64 + k, k % 2 ? 40.0 : -40.0);
    }
    out.poison();
    KS_RUN_OR_SKIP(run_gemm(out, a, b));
    EXPECT_EQ(out.get(0), INFINITY);
    EXPECT_EQ(out.get(1), 0.0);
  }();
}

TEST(Gemm, IntermediateSumsPastFp16Range) {
  // Partial sums reach 180000 (> 65504) but the result is 7: FP32 accumulation gives exactly
  // 7 in every dtype; an fp16 accumulator would give inf/NaN.
  FOR_EACH_VARIANT(kOp)
  for (DType dt : kFloatTypes()) [&] {
    Buf a(dt, {2, 5}, 1), b(dt, {1, 5}, 2), out(dt, {2, 1});
    const double av[] = {300, 300, -300, -300, 1}, bv[] = {300, 300, 300, 300, 7};
    for (int k = 0; k < 5; ++k) {
      a.set(k, av[k]);
      a.set(5 + k, -av[k]);
      b.set(k, bv[k]);
    }
    out.poison();
    KS_RUN_OR_SKIP(run_gemm(out, a, b));
    EXPECT_EQ(out.get(0), 7.0) << dt_name(dt);
    EXPECT_EQ(out.get(1), -7.0) << dt_name(dt);
  }();
}

TEST(Gemm, SameStorageForAAndB) {
  // a and b may be the same read-only tensor: out = a @ a^T (symmetric).
  FOR_EACH_VARIANT(kOp)
  for (DType dt : kFloatTypes()) [&] {
    Buf a(dt, {7, 19}, 1), out(dt, {7, 7});
    kstest::fill_normal(a);
    out.poison();
    DLTensor o = out.dl(), x = a.dl(), y = a.dl();
    KS_RUN_OR_SKIP(ks_gemm(&o, &x, &y, KS_BACKEND_AUTO, nullptr));
    EXPECT_TRUE(close(out, reference(a, a, 7, 7, 19)));
    for (int i = 0; i < 7; ++i)
      for (int j = 0; j < 7; ++j) EXPECT_EQ(out.get(i * 7 + j), out.get(j * 7 + i));
  }();
}

TEST(Gemm, ZeroMOrNIsANoOp) {
  for (DType dt : kFloatTypes()) {
    {
      Buf a(dt, {0, 5}), b(dt, {3, 5}), out(dt, {0, 3});
      kstest::fill_normal(b);
      Snap s{&a, &b, &out};
      EXPECT_EQ(run_gemm(out, a, b), KS_SUCCESS) << ks_last_error();
      EXPECT_TRUE(s.same());
    }
    {
      Buf a(dt, {4, 5}), b(dt, {0, 5}), out(dt, {4, 0});
      kstest::fill_normal(a);
      Snap s{&a, &b, &out};
      EXPECT_EQ(run_gemm(out, a, b), KS_SUCCESS) << ks_last_error();
      EXPECT_TRUE(s.same());
    }
    {  // empty tensors may have NULL data
      Buf a(dt, {0, 5}), b(dt, {0, 5}), out(dt, {0, 0});
      DLTensor o = out.dl(), x = a.dl(), y = b.dl();
      o.data = x.data = y.data = nullptr;
      EXPECT_EQ(ks_gemm(&o, &x, &y, KS_BACKEND_AUTO, nullptr), KS_SUCCESS) << ks_last_error();
    }
    {  // M = 0 still validates: K mismatch is rejected
      Buf a(dt, {0, 5}), b(dt, {3, 6}), out(dt, {0, 3});
      Snap s{&a, &b, &out};
      EXPECT_TRUE(fails_cleanly(run_gemm(out, a, b), KS_ERROR_INVALID_ARGUMENT, kOp, "b", s));
    }
    {  // N = 0 still validates: out shape is checked
      Buf a(dt, {4, 5}), b(dt, {0, 5}), out(dt, {0, 4});
      Snap s{&a, &b, &out};
      EXPECT_TRUE(fails_cleanly(run_gemm(out, a, b), KS_ERROR_INVALID_ARGUMENT, kOp, "out", s));
    }
  }
}

TEST(Gemm, ZeroKIsRejected) {
  // K > 0 (an empty feature dimension is rejected), nothing written.
  Buf a(DType::F32, {2, 0}), b(DType::F32, {3, 0}), out(DType::F32, {2, 3});
  out.poison();
  Snap s{&out, &a, &b};
  EXPECT_TRUE(fails_cleanly(run_gemm(out, a, b), KS_ERROR_INVALID_ARGUMENT, kOp, "a", s));
}

void batch_invariance_case(DType dt) {
  // Row m of an M-row call equals the 1-row call on a[m], bit for bit (contract: a row's
  // result does not depend on the number of rows in the call).
  const int64_t M = 37, N = 19, K = 300;
  Buf a(dt, {M, K}), b(dt, {N, K}), out(dt, {M, N});
  kstest::fill_normal(a);
  kstest::fill_normal(b);
  out.poison();
  KS_RUN_OR_SKIP(run_gemm(out, a, b));
  const size_t es = ks::dtype_size(dt);
  for (int64_t m : {int64_t(0), int64_t(17), M - 1}) {
    Buf a1(dt, {1, K}, 3), o1(dt, {1, N}, 1);
    std::memcpy(a1.data(), static_cast<uint8_t*>(a.data()) + size_t(m * K) * es, size_t(K) * es);
    o1.poison();
    KS_RUN_OR_SKIP(run_gemm(o1, a1, b));
    EXPECT_EQ(0, std::memcmp(o1.data(), static_cast<uint8_t*>(out.data()) + size_t(m * N) * es, size_t(N) * es))
        << dt_name(dt) << " row " << m;
  }
}

TEST(Gemm, RowsAreIndependentOfBatch) {
  FOR_EACH_VARIANT(kOp) {
    for (DType dt : kFloatTypes()) batch_invariance_case(dt);
  }
}

TEST(Gemm, CommonTensorRules) {
  for (DType dt : kFloatTypes()) {
    Buf a(dt, {3, 5}), b(dt, {4, 5}), out(dt, {3, 4});
    kstest::fill_normal(a);
    kstest::fill_normal(b);
    out.poison();
    check_common_rules(kOp,
                       {{"out", &out, false, {other_float(dt), kI32}},
                        {"a", &a, false, {kI32, kU8}},
                        {"b", &b, false, {other_float(dt), kI32}}},
                       [&](std::vector<DLTensor*>& t, ks_backend_t be) { return ks_gemm(t[0], t[1], t[2], be, nullptr); });
  }
}

TEST(Gemm, RejectsBadShapes) {
  const ks_status_t INV = KS_ERROR_INVALID_ARGUMENT;
  auto expect = [&](Buf&& out, Buf&& a, Buf&& b, const char* arg, const char* what) {
    kstest::fill_normal(a);
    kstest::fill_normal(b);
    out.poison();
    Snap s{&out, &a, &b};
    EXPECT_TRUE(fails_cleanly(run_gemm(out, a, b), INV, kOp, arg, s)) << what;
  };
  const DType f = DType::F32;
  expect(Buf(f, {3, 4}), Buf(f, {3, 5}), Buf(f, {4, 6}), "b", "K 5 vs 6");
  expect(Buf(f, {4, 3}), Buf(f, {3, 5}), Buf(f, {4, 5}), "out", "out transposed");
  expect(Buf(f, {3, 5}), Buf(f, {3, 5}), Buf(f, {4, 5}), "out", "out N wrong");
  expect(Buf(f, {12}), Buf(f, {3, 5}), Buf(f, {4, 5}), "out", "out 1-D");
  expect(Buf(f, {1, 3, 4}), Buf(f, {3, 5}), Buf(f, {4, 5}), "out", "out 3-D");
  // (a [..., K] is taken, out [..., N]: test_linear_leading_dims.cpp; a 0-d a is not, nor out of
  // the 2-D reshape's shape for a 3-D a)
  expect(Buf(f, {4}), Buf(f, {}), Buf(f, {4, 5}), "a", "a 0-d");
  expect(Buf(f, {3, 4}), Buf(f, {1, 3, 5}), Buf(f, {4, 5}), "out", "a 3-D, out the reshape's [3, 4]");
  expect(Buf(f, {3, 4}), Buf(f, {3, 5}), Buf(f, {20}), "b", "b 1-D");
  expect(Buf(f, {3, 4}), Buf(f, {3, 5}), Buf(f, {1, 4, 5}), "b", "b 3-D");
}

TEST(Gemm, RejectsMixedDtypes) {
  for (DType x : kFloatTypes())
    for (DType y : kFloatTypes())
      for (DType z : kFloatTypes()) {
        if (x == y && y == z) continue;
        Buf a(x, {2, 3}), b(y, {2, 3}), out(z, {2, 2});
        kstest::fill_normal(a);
        kstest::fill_normal(b);
        out.poison();
        Snap s{&out, &a, &b};
        EXPECT_TRUE(fails_cleanly(run_gemm(out, a, b), KS_ERROR_UNSUPPORTED_DTYPE, kOp, x != y ? "b" : "out", s))
            << dt_name(x) << "/" << dt_name(y) << "/" << dt_name(z);
      }
}

TEST(Gemm, RejectsOverlap) {
  // out's storage inside a, inside b, and straddling the end of a.
  Buf store(DType::F32, {200});
  kstest::fill_normal(store);
  float* base = static_cast<float*>(store.data());
  int64_t as[2] = {4, 8}, bs[2] = {5, 8}, os[2] = {4, 5};
  auto mk = [&](float* p, int64_t* s) {
    DLTensor t = store.dl();
    t.ndim = 2;
    t.shape = s;
    t.data = p;
    return t;
  };
  for (auto [ooff, arg] : {std::pair{0, "out|a"}, {10, "out|a"}, {30, "out|a"}, {40, "out|b"}, {70, "out|b"}}) {
    DLTensor a = mk(base, as), b = mk(base + 32, bs), o = mk(base + ooff, os);
    Snap s{&store};
    EXPECT_TRUE(fails_cleanly(ks_gemm(&o, &a, &b, KS_BACKEND_AUTO, nullptr), KS_ERROR_INVALID_ARGUMENT, kOp, arg, s))
        << "out at +" << ooff;
  }
  DLTensor a = mk(base, as), b = mk(base + 32, bs), o = mk(base + 72, os);  // right after b: fine
  EXPECT_EQ(ks_gemm(&o, &a, &b, KS_BACKEND_AUTO, nullptr), KS_SUCCESS) << ks_last_error();
}

// A big-enough call for threaded/blocked paths must agree with the reference too.
TEST(Gemm, LargerProblem) {
  FOR_EACH_VARIANT(kOp) {
    for (DType dt : kFloatTypes()) check_case(dt, 67, 45, 515, 2, 1, 3);
  }
}

}  // namespace
