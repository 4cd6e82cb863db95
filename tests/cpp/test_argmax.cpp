// ks_argmax: out[...] = first index of the maximum of x[..., :] (int64). Ties -> lowest index;
// a row holding NaN -> index of its first NaN (torch.argmax); -inf rows -> 0.
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
#include <thread>
#include <vector>

#include "validation_harness.hpp"

namespace {

using namespace kstest::harness;

const char* kOp = "argmax";

ks_status_t run_argmax(Buf& out, Buf& x, ks_backend_t be = KS_BACKEND_AUTO) {
  DLTensor o = out.dl(), a = x.dl();
  return ks_argmax(&o, &a, be, nullptr);
}

// Reference on the stored values (as doubles: exact for every float dtype).
int64_t ref_argmax(const Buf& x, int64_t r, int64_t V) {
  int64_t best = 0;
  double bv = x.get(r * V);
  for (int64_t i = 0; i < V; ++i) {
    const double v = x.get(r * V + i);
    if (std::isnan(v)) return i;
    if (v > bv) bv = v, best = i;
  }
  return best;
}

void check_rows_one(Buf& x, size_t off_out, const std::string& what) {
  const int64_t rows = x.shape[0], V = x.shape[1];
  Buf out(DType::I64, {rows}, off_out);
  out.poison();
  Snap in{&x};
  KS_RUN_OR_SKIP(run_argmax(out, x));
  for (int64_t r = 0; r < rows; ++r)
    EXPECT_EQ(get_i(out, r), ref_argmax(x, r, V)) << what << " row " << r << " (" << dt_name(x.dtype) << ")";
  EXPECT_TRUE(out.guards_intact()) << what;
  EXPECT_TRUE(in.same()) << "x modified: " << what;
}

// Under each CPU variant (automatic choice first).
void check_rows(Buf& x, size_t off_out, const std::string& what) {
  FOR_EACH_VARIANT(kOp) check_rows_one(x, off_out, what);
}

// Build a [rows, V] tensor from explicit rows (values set with rounding to the dtype).
Buf rows_of(DType dt, const std::vector<std::vector<double>>& rows, size_t off = 0) {
  const int64_t V = int64_t(rows[0].size());
  Buf x(dt, {int64_t(rows.size()), V}, off);
  for (size_t r = 0; r < rows.size(); ++r)
    for (int64_t i = 0; i < V; ++i) x.set(int64_t(r) * V + i, rows[r][size_t(i)]);
  return x;
}

const double kInf = std::numeric_limits<double>::infinity();
const double kNaN = std::numeric_limits<double>::quiet_NaN();

void expect_rows_one(DType dt, const std::vector<std::vector<double>>& rows, const std::vector<int64_t>& want,
                     const std::string& what) {
  Buf x = rows_of(dt, rows, 1);
  Buf out(DType::I64, {int64_t(rows.size())}, 3);
  out.poison();
  KS_RUN_OR_SKIP(run_argmax(out, x));
  for (size_t r = 0; r < rows.size(); ++r)
    EXPECT_EQ(get_i(out, int64_t(r)), want[r]) << what << " row " << r << " (" << dt_name(dt) << ")";
  EXPECT_TRUE(out.guards_intact());
}

void expect_rows(DType dt, const std::vector<std::vector<double>>& rows, const std::vector<int64_t>& want,
                 const std::string& what) {
  FOR_EACH_VARIANT(kOp) expect_rows_one(dt, rows, want, what);
}

TEST(Argmax, RandomRows) {
  for (DType dt : kFloatTypes())
    for (int64_t V : {1, 2, 3, 31, 32, 33, 255, 1000, 4097}) {
      Buf x(dt, {7, V}, size_t(V % 3));
      kstest::fill_normal(x, 3.0);
      check_rows(x, size_t(V % 5), "V " + std::to_string(V));
    }
}

TEST(Argmax, TiesTakeTheLowestIndex) {
  for (DType dt : kFloatTypes()) {
    expect_rows(dt,
                {{1, 5, 2, 5, 5},
                 {5, 5, 5, 5, 5},
                 {-3, -1, -2, -1, -7},
                 {0, 0, 0, 0, 0},
                 {-0.0, 0.0, -0.0, 0.0, -1},  // -0 == +0: a tie
                 {0.0, -0.0, 0.0, -0.0, -1},
                 {1, 2, 3, 4, 4}},
                {1, 0, 1, 0, 0, 0, 3}, "ties");
    // Values that only tie after rounding to the dtype (fp16 / bf16 ulp at 1000).
    Buf x(dt, {1, 4});
    x.set(0, 999.0);
    x.set(1, 1000.2);
    x.set(2, 1000.0);
    x.set(3, 1000.4);
    check_rows(x, 0, "rounding ties");
  }
}

TEST(Argmax, NaNRowGivesFirstNaN) {
  for (DType dt : kFloatTypes()) {
    expect_rows(dt,
                {{1, kNaN, 5, kNaN},
                 {kNaN, 1, 2, 3},
                 {1, 2, 3, kNaN},
                 {kInf, kNaN, kInf, 0},
                 {9, 8, kNaN, kNaN},
                 {-kInf, -kInf, -kInf, kNaN},
                 {kNaN, kNaN, kNaN, kNaN}},
                {1, 0, 3, 1, 2, 3, 0}, "NaN");
    // A negative NaN (sign bit set) and a NaN with a payload are NaNs too.
    Buf x(dt, {2, 3});
    fill_bytes(x);
    for (int i = 0; i < 6; ++i) x.set(i, double(i));
    auto* p = static_cast<uint8_t*>(x.data());
    const size_t es = ks::dtype_size(dt);
    if (dt == DType::F32) {
      const uint32_t nneg = 0xFFC00001u, snan = 0x7F800001u;
      std::memcpy(p + 1 * es, &nneg, 4);
      std::memcpy(p + 5 * es, &snan, 4);
    } else if (dt == DType::F16) {
      const uint16_t nneg = 0xFE01, snan = 0x7C01;
      std::memcpy(p + 1 * es, &nneg, 2);
      std::memcpy(p + 5 * es, &snan, 2);
    } else {
      const uint16_t nneg = 0xFFC1, snan = 0x7F81;
      std::memcpy(p + 1 * es, &nneg, 2);
      std::memcpy(p + 5 * es, &snan, 2);
    }
    Buf out(DType::I64, {2});
    out.poison();
    ASSERT_EQ(run_argmax(out, x), KS_SUCCESS) << ks_last_error();
    EXPECT_EQ(get_i(out, 0), 1) << dt_name(dt) << " negative NaN";
    EXPECT_EQ(get_i(out, 1), 2) << dt_name(dt) << " signaling NaN";
  }
}

TEST(Argmax, InfinitiesAndExtremes) {
  for (DType dt : kFloatTypes()) {
    expect_rows(dt,
                {{-kInf, -kInf, -kInf, -kInf},
                 {-kInf, -kInf, -5, -kInf},
                 {1, kInf, kInf, 2},
                 {kInf, 1, 2, kInf},
                 {-kInf, -60000, -60000, -kInf}},
                {0, 2, 1, 0, 1}, "inf");
  }
  // Largest finite vs. infinity, subnormals.
  Buf h(DType::F16, {1, 3});
  h.set(0, 65504.0);
  h.set(1, kInf);
  h.set(2, 65504.0);
  check_rows(h, 0, "fp16 max vs inf");
  Buf s(DType::F32, {1, 4});
  s.set(0, 1e-45);
  s.set(1, 3e-45);
  s.set(2, 0.0);
  s.set(3, -1e-45);
  check_rows(s, 0, "fp32 subnormals");
  EXPECT_EQ(ref_argmax(s, 0, 4), 1);
}

TEST(Argmax, VocabWideRow128256) {
  const int64_t V = 128256;
  for (DType dt : kFloatTypes()) {
    Buf x(dt, {4, V}, 2);
    kstest::fill_uniform(x, -8.0, 8.0);
    // Row 0: unique max at the very end. Row 1: unique max at V/2 + 1. Row 2: equal maxima at
    // 70001 and 128255 (lowest wins). Row 3: the max at 0 and again at V-1.
    x.set(0 * V + V - 1, 100.0);
    x.set(1 * V + V / 2 + 1, 100.0);
    x.set(2 * V + 70001, 100.0);
    x.set(2 * V + V - 1, 100.0);
    x.set(3 * V + 0, 100.0);
    x.set(3 * V + V - 1, 100.0);
    Buf out(DType::I64, {4}, 1);
    out.poison();
    ASSERT_EQ(run_argmax(out, x), KS_SUCCESS) << ks_last_error();
    EXPECT_EQ(get_i(out, 0), V - 1) << dt_name(dt);
    EXPECT_EQ(get_i(out, 1), V / 2 + 1) << dt_name(dt);
    EXPECT_EQ(get_i(out, 2), 70001) << dt_name(dt);
    EXPECT_EQ(get_i(out, 3), 0) << dt_name(dt);
    EXPECT_TRUE(out.guards_intact());
    // Without planted values: many near-ties among random fp16/bf16 values; a NaN far out.
    Buf y(dt, {2, V});
    kstest::fill_normal(y, 2.0);
    y.set(1 * V + 120000, kNaN);
    check_rows(y, 0, "wide random");
  }
}

// A 1-d x [V] is one row with a 0-d out (as torch.argmax of a 1-d tensor), under every variant.
TEST(Argmax, OneDimensionalXGivesA0dIndex) {
  for (DType dt : kFloatTypes())
    for (int64_t V : {1, 33, 4097, 128256}) {
      Buf x(dt, {V}, size_t(V % 3));
      kstest::fill_normal(x, 3.0);
      if (V > 40) x.set(V - 7, 1e4), x.set(V / 2, 1e4);  // a tie: the lower index wins
      FOR_EACH_VARIANT(kOp) {
        Buf out(DType::I64, {}, 1);
        out.poison();
        Snap in{&x};
        KS_RUN_OR_SKIP(run_argmax(out, x));
        EXPECT_EQ(get_i(out, 0), ref_argmax(x, 0, V)) << "V " << V << " (" << dt_name(dt) << ")";
        if (V > 40) EXPECT_EQ(get_i(out, 0), V / 2);
        EXPECT_TRUE(out.guards_intact());
        EXPECT_TRUE(in.same());
      }
    }
}

// Leading dims: x [..., V] gives out [...] (torch.argmax(x, dim=-1)), each row as in the 2-D
// reshape, under every variant; a zero leading dim is a no-op.
TEST(Argmax, LeadingDimsGiveOneIndexPerRow) {
  for (DType dt : kFloatTypes()) {
    Buf x(dt, {2, 3, 5, 41}, 2);
    kstest::fill_normal(x, 3.0);
    x.set((1 * 15 + 2 * 5 + 4) * 41 + 9, 1e4), x.set((1 * 15 + 2 * 5 + 4) * 41 + 30, 1e4);  // a tie in row 29
    FOR_EACH_VARIANT(kOp) {
      Buf out(DType::I64, {2, 3, 5}, 1);
      out.poison();
      Snap in{&x};
      KS_RUN_OR_SKIP(run_argmax(out, x));
      for (int64_t r = 0; r < 30; ++r) EXPECT_EQ(get_i(out, r), ref_argmax(x, r, 41)) << "row " << r << " (" << dt_name(dt) << ")";
      EXPECT_EQ(get_i(out, 29), 9);
      EXPECT_TRUE(out.guards_intact());
      EXPECT_TRUE(in.same());
    }
    Buf empty(dt, {4, 0, 7}), out0(DType::I64, {4, 0});
    EXPECT_EQ(run_argmax(out0, empty), KS_SUCCESS) << ks_last_error();
  }
}

TEST(Argmax, ManyRows) {
  for (DType dt : kFloatTypes()) {
    Buf x(dt, {300, 513}, 1);
    kstest::fill_normal(x);
    check_rows(x, 1, "300 rows");
  }
}

TEST(Argmax, ZeroRowsIsANoOp) {
  for (DType dt : kFloatTypes()) {
    Buf x(dt, {0, 8}), out(DType::I64, {0});
    Snap s{&x, &out};
    EXPECT_EQ(run_argmax(out, x), KS_SUCCESS) << ks_last_error();
    EXPECT_TRUE(s.same());
    DLTensor o = out.dl(), a = x.dl();
    o.data = a.data = nullptr;
    EXPECT_EQ(ks_argmax(&o, &a, KS_BACKEND_AUTO, nullptr), KS_SUCCESS) << ks_last_error();
    // Zero rows still validate: int32 out is rejected.
    Buf o32(DType::I32, {0});
    EXPECT_TRUE(fails_cleanly(run_argmax(o32, x), KS_ERROR_UNSUPPORTED_DTYPE, kOp, "out", s));
  }
}

TEST(Argmax, CommonTensorRules) {
  for (DType dt : kFloatTypes()) {
    Buf x(dt, {3, 17}), out(DType::I64, {3});
    kstest::fill_normal(x);
    out.poison();
    check_common_rules(kOp,
                       {{"out", &out, false, {kI32, kF32, DLDataType{kDLUInt, 64, 1}, kF16}},
                        {"x", &x, false, {kI32, kU8, kI64, kI16}}},
                       [&](std::vector<DLTensor*>& t, ks_backend_t be) { return ks_argmax(t[0], t[1], be, nullptr); });
  }
}

TEST(Argmax, RejectsBadShapes) {
  const ks_status_t INV = KS_ERROR_INVALID_ARGUMENT;
  auto expect = [&](Buf&& out, Buf&& x, const char* arg, const char* what) {
    kstest::fill_normal(x);
    out.poison();
    Snap s{&out, &x};
    EXPECT_TRUE(fails_cleanly(run_argmax(out, x), INV, kOp, arg, s)) << what;
  };
  expect(Buf(DType::I64, {1}), Buf(DType::F32, {9}), "out", "x 1-D, out [1] (not 0-d)");
  expect(Buf(DType::I64, {}), Buf(DType::F32, {0}), "x", "x 1-D, V = 0");
  expect(Buf(DType::I64, {6}), Buf(DType::F32, {2, 3, 4}), "out", "x 3-D, out the rows' count (not [2, 3])");
  expect(Buf(DType::I64, {3, 2}), Buf(DType::F32, {2, 3, 4}), "out", "x 3-D, out's dims swapped");
  expect(Buf(DType::I64, {}), Buf(DType::F32, {}), "x", "x 0-d");
  expect(Buf(DType::I64, {3}), Buf(DType::F32, {3, 0}), "x", "V = 0");
  expect(Buf(DType::I64, {4}), Buf(DType::F32, {3, 5}), "out", "out too long");
  expect(Buf(DType::I64, {2}), Buf(DType::F32, {3, 5}), "out", "out too short");
  expect(Buf(DType::I64, {3, 1}), Buf(DType::F32, {3, 5}), "out", "out 2-D");
  expect(Buf(DType::I64, {}), Buf(DType::F32, {1, 5}), "out", "out 0-d");
}

TEST(Argmax, RejectsOverlap) {
  Buf store(DType::F32, {40});
  kstest::fill_normal(store);
  Dl x(store), o(store);
  x.set_shape({3, 8});
  o.set_shape({3});
  o.t.dtype = kI64;
  o.t.data = static_cast<float*>(store.data()) + 20;  // inside x (24 floats)
  Snap s{&store};
  EXPECT_TRUE(fails_cleanly(ks_argmax(o.p(), x.p(), KS_BACKEND_AUTO, nullptr), KS_ERROR_INVALID_ARGUMENT, kOp, "out|x", s));
  o.t.data = static_cast<float*>(store.data()) + 24;  // right after x
  EXPECT_EQ(ks_argmax(o.p(), x.p(), KS_BACKEND_AUTO, nullptr), KS_SUCCESS) << ks_last_error();
}

TEST(Argmax, LastErrorIsPerThread) {
  Buf x(DType::F32, {2, 3}), bad_out(DType::I32, {2}), out(DType::I64, {2});
  kstest::fill_normal(x);
  ASSERT_EQ(run_argmax(bad_out, x), KS_ERROR_UNSUPPORTED_DTYPE);
  const std::string mine = ks_last_error();
  EXPECT_NE(mine.find("argmax"), std::string::npos);
  std::string other_before, other_after_fail;
  std::thread th([&] {
    other_before = ks_last_error();  // nothing has failed on this thread
    Buf x2(DType::F32, {1, 0}), o2(DType::I64, {1});
    (void)run_argmax(o2, x2);
    other_after_fail = ks_last_error();
    Buf x3(DType::F32, {1, 4}), o3(DType::I64, {1});
    kstest::fill_normal(x3);
    EXPECT_EQ(run_argmax(o3, x3), KS_SUCCESS);
    EXPECT_STREQ(ks_last_error(), "");
  });
  th.join();
  EXPECT_EQ(other_before, "");
  EXPECT_NE(other_after_fail.find("argmax"), std::string::npos);
  EXPECT_EQ(std::string(ks_last_error()), mine) << "another thread changed this thread's last error";
  ASSERT_EQ(run_argmax(out, x), KS_SUCCESS);
  EXPECT_STREQ(ks_last_error(), "");
}

}  // namespace
