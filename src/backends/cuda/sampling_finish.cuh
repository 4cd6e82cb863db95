// The last step of the top-k sampling kernels (sampling_cluster.cu,
// sampling_local.cu), run by one CTA per row once the row's top-k members are
// known (contract: docs/contracts.md#sample): the fixed-point weights w =
// round(2^40 exp(z - max)), top-p as the shortest prefix of (w desc, index asc)
// whose mass reaches ceil(top_p W), and the Philox draw over the kept ids in
// index order: the CPU reference's steps (core/sampling_math.hpp), on exact
// integers.
#pragma once

#include <cstdint>

#include "backends/cuda/common.cuh"
#include "backends/cuda/sampling_common.cuh"
#include "core/sampling_math.hpp"

namespace ks::cuda {

constexpr int kSampleMaxTopK = 1024;  // the top-k kernels' limit (members held in shared memory)

// The members' shared memory: ids in index order, their weights, the (w desc,
// index asc) order and the kept flags.
struct SampleMembers {
  int idx[kSampleMaxTopK];
  unsigned long long w[kSampleMaxTopK];
  int by_weight[kSampleMaxTopK];
  unsigned char kept[kSampleMaxTopK];
};

template <typename T>
__device__ __forceinline__ float sample_z(const T *row, int64_t i, float t) {
  return scaled_logit(Dt<T>::to_f(row[i]), t);
}

// Member e's z: from the row (keys_in_w false), or from its order key, which the caller left in
// m.w[e] (keys_in_w true: no second read of the logits). The same weight either way: the key
// gives z back exactly except -0 as +0, and exp(+0 - zmax) == exp(-0 - zmax) (both 1 where
// zmax is a zero, sample_exp(x >= 0) = 1).
template <typename T>
__device__ __forceinline__ float member_z(const T *row, const SampleMembers &m, int e, float t, bool keys_in_w) {
  return keys_in_w ? ks::sampling::from_order_key(unsigned(m.w[e])) : sample_z(row, m.idx[e], t);
}

// sample_finish_row's steps by one warp, for n <= 64 members (lane l holds members l and l + 32),
// with no CTA barrier: the same integers, so the same id. Top-p: member e's mass at or before it
// in the (w desc, index asc) order is c_e = sum of w_j over the members j with w_j > w_e, or
// w_j == w_e and j <= e; the shortest prefix reaching the target keeps exactly the members whose
// mass before them, c_e - w_e, is below it. The draw: the first kept member (index order) whose
// running weight exceeds c, found by a ballot over the inclusive scan. Called by the 32 threads
// of one warp; m.w must not be read by other warps meanwhile. keys_in_w: member_z.
template <typename T>
__device__ void sample_finish_row_warp(const SampleParams &p, int64_t r, const T *row, float zmax, int n,
                                       SampleMembers &m, bool keys_in_w) {
  namespace smp = ks::sampling;
  const int lane = threadIdx.x & 31, e0 = lane, e1 = lane + 32;
  const float t = p.temperature;
  unsigned long long w0 = 0, w1 = 0;
  if (e0 < n) w0 = static_cast<unsigned long long>(smp::to_weight(smp::sample_exp(member_z(row, m, e0, t, keys_in_w) - zmax)));
  if (e1 < n) w1 = static_cast<unsigned long long>(smp::to_weight(smp::sample_exp(member_z(row, m, e1, t, keys_in_w) - zmax)));
  if (e0 < n) m.w[e0] = w0;
  if (e1 < n) m.w[e1] = w1;
  __syncwarp();
  const unsigned long long W_sum = warp_sum_u64(w0 + w1);
  bool k0 = e0 < n, k1 = e1 < n;
  unsigned long long total = W_sum;
  if (p.top_p < 1.0) {
    long long target = static_cast<long long>(ceil(p.top_p * double(W_sum)));
    target = min(max(target, 1ll), static_cast<long long>(W_sum));
    const unsigned long long tgt = static_cast<unsigned long long>(target);
    unsigned long long c0 = 0, c1 = 0;
#pragma unroll 4
    for (int j = 0; j < n; ++j) {  // (exact integer sums: any order gives the same)
      const unsigned long long wj = m.w[j];
      c0 += (wj > w0 || (wj == w0 && j <= e0)) ? wj : 0ull;
      c1 += (wj > w1 || (wj == w1 && j <= e1)) ? wj : 0ull;
    }
    k0 = k0 && c0 - w0 < tgt;
    k1 = k1 && c1 - w1 < tgt;
    total = warp_sum_u64((k0 ? w0 : 0ull) + (k1 ? w1 : 0ull));
  }
  const unsigned long long c =
      smp::scale_draw(smp::row_draw(uint64_t(p.seed_offset[0]), uint64_t(p.seed_offset[1]), uint64_t(r)), total);
  const unsigned long long a0 = k0 ? w0 : 0ull, a1 = k1 ? w1 : 0ull;
  const unsigned long long s0 = warp_inclusive_scan_u64(a0);
  const unsigned long long s1 = __shfl_sync(0xffffffffu, s0, 31) + warp_inclusive_scan_u64(a1);
  const unsigned b0 = __ballot_sync(0xffffffffu, a0 > 0 && s0 > c), b1 = __ballot_sync(0xffffffffu, a1 > 0 && s1 > c);
  int chosen = b0 ? __ffs(int(b0)) - 1 : b1 ? 32 + __ffs(int(b1)) - 1 : -1;
  if (chosen < 0) {  // not reached (c < total); the CPU's default: the largest kept id
    const unsigned kb0 = __ballot_sync(0xffffffffu, k0), kb1 = __ballot_sync(0xffffffffu, k1);
    chosen = kb1 ? 63 - __clz(int(kb1)) : kb0 ? 31 - __clz(int(kb0)) : -1;
  }
  if (lane == 0) {
    p.out[r] = chosen >= 0 ? m.idx[chosen] : 0;
    if (p.valid) p.valid[r] = 1;
  }
}

// Every thread of the CTA (W warps, 2 * 32 W >= kSampleMaxTopK) calls it with
// the same arguments; m.idx[0 .. n) holds row r's n members (1 <= n <=
// kSampleMaxTopK) in index order, zmax the row's largest z. Writes out[r] and
// valid[r]. warp_u64: W scratch slots; decided: 3 slots. keys_in_w: m.w[e] holds member e's
// order key instead of the row being read again (member_z). Ends with a barrier: shared memory
// may be reused after it.
template <int W, typename T>
__device__ void sample_finish_row(const SampleParams &p, int64_t r, const T *row, float zmax, int n, SampleMembers &m,
                                  unsigned long long *warp_u64, unsigned long long *decided, bool keys_in_w = false) {
  static_assert(2 * 32 * W >= kSampleMaxTopK, "two members per thread in the scans");
  namespace smp = ks::sampling;
  if (n <= 64 && p.finish_warp) {  // warp 0 alone, without the CTA's barriers (the same id)
    if (threadIdx.x < 32) sample_finish_row_warp(p, r, row, zmax, n, m, keys_in_w);
    __syncthreads();
    return;
  }
  const float t = p.temperature;
  const int threads = 32 * W;
  unsigned long long W_sum = 0;
  for (int e = threadIdx.x; e < n; e += threads) {
    const float z = member_z(row, m, e, t, keys_in_w);
    const unsigned long long w = static_cast<unsigned long long>(smp::to_weight(smp::sample_exp(z - zmax)));
    m.w[e] = w;
    m.kept[e] = 1;
    W_sum += w;
  }
  W_sum = block_sum_u64<W>(W_sum,
                           warp_u64);  // (its barriers also publish w and kept)
  unsigned long long total = W_sum;
  if (p.top_p < 1.0) {
    long long target = static_cast<long long>(ceil(p.top_p * double(W_sum)));
    target = min(max(target, 1ll), static_cast<long long>(W_sum));
    for (int e = threadIdx.x; e < n; e += threads) {  // (w desc, index asc) order by counting
      const unsigned long long w = m.w[e];
      int pos = 0;
      for (int j = 0; j < n; ++j) pos += m.w[j] > w || (m.w[j] == w && j < e);
      m.by_weight[pos] = e;
    }
    __syncthreads();
    // the shortest prefix of that order whose mass reaches target: 2 entries
    // per thread
    const int j0 = 2 * int(threadIdx.x);
    const unsigned long long w0 = j0 < n ? m.w[m.by_weight[j0]] : 0;
    const unsigned long long w1 = j0 + 1 < n ? m.w[m.by_weight[j0 + 1]] : 0;
    unsigned long long all;
    const unsigned long long inc = block_scan_u64<W>(w0 + w1, &all, warp_u64);
    const unsigned long long c0 = inc - w1,
                             c1 = inc;  // running mass through j0, j0 + 1
    if (threadIdx.x == 0) decided[0] = static_cast<unsigned long long>(n);
    __syncthreads();
    const unsigned long long tgt = static_cast<unsigned long long>(target);
    if (j0 < n && c0 >= tgt && c0 - w0 < tgt) decided[0] = unsigned(j0 + 1), decided[1] = c0;
    if (j0 + 1 < n && c1 >= tgt && c1 - w1 < tgt) decided[0] = unsigned(j0 + 2), decided[1] = c1;
    __syncthreads();
    const int keep = int(decided[0]);
    total = keep < n ? decided[1] : W_sum;
    for (int j = threadIdx.x; j < n; j += threads) m.kept[m.by_weight[j]] = j < keep;
    __syncthreads();
  }
  // the draw: the first kept id (index order) whose running weight exceeds c
  const unsigned long long c =
      smp::scale_draw(smp::row_draw(uint64_t(p.seed_offset[0]), uint64_t(p.seed_offset[1]), uint64_t(r)), total);
  if (threadIdx.x == 0) decided[2] = ~0ull;
  __syncthreads();
  const int e0 = 2 * int(threadIdx.x);
  const unsigned long long a0 = e0 < n && m.kept[e0] ? m.w[e0] : 0;
  const unsigned long long a1 = e0 + 1 < n && m.kept[e0 + 1] ? m.w[e0 + 1] : 0;
  unsigned long long all;
  const unsigned long long inc = block_scan_u64<W>(a0 + a1, &all, warp_u64);
  const unsigned long long run0 = inc - a1, run1 = inc;
  if (a0 > 0 && run0 > c && run0 - a0 <= c) decided[2] = unsigned(e0);
  if (a1 > 0 && run1 > c && run1 - a1 <= c) decided[2] = unsigned(e0 + 1);
  __syncthreads();
  if (threadIdx.x == 0) {
    int chosen = decided[2] == ~0ull ? -1 : int(decided[2]);
    if (chosen < 0)  // not reached (c < total); the CPU's default: the largest kept id
      for (int e = n - 1; e >= 0 && chosen < 0; --e)
        if (m.kept[e]) chosen = e;
    p.out[r] = chosen >= 0 ? m.idx[chosen] : 0;
    if (p.valid) p.valid[r] = 1;
  }
  __syncthreads();
}

}  // namespace ks::cuda
