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

}  // namespace ks::cuda
