// The CUDA row-group launch rule (common.cuh) must reproduce the configurations
// that were measured on the H200 (docs/perf/h200_kernscope_raw.csv, 132 SMs): a
// change to the rule is a change to the measured kernels and needs a new GPU run.
// Host-only: runs in every build, with or without CUDA.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <map>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "backends/cuda/launch_rules.hpp"
#include "backends/cuda/mma_x_staging.hpp"

namespace {

std::map<std::string, long long> parse_config(const std::string& cfg) {
  std::map<std::string, long long> kv;
  std::istringstream in(cfg);
  std::string tok;
  while (in >> tok) {
    const auto eq = tok.find('=');
    if (eq != std::string::npos) kv[tok.substr(0, eq)] = std::stoll(tok.substr(eq + 1));
  }
  return kv;
}

TEST(CudaLaunchRule, ReproducesTheMeasuredRowGroupConfigurations) {
  std::ifstream f(std::string(KS_SOURCE_DIR) + "/docs/perf/h200_kernscope_raw.csv");
  ASSERT_TRUE(f.good());
  std::string line;
  std::getline(f, line);  // header
  int checked = 0;
  while (std::getline(f, line)) {
    // gpu,driver,cuda,commit,op,shape,dtype,impl,"config",us,gbs,pct_copy,copy_gbs
    const auto q0 = line.find('"'), q1 = line.rfind('"');
    ASSERT_NE(q0, std::string::npos);
    const std::string cfg = line.substr(q0 + 1, q1 - q0 - 1);
    std::vector<std::string> head;
    std::istringstream hs(line.substr(0, q0));
    for (std::string c; std::getline(hs, c, ',');) head.push_back(c);
    const std::string op = head[4], shape = head[5], dtype = head[6];
    if (op != "rms_norm" && op != "fused_add_rms_norm" && op != "softmax") continue;
    if (cfg.find("cluster") != std::string::npos) continue;
    const long long rows = std::stoll(shape.substr(0, shape.find('x')));
    const long long H = std::stoll(shape.substr(shape.find('x') + 1));
    const auto kv = parse_config(cfg);
    const long long vec = kv.at("vec");
    const auto g = ks::cuda::row_group_config(rows, (H + vec - 1) / vec, vec == 1, 132);
    SCOPED_TRACE(op + " " + shape + " " + dtype + ": " + cfg);
    EXPECT_EQ(g.nv, kv.at("nv"));
    EXPECT_EQ(g.warps_per_row, kv.at("warps_per_row"));
    EXPECT_EQ(g.rows_per_cta, kv.at("rows_per_cta"));
    EXPECT_EQ(g.grid, kv.at("grid"));
    if (kv.count("preload_w")) {
      const long long ctas = (rows + g.rows_per_cta - 1) / g.rows_per_cta;
      EXPECT_EQ(ks::cuda::preload_weights(ctas, 132) ? 1 : 0, kv.at("preload_w"));
    }
    ++checked;
  }
  EXPECT_GE(checked, 40);
}

}  // namespace

// ---- softmax's cluster choice, with fake occupancy tables --------------------------------
namespace {
struct FakeOccupancy {
  std::map<std::tuple<int, int, int>, int> table;  // (nv, C, threads) -> co-resident clusters
  int smem_active = 0;                             // for NV = 0 (shared-memory staging)
  int operator()(int nv, int c, int th, int64_t smem) const {
    if (nv == 0) return smem > 0 ? smem_active : 0;
    auto it = table.find({nv, c, th});
    return it == table.end() ? 0 : it->second;
  }
};
auto no_report = [](int, int, int, int64_t, int, int64_t) {};
}  // namespace

// 64 x 128256 bf16 (16032 vectors per row) with the H200's reported counts: two waves
// at best, and among those the smallest NV wins (what the H200 run chose).
TEST(SoftmaxClusterChoice, FewestWavesThenSmallestNvThenSmallestC) {
  FakeOccupancy occ;
  occ.table = {{{4, 16, 256}, 35}, {{8, 8, 256}, 62}, {{16, 4, 256}, 60}, {{2, 16, 512}, 16}, {{4, 8, 512}, 30}};
  auto k = ks::cuda::choose_cluster(64, 16032, 0, 0, occ, no_report);
  EXPECT_EQ(k.cluster, 16);
  EXPECT_EQ(k.threads, 256);
  EXPECT_EQ(k.nv, 4);
  EXPECT_EQ(k.active, 35);
  EXPECT_EQ(k.waves, 2);
  EXPECT_EQ(k.slice, 1002);
  // one wave becomes possible: it wins although its NV is the largest
  occ.table[{16, 4, 256}] = 66;
  k = ks::cuda::choose_cluster(64, 16032, 0, 0, occ, no_report);
  EXPECT_EQ(k.cluster, 4);
  EXPECT_EQ(k.nv, 16);
  // 128-thread CTAs: chosen only when they save a wave (ties go to the smaller NV)
  occ.table[{16, 4, 256}] = 60;
  occ.table[{8, 16, 128}] = 62;
  EXPECT_EQ(ks::cuda::choose_cluster(64, 16032, 0, 0, occ, no_report).threads, 256);
  occ.table[{8, 16, 128}] = 64;
  k = ks::cuda::choose_cluster(64, 16032, 0, 0, occ, no_report);
  EXPECT_EQ(k.threads, 128);
  EXPECT_EQ(k.cluster, 16);
  EXPECT_EQ(k.nv, 8);
  EXPECT_EQ(k.waves, 1);
}

