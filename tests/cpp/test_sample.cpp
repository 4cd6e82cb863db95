// ks_sample: temperature, top-k, top-p, Philox4x32-10 draws on fixed-point weights
// (docs/contracts.md#sample). Checked here: the generator against the published
// known-answer vectors, the exp against FP64, the cut-off rules with ties, invalid
// rows, reproducibility, and the sampled distribution against FP64 probabilities.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "core/sampling_math.hpp"
#include "validation_harness.hpp"

namespace {

using namespace kstest::harness;
namespace smp = ks::sampling;

const char* kOp = "sample";

struct Result {
  std::vector<int64_t> ids;
  std::vector<int> valid;
};

Result run(Buf& logits, int64_t seed, int64_t offset, double temperature, int64_t top_k, double top_p,
           ks_status_t* st = nullptr) {
  const int64_t rows = logits.shape[0];
  Buf out(DType::I64, {rows}), valid(DType::U8, {rows}), so(DType::I64, {2});
  out.poison();
  valid.poison();
  set_i(so, 0, seed);
  set_i(so, 1, offset);
  DLTensor o = out.dl(), v = valid.dl(), l = logits.dl(), s = so.dl();
  const ks_status_t rc = ks_sample(&o, &v, &l, &s, temperature, top_k, top_p, KS_BACKEND_AUTO, nullptr);
  if (st) *st = rc;
  Result r;
  if (rc != KS_SUCCESS) return r;
  for (int64_t i = 0; i < rows; ++i) {
    r.ids.push_back(get_i(out, i));
    r.valid.push_back(int(valid.get(i)));
  }
  return r;
}

Buf rows_of(DType dt, const std::vector<std::vector<double>>& rows) {
  Buf b(dt, {int64_t(rows.size()), int64_t(rows[0].size())});
  for (size_t r = 0; r < rows.size(); ++r)
    for (size_t i = 0; i < rows[r].size(); ++i) b.set(int64_t(r * rows[0].size() + i), rows[r][i]);
  return b;
}

// Random123's published known-answer vectors for philox4x32-10 (first output word).
TEST(Sample, PhiloxKnownAnswers) {
  EXPECT_EQ(smp::philox_first(0, 0, 0, 0, 0, 0), 0x6627e8d5u);
  EXPECT_EQ(smp::philox_first(~0u, ~0u, ~0u, ~0u, ~0u, ~0u), 0x408f276du);
  EXPECT_EQ(smp::philox_first(0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u, 0xa4093822u, 0x299f31d0u),
            0xd16cfe09u);
}

// sample_exp within 2 ulp of exp (FP64) over its whole range, exactly 1 at 0 and 0 below -104.
TEST(Sample, ExpWithinTwoUlp) {
  EXPECT_EQ(smp::sample_exp(0.0f), 1.0f);
  EXPECT_EQ(smp::sample_exp(-104.0f), 0.0f);
  EXPECT_EQ(smp::sample_exp(-1e30f), 0.0f);
  double worst = 0;
  for (float x = -103.9f; x < 0.0f; x = std::nextafter(x + 0.0137f * std::fabs(x) * 0.01f + 1e-4f, 0.0f)) {
    const double want = std::exp(double(x)), got = smp::sample_exp(x);
    if (want < 1.17549435e-38) {  // denormal range: absolute error within one denormal ulp per step
      EXPECT_LE(std::fabs(got - want), 3e-45) << x;
      continue;
    }
    const double ulp = std::ldexp(1.0, std::ilogb(want) - 23);
    worst = std::max(worst, std::fabs(got - want) / ulp);
  }
  EXPECT_LE(worst, 2.0);
}

// from_order_key inverts order_key (the CUDA top-k kernels' last step reads members' z from their
// keys): every float but -0 (its key is +0's) and NaN (a NaN) comes back bit for bit; keys keep
// the order. Random bit patterns plus the edges.
TEST(Sample, OrderKeyRoundTripsAndKeepsTheOrder) {
  namespace smp = ks::sampling;
  std::mt19937_64 g(17);
  std::vector<uint32_t> bits = {0x00000000u, 0x80000000u, 0x00000001u, 0x80000001u, 0x007fffffu, 0x807fffffu,
                                0x00800000u, 0x80800000u, 0x3f800000u, 0xbf800000u, 0x7f7fffffu, 0xff7fffffu,
                                0x7f800000u, 0xff800000u, 0x7fc00000u, 0xffc00000u};
  for (int i = 0; i < 1000000; ++i) bits.push_back(uint32_t(g()));
  float prev = 0.0f;
  for (size_t i = 0; i < bits.size(); ++i) {
    const float f = ks::bits_to_f32(bits[i]);
    const float back = smp::from_order_key(smp::order_key(f));
    if (f != f) {
      EXPECT_TRUE(back != back) << std::hex << bits[i];
      continue;
    }
    const uint32_t want = bits[i] == 0x80000000u ? 0u : bits[i];
    ASSERT_EQ(ks::f32_to_bits(back), want) << std::hex << bits[i];
    if (i > 0 && prev == prev)  // the order: keys compare as the floats do (-0 == +0)
      ASSERT_EQ(smp::order_key(prev) < smp::order_key(f), prev < f) << prev << " vs " << f;
    prev = f;
  }
}

TEST(Sample, TopKOneIsArgmaxWithTiesToTheLowerIndex) {
  for (DType dt : kFloatTypes()) {
    Buf x = rows_of(dt, {{0.5, 3.0, -1.0, 3.0, 2.0}, {-INFINITY, -INFINITY, 1.0, -INFINITY, 1.0}});
    for (int64_t off = 0; off < 20; ++off) {
      const Result r = run(x, 7, off, 1.0, 1, 1.0);
      ASSERT_EQ(r.ids.size(), 2u);
      EXPECT_EQ(r.ids[0], 1);
      EXPECT_EQ(r.ids[1], 2);
      EXPECT_EQ(r.valid[0], 1);
    }
  }
}

// Three logits tie at the top-k cut-off: the lower indices are kept, the last never drawn.
TEST(Sample, TopKTiesAtTheCutOffKeepLowerIndices) {
  Buf x = rows_of(DType::F32, {{1.0, 5.0, 5.0, 0.0, 5.0, 5.0}});
  std::set<int64_t> seen;
  for (int64_t off = 0; off < 400; ++off) seen.insert(run(x, 3, off, 1.0, 3, 1.0).ids[0]);
  EXPECT_EQ(seen, (std::set<int64_t>{1, 2, 4}));
}

// top_p: weights with exact masses. With logits ln(8), ln(4), ln(2), ln(2) the probabilities
// are 1/2, 1/4, 1/8, 1/8: top_p = 0.5 keeps only id 0; 0.75 keeps {0, 1}; 0.8 needs a third
// id and the tie between ids 2 and 3 keeps id 2.
TEST(Sample, TopPCutOffWithTies) {
  Buf x = rows_of(DType::F32, {{std::log(8.0), std::log(4.0), std::log(2.0), std::log(2.0)}});
  auto support = [&](double top_p) {
    std::set<int64_t> s;
    for (int64_t off = 0; off < 600; ++off) s.insert(run(x, 11, off, 1.0, 0, top_p).ids[0]);
    return s;
  };
  EXPECT_EQ(support(0.5), (std::set<int64_t>{0}));
  EXPECT_EQ(support(0.3), (std::set<int64_t>{0}));
  EXPECT_EQ(support(0.75), (std::set<int64_t>{0, 1}));
  EXPECT_EQ(support(0.8), (std::set<int64_t>{0, 1, 2}));
  EXPECT_EQ(support(1.0), (std::set<int64_t>{0, 1, 2, 3}));
}

// NaN, +inf and all -inf rows: placeholder 0, valid 0; the other rows of the batch are
// sampled as they would be anyway (their draws do not depend on other rows).
TEST(Sample, InvalidRowsGetThePlaceholderAndDoNotDisturbOthers) {
  for (DType dt : kFloatTypes()) {
    const std::vector<double> good = {0.1, 2.0, 1.5, -0.5, 0.7};
    Buf batch = rows_of(dt, {good, {0.0, NAN, 1.0, 1.0, 1.0}, good, {1.0, INFINITY, 0.0, 0.0, 0.0},
                             {-INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY}, good});
    Buf clean = rows_of(dt, {good, good, good, good, good, good});
    for (int64_t off = 0; off < 30; ++off) {
      const Result a = run(batch, 5, off, 0.9, 0, 1.0), b = run(clean, 5, off, 0.9, 0, 1.0);
      ASSERT_EQ(a.ids.size(), 6u);
      for (int r : {1, 3, 4}) {
        EXPECT_EQ(a.ids[size_t(r)], 0) << dt_name(dt) << " row " << r;
        EXPECT_EQ(a.valid[size_t(r)], 0) << dt_name(dt) << " row " << r;
      }
      for (int r : {0, 2, 5}) {
        EXPECT_EQ(a.ids[size_t(r)], b.ids[size_t(r)]) << dt_name(dt) << " row " << r;
        EXPECT_EQ(a.valid[size_t(r)], 1);
      }
    }
  }
}

// A finite logit whose z = x / T overflows to +inf makes the row invalid (no distribution).
TEST(Sample, OverflowingScoreMakesTheRowInvalid) {
  Buf x = rows_of(DType::F32, {{3e38, 1.0, 2.0}, {1.0, 2.0, 3.0}});
  const Result r = run(x, 1, 2, 0.5, 0, 1.0);
  EXPECT_EQ(r.ids[0], 0);
  EXPECT_EQ(r.valid[0], 0);
  EXPECT_EQ(r.valid[1], 1);
}

// Same (seed, offset): the same ids; another offset or seed: other draws.
TEST(Sample, ReproducibleAndOffsetAdvances) {
  Buf x(DType::BF16, {8, 1000});
  kstest::fill_normal(x, 2.0);
  const Result a = run(x, 42, 9, 1.0, 50, 0.9), b = run(x, 42, 9, 1.0, 50, 0.9);
  EXPECT_EQ(a.ids, b.ids);
  int differ_offset = 0, differ_seed = 0;
  for (int64_t off = 10; off < 20; ++off) {
    const Result c = run(x, 42, off, 1.0, 50, 0.9), d = run(x, 43, 9 + off - 10, 1.0, 50, 0.9);
    differ_offset += c.ids != a.ids;
    differ_seed += d.ids != a.ids;
  }
  EXPECT_GE(differ_offset, 9);
  EXPECT_GE(differ_seed, 9);
}

// The sampled frequencies match softmax(logits / T) restricted by top-k / top-p, computed
// in FP64, within 5 standard deviations per id (20000 draws).
TEST(Sample, DistributionMatchesFp64Probabilities) {
  const std::vector<double> logits = {1.0, 2.5, -0.3, 0.0, 2.4, -3.0, 1.7, 0.9};
  struct Cfg {
    double t;
    int64_t k;
    double p;
  };
  for (Cfg c : {Cfg{1.0, 0, 1.0}, Cfg{0.7, 5, 1.0}, Cfg{1.3, 0, 0.8}, Cfg{0.9, 4, 0.7}}) {
    std::vector<size_t> order(logits.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return logits[a] > logits[b]; });
    const size_t kk = c.k > 0 ? size_t(c.k) : logits.size();
    std::vector<double> p(logits.size(), 0.0);
    double z = 0;
    for (size_t j = 0; j < kk; ++j) z += std::exp(logits[order[j]] / c.t);
    for (size_t j = 0; j < kk; ++j) p[order[j]] = std::exp(logits[order[j]] / c.t) / z;
    if (c.p < 1.0) {
      double acc = 0, kept = 0;
      std::vector<double> q(logits.size(), 0.0);
      for (size_t j = 0; j < kk && acc < c.p; ++j) acc += p[order[j]], q[order[j]] = p[order[j]], kept += p[order[j]];
      for (auto& v : q) v /= kept;
      p = q;
    }
    Buf x = rows_of(DType::F32, {logits});
    std::vector<double> freq(logits.size(), 0.0);
    const int n = 20000;
    for (int64_t off = 0; off < n; ++off) freq[size_t(run(x, 1234, off, c.t, c.k, c.p).ids[0])] += 1.0 / n;
    for (size_t i = 0; i < p.size(); ++i) {
      const double sd = std::sqrt(std::max(p[i] * (1 - p[i]), 1e-12) / n);
      EXPECT_NEAR(freq[i], p[i], 5 * sd + 1e-9) << "id " << i << " T " << c.t << " k " << c.k << " p " << c.p;
    }
  }
}

