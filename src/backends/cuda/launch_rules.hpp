// Host-side launch rules of the CUDA backend (plain C++: unit-tested without a
// GPU or nvcc against the configurations measured on the H200).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace ks::cuda {

// Launch shape shared by the row-group kernels (rms_norm, fused_add_rms_norm,
// softmax): W warps own a row of hv vectors, each thread caching nv of them.
// About four vectors per thread with at most 16 warps; rows wider than 8
// vectors per thread (4 on the scalar path) use the uncached kernel (nv = 0)
// with 32 warps. Small W packs max(1, 4 / W) rows into a CTA.
struct RowGroupConfig {
  int nv, warps_per_row, rows_per_cta, threads, grid;
};
inline int pow2_ceil(int64_t v) {
  int p = 1;
  while (p < v) p <<= 1;
  return p;
}
inline RowGroupConfig row_group_config(int64_t rows, int64_t hv, bool scalar, int sm_count) {
  RowGroupConfig c{};
  c.warps_per_row = pow2_ceil((hv + 127) / 128);
  if (c.warps_per_row > 16) c.warps_per_row = 16;
  const int64_t need = (hv + 32 * c.warps_per_row - 1) / (32 * c.warps_per_row);
  c.nv = need <= 1 ? 1 : need <= 2 ? 2 : need <= 4 ? 4 : need <= 8 ? 8 : 0;
  if (scalar && c.nv > 4) c.nv = 0;  // scalar path: keep register arrays small
  if (c.nv == 0) c.warps_per_row = 32;
  c.rows_per_cta = c.warps_per_row >= 4 ? 1 : 4 / c.warps_per_row;
  c.threads = 32 * c.warps_per_row * c.rows_per_cta;
  const int64_t ctas = (rows + c.rows_per_cta - 1) / c.rows_per_cta;
  c.grid = int(ctas < int64_t(sm_count) * 64 ? ctas : int64_t(sm_count) * 64);
  return c;
}

// rms_norm / fused_add_rms_norm load the weights together with the row (one memory
// round trip instead of a second one after the reduction) while the grid is at most
// ctas_per_sm CTAs per SM (default 8: measured on the H200, 512 x 4096 bf16
// 4.97 -> 4.04 us, larger grids unchanged; beyond it the preloading variants' extra
// registers cost rows in flight).
inline bool preload_weights(int64_t ctas, int sm_count, int64_t ctas_per_sm = 8) {
  return ctas <= ctas_per_sm * int64_t(sm_count);
}