// Shared-memory staging (C = 8): mode 0 never, 2 always, 1 (auto) only when the
// register choice needs >= 4 waves (the measured crossover).
TEST(SoftmaxClusterChoice, SharedMemoryStagingRule) {
  FakeOccupancy occ;
  occ.table = {{{4, 16, 256}, 35}, {{8, 8, 256}, 62}, {{6, 8, 512}, 30}};  // the last: 256 x 151936's
  occ.smem_active = 77;
  EXPECT_EQ(ks::cuda::choose_cluster(64, 16032, 0, 1, occ, no_report).nv, 4) << "2 register waves: keep registers";
  auto k = ks::cuda::choose_cluster(256, 18992, 0, 1, occ, no_report);  // 256 x 151936 bf16
  EXPECT_EQ(k.nv, 0) << "many register waves: stage";
  EXPECT_EQ(k.cluster, 8);
  EXPECT_EQ(k.threads, 256);
  EXPECT_EQ(k.slice, 2374);
  k = ks::cuda::choose_cluster(256, 18992, 0, 0, occ, no_report);
  EXPECT_EQ(k.nv, 6) << "mode 0: never";
  EXPECT_EQ(k.waves, 9);
  EXPECT_EQ(ks::cuda::choose_cluster(64, 16032, 0, 2, occ, no_report).nv, 0) << "mode 2: always";
  EXPECT_EQ(ks::cuda::choose_cluster(64, 16032, 4, 2, occ, no_report).cluster, 4) << "a pinned C applies to staging";
  // slices over 160 KB are never staged: 8 CTAs x 160 KB < a 2^18-vector row
  std::vector<int> staged;
  ks::cuda::choose_cluster(4, int64_t(1) << 18, 0, 2, [](int, int, int, int64_t) { return 1000; },
                           [&](int, int, int nv, int64_t, int, int64_t) { staged.push_back(nv); });
  for (int nv : staged) EXPECT_NE(nv, 0);
}

TEST(SoftmaxClusterChoice, CandidatesRespectTheLimits) {
  std::vector<std::tuple<int, int, int, int64_t>> seen;
  auto all = [](int, int, int, int64_t) { return 1000; };
  auto record = [&](int c, int th, int nv, int64_t smem, int, int64_t) { seen.emplace_back(c, th, nv, smem); };
  ks::cuda::choose_cluster(64, 32768, 0, 2, all, record);
  ASSERT_FALSE(seen.empty());
  for (auto [c, th, nv, smem] : seen) {
    if (nv > 8) {
      EXPECT_LE(th, 256) << "NV > 8 only with 128 or 256 threads";
    }
    EXPECT_TRUE(th == 128 || th == 256 || th == 512);
    if (nv > 0) {
      EXPECT_GE(int64_t(c) * th * nv, 32768) << "the candidate must hold the row";
    } else {
      EXPECT_LE(smem, 160 * 1024);
    }
    EXPECT_TRUE(c == 2 || c == 4 || c == 8 || c == 16);
  }
  // a pinned C keeps only that C
  seen.clear();
  ks::cuda::choose_cluster(64, 32768, 8, 2, all, record);
  for (auto [c, th, nv, smem] : seen) EXPECT_EQ(c, 8);
  // nothing launchable: no choice (the caller falls back to row groups)
  auto none = [](int, int, int, int64_t) { return 0; };
  EXPECT_EQ(ks::cuda::choose_cluster(64, 32768, 0, 2, none, no_report).cluster, 0);
  // a row too wide for any register candidate and for staging
  EXPECT_EQ(ks::cuda::choose_cluster(4, int64_t(1) << 20, 0, 2, all, no_report).cluster, 0);
}

// cuda_mma_cluster's split beyond a cluster at the bench shapes of the H200 (132 SMs, bf16),
// with the cluster sizes its launcher chose there (docs/perf/h200_attention*.csv): split where
// it was measured faster, not at 9/3 heads x 8192 keys (slower split) or at 1024 keys.
TEST(AttentionSplitRule, ReproducesTheMeasuredChoices) {
  using ks::cuda::attention_splits;
  const int64_t kMin = 256 * 1024, kKeys = 256;
  //                        units capacity SMs  C  head_dim bytes
  EXPECT_EQ(attention_splits(8, 32768, 132, 8, 128, 2, kKeys, kMin), 16);   // b1 32/8 T32768
  EXPECT_EQ(attention_splits(8, 8192, 132, 8, 128, 2, kKeys, kMin), 16);    // b1 32/8 T8192 (512 KB)
  EXPECT_EQ(attention_splits(3, 32768, 132, 16, 64, 2, kKeys, kMin), 44);   // b1 9/3 T32768
  EXPECT_EQ(attention_splits(3, 8192, 132, 16, 64, 2, kKeys, kMin), 1);     // b1 9/3 T8192 (128 KB)
  EXPECT_EQ(attention_splits(8, 1024, 132, 4, 128, 2, kKeys, kMin), 1);     // b1 32/8 T1024
  EXPECT_EQ(attention_splits(1, 262144, 132, 16, 128, 2, kKeys, kMin), 132); // the layout experiment
  EXPECT_EQ(attention_splits(16, 32768, 132, 8, 128, 2, kKeys, kMin), 1);   // 16 units: 8 per unit, no more than C
  EXPECT_EQ(attention_splits(14, 20480, 132, 8, 40, 2, kKeys, kMin), 9);    // NonFiniteAndDroppedKeysAcrossClusters
  EXPECT_EQ(attention_splits(1, 4096, 132, 16, 128, 2, kKeys, kMin), 1);    // capacity / 256 = 16, not above C
  EXPECT_EQ(attention_splits(0, 32768, 132, 8, 128, 2, kKeys, kMin), 1);    // no unit
}

// argmax's cluster per row: the sizes measured fastest at adba7d4 on the H200 (132 SMs; every
// size forced in one call), SmolLM2's 49152-entry vocabulary unchanged from the earlier rule (4),
// and limits: never past max_cluster, one CTA for short rows, a power of two.
TEST(ArgmaxClusterRule, ReproducesTheMeasuredChoices) {
  using ks::cuda::argmax_cluster;
  EXPECT_EQ(argmax_cluster(1, 128256, 132, 16), 16);
  EXPECT_EQ(argmax_cluster(64, 128256, 132, 16), 4);
  EXPECT_EQ(argmax_cluster(256, 151936, 132, 16), 1);
  EXPECT_EQ(argmax_cluster(1, 49152, 132, 16), 4);
  EXPECT_EQ(argmax_cluster(1, 128256, 132, 8), 8);
  EXPECT_EQ(argmax_cluster(1, 15999, 132, 16), 1);
  EXPECT_EQ(argmax_cluster(1, 16000, 132, 16), 2);
  for (int64_t rows : {1, 2, 7, 66, 132, 133, 1000})
    for (int64_t cols : {1, 8000, 65536, 128256, 1 << 22}) {
      const int C = argmax_cluster(rows, cols, 132, 16);
      EXPECT_TRUE(C == 1 || C == 2 || C == 4 || C == 8 || C == 16);
      EXPECT_LE(rows * C, std::max<int64_t>(264, rows));
      if (C > 1) {
        EXPECT_GE(cols, int64_t(C) * 8000);
      }
    }
}