// Leading dims: logits [2, 3, vocab] draw as their [6, vocab] reshape (row r of the row-major
// order draws counter (offset, r)), out and valid [2, 3]; [vocab] is one row with a 0-d id, row
// 0's draw; out or valid of the reshape's [6] is refused, naming it, and nothing is written.
TEST(Sample, LeadingDimsDrawAsTheTwoDimReshape) {
  Buf x(DType::BF16, {2, 3, 500}, 1);
  kstest::fill_normal(x, 2.0);
  x.set(3 * 500 + 11, NAN);  // row 3 has no distribution
  Buf flat_x(DType::BF16, {6, 500});
  for (int64_t i = 0; i < 3000; ++i) flat_x.set(i, x.get(i));
  const Result want = run(flat_x, 77, 3, 0.8, 40, 0.9);
  ASSERT_EQ(want.ids.size(), 6u);
  Buf out(DType::I64, {2, 3}, 2), valid(DType::U8, {2, 3}, 1), so(DType::I64, {2});
  set_i(so, 0, 77);
  set_i(so, 1, 3);
  out.poison();
  valid.poison();
  DLTensor o = out.dl(), v = valid.dl(), l = x.dl(), sd = so.dl();
  ASSERT_EQ(ks_sample(&o, &v, &l, &sd, 0.8, 40, 0.9, KS_BACKEND_AUTO, nullptr), KS_SUCCESS) << ks_last_error();
  for (int64_t r = 0; r < 6; ++r) {
    EXPECT_EQ(get_i(out, r), want.ids[size_t(r)]) << "row " << r;
    EXPECT_EQ(int(valid.get(r)), want.valid[size_t(r)]) << "row " << r;
  }
  EXPECT_EQ(want.valid[3], 0);
  EXPECT_TRUE(out.guards_intact() && valid.guards_intact());
  // one row [vocab]: a 0-d id and flag
  Buf row(DType::BF16, {500}), o0(DType::I64, {}), v0(DType::U8, {});
  for (int64_t i = 0; i < 500; ++i) row.set(i, x.get(i));
  o0.poison();
  v0.poison();
  DLTensor lr = row.dl(), or0 = o0.dl(), vr0 = v0.dl();
  ASSERT_EQ(ks_sample(&or0, &vr0, &lr, &sd, 0.8, 40, 0.9, KS_BACKEND_AUTO, nullptr), KS_SUCCESS) << ks_last_error();
  EXPECT_EQ(get_i(o0, 0), want.ids[0]);
  EXPECT_EQ(v0.get(0), 1.0);
  // the C++ header's ks::sample writes a 0-d valid too (only a default-constructed view is "absent"):
  // a NaN row gives the placeholder and valid 0
  {
    Buf nan_row(DType::F32, {4}), o1(DType::I64, {}), v1(DType::U8, {});
    nan_row.set(0, NAN), nan_row.set(1, 1.0), nan_row.set(2, 2.0), nan_row.set(3, 3.0);
    o1.poison();
    v1.poison();
    ks::sample(o1.view(), v1.view(), nan_row.view(), so.view(), 1.0);
    EXPECT_EQ(get_i(o1, 0), 0);
    EXPECT_EQ(v1.get(0), 0.0);
    Buf o2(DType::I64, {});
    ks::sample(o2.view(), ks::TensorView(), nan_row.view(), so.view(), 1.0);  // absent: no flag wanted
    EXPECT_EQ(get_i(o2, 0), 0);
  }
  // the reshape's [6] is not the shape
  Buf o6(DType::I64, {6}), v6(DType::U8, {6});
  o6.poison();
  v6.poison();
  out.poison();
  valid.poison();
  Snap s{&x, &out, &valid, &o6, &v6, &so};
  DLTensor p6 = o6.dl(), q6 = v6.dl();
  EXPECT_TRUE(fails_cleanly(ks_sample(&p6, &v, &l, &sd, 1.0, 0, 1.0, KS_BACKEND_AUTO, nullptr), KS_ERROR_INVALID_ARGUMENT,
                            kOp, "out", s));
  EXPECT_TRUE(fails_cleanly(ks_sample(&o, &q6, &l, &sd, 1.0, 0, 1.0, KS_BACKEND_AUTO, nullptr), KS_ERROR_INVALID_ARGUMENT,
                            kOp, "valid", s));
}

