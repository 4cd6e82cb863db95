// Host-side launch rules of the CUDA backend (plain C++: unit-tested without a
// GPU or nvcc against the configurations measured on the H200).
#pragma once

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

// Softmax's cluster path: C CTAs split a row; each thread holds NV 16-byte vectors in
// registers (NV > 8 only with 256 threads), or NV = 0: the CTA's slice is staged in
// shared memory (256 threads). Among every candidate whose co-resident cluster count
// `active(nv, c, threads, smem_bytes)` is > 0, take the fewest waves (each wave pays
// the whole load -> cluster exchange -> store chain); ties: the smallest NV (0 first),
// then the smallest C. forced_c != 0 keeps only that C; smem_stage adds the NV = 0
// candidates (slices up to 160 KB). report(...) sees every candidate (debug output).
constexpr int kClusterNvs[] = {2, 4, 6, 8, 12, 16};
constexpr int kClusterSizes[] = {2, 4, 8, 16};
constexpr int kClusterThreadCounts[] = {256, 512};
struct ClusterChoice {
  int cluster = 0, threads = 0, nv = 0, active = 0;  // cluster 0: none launchable
  int64_t slice = 0;                                 // vectors per CTA
};
template <class Active, class Report>
ClusterChoice choose_cluster(int64_t rows, int64_t hv, int forced_c, bool smem_stage, Active&& active,
                             Report&& report) {
  ClusterChoice best;
  double best_cost = 0;
  auto consider = [&](int c, int threads, int nv, int64_t smem_bytes) {
    const int n = active(nv, c, threads, smem_bytes);
    const int64_t waves = n > 0 ? (rows + n - 1) / n : 0;
    report(c, threads, nv, smem_bytes, n, waves);
    if (n <= 0) return;
    const double cost = double(waves) * 1e4 + nv * 100 + c;  // lexicographic (waves, NV, C)
    if (best.cluster == 0 || cost < best_cost) {
      best_cost = cost;
      best = ClusterChoice{c, threads, nv, n, 0};
    }
  };
  for (int c : kClusterSizes) {
    if (forced_c && c != forced_c) continue;
    for (int th : kClusterThreadCounts) {
      const int64_t per_thread = (hv + int64_t(c) * th - 1) / (int64_t(c) * th);
      int nv = 0;
      for (int v : kClusterNvs)
        if (!nv && per_thread <= v && (v <= 8 || th == 256)) nv = v;
      if (nv) consider(c, th, nv, 0);
    }
    const int64_t slice_bytes = (hv + c - 1) / c * 16;
    if (smem_stage && slice_bytes <= 160 * 1024) consider(c, 256, 0, slice_bytes);
  }
  if (best.cluster) best.slice = (hv + best.cluster - 1) / best.cluster;
  return best;
}

}  // namespace ks::cuda