namespace {
// A bulk plan against the configuration a launcher recorded (one CTA per SM on 132 SMs).
void expect_recorded_plan(const ks::cuda::BulkPlan& p, int rps, int group, int slot_bytes, int slots, size_t smem) {
  EXPECT_EQ(p.rps, rps);
  EXPECT_EQ(p.group, group);
  EXPECT_EQ(p.slot_bytes, slot_bytes);
  EXPECT_EQ(p.slots, slots);
  EXPECT_EQ(p.smem, smem);
  EXPECT_EQ(p.grid, 132u);
}
// Every few CTAs' stages of a bulk plan over N rows of RB bytes: at least one row per CTA, and each
// stage's byte range, widened to 16-byte boundaries, within a slot.
void expect_stages_fit(const ks::cuda::BulkPlan& p, int64_t N, int64_t RB) {
  for (int64_t c = 0; c < int64_t(p.grid); c += std::max<int64_t>(1, int64_t(p.grid) / 7)) {
    const int64_t r0 = c * N / p.grid, r1 = (c + 1) * N / p.grid;
    ASSERT_GE(r1 - r0, 1);
    for (int64_t a = r0; a < r1; a += p.rps) {
      const int64_t e = std::min(r1, a + p.rps);
      const int64_t g0 = (a * RB) / 16 * 16, g1 = (e * RB + 15) / 16 * 16;
      ASSERT_LE(g1 - g0, p.slot_bytes) << "rows " << a << ".." << e;
    }
  }
}
}  // namespace

// quant_matmul's cuda_bulk_stream plan: the configurations its launcher recorded on the H200 at
// f299a95 (docs/perf/h200_quant_bulk_f299a95.csv: 132 SMs, 227 KB of opt-in shared memory less
// the kernel's 128 bytes of mbarriers, 128 KB stages), then invariants over hostile shapes: the
// shared memory fits, every stage's widened byte range fits its slot, whole groups per stage,
// at most one CTA per row, and a decline exactly when x and one group's slot cannot fit.
TEST(BulkStreamPlan, ReproducesTheLaunchedPlansAndKeepsItsInvariants) {
  using ks::cuda::bulk_plan;
  const int64_t kLimit = 232448 - 128, kTarget = 128 * 1024;
  struct Want {
    int64_t N, K, block_bytes;
    int rps, group, slot_bytes, slots;
    size_t smem;
  };
  for (const Want& w : std::vector<Want>{{14336, 4096, 18, 32, 1, 73744, 2, 165920},
                                         {4096, 4096, 18, 32, 1, 73744, 1, 92176},
                                         {49152, 576, 18, 336, 7, 108880, 2, 228416},
                                         {576, 576, 18, 5, 5, 1648, 1, 10000},
                                         {1536, 576, 20, 14, 7, 5056, 1, 15712},
                                         {49152, 576, 20, 224, 7, 80656, 2, 171968},
                                         {14336, 4096, 34, 24, 1, 104464, 2, 227360},
                                         {4096, 4096, 34, 32, 1, 139280, 1, 157712},
                                         {49152, 576, 34, 112, 7, 68560, 3, 216336}}) {
    const auto p = bulk_plan(w.N, w.K, w.K / 32 * w.block_bytes, 132, kLimit, kTarget);
    SCOPED_TRACE(std::to_string(w.N) + "x" + std::to_string(w.K) + " block " + std::to_string(w.block_bytes));
    expect_recorded_plan(p, w.rps, w.group, w.slot_bytes, w.slots, w.smem);
    // a thread per short row only where a stage holds >= 64 of them (49152 x 576: 112..336 rows)
    EXPECT_EQ(ks::cuda::bulk_thread_rows(p, w.K), w.N == 49152) << "rows per stage " << p.rps;
    // lanes per short row: what the kernel's split supports (1, 2 or 4 lanes: 16 tree slots
    // divided evenly, the lanes of a row inside one warp and one row slot per lanes threads),
    // and the choice measured at 49152 x 576 (Q4_1 1, Q4_0 and Q8_0 2)
    for (int64_t bb : {int64_t(18), int64_t(20), int64_t(34)}) {
      const int lanes = ks::cuda::bulk_lanes_per_row(bb);
      EXPECT_TRUE(lanes == 1 || lanes == 2 || lanes == 4) << lanes;
      EXPECT_EQ(16 % lanes, 0);
      EXPECT_EQ((32 * ks::cuda::kBulkWarps) % lanes, 0);
      EXPECT_EQ(lanes, bb == 20 ? 1 : 2) << "block bytes " << bb;
    }
  }
  // x alone past the limit (65536 values: 295 KB as floats) declines; 28672 values of Q8_0 fit
  EXPECT_EQ(bulk_plan(1, 65536, 2048 * 34, 132, kLimit, kTarget).slots, 0);
  EXPECT_EQ(bulk_plan(300, 28672, 896 * 34, 132, kLimit, kTarget).slots, 1);
  for (int64_t bb : {18, 20, 34})
    for (int64_t K : {32, 64, 576, 1024, 1056, 2880, 4096, 11008, 14336, 20480, 24608, 28672, 65536})
      for (int64_t N : {1, 7, 131, 133, 265, 576, 4096, 14336, 49152, 152064})
        for (int sms : {1, 8, 132})
          for (int64_t target : {int64_t(1024), kTarget, int64_t(1) << 20}) {
            const int64_t RB = K / 32 * bb, nb = K / 32;
            const auto p = bulk_plan(N, K, RB, sms, kLimit, target);
            SCOPED_TRACE("N=" + std::to_string(N) + " K=" + std::to_string(K) + " block " + std::to_string(bb) +
                         " sms=" + std::to_string(sms) + " target=" + std::to_string(target));
            const int64_t x_bytes = nb * 36 * 4;
            if (p.slots == 0) {  // declined: not even x, the sums and one group's slot fit
              const int64_t g = nb >= 32 ? 1 : 32;  // (the largest group the rule may pick)
              EXPECT_GT(x_bytes + (nb < 32 ? ks::cuda::kBulkWarps * g * nb * 4 : 0) + RB, kLimit - 32);
              continue;
            }
            ASSERT_GE(p.group, 1);
            ASSERT_LE(p.group, 32);
            if (nb >= 32) {
              EXPECT_EQ(p.group, 1);
            }
            EXPECT_EQ(p.rps % p.group, 0);
            EXPECT_LE(p.smem, size_t(kLimit));
            EXPECT_LE(p.slots, ks::cuda::kBulkMaxSlots);
            EXPECT_EQ(p.grid, unsigned(std::min<int64_t>(N, sms)));
            EXPECT_EQ(p.slot_bytes % 16, 0);
            expect_stages_fit(p, N, RB);
          }
}