// Softmax's cluster path: C CTAs split a row; each thread holds NV 16-byte vectors in
// registers (NV > 8 only with 128 or 256 threads; 128-thread CTAs let more clusters
// be co-resident when registers, not threads, bound a CTA per SM), or NV = 0: each CTA stages its slice in
// shared memory (256 threads, slices up to 160 KB).
// Register candidates: among every one whose co-resident cluster count
// `active(nv, c, threads, smem_bytes)` is > 0, the fewest waves (each wave pays the
// whole load -> cluster exchange -> store chain); ties: the smallest NV, then the
// smallest C. Staging (C = 8, or the pinned C) replaces that choice when smem_mode is
// 2 (always), or 1 (auto) and the register choice needs >= 4 waves. Measured on the H200
// (commit b2f1832, us, register choice -> staging C = 8): bf16 64x32000 (1 wave) 7.1 ->
// 7.4, 64x128256 (2 waves) 16.0 -> 15.4, 256x151936 (9 waves) 66.9 -> 55.0; fp32
// 64x128256 (3 waves) 25.7 -> 28.8, 256x151936 (19 waves) 127.0 -> 104.3.
// forced_c != 0 keeps only that C. report(...) sees every candidate (debug output).
constexpr int kClusterNvs[] = {2, 4, 6, 8, 12, 16};
constexpr int kClusterSizes[] = {2, 4, 8, 16};
constexpr int kClusterThreadCounts[] = {128, 256, 512};
constexpr int kStagingCluster = 8, kStagingThreads = 256, kStagingMinWaves = 4;
struct ClusterChoice {
  int cluster = 0, threads = 0, nv = 0, active = 0;  // cluster 0: none launchable
  int64_t waves = 0;
  int64_t slice = 0;  // vectors per CTA
};
template <class Active, class Report>
ClusterChoice choose_cluster(int64_t rows, int64_t hv, int forced_c, int smem_mode, Active&& active,
                             Report&& report) {
  ClusterChoice best;
  double best_cost = 0;
  for (int c : kClusterSizes) {
    if (forced_c && c != forced_c) continue;
    for (int th : kClusterThreadCounts) {
      const int64_t per_thread = (hv + int64_t(c) * th - 1) / (int64_t(c) * th);
      int nv = 0;
      for (int v : kClusterNvs)
        if (!nv && per_thread <= v && (v <= 8 || th <= 256)) nv = v;
      if (!nv) continue;
      const int n = active(nv, c, th, int64_t(0));
      const int64_t waves = n > 0 ? (rows + n - 1) / n : 0;
      report(c, th, nv, int64_t(0), n, waves);
      if (n <= 0) continue;
      const double cost = double(waves) * 1e4 + nv * 100 + c;  // lexicographic (waves, NV, C)
      if (best.cluster == 0 || cost < best_cost) {
        best_cost = cost;
        best = ClusterChoice{c, th, nv, n, waves, 0};
      }
    }
  }
  const int cs = forced_c ? forced_c : kStagingCluster;
  const int64_t slice_bytes = (hv + cs - 1) / cs * 16;
  // Queried only when it could be chosen (mode 2, or auto after a >= 4-wave register choice).
  const bool may_stage = smem_mode == 2 || (smem_mode == 1 && (best.cluster == 0 || best.waves >= kStagingMinWaves));
  if (may_stage && slice_bytes <= 160 * 1024) {
    const int n = active(0, cs, kStagingThreads, slice_bytes);
    const int64_t waves = n > 0 ? (rows + n - 1) / n : 0;
    report(cs, kStagingThreads, 0, slice_bytes, n, waves);
    if (n > 0) best = ClusterChoice{cs, kStagingThreads, 0, n, waves, 0};
  }
  if (best.cluster) best.slice = (hv + best.cluster - 1) / best.cluster;
  return best;
}

// paged_attention, cuda_mma_cluster with few (token, kv head) units (8 warps per CTA): the CTAs
// each unit's keys are split over beyond one cluster. S = min(SMs / units, capacity /
// split_keys) CTAs of one SM each (one wave), taken when S exceeds the cluster size C and a
// cluster CTA would read at least min_cta_bytes of K and V (capacity / C keys of head_dim
// elements, K and V); else 1 (no split: the cluster of C). Measured on the H200 (docs/cuda.md):
// below 256 KB per cluster CTA the workspace and the combine kernel cost more than the SMs
// gained (9/3 heads of 64, 8192 keys: 12.95 us split 32 ways against 11.38 on clusters of 16).
inline int64_t attention_splits(int64_t units, int64_t capacity, int sm_count, int C, int64_t head_dim,
                                int64_t elem_bytes, int64_t split_keys, int64_t min_cta_bytes) {
  if (units <= 0 || C <= 0 || split_keys <= 0) return 1;
  const int64_t S = std::min(int64_t(sm_count) / units, capacity / split_keys);
  const int64_t cta_bytes = capacity / C * 2 * head_dim * elem_bytes;
  return S > C && cta_bytes >= min_cta_bytes ? S : 1;
}


// argmax's cluster per row (model_ops.cu, sm_90): doubled while the rows at twice the cluster
// still fit two CTAs per SM and each CTA keeps at least 8000 elements, up to max_cluster (16; the
// launcher falls back to 8 where a cluster of 16 cannot be resident). The H200 at adba7d4, every
// size forced in one call (docs/perf/h200_followup_adba7d4.csv, bf16): 1 x 128256 C = 16 3.67 us
// (8: 3.94, 4: 4.96, 1: 11.02); 64 x 128256 C = 4 13.11 (1: 14.34, 8: 14.75, 16: 22.14);
// 256 x 151936 C = 1 27.60 (2: 30.82, 4: 39.61, 16: 76.19).
inline int argmax_cluster(int64_t rows, int64_t cols, int sm_count, int max_cluster) {
  int C = 1;
  while (2 * C <= max_cluster && rows * 2 * C <= 2 * int64_t(sm_count) && cols >= int64_t(2 * C) * 8000) C *= 2;
  return C;
}