TEST(Sample, ValidationNamesTheArgumentAndWritesNothing) {
  Buf x(DType::F32, {2, 16}), out(DType::I64, {2}), valid(DType::U8, {2}), so(DType::I64, {2});
  kstest::fill_normal(x);
  out.poison();
  valid.poison();
  Snap s{&x, &out, &valid, &so};
  DLTensor o = out.dl(), v = valid.dl(), l = x.dl(), sd = so.dl();
  auto call = [&](double t, int64_t k, double p) { return ks_sample(&o, &v, &l, &sd, t, k, p, KS_BACKEND_AUTO, nullptr); };
  for (double t : {0.0, -1.0, double(NAN), double(INFINITY), 1e-50, 1e300})
    EXPECT_TRUE(fails_cleanly(call(t, 0, 1.0), KS_ERROR_INVALID_ARGUMENT, kOp, "temperature", s)) << t;
  EXPECT_TRUE(fails_cleanly(call(1.0, -1, 1.0), KS_ERROR_INVALID_ARGUMENT, kOp, "top_k", s));
  for (double p : {0.0, -0.1, 1.5, double(NAN)})
    EXPECT_TRUE(fails_cleanly(call(1.0, 0, p), KS_ERROR_INVALID_ARGUMENT, kOp, "top_p", s)) << p;
  Buf so3(DType::I64, {3}), out3(DType::I64, {3}), xi(DType::I32, {2, 16}), so32(DType::I32, {2});
  DLTensor s3 = so3.dl(), o3 = out3.dl(), li = xi.dl(), s32 = so32.dl();
  EXPECT_TRUE(fails_cleanly(ks_sample(&o, &v, &l, &s3, 1.0, 0, 1.0, KS_BACKEND_AUTO, nullptr), KS_ERROR_INVALID_ARGUMENT,
                            kOp, "seed_offset", s));
  EXPECT_TRUE(fails_cleanly(ks_sample(&o3, &v, &l, &sd, 1.0, 0, 1.0, KS_BACKEND_AUTO, nullptr), KS_ERROR_INVALID_ARGUMENT,
                            kOp, "out", s));
  EXPECT_TRUE(fails_cleanly(ks_sample(&o, &v, &li, &sd, 1.0, 0, 1.0, KS_BACKEND_AUTO, nullptr),
                            KS_ERROR_UNSUPPORTED_DTYPE, kOp, "logits", s));
  EXPECT_TRUE(fails_cleanly(ks_sample(&o, &v, &l, &s32, 1.0, 0, 1.0, KS_BACKEND_AUTO, nullptr),
                            KS_ERROR_UNSUPPORTED_DTYPE, kOp, "seed_offset", s));
  // valid aliasing out
  Dl vbad(out);
  vbad.t.dtype = DLDataType{kDLUInt, 8, 1};
  EXPECT_TRUE(fails_cleanly(ks_sample(&o, vbad.p(), &l, &sd, 1.0, 0, 1.0, KS_BACKEND_AUTO, nullptr),
                            KS_ERROR_INVALID_ARGUMENT, kOp, "valid", s));
  // a vocab of 2^23: 2^23 weights of 2^40 (equal logits) would sum to 2^63, past int64 (an id out
  // of range at top_p < 1 before this check, a wrong draw at top_p 1); 2^23 - 1 ids still run
  {
    Buf xw(DType::BF16, {1, int64_t(1) << 23}), ow(DType::I64, {1}), vw(DType::U8, {1});
    for (int64_t i = 0; i < xw.shape[1]; ++i) xw.set(i, 0.0);
    ow.poison();
    vw.poison();
    Snap sw{&xw, &ow, &vw, &so};
    DLTensor lw = xw.dl(), o1 = ow.dl(), v1 = vw.dl();
    EXPECT_TRUE(fails_cleanly(ks_sample(&o1, &v1, &lw, &sd, 1.0, 0, 0.5, KS_BACKEND_AUTO, nullptr),
                              KS_ERROR_INVALID_ARGUMENT, kOp, "vocab", sw));
    lw.shape[1] = (int64_t(1) << 23) - 1;  // (the Buf's shape storage; the row is one id shorter)
    ASSERT_EQ(ks_sample(&o1, &v1, &lw, &sd, 1.0, 0, 0.5, KS_BACKEND_CPU, nullptr), KS_SUCCESS) << ks_last_error();
    EXPECT_EQ(vw.get(0), 1.0);
    EXPECT_GE(ow.get(0), 0.0);
    EXPECT_LT(ow.get(0), double((int64_t(1) << 23) - 1) / 2 + 1);  // top_p 0.5 of equal weights: the lower half
    xw.shape[1] = int64_t(1) << 23;
  }
  // valid is optional; zero rows are a no-op
  EXPECT_EQ(ks_sample(&o, nullptr, &l, &sd, 1.0, 0, 1.0, KS_BACKEND_AUTO, nullptr), KS_SUCCESS) << ks_last_error();
  Buf x0(DType::F32, {0, 16}), out0(DType::I64, {0});
  DLTensor l0 = x0.dl(), o0 = out0.dl();
  EXPECT_EQ(ks_sample(&o0, nullptr, &l0, &sd, 1.0, 0, 1.0, KS_BACKEND_AUTO, nullptr), KS_SUCCESS) << ks_last_error();
}

// A 128256-wide row (the Llama-3 vocabulary) with top-k 50 and top-p 0.9: the id is one
// of the 50 largest logits, and with a logit far above the rest it is always that one.
TEST(Sample, WideVocabulary) {
  Buf x(DType::BF16, {2, 128256});
  kstest::fill_normal(x, 1.5);
  x.set(128256 + 77777, 40.0);
  std::vector<std::pair<double, int64_t>> v;
  for (int64_t i = 0; i < 128256; ++i) v.push_back({x.get(i), -i});
  std::sort(v.rbegin(), v.rend());
  std::set<int64_t> top50;
  for (int j = 0; j < 50; ++j) top50.insert(-v[size_t(j)].second);
  for (int64_t off = 0; off < 10; ++off) {
    const Result r = run(x, 99, off, 1.0, 50, 0.9);
    EXPECT_TRUE(top50.count(r.ids[0])) << r.ids[0];
    EXPECT_EQ(r.ids[1], 77777);
  }
}

}  // namespace