// cuda_a8_bulk_stream's plan: the configurations its launcher recorded on the H200 at 10e8adf
// (docs/perf/h200_quant_a8_bulk_rows_10e8adf.csv: 132 SMs, 227 KB of opt-in shared memory less the
// kernel's 128 bytes of mbarriers, 64 KB stages for Q4, 32 KB for Q8_0, x as 48-byte blocks), rows
// per warp step 4 exactly where a row has fewer than 32 blocks or Q4_0's blocks (or as forced), then invariants:
// an even number of rows per stage, the shared memory within the limit, every stage's widened
// byte range inside its slot.
TEST(A8BulkStreamPlan, ReproducesTheLaunchedPlansAndPicksRowsPerStep) {
  using ks::cuda::a8_bulk_plan;
  const int64_t kLimit = 232448 - 128, kX = 48;
  struct Want {
    int64_t N, K, block_bytes, target_kb;
    int rps, slot_bytes, slots, rows_per_step;
    size_t smem;
  };
  for (const Want& w : std::vector<Want>{{14336, 4096, 18, 64, 28, 64528, 3, 4, 199728},
                                         {4096, 4096, 18, 64, 28, 64528, 2, 4, 135200},
                                         {14336, 4096, 34, 32, 6, 26128, 8, 2, 215168},
                                         {4096, 4096, 20, 64, 24, 61456, 2, 2, 129056},
                                         {4096, 4096, 34, 32, 6, 26128, 6, 2, 162912},
                                         {49152, 576, 34, 32, 52, 31840, 7, 4, 223744}}) {
    const auto p = a8_bulk_plan(w.N, w.K, w.K / 32 * w.block_bytes, 132, kLimit, w.target_kb * 1024, kX, w.block_bytes);
    SCOPED_TRACE(std::to_string(w.N) + "x" + std::to_string(w.K) + " block " + std::to_string(w.block_bytes));
    expect_recorded_plan(p, w.rps, w.rows_per_step, w.slot_bytes, w.slots, w.smem);
  }
  EXPECT_EQ(a8_bulk_plan(49152, 576, 612, 132, kLimit, 32768, kX, 34, 2).group, 2);
  EXPECT_EQ(a8_bulk_plan(14336, 4096, 4352, 132, kLimit, 32768, kX, 34, 4).group, 4);
  EXPECT_EQ(a8_bulk_plan(14336, 4096, 4352, 132, kLimit, 32768, kX, 34, 3).group, 2);  // (not a form: the rule's)
  EXPECT_EQ(a8_bulk_plan(14336, 4096, 2304, 132, kLimit, 65536, kX, 18, 2).group, 2);
  EXPECT_EQ(a8_bulk_plan(576, 992, 31 * 34, 132, kLimit, 32768, kX, 34).group, 4);
  EXPECT_EQ(a8_bulk_plan(576, 1024, 32 * 34, 132, kLimit, 32768, kX, 34).group, 2);
  EXPECT_EQ(a8_bulk_plan(576, 1024, 32 * 20, 132, kLimit, 32768, kX, 20).group, 2);
  EXPECT_EQ(a8_bulk_plan(576, 1024, 32 * 18, 132, kLimit, 32768, kX, 18).group, 4);
  EXPECT_EQ(a8_bulk_plan(0, 4096, 2304, 132, kLimit, 32768, kX, 18).slots, 0);
  for (int64_t bb : {18, 20, 34})
    for (int64_t K : {32, 64, 576, 992, 1024, 4096, 14336, 65536})
      for (int64_t N : {1, 7, 131, 133, 4096, 14336, 49152})
        for (int sms : {1, 132})
          for (int64_t target : {int64_t(1024), int64_t(32768), int64_t(1) << 20}) {
            const int64_t RB = K / 32 * bb;
            const auto p = a8_bulk_plan(N, K, RB, sms, kLimit, target, kX, bb);
            SCOPED_TRACE("N=" + std::to_string(N) + " K=" + std::to_string(K) + " block " + std::to_string(bb) +
                         " sms=" + std::to_string(sms) + " target=" + std::to_string(target));
            if (p.slots == 0) {  // declined: x and one stage of a pair of rows do not fit
              EXPECT_GT(K / 32 * kX + 2 * RB, kLimit - 32);
              continue;
            }
            EXPECT_EQ(p.group, K / 32 < 32 || bb == 18 ? 4 : 2);
            EXPECT_EQ(p.rps % 2, 0);
            EXPECT_LE(p.smem, size_t(kLimit));
            EXPECT_LE(p.slots, ks::cuda::kBulkMaxSlots);
            EXPECT_EQ(p.grid, unsigned(std::min<int64_t>(N, sms)));
            expect_stages_fit(p, N, RB);
          }
}