// quant_matmul's cuda_mma_rows (quant_mma.cu): the plan of M rows of x times an N x K matrix.
// mt weight tiles of 16 rows per CTA from N alone (1, 2, 4 or 8: at least 128 CTAs of rows
// where N allows; the sums' order depends on it: a CTA's 8 warps are mt tiles x 8 / mt splits of
// K). rg groups of 8 rows of x per CTA (in no sum's order): the largest of 4, 3, 2, 1 that leaves
// a CTA per SM, else 1; one fewer where K is split over the warps (mt < 8) and one fewer stages
// the whole row while rg would need chunks; then evened out: the fewest groups per CTA for that
// many CTAs along y (4 groups go 2 + 2, not 3 + 1). kc blocks per staged chunk: the whole row
// where it fits the stage budget (stage_kb, default 96 KB, and the device's limit), else a
// multiple of 8 (either way a warp's blocks keep their order). smem_limit: the kernel's dynamic
// shared memory limit on the device; the budget shrinks to fit it, then rg; smem = 0 when not
// even one group's 8 blocks fit (the variant declines). forced_groups 1..4 (experiments) sets rg
// (at most the call's groups; 0: the rule); stage_kb outside 8..200 means the default.
// Measured on the H200 (fp32 x, SmolLM2's matrices):
// - a CTA per SM, not two: at 16 rows of 3072 x 576, 2 groups in 192 CTAs took 8.01 us and 1
//   group in 384 9.73; at 32 rows 3 + 1 groups in 384 CTAs 17.4 against 15.2 for 4 in 192 and
//   14.6 for 1 in 768 (37a61f2);
// - chunks of 8 blocks leave a split's warps idle in a short last chunk: at 512 rows, 3 groups
//   staging the whole row of 18 blocks took 27.8 us for 576 x 576 and 147 for 3072 x 576 against
//   38.1 and 162 for 4 in chunks of 8, 8 and 2; at 64 rows of 576 x 1536, 1 group (whole rows)
//   15.0 against 16.3 for 2 (chunks) (a465d94, KS_QMM_ROWS_GROUPS rows); with mt = 8 (no split)
//   the chunks cost no idle warps.
constexpr int kRowsWarps = 8;
constexpr int kRowsMaxGroups = 4;
constexpr int64_t kRowsStageKb = 96;  // a chunk's staged x (about): two CTAs per SM
struct RowsPlan {
  int mt = 1, rg = 1, kc = 8;
  size_t smem = 0;
  int64_t grid_x = 0, grid_y = 0;  // CTAs of weight rows, of x rows (before any cap on y)
};
inline RowsPlan rows_plan(int64_t M, int64_t N, int64_t K, bool fp32, bool q41, int sm_count, int64_t smem_limit,
                          int forced_groups = 0, int64_t stage_kb = 0) {
  RowsPlan s;
  const int64_t ntiles = (N + 15) / 16, groups = (M + 7) / 8, nb = K / 32;
  while (s.mt < 8 && ntiles / (2 * s.mt) >= 128) s.mt *= 2;
  const int64_t xctas = (ntiles + s.mt - 1) / s.mt;
  s.rg = int(std::clamp<int64_t>(groups, 1, kRowsMaxGroups));  // (M = 0: one group, nothing launched)
  while (s.rg > 1 && xctas * ((groups + s.rg - 1) / s.rg) < int64_t(sm_count)) --s.rg;
  const int pieces = fp32 ? 3 : 1;
  const int64_t wanted = (stage_kb >= 8 && stage_kb <= 200 ? stage_kb : kRowsStageKb) * 1024;
  // a chunk's staged bytes per block (B's pairs, Q4_1's X sums) and the splits' partial sums, at rg groups
  auto per_block = [&](int rg) { return int64_t(rg) * (pieces * 512 + (q41 ? 32 : 0)); };
  auto part_bytes = [&](int rg) { return int64_t(kRowsWarps) * 16 * rg * 8 * int64_t(sizeof(float)); };
  auto whole_row = [&](int rg) { return nb * per_block(rg) <= std::min(wanted, smem_limit - part_bytes(rg)); };
  if (s.mt < 8 && s.rg > 1 && !whole_row(s.rg) && whole_row(s.rg - 1)) --s.rg;
  const int64_t ny = std::max<int64_t>(1, (groups + s.rg - 1) / s.rg);  // (M = 0: groups = 0)
  s.rg = int(std::max<int64_t>(1, (groups + ny - 1) / ny));
  if (forced_groups >= 1 && forced_groups <= kRowsMaxGroups) s.rg = int(std::clamp<int64_t>(groups, 1, forced_groups));
  for (;; --s.rg) {
    const int64_t pb = per_block(s.rg), part = part_bytes(s.rg);
    const int64_t budget = std::min(wanted, smem_limit - part);
    s.kc = nb * pb <= budget ? int(std::max<int64_t>(nb, 1)) : int(std::max<int64_t>(8, budget / pb / 8 * 8));
    s.smem = size_t(s.kc * pb + part);
    if (int64_t(s.smem) <= smem_limit) break;
    if (s.rg == 1) {
      s.smem = 0;
      break;
    }
  }
  s.grid_x = xctas;
  s.grid_y = (groups + s.rg - 1) / s.rg;
  return s;
}

