// ks_varlen_attention against an FP64 reference of the documented formula: packed sequences
// (cu_seqlens), GQA, causal (bottom-right aligned) and not, empty sequences, fewer queries than
// keys (chunked prefill), every CPU variant; validation names the argument and writes nothing.
#include <cmath>
#include <string>
#include <vector>

#include "validation_harness.hpp"

namespace {

using namespace kstest::harness;

const char* kOp = "varlen_attention";

struct Problem {
  DType dt;
  int64_t H, KVH, D;
  std::vector<int32_t> lq, lk;  // per sequence
  bool causal;
};

void run_problem(const Problem& p) {
  const int64_t S = int64_t(p.lq.size());
  std::vector<int32_t> cq{0}, ck{0};
  for (int64_t s = 0; s < S; ++s) cq.push_back(cq.back() + p.lq[size_t(s)]), ck.push_back(ck.back() + p.lk[size_t(s)]);
  const int64_t TQ = cq.back(), TK = ck.back();
  Buf q(p.dt, {TQ, p.H, p.D}), k(p.dt, {TK, p.KVH, p.D}), v(p.dt, {TK, p.KVH, p.D}), out(p.dt, {TQ, p.H, p.D});
  Buf bq(DType::I32, {S + 1}), bk(DType::I32, {S + 1});
  kstest::fill_normal(q);
  kstest::fill_normal(k);
  kstest::fill_normal(v);
  for (int64_t i = 0; i <= S; ++i) bq.set(i, cq[size_t(i)]), bk.set(i, ck[size_t(i)]);
  out.poison();
  const double scale = 1.0 / std::sqrt(double(p.D));
  DLTensor o = out.dl(), qq = q.dl(), kk = k.dl(), vv = v.dl(), c1 = bq.dl(), c2 = bk.dl();
  KS_RUN_OR_SKIP(ks_varlen_attention(&o, &qq, &kk, &vv, &c1, &c2, scale, p.causal ? 1 : 0, KS_BACKEND_CPU, nullptr));
  const int64_t G = p.H / p.KVH;
  const double t = kstest::tol(p.dt);
  for (int64_t s = 0; s < S; ++s)
    for (int64_t i = 0; i < p.lq[size_t(s)]; ++i)
      for (int64_t h = 0; h < p.H; ++h) {
        const int64_t lq = p.lq[size_t(s)], lk = p.lk[size_t(s)];
        const int64_t vis = p.causal ? std::min<int64_t>(lk, std::max<int64_t>(0, i + lk - lq + 1)) : lk;
        const int64_t row = (cq[size_t(s)] + i) * p.H + h, kvh = h / G;
        std::vector<double> sc(static_cast<size_t>(vis));
        double mx = -INFINITY, sum = 0, bound = 0;
        for (int64_t j = 0; j < vis; ++j) {
          double dot = 0;
          for (int64_t d = 0; d < p.D; ++d)
            dot += q.get(row * p.D + d) * k.get(((ck[size_t(s)] + j) * p.KVH + kvh) * p.D + d);
          sc[size_t(j)] = dot * scale;
          mx = std::max(mx, sc[size_t(j)]);
        }
        for (auto& x : sc) sum += (x = std::exp(x - mx));
        for (int64_t d = 0; d < p.D; ++d) {
          double want = 0;
          for (int64_t j = 0; j < vis; ++j) want += sc[size_t(j)] / sum * v.get(((ck[size_t(s)] + j) * p.KVH + kvh) * p.D + d);
          const double got = out.get(row * p.D + d);
          bound = 1e-5 * std::sqrt(double(std::max<int64_t>(vis, 1)) * p.D);  // FP32 sums of scores and weights
          ASSERT_LE(std::fabs(got - want), t + t * std::fabs(want) + bound)
              << dt_name(p.dt) << " seq " << s << " query " << i << " head " << h << " dim " << d << " (visible " << vis
              << (p.causal ? ", causal" : "") << ")";
        }
      }
  EXPECT_TRUE(out.guards_intact());
}

TEST(VarlenAttention, AgainstFp64AllDtypesCausalAndNot) {
  for (DType dt : kFloatTypes())
    for (bool causal : {true, false}) {
      FOR_EACH_VARIANT(kOp) run_problem({dt, 4, 2, 32, {5, 0, 17, 1}, {5, 0, 17, 1}, causal});  // prefill
      FOR_EACH_VARIANT(kOp) run_problem({dt, 9, 3, 64, {3, 8}, {20, 8}, causal});                // chunked: lq < lk
      FOR_EACH_VARIANT(kOp) run_problem({dt, 2, 2, 8, {4}, {2}, causal});                        // lq > lk: early rows see none
    }
}

TEST(VarlenAttention, LongSequencesAndZeroRows) {
  for (DType dt : kFloatTypes()) run_problem({dt, 2, 1, 80, {300, 129}, {300, 129}, true});  // several key tiles
  Buf q(DType::F32, {0, 2, 8}), k(DType::F32, {0, 2, 8}), v(DType::F32, {0, 2, 8}), out(DType::F32, {0, 2, 8});
  Buf cu(DType::I32, {2});
  cu.set(0, 0), cu.set(1, 0);
  DLTensor o = out.dl(), qq = q.dl(), kk = k.dl(), vv = v.dl(), c = cu.dl();
  EXPECT_EQ(ks_varlen_attention(&o, &qq, &kk, &vv, &c, &c, 0.5, 1, KS_BACKEND_CPU, nullptr), KS_SUCCESS) << ks_last_error();
}

// A NaN in one query row poisons exactly that (row, head); an all -inf score row is NaN
// (softmax of all -inf); every other row, including the next sequence's, stays finite.
TEST(VarlenAttention, NonFiniteScoresStayInTheirRow) {
  for (DType dt : kFloatTypes()) {
    FOR_EACH_VARIANT(kOp) {
      Buf q(dt, {5, 2, 16}), k(dt, {5, 1, 16}), v(dt, {5, 1, 16}), out(dt, {5, 2, 16});
      kstest::fill_normal(q);
      kstest::fill_normal(k);
      kstest::fill_normal(v);
      q.set(1 * 2 * 16 + 0 * 16 + 3, NAN);  // row 1, head 0
      Buf cu(DType::I32, {3});
      cu.set(0, 0), cu.set(1, 3), cu.set(2, 5);
      out.poison();
      DLTensor o = out.dl(), qq = q.dl(), kk = k.dl(), vv = v.dl(), c = cu.dl();
      KS_RUN_OR_SKIP(ks_varlen_attention(&o, &qq, &kk, &vv, &c, &c, 0.25, 1, KS_BACKEND_CPU, nullptr));
      for (int64_t r = 0; r < 5; ++r)
        for (int64_t h = 0; h < 2; ++h)
          for (int64_t d = 0; d < 16; ++d) {
            const double x = out.get((r * 2 + h) * 16 + d);
            if (r == 1 && h == 0)
              EXPECT_TRUE(std::isnan(x)) << dt_name(dt) << " d " << d;
            else
              EXPECT_TRUE(std::isfinite(x)) << dt_name(dt) << " row " << r << " head " << h << " d " << d;
          }
      EXPECT_TRUE(out.guards_intact());
    }
  }
}

TEST(VarlenAttention, ValidationNamesTheArgumentAndWritesNothing) {
  Buf q(DType::F32, {6, 2, 8}), k(DType::F32, {6, 1, 8}), v(DType::F32, {6, 1, 8}), out(DType::F32, {6, 2, 8});
  kstest::fill_normal(q);
  kstest::fill_normal(k);
  kstest::fill_normal(v);
  out.poison();
  Buf good(DType::I32, {3}), bad(DType::I32, {3}), short_(DType::I32, {2});
  good.set(0, 0), good.set(1, 2), good.set(2, 6);
  bad.set(0, 0), bad.set(1, 4), bad.set(2, 3);  // decreasing
  short_.set(0, 0), short_.set(1, 6);
  Snap s{&q, &k, &v, &out};
  DLTensor o = out.dl(), qq = q.dl(), kk = k.dl(), vv = v.dl(), g = good.dl(), b = bad.dl(), sh = short_.dl();
  EXPECT_TRUE(fails_cleanly(ks_varlen_attention(&o, &qq, &kk, &vv, &b, &g, 0.3, 1, KS_BACKEND_CPU, nullptr),
                            KS_ERROR_INVALID_ARGUMENT, kOp, "cu_seqlens_q", s));
  EXPECT_TRUE(fails_cleanly(ks_varlen_attention(&o, &qq, &kk, &vv, &g, &sh, 0.3, 1, KS_BACKEND_CPU, nullptr),
                            KS_ERROR_INVALID_ARGUMENT, kOp, "cu_seqlens_k", s));
  Buf k3(DType::F32, {6, 3, 8}), v3(DType::F32, {6, 3, 8});
  DLTensor k3d = k3.dl(), v3d = v3.dl();
  EXPECT_TRUE(fails_cleanly(ks_varlen_attention(&o, &qq, &k3d, &v3d, &g, &g, 0.3, 1, KS_BACKEND_CPU, nullptr),
                            KS_ERROR_INVALID_ARGUMENT, kOp, "num_kv_heads", s));
  EXPECT_TRUE(fails_cleanly(ks_varlen_attention(&o, &qq, &kk, &vv, &g, &g, INFINITY, 1, KS_BACKEND_CPU, nullptr),
                            KS_ERROR_INVALID_ARGUMENT, kOp, "scale", s));
  Buf none(DType::I32, {1});
  none.set(0, 0);
  DLTensor nd = none.dl();
  EXPECT_TRUE(fails_cleanly(ks_varlen_attention(&o, &qq, &kk, &vv, &nd, &nd, 0.3, 1, KS_BACKEND_CPU, nullptr),
                            KS_ERROR_INVALID_ARGUMENT, kOp, "cu_seqlens_q holds no sequence", s));
  EXPECT_EQ(ks_varlen_attention(&o, &qq, &kk, &vv, &g, &g, 0.3, 1, KS_BACKEND_CPU, nullptr), KS_SUCCESS) << ks_last_error();
}

}  // namespace