// cuda_a8_resident's plan: 1 CTA per SM where rows have 32 blocks or more, else 2 (or N CTAs),
// every CTA's rows, x's blocks and the copies' slack within its shared memory, the whole grid
// within one wave of the SMs' shared memory, and the trigger at entry only where the call takes at
// most half of it or, at long rows, where one more CTA fits beside the call's on every SM (by shared
// memory and by registers at 64 a thread); 2 CTAs where rows are long and one CTA would take more than half: of 8
// warps where a third CTA then fits beside them, else 16; at short rows 12 warps per CTA where it
// has 24 rows or more, else 8. The H200's (132 SMs, 228 KB per SM, 227 KB per CTA) at the
// benchmark's shapes: 4096 x 4096 of every format (Q8_0 past half an SM at one CTA: two CTAs of 16
// rows and 8 warps, 2 x 76.9 KB with a third's 76.9 KB beside them, trigger at entry) and
// 49152 x 576 (past half: Q8_0's 2 CTAs fill all but 0.7 KB of an SM) resident, 14336 x 4096 not.
TEST(A8ResidentPlan, OneWavePerCallAndTheMeasuredChoices) {
  using ks::cuda::a8_resident_plan;
  const int64_t kSmem = 233472, kLimit = 232448, kX = 48;
  struct Want {
    int64_t N, K, block_bytes;
    unsigned grid;
    int64_t rows_cta;
    size_t smem;
    bool entry;
  };
  for (const Want& w : std::vector<Want>{{4096, 4096, 20, 132, 32, 6144 + 32 * 2560 + 32, true},
                                         {4096, 4096, 18, 132, 32, 6144 + 32 * 2304 + 32, true},
                                         {4096, 4096, 34, 264, 16, 6144 + 16 * 4352 + 32, true},
                                         {49152, 576, 20, 264, 187, 864 + 187 * 360 + 32, false},
                                         {49152, 576, 18, 264, 187, 864 + 187 * 324 + 32, false},
                                         {576, 576, 20, 264, 3, 864 + 3 * 360 + 32, true},
                                         {7, 64, 18, 7, 1, 96 + 36 + 32, true},
                                         {14336, 4096, 20, 0, 0, 0, false},
                                         {14336, 4096, 34, 0, 0, 0, false},
                                         {49152, 576, 34, 264, 187, 864 + 187 * 612 + 32, false}}) {
    SCOPED_TRACE(std::to_string(w.N) + "x" + std::to_string(w.K) + " block " + std::to_string(w.block_bytes));
    const auto p = a8_resident_plan(w.N, w.K, w.K / 32 * w.block_bytes, 132, kSmem, kLimit, kX);
    EXPECT_EQ(p.grid, w.grid);
    EXPECT_EQ(p.rows_cta, w.rows_cta);
    EXPECT_EQ(p.smem, w.smem);
    EXPECT_EQ(p.entry_trigger, w.entry);
    if (p.grid) {
      EXPECT_EQ(p.ctas_per_sm, (w.N >= 264 && w.K < 1024) || w.block_bytes == 34 ? 2 : 1);
    }
    if (p.grid) {
      EXPECT_EQ(p.rows_per_step, w.rows_cta >= 16 ? 4 : 2);
    }
    if (p.grid) {
      EXPECT_EQ(p.warps, w.K >= 1024 && w.block_bytes != 34 ? 16 : 8);
    }
  }
  // the padded rows' strides (a8_padded_row_bytes): Q4_0 4096 x 4096 keeps one CTA with room for the
  // next call's beside it; Q8_0 takes two CTAs, whose 2 x 80.5 KB leave no room for a third: 16
  // warps each, the trigger after the wait
  const auto q40 = a8_resident_plan(4096, 4096, 2304 + 15 * 16, 132, kSmem, kLimit, kX);
  EXPECT_EQ(q40.grid, 132u);
  EXPECT_EQ(q40.smem, size_t(6144 + 32 * 2544 + 32));
  EXPECT_TRUE(q40.entry_trigger);
  const auto q80 = a8_resident_plan(4096, 4096, 4352 + 7 * 32, 132, kSmem, kLimit, kX);
  EXPECT_EQ(q80.grid, 264u);
  EXPECT_EQ(q80.smem, size_t(6144 + 16 * 4576 + 32));
  EXPECT_EQ(q80.warps, 16);
  EXPECT_FALSE(q80.entry_trigger);
  // the third CTA's room counts registers too: forced 16 warps (3 x 16 x 32 x 64 > 65536), no trigger
  const auto q80w16 = a8_resident_plan(4096, 4096, 4352, 132, kSmem, kLimit, kX, 0, true, 16);
  EXPECT_EQ(q80w16.grid, 264u);
  EXPECT_FALSE(q80w16.entry_trigger);
  // forced rows per step: 2 gives 49152 x 576 its 12 warps (a pair of rows each), 4 gives 576 x 576 4
  const auto two = a8_resident_plan(49152, 576, 360, 132, kSmem, kLimit, kX, 0, true, 0, 0, 2);
  EXPECT_EQ(two.rows_per_step, 2);
  EXPECT_EQ(two.warps, 12);
  EXPECT_EQ(a8_resident_plan(576, 576, 360, 132, kSmem, kLimit, kX, 0, true, 0, 0, 4).rows_per_step, 4);
  EXPECT_EQ(a8_resident_plan(576, 576, 360, 132, kSmem, kLimit, kX, 0, true, 0, 0, 3).grid, 0u);
  // forced counts and sizes; nothing for empty or malformed shapes or sizes
  EXPECT_EQ(a8_resident_plan(4096, 4096, 2560, 132, kSmem, kLimit, kX, 2).grid, 264u);
  EXPECT_EQ(a8_resident_plan(4096, 4096, 2560, 132, kSmem, kLimit, kX, 4).grid, 528u);
  EXPECT_EQ(a8_resident_plan(4096, 4096, 2560, 132, kSmem, kLimit, kX, 0, true, 4).warps, 4);
  EXPECT_EQ(a8_resident_plan(4096, 4096, 2560, 132, kSmem, kLimit, kX, 0, true, 17).grid, 0u);
  EXPECT_EQ(a8_resident_plan(0, 4096, 2560, 132, kSmem, kLimit, kX).grid, 0u);
  // the kernel's static shared memory counts per CTA: Q8_0 49152 x 576's two CTAs (115340 dynamic
  // bytes each) fit with 16 static bytes and not with 400 (2 x (115840 + 1024) > 233472)
  EXPECT_EQ(a8_resident_plan(49152, 576, 612, 132, kSmem, kLimit, kX, 0, true, 0, 16).grid, 264u);
  EXPECT_EQ(a8_resident_plan(49152, 576, 612, 132, kSmem, kLimit, kX, 0, true, 0, 400).grid, 0u);
  EXPECT_EQ(a8_resident_plan(8, 16, 10, 132, kSmem, kLimit, kX).grid, 0u);
  // several waves allowed (a measurement): 14336 x 4096 Q4_1 at 8 per SM, 14 rows per CTA
  const auto waves = a8_resident_plan(14336, 4096, 2560, 132, kSmem, kLimit, kX, 8, false);
  EXPECT_EQ(waves.grid, 1056u);
  EXPECT_EQ(waves.rows_cta, 14);
  for (int64_t bb : {18, 20, 34})
    for (int64_t K : {32, 64, 576, 992, 1024, 4096, 14336, 32768, 65536})
      for (int64_t N : {1, 7, 131, 264, 265, 4096, 4105, 14336, 49152, 600005})
        for (int sms : {1, 8, 132})
          for (int force : {0, 1, 3, 8}) {
            const int64_t RB = K / 32 * bb;
            const auto p = a8_resident_plan(N, K, RB, sms, kSmem, kLimit, kX, force);
            SCOPED_TRACE("N=" + std::to_string(N) + " K=" + std::to_string(K) + " block " + std::to_string(bb) +
                         " sms=" + std::to_string(sms) + " force=" + std::to_string(force));
            // a grid of c CTAs per SM: its CTAs' rows, bytes, whether it fits one wave, and whether
            // the next call's CTAs fit beside it
            struct Shape {
              int64_t grid, rows, need, per_sm;
              bool fits, beside;
            };
            // (w warps a CTA at 64 registers a thread: the next call's CTAs beside it all by shared
            // memory, or at long rows one more per SM by shared memory and registers)
            auto shape = [&](int c, int w) {
              Shape r{};
              r.grid = std::min<int64_t>(N, int64_t(sms) * c);
              r.rows = (N + r.grid - 1) / r.grid;
              r.need = K / 32 * kX + r.rows * RB + 32;
              r.per_sm = (r.grid + sms - 1) / sms;
              const int64_t cta = (r.need + 127) / 128 * 128 + 1024;  // (128-byte units, the runtime's 1 KB)
              r.fits = r.need <= kLimit && r.per_sm * cta <= kSmem;
              r.beside = 2 * r.per_sm * cta <= kSmem ||
                         (K >= 1024 && (r.per_sm + 1) * cta <= kSmem && (r.per_sm + 1) * w * 32 * 64 <= 65536);
              return r;
            };
            int c = force ? force : K >= 1024 ? 1 : 2;
            int w = c > 2 ? 8 : K >= 1024 ? 16 : 8;
            // long rows, one CTA past half an SM, enough rows for two per SM: two CTAs where they
            // fit, of 8 warps where the next call's CTA then fits beside them, else of 16
            if (!force && c == 1 && shape(1, 16).fits && !shape(1, 16).beside && N >= 2 * sms) {
              if (shape(2, 8).fits && shape(2, 8).beside)
                c = 2, w = 8;
              else if (shape(2, 16).fits)
                c = 2;
            }
            const Shape sh = shape(c, w);
            ASSERT_EQ(p.grid != 0, sh.fits);
            if (!sh.fits) continue;
            const int64_t grid = sh.grid, need = sh.need;
            EXPECT_EQ(p.grid, unsigned(grid));
            EXPECT_LE(p.ctas_per_sm, c);
            EXPECT_EQ(p.rows_per_step, sh.rows >= 16 ? 4 : 2);
            EXPECT_EQ(p.warps, w);
            EXPECT_EQ(p.entry_trigger, sh.beside);
            // every CTA's rows (grid-split as the kernel splits them) within rows_cta, and their
            // widened byte range inside the CTA's shared memory beside x
            for (int64_t b = 0; b < grid; b += std::max<int64_t>(1, grid / 9)) {
              const int64_t r0 = b * N / grid, r1 = (b + 1) * N / grid;
              ASSERT_GE(r1 - r0, 1);
              ASSERT_LE(r1 - r0, p.rows_cta);
              EXPECT_LE(K / 32 * kX + 15 + (r1 - r0) * RB + 15 + 2, int64_t(p.smem));
            }
          }
}