// quant_matmul's cuda_bulk_stream (one row of x, model_ops.cu): the plan of an N x K matrix of
// row_bytes-byte rows on sm_count SMs with `limit` bytes of dynamic shared memory per CTA and
// stages of about `target` bytes. A CTA per SM (at most one per row) owns a contiguous range of
// at most rows_cta rows and streams it through `slots` slots of `slot_bytes` (whole rows widened
// to 16-byte boundaries: rows * row_bytes + up to 15 bytes on each side); x as floats (36 per
// block of 32) and, for rows of fewer than 32 blocks, each consumer warp's row of `group` x
// blocks sums share the CTA's memory. slots == 0: the call does not fit (the variant declines).
constexpr int kBulkWarps = 16;    // consumer warps per CTA (one more warp issues the copies)
constexpr int kBulkMaxSlots = 8;  // mbarrier pairs per CTA
struct BulkPlan {
  int rps = 0, slot_bytes = 0, slots = 0, group = 0;
  unsigned grid = 0;
  size_t smem = 0;
};
// The bulk plans' last step: from rps rows per stage down (by `unit` rows, then by `step`) to the
// first whose stages (rows widened to 16-byte boundaries) fit two slots beside `fixed` bytes in
// `limit` (or one where the CTA has one stage); slots < 1 (an empty plan) where none fits.
inline BulkPlan bulk_fit_stages(int64_t rps, int64_t unit, int64_t step, int64_t rows_cta, int64_t RB, int64_t fixed,
                                int64_t limit, int64_t group, int64_t grid) {
  int64_t slot = 0, slots = 0;
  for (;; rps -= rps > unit ? unit : step) {
    slot = (rps * RB + 30) / 16 * 16;  // a stage's rows, widened to 16-byte boundaries
    const int64_t stages = (rows_cta + rps - 1) / rps;
    slots = std::min<int64_t>({kBulkMaxSlots, stages, limit > fixed ? (limit - fixed) / slot : 0});
    if (slots >= std::min<int64_t>(2, stages) || rps <= step) break;
  }
  BulkPlan b;
  if (slots < 1) return b;
  b.rps = int(rps);
  b.slot_bytes = int(slot);
  b.slots = int(slots);
  b.group = int(group);
  b.grid = unsigned(grid);
  b.smem = size_t(slots * slot + fixed);
  return b;
}
inline BulkPlan bulk_plan(int64_t N, int64_t K, int64_t row_bytes, int sm_count, int64_t limit, int64_t target) {
  BulkPlan b;
  const int64_t RB = row_bytes;
  if (N <= 0 || K < 32 || RB <= 0 || sm_count <= 0 || target <= 0) return b;
  const int64_t nb = K / 32, grid = std::min<int64_t>(N, sm_count), rows_cta = (N + grid - 1) / grid;
  // Short rows: a warp's group of rows, the fewest whose blocks keep >= 90% of its lanes busy
  // two items at a time (SmolLM2's 18 blocks: 7 rows, 126 items in 2 x 64 lane slots).
  int64_t group = 1;
  double best = 0;
  for (int64_t g = 1; g <= 32; ++g) {
    const double use = double(g * nb) / double(64 * ((g * nb + 63) / 64));
    if (use > best + 1e-9) best = use, group = g;
    if (use >= 0.9) break;
  }
  group = nb >= 32 ? 1 : std::min(group, rows_cta);  // (long rows: a warp takes rows in pairs, no sums kept)
  const int64_t fixed = nb * 36 * 4 + (nb < 32 ? int64_t(kBulkWarps) * group * nb * 4 : 0);  // x as floats, sums
  // Rows per stage: whole rounds of the warps' units (row pairs or groups; each warp then gets as
  // many units per stage as the others) within about `target` bytes, one round if that is more;
  // no more than the CTA's rows; fewer (whole rounds, then whole groups) where two slots would
  // not fit.
  const int64_t unit = (nb >= 32 ? 2 : group) * kBulkWarps;
  int64_t rps = std::max<int64_t>(target / RB / unit, 1) * unit;
  rps = std::min(rps, (rows_cta + group - 1) / group * group);
  return bulk_fit_stages(rps, unit, group, rows_cta, RB, fixed, limit, group, grid);
}
// cuda_a8_bulk_stream's plan (quant_matmul_a8): its warps take a stage's rows in groups of
// `group` (rows per warp step: one load of x's blocks serves them), dealt in turn across stages,
// so a stage may hold any even number of rows: about `target` bytes of them (at least a pair); x
// takes x_block_bytes per block of 32. Rows per step: 4 where a row has fewer than 32 blocks
// (K < 1024) or the blocks are Q4_0's (block_bytes 18), else 2; forced_rows 2 or 4 overrides
// (KS_QMM_A8_BULK_ROWS, a measurement). Measured on the H200 (bf16 x, docs/perf/h200_quant_a8.md):
// at 10e8adf, 49152 x 576 Q8_0 11.6 -> 10.4 us at 4 rows, Q4_1 9.5 -> 8.6, Q4_0 9.8 -> 8.8; at
// 14336 x 4096 4 rows were slower for Q8_0 (18.1 against 16.3) and Q4_1 (10.7 against 10.3) but
// faster for Q4_0 in both calls that timed it (10.53 against 11.02 at 10e8adf, 10.51 against 10.72
// at b2d8bd2), so long rows keep pairs except Q4_0's.
inline BulkPlan a8_bulk_plan(int64_t N, int64_t K, int64_t row_bytes, int sm_count, int64_t limit, int64_t target,
                             int64_t x_block_bytes, int64_t block_bytes, int forced_rows = 0) {
  const int64_t RB = row_bytes;
  if (N <= 0 || K < 32 || RB <= 0 || sm_count <= 0 || target <= 0) return BulkPlan{};
  const int64_t grid = std::min<int64_t>(N, sm_count), rows_cta = (N + grid - 1) / grid;
  const int64_t rows_per_step =
      forced_rows == 2 || forced_rows == 4 ? forced_rows : K / 32 < 32 || block_bytes == 18 ? 4 : 2;
  int64_t rps = std::min(std::max<int64_t>(target / RB / 2, 1) * 2, (rows_cta + 1) / 2 * 2);
  return bulk_fit_stages(rps, 2, 2, rows_cta, RB, K / 32 * x_block_bytes, limit, rows_per_step, grid);
}
// cuda_a8_resident's plan (quant_matmul_a8 at one row of x): `grid` CTAs of `warps` warps,
// `ctas_per_sm` per SM (the grid is sm_count x that, or N where fewer rows), each CTA's contiguous
// rows (rows_cta at most) copied into its shared memory at once beside x's quantized blocks
// (x_block_bytes each), so that the whole call is resident in one wave; no plan (grid 0) where it
// is not (with the 1 KB the runtime reserves per CTA): larger matrices stream (cuda_a8_bulk_stream).
// Measured on the H200 at ae645f0, a17d246, 88d9055 and b26abff (bf16 x, docs/perf/h200_quant_a8.md;
// the GPU tests passed under each form, forced by the switches below, at cfbbebc and b26abff):
//  - CTAs per SM: 1 where a row has 32 blocks or more (K >= 1024: every lane busy, the sums
//    short), 2 below (K = 576's 18 blocks per row leave lanes idle, so the sums weigh): 4096 x 4096
//    Q4_1 3.37 us at 1 against 3.49 at 2, Q4_0 3.75 against 4.25 (8 warps); 49152 x 576 Q4_1
//    12.05 at 1 against 10.22 at 2; 4 per SM slower everywhere (more copies of x); but 2 of 16
//    warps where rows are long and one CTA would take more than half an SM (so no room for the
//    next call's beside it; 2 x 16 warps is also the most the registers allow): Q8_0 4096 x 4096
//    6.28 against 6.70 (88d9055; 6.28 again at b26abff, 6.36 at cfbbebc);
//  - warps: 16 at long rows (4096 x 4096 Q4_1 3.15 us against 3.43 with 8, 3.51 with 12 and 4.54
//    with 4; Q4_0 3.35 against 3.89, Q8_0 6.66 against 6.81), at short rows 12 where each has a
//    pair of rows (49152 x 576 Q4_1 8.35 against 8.64 with 8 and 9.17 with 16; Q4_0 9.24 against
//    9.63; 88d9055), else 8 (576 x 576 and 1536 x 576, 3 and 6 rows per CTA: 1.72-1.79 us with 8,
//    2.04-2.16 with 12 at cfbbebc); never more than 16 (24 / 32 warps at d98dc51: Q4_1 4096 x 4096
//    4.79 / 5.16 us against 3.17: one CTA of 1024 threads takes all of an SM's registers, so the
//    next call's CTA no longer fits beside it); but 2 CTAs of 8 warps, not 16, where one CTA would
//    take more than half an SM and a third CTA (the next call's) then fits beside the two by shared
//    memory and registers: Q8_0 4096 x 4096, 2 x 75.8 KB, 5.35 us (79%) against 6.02 (70%) with 16
//    warps and the trigger after the wait (two H200 calls at da51376, forced by the switches below;
//    padded rows, 79.4 KB, no longer leave room: 6.35; 10 warps 5.74; pairs of rows 6.29);
//  - rows per warp step (a8_row_group: one load of x's blocks serves that many rows): 4 where a CTA
//    has 16 rows or more, with 8 warps at short rows (measured at 364b09a, bf16 x, against the 2 rows
//    and the warps above: 49152 x 576 Q4_1 7.36 us against 9.35, Q4_0 8.35 against 9.27; 4096 x
//    4096 Q4_1 3.10 against 3.17 at 16 warps, 3.25 at 8; Q8_0 5.98 with padded rows against 6.02
//    with 2 rows), else 2 (a warp would take every row);
//  - entry_trigger (the next kernel launched at entry, not after the wait) where the call takes at
//    most half of each SM's shared memory, so the next call's CTAs fit beside it and its copies
//    overlap this call's x staging and sums: Q4_1 4096 x 4096 (96 KB per SM at 2 CTAs) 3.49 us
//    against 4.47; where it takes more, the next call's CTAs land on the few SMs with room and
//    wait there: Q8_0 4096 x 4096 (153 KB, 2 x 16 warps: no registers left for a third CTA) 6.46
//    against 5.82 after the wait, Q4_1 49152 x 576 (138 KB) 10.22 against 8.73; also where one more
//    CTA fits beside the call's on every SM by shared memory and registers (Q8_0 4096 x 4096 at
//    2 x 8 warps, above).
// static_bytes: the kernel's static shared memory (counted per CTA with the dynamic bytes, in the
// 128-byte units the SM allocates). ctas_per_sm > 0 forces the count (KS_QMM_A8_RES_CTAS, 1 to 8;
// whether that many CTAs fit the SM's threads and registers is not checked), warps > 0 the CTA's size
// (KS_QMM_A8_RES_WARPS, 4 to 16), rows_per_step 2 or 4 the rows per warp step (KS_QMM_A8_RES_ROWS);
// one_wave = false (KS_QMM_A8_RES_WAVES=1, a measurement) also plans
// grids that run in several waves (each CTA's rows within its shared memory; measured slower than
// the bulk ring at 14336 x 4096: Q4_1 11.87-12.75 us against 10.40).
constexpr int kA8ResidentMaxWarps = 16;
// the resident kernel's register bound per thread (__launch_bounds__(32 * kA8ResidentMaxWarps, 2):
// 65536 / 1024) and an SM's register file (sm_80 to sm_90)
constexpr int64_t kA8ResidentMaxRegs = 64, kRegistersPerSm = 65536;
// cuda_a8_resident's padded rows (Q4_0, Q8_0). A warp's lane l reads block l of a row (then
// l + 32, ...) with 4-byte loads; blocks of 18 or 34 bytes put lanes l and l + 8 (Q4_0) or
// l + 16 (Q8_0) in the same shared-memory bank, so every weight load took two passes (Q4_1's
// 20 bytes: none). Staged with `pad_bytes` of padding after each group of `group_blocks`
// blocks (a multiple of 16 bytes, so 16-byte copies make it), the 32 lanes' words fall in 32
// banks: groups of 8 Q4_0 blocks (144 bytes) + 16, of 16 Q8_0 blocks (544 bytes) + 32 (found by
// enumerating groups and pads; tests/cpp/test_launch_config.cpp checks the banks).
struct A8RowPad {
  int group_blocks = 0, pad_bytes = 0;  // 0: rows as in memory
};
constexpr A8RowPad a8_row_pad(int64_t block_bytes) {
  return block_bytes == 18 ? A8RowPad{8, 16} : block_bytes == 34 ? A8RowPad{16, 32} : A8RowPad{};
}
// A row's bytes in shared memory under `pad` (row_bytes a multiple of 16 and of block_bytes):
// every group but the last followed by its pad.
constexpr int64_t a8_padded_row_bytes(int64_t row_bytes, int64_t block_bytes, A8RowPad pad) {
  if (pad.group_blocks == 0) return row_bytes;
  const int64_t groups = (row_bytes / block_bytes + pad.group_blocks - 1) / pad.group_blocks;
  return row_bytes + (groups > 0 ? groups - 1 : 0) * pad.pad_bytes;
}
// Where block b of a padded row starts, bytes from the row's start.
constexpr int64_t a8_padded_block_offset(int64_t b, int64_t block_bytes, A8RowPad pad) {
  return b * block_bytes + (pad.group_blocks ? b / pad.group_blocks * pad.pad_bytes : 0);
}
// short rows: 12 warps per CTA from this many rows per CTA (a pair for each), else 8
constexpr int64_t kA8ResidentShortRows = 24;
// 4 rows per warp step from this many rows per CTA, else 2
constexpr int64_t kA8ResidentFourRows = 16;
struct A8ResidentPlan {
  unsigned grid = 0;
  int ctas_per_sm = 0, warps = 0, rows_per_step = 0;
  int64_t rows_cta = 0;
  size_t smem = 0;
  bool entry_trigger = false;
};
inline A8ResidentPlan a8_resident_plan(int64_t N, int64_t K, int64_t RB, int sm_count, int64_t smem_per_sm,
                                       int64_t limit, int64_t x_block_bytes, int ctas_per_sm = 0,
                                       bool one_wave = true, int warps = 0, int64_t static_bytes = 0,
                                       int rows_per_step = 0) {
  if (N <= 0 || K < 32 || RB <= 0 || sm_count <= 0 || smem_per_sm <= 0 || warps < 0 || warps > kA8ResidentMaxWarps ||
      (rows_per_step != 0 && rows_per_step != 2 && rows_per_step != 4))
    return A8ResidentPlan{};
  const bool long_rows = K / 32 >= 32;
  auto plan = [&](int c, int w) {
    const int64_t grid = std::min<int64_t>(N, int64_t(sm_count) * c), rows = (N + grid - 1) / grid;
    // x's blocks, the rows, up to 15 bytes of head misalignment and the tail's zero-filled piece
    // (which also holds the 2 bytes past a Q4_0 / Q8_0 block that its word loads cover)
    const int64_t smem = K / 32 * x_block_bytes + rows * RB + 32;
    // per CTA on the SM: the dynamic and static bytes in 128-byte units, and the runtime's 1 KB
    const int64_t cta_bytes = (smem + static_bytes + 127) / 128 * 128 + 1024;
    const int64_t per_sm = (grid + sm_count - 1) / sm_count, sm_bytes = per_sm * cta_bytes;
    if (smem > limit || (one_wave && sm_bytes > smem_per_sm)) return A8ResidentPlan{};
    const int r = rows_per_step ? rows_per_step : rows >= kA8ResidentFourRows ? 4 : 2;
    if (w == 0) w = long_rows ? 16 : r == 4 ? 8 : rows >= kA8ResidentShortRows ? 12 : 8;  // (short rows: 2 CTAs per SM)
    // the trigger at entry where the next call's CTAs fit beside this call's: all of them by shared
    // memory, or (long rows: measured there only) one more per SM by shared memory and registers
    // (at the kernel's bound of kA8ResidentMaxRegs per thread)
    const bool one_more = long_rows && (per_sm + 1) * cta_bytes <= smem_per_sm &&
                          (per_sm + 1) * w * 32 * kA8ResidentMaxRegs <= kRegistersPerSm;
    return A8ResidentPlan{unsigned(grid), int(per_sm), w, r, rows, size_t(smem),
                          2 * sm_bytes <= smem_per_sm || one_more};
  };
  if (ctas_per_sm > 0) return plan(ctas_per_sm, warps > 0 ? warps : ctas_per_sm <= 2 ? 0 : 8);
  if (!long_rows) return plan(2, warps);
  const A8ResidentPlan one = plan(1, warps);
  // one CTA past half an SM (no room for the next call's beside it): two per SM, of 8 warps where
  // the next call's CTA then fits beside them (so it launches at entry and its copies overlap this
  // call's sums), else of 16
  if (one.grid && !one.entry_trigger && N >= 2 * int64_t(sm_count)) {
    if (warps == 0) {
      const A8ResidentPlan eight = plan(2, 8);
      if (eight.grid && eight.entry_trigger) return eight;
    }
    const A8ResidentPlan two = plan(2, warps);
    if (two.grid) return two;
  }
  return one;
}
// Whether a plan's short rows (fewer than 32 blocks) go a thread per row instead of in warp
// groups: where a stage holds at least kBulkThreadRowsMin rows. Measured on the H200 (5ff2190,
// bf16 x): 49152 x 576 (stages of 112-336 rows) Q4_1 11.6 us against 18.5, Q8_0 19.7 against
// 23.1, Q4_0 16.4 against 19.3; but 1536 x 576 (14 rows) 6.9 against 4.1 and 576 x 576 (5 rows)
// 7.2 against 3.6, where a few threads would walk whole rows while the other warps idle.
constexpr int64_t kBulkThreadRowsMin = 64;
inline bool bulk_thread_rows(const BulkPlan& b, int64_t K) { return K / 32 < 32 && b.rps >= kBulkThreadRowsMin; }
// Adjacent lanes per short row where bulk_thread_rows holds, by the weight format's block bytes
// (18 Q4_0, 20 Q4_1, 34 Q8_0): a row's blocks split over 2 lanes (the subtrees of lane 0's
// butterfly joined by a shuffle: the same bits) or walked by one. Measured on the H200 at
// 49152 x 576, bf16 x (01d720c and 87eb81b, one machine): Q8_0 2 lanes 20.12 us, 1 lane 22.27-22.34,
// 4 lanes 24.54; Q4_0 2 lanes 17.39, 1 lane 17.98; Q4_1 1 lane 12.58-12.63, 2 lanes 17.40.
constexpr int bulk_lanes_per_row(int64_t block_bytes) { return block_bytes == 20 ? 1 : 2; }

// Whether the comma-separated `list` (e.g. KS_PDL_OFF's value; empty items ignored, no spaces
// trimmed) names `name` exactly.
inline bool name_in_list(const char* list, const char* name) {
  if (!list || !name || !*name) return false;
  for (const char* item = list;;) {
    const char* end = item;
    while (*end && *end != ',') ++end;
    size_t n = 0;
    while (name[n] && item + n < end && item[n] == name[n]) ++n;
    if (!name[n] && item + n == end) return true;
    if (!*end) return false;
    item = end + 1;
  }
}

}  // namespace ks::cuda