// cuda_a8_resident's padded rows (a8_row_pad): a warp's 32 lanes read blocks 32 i .. 32 i + 31 of a
// row, each the 4-byte words covering its block from the word at or just before its start (the
// kernel's a8_load_block: Q4_0 / Q8_0 blocks are 2-byte aligned). Padded, each of those loads
// touches 32 distinct banks at every i; in memory's layout, Q4_0 and Q8_0 put two words in a bank
// (two passes per load), Q4_1 none. Also the offsets: the groups are whole 16-byte pieces apart.
TEST(A8RowPad, OneBankPerLaneInEveryWordLoad) {
  using ks::cuda::a8_padded_block_offset;
  using ks::cuda::a8_padded_row_bytes;
  using ks::cuda::a8_row_pad;
  using ks::cuda::A8RowPad;
  auto worst_pass = [](int64_t bb, A8RowPad pad, int64_t nb) {  // most words in one bank, any load
    const int words = bb == 34 ? 9 : 5;
    int worst = 0;
    for (int64_t i = 0; 32 * i < nb; ++i)
      for (int j = 0; j < words; ++j) {
        std::map<int64_t, std::set<int64_t>> banks;
        for (int64_t lane = 0; lane < 32 && 32 * i + lane < nb; ++lane) {
          const int64_t at = a8_padded_block_offset(32 * i + lane, bb, pad);
          const int64_t word = (at - (at & 2)) / 4 + j;
          banks[word % 32].insert(word);
        }
        for (const auto& kv : banks) worst = std::max(worst, int(kv.second.size()));
      }
    return worst;
  };
  for (int64_t nb : {8, 40, 128, 448, 1024}) {
    SCOPED_TRACE("blocks " + std::to_string(nb));
    EXPECT_EQ(worst_pass(18, a8_row_pad(18), nb), 1);
    EXPECT_EQ(worst_pass(34, a8_row_pad(34), nb), 1);
    EXPECT_EQ(worst_pass(18, A8RowPad{}, nb), nb >= 16 ? 2 : 1);
    EXPECT_EQ(worst_pass(34, A8RowPad{}, nb), nb >= 16 ? 2 : 1);
    EXPECT_EQ(worst_pass(20, a8_row_pad(20), nb), 1);  // (Q4_1: no pad, none needed)
  }
  EXPECT_EQ(a8_row_pad(20).group_blocks, 0);
  EXPECT_EQ(a8_padded_row_bytes(2560, 20, a8_row_pad(20)), 2560);
  EXPECT_EQ(a8_padded_row_bytes(2304, 18, a8_row_pad(18)), 2304 + 15 * 16);  // 16 groups of 8
  EXPECT_EQ(a8_padded_row_bytes(4352, 34, a8_row_pad(34)), 4352 + 7 * 32);   // 8 groups of 16
  EXPECT_EQ(a8_padded_row_bytes(1360, 34, a8_row_pad(34)), 1360 + 2 * 32);   // 40 blocks: 16 + 16 + 8
  for (int64_t bb : {18, 34}) {
    const A8RowPad pad = a8_row_pad(bb);
    EXPECT_EQ(pad.group_blocks * bb % 16, 0);
    EXPECT_EQ(pad.pad_bytes % 16, 0);
    EXPECT_EQ(a8_padded_block_offset(pad.group_blocks, bb, pad), pad.group_blocks * bb + pad.pad_bytes);
    EXPECT_EQ(a8_padded_block_offset(pad.group_blocks - 1, bb, pad), (pad.group_blocks - 1) * bb);
  }
}

// KS_PDL_OFF's list: exact names between commas, empty items skipped.
TEST(PdlOffList, NamesExactOpsOnly) {
  using ks::cuda::name_in_list;
  EXPECT_TRUE(name_in_list("paged_attention", "paged_attention"));
  EXPECT_TRUE(name_in_list("rotary_embedding_kv_append,paged_attention", "paged_attention"));
  EXPECT_TRUE(name_in_list(",,paged_attention,", "paged_attention"));
  EXPECT_TRUE(name_in_list("a,b,c", "b"));
  EXPECT_FALSE(name_in_list("paged_attention", "paged"));
  EXPECT_FALSE(name_in_list("paged", "paged_attention"));
  EXPECT_FALSE(name_in_list("rotary_embedding_kv_append_paged_attention", "paged_attention"));
  EXPECT_FALSE(name_in_list("paged_attention ", "paged_attention"));
  EXPECT_FALSE(name_in_list("", "paged_attention"));
  EXPECT_FALSE(name_in_list(",", "paged_attention"));
  EXPECT_FALSE(name_in_list(nullptr, "paged_attention"));
  EXPECT_FALSE(name_in_list("a,,b", ""));
}

// cuda_mma_rows' plan (launch_rules.hpp rows_plan) on the H200 (132 SMs, 227 KB of opt-in shared
// memory per CTA), fp32 x, SmolLM2's matrices: the launch records of bench_ops at a465d94
// (docs/perf/h200_qmm_rows_a465d94.csv) where the rule has not changed since, and where it has
// (2d7c6fb: one group fewer where that stages the whole row instead of chunks), the plans that
// a465d94 measured under KS_QMM_ROWS_GROUPS (27.8 against 38.1 us at 512 rows of 576 x 576, 147
// against 162 at 512 rows of 3072 x 576, 14.5 against 15.3 at 32 rows, 24.3 against 28.4 at 64,
// 15.0 against 16.3 at 64 rows of 576 x 1536).
TEST(MmaRowsPlan, ReproducesTheMeasuredPlans) {
  using ks::cuda::rows_plan;
  const int64_t kLimit = 232448;
  struct Want {
    int64_t M, N, K;
    bool q41;
    int mt, rg, kc;
    size_t smem;
    int64_t gx, gy;
  };
  for (const Want& w : std::vector<Want>{
           // unchanged since a465d94's records
           {2, 576, 576, true, 1, 1, 18, 32320, 36, 1},
           {16, 576, 576, true, 1, 1, 18, 32320, 36, 2},
           {32, 576, 576, true, 1, 1, 18, 32320, 36, 4},
           {64, 576, 576, true, 1, 2, 18, 64640, 36, 4},
           {8, 3072, 576, true, 1, 1, 18, 32320, 192, 1},
           {16, 3072, 576, true, 1, 2, 18, 64640, 192, 1},
           {32, 576, 1536, true, 1, 1, 48, 79360, 36, 4},
           {512, 576, 1536, true, 1, 4, 8, 66560, 36, 16},
           {16, 49152, 576, false, 8, 2, 18, 63488, 384, 1},
           {32, 49152, 576, false, 8, 4, 16, 114688, 384, 1},
           {512, 49152, 576, false, 8, 4, 16, 114688, 384, 16},
           // changed by 2d7c6fb: the whole row staged with one group fewer, then evened out
           {512, 576, 576, true, 1, 3, 18, 96960, 36, 22},
           {32, 3072, 576, true, 1, 2, 18, 64640, 192, 2},
           {64, 3072, 576, true, 1, 3, 18, 96960, 192, 3},
           {512, 3072, 576, true, 1, 3, 18, 96960, 192, 22},
           {64, 576, 1536, true, 1, 1, 48, 79360, 36, 8},
       }) {
    SCOPED_TRACE("M=" + std::to_string(w.M) + " " + std::to_string(w.N) + "x" + std::to_string(w.K));
    const auto p = rows_plan(w.M, w.N, w.K, /*fp32=*/true, w.q41, 132, kLimit);
    EXPECT_EQ(p.mt, w.mt);
    EXPECT_EQ(p.rg, w.rg);
    EXPECT_EQ(p.kc, w.kc);
    EXPECT_EQ(p.smem, w.smem);
    EXPECT_EQ(p.grid_x, w.gx);
    EXPECT_EQ(p.grid_y, w.gy);
  }
}

// The plan's invariants over many shapes, devices and switches: kc is the whole row or a
// multiple of 8 blocks (a warp's blocks keep their order however K is chunked: the sums' order
// depends on N, K and the format only), the shared memory fits the limit (or the plan declines
// with smem = 0, and only where not even one group's 8 blocks fit), every row range of x is
// covered, mt depends on N alone, and the switches act as documented.
TEST(MmaRowsPlan, KeepsItsInvariantsAndSwitches) {
  using ks::cuda::rows_plan;
  for (int64_t limit : {int64_t(232448), int64_t(101376), int64_t(49152), int64_t(20000), int64_t(10000)})
    for (int sms : {16, 84, 132, 170})
      for (bool fp32 : {true, false})
        for (bool q41 : {true, false})
          for (int64_t M : {0, 1, 7, 8, 9, 31, 33, 64, 100, 512, 4097})
            for (int64_t N : {16, 576, 960, 3072, 49152})
              for (int64_t K : {0, 32, 576, 1536, 4096, 14336}) {
                SCOPED_TRACE("limit " + std::to_string(limit) + " sms " + std::to_string(sms) + " M=" +
                             std::to_string(M) + " N=" + std::to_string(N) + " K=" + std::to_string(K) +
                             (fp32 ? " fp32" : " 16-bit") + (q41 ? " q4_1" : ""));
                const auto p = rows_plan(M, N, K, fp32, q41, sms, limit);
                const int64_t nb = K / 32, groups = (M + 7) / 8;
                EXPECT_EQ(p.mt, rows_plan(1, N, 32, false, false, 1, 232448).mt);  // N alone
                EXPECT_TRUE(p.mt == 1 || p.mt == 2 || p.mt == 4 || p.mt == 8);
                EXPECT_GE(p.rg, 1);
                EXPECT_LE(p.rg, ks::cuda::kRowsMaxGroups);
                EXPECT_EQ(p.grid_x, ((N + 15) / 16 + p.mt - 1) / p.mt);
                EXPECT_EQ(p.grid_y, (groups + p.rg - 1) / p.rg);
                EXPECT_GE(p.grid_y * p.rg * 8, M);  // every row covered
                const int64_t pieces = fp32 ? 3 : 1, per_block = p.rg * (pieces * 512 + (q41 ? 32 : 0));
                const int64_t part = int64_t(ks::cuda::kRowsWarps) * 16 * p.rg * 8 * 4;
                if (p.smem == 0) {  // declined: one group's 8 blocks do not fit
                  EXPECT_GT(std::min<int64_t>(std::max<int64_t>(nb, 1), 8) * (pieces * 512 + (q41 ? 32 : 0)) +
                                ks::cuda::kRowsWarps * 16 * 8 * 4,
                            limit);
                  continue;
                }
                EXPECT_LE(int64_t(p.smem), limit);
                EXPECT_EQ(int64_t(p.smem), p.kc * per_block + part);
                EXPECT_TRUE(p.kc == std::max<int64_t>(nb, 1) || p.kc % 8 == 0) << p.kc;
                if (p.kc != std::max<int64_t>(nb, 1)) {
                  EXPECT_LT(p.kc, nb);
                }
              }
  // the switches: forced groups (at most the call's), the stage budget
  EXPECT_EQ(rows_plan(512, 576, 576, true, true, 132, 232448, 4).rg, 4);
  EXPECT_EQ(rows_plan(512, 576, 576, true, true, 132, 232448, 4).kc, 8);  // 4 groups: chunks of 8
  EXPECT_EQ(rows_plan(512, 576, 576, true, true, 132, 232448, 3).grid_y, 22);  // 3 forced: not evened out
  EXPECT_EQ(rows_plan(8, 576, 576, true, true, 132, 232448, 4).rg, 1);  // one group in the call
  EXPECT_EQ(rows_plan(32, 3072, 576, true, true, 132, 232448, 0, 64).rg, 4);  // 3 groups do not fit 64 KB whole
  EXPECT_EQ(rows_plan(32, 3072, 576, true, true, 132, 232448, 0, 64).kc, 8);
  EXPECT_EQ(rows_plan(32, 3072, 576, true, true, 132, 232448, 0, 7).kc, 18);  // out of range: the default 96 KB
}

// The three bf16 pieces of fp32 x (mma_x_staging.hpp, cuda_mma_rows' staging): each piece's
// pattern is the upper half of an FP32 value (the lower half zero); piece 0 is v rounded toward
// zero to bf16, piece 1 the remainder rounded toward zero, piece 2 the rest, and the three add up
// to v exactly for every finite v of magnitude 2^-110 or more (FP64 sum), below it to within
// 2^-133 (bf16's smallest subnormal: the bits under it are dropped, toward zero); a non-finite v is
// all in piece 0 (a NaN as the canonical 0x7FFF); over edge values and 2,000,000 random bit patterns.
TEST(Bf16Pieces, ExactSplitOfEveryFloat) {
  using ks::cuda::bf16_piece_words;
  using ks::bits_to_f32;
  using ks::f32_to_bits;
  auto check = [](uint32_t bits) {
    const float v = bits_to_f32(bits);
    uint32_t w[3];
    bf16_piece_words(v, w);
    for (uint32_t x : w) ASSERT_EQ(x & 0xffffu, 0u) << std::hex << bits;
    if (std::isnan(v)) {
      ASSERT_EQ(w[0], 0x7fff0000u) << std::hex << bits;
      ASSERT_EQ(w[1] | w[2], 0u) << std::hex << bits;
      return;
    }
    if (std::isinf(v)) {
      ASSERT_EQ(w[0], bits) << std::hex << bits;
      ASSERT_EQ(w[1] | w[2], 0u) << std::hex << bits;
      return;
    }
    ASSERT_EQ(w[0], bits & 0xffff0000u) << std::hex << bits;  // rz: the upper half
    const double p0 = bits_to_f32(w[0]), p1 = bits_to_f32(w[1]), p2 = bits_to_f32(w[2]);
    const double sum = p0 + p1 + p2;  // (exact: each term has at most 8 significant bits)
    if (std::fabs(v) >= std::ldexp(1.0, -110)) {
      ASSERT_EQ(sum, double(v)) << std::hex << bits;
    } else {
      ASSERT_LT(std::fabs(double(v) - sum), std::ldexp(1.0, -133)) << std::hex << bits;
      ASSERT_LE(std::fabs(sum), std::fabs(double(v))) << std::hex << bits;  // toward zero
    }
    const float r1 = v - bits_to_f32(w[0]);  // (exact)
    ASSERT_EQ(w[1], f32_to_bits(r1) & 0xffff0000u) << std::hex << bits;
    ASSERT_EQ(w[2], f32_to_bits(r1 - bits_to_f32(w[1])) & 0xffff0000u) << std::hex << bits;
  };
  for (uint32_t b : {0x00000000u, 0x80000000u, 0x00000001u, 0x807fffffu, 0x00800000u, 0x7f7fffffu, 0xff7fffffu,
                     0x3f800000u, 0x3f800001u, 0x3fffffffu, 0x7f800000u, 0xff800000u, 0x7fc00000u, 0x7f800001u,
                     0xffffffffu, 0x7fff0001u, 0x0000ffffu, 0x3effff00u})
    check(b);
  std::mt19937 rng(12345);
  for (int i = 0; i < 2000000; ++i) check(uint32_t(rng()));
}

// div_by_magic(n, div_magic(d)) == n / d for every n < 2^16 at every width from 2 to 255 and every
// multiple of 4 up to 4096 (cuda_mma_rows' staging divides by 4 kc).
TEST(Bf16Pieces, SmallDivisionByMagic) {
  using ks::cuda::div_by_magic;
  using ks::cuda::div_magic;
  auto check = [](uint32_t d) {
    const uint32_t m = div_magic(d);
    for (uint32_t n = 0; n < 65536u; ++n)
      if (div_by_magic(n, m) != n / d) {
        ADD_FAILURE() << n << " / " << d;
        return;
      }
  };
  for (uint32_t d = 2; d < 256; ++d) check(d);
  for (uint32_t d = 256; d <= 4096; d += 4) check(d);
}
