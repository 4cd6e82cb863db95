// ks_sample on CUDA (contract: docs/contracts.md#sample). A CTA per row, 1024 threads,
// passes over the row (L2-resident after the first):
//   1. validity (NaN / +inf / no finite logit), max of z = x / T, count of finite z;
//   2. top-k: radix selection of the k-th largest order key (4 rounds of 8 bits, integer
//      counts), then the tie cut-off index by an ordered scan (lower indices first);
//   3. fixed-point weights w = round(2^40 exp(z - max)) of the candidates, their sum W;
//   4. top-p: radix selection on w with exact 64-bit mass histograms (6 rounds), then the
//      tie cut-off by an ordered scan;
//   5. the draw: c = floor(u W_kept / 2^24), u from Philox4x32-10; an ordered inclusive
//      scan finds the first kept id whose running weight exceeds c.
// Every decision is on integers, and exp and the division are the same IEEE operation
// sequence as the CPU reference (core/sampling_math.hpp): the ids are bit-identical to
// the CPU backend's. Not yet tuned for speed (a first, correct version).
#include <cstdint>

#include "backends/cuda/sampling_common.cuh"
#include "backends/cuda/common.cuh"
#include "core/sampling_math.hpp"
#include "ops/args.hpp"

namespace ks::cuda {
namespace {

namespace smp = ks::sampling;
constexpr int kSampleThreads = 1024, kWarps = kSampleThreads / 32;

struct Shared {
  unsigned long long hist[256];
  unsigned long long warp_u64[kWarps];
  float warp_f[kWarps];
  int warp_i[kWarps];
  unsigned long long bcast_u64[4];
  long long bcast_i64[4];
};

__device__ __forceinline__ unsigned long long block_sum_u64(unsigned long long v, Shared& sh) {
  return ks::cuda::block_sum_u64<kWarps>(v, sh.warp_u64);
}
__device__ __forceinline__ float block_max_f(float v, Shared& sh) { return ks::cuda::block_max_f<kWarps>(v, sh.warp_f); }
__device__ __forceinline__ int block_or(int v, Shared& sh) {
  v = __any_sync(0xffffffffu, v);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) sh.warp_i[threadIdx.x >> 5] = v;
  __syncthreads();
  int r = 0;
  for (int w = 0; w < kWarps; ++w) r |= sh.warp_i[w];
  return r;
}
__device__ __forceinline__ unsigned long long block_scan_u64(unsigned long long v, unsigned long long* total,
                                                             Shared& sh) {
  return ks::cuda::block_scan_u64<kWarps>(v, total, sh.warp_u64);
}

template <typename T>
__device__ __forceinline__ float z_at(const T* row, int64_t i, float t) {
  return scaled_logit(Dt<T>::to_f(row[i]), t);
}

// Radix selection, most significant digit first: among the elements for which
// value(i) returns true (with their key and amount), finds the key of the element where
// the running amount (largest keys first) reaches `need`; `need` becomes what is still
// needed from the elements with exactly that key. Uniform over the block.
template <int BITS, class F>
__device__ unsigned long long radix_select(int64_t n, unsigned long long* need, Shared& sh, F&& value) {
  unsigned long long prefix = 0, mask = 0;
  for (int shift = BITS - 8; shift >= 0; shift -= 8) {
    for (int b = threadIdx.x; b < 256; b += blockDim.x) sh.hist[b] = 0;
    __syncthreads();
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      unsigned long long key, amount;
      if (value(i, &key, &amount) && (key & mask) == prefix)
        atomicAdd(&sh.hist[(key >> shift) & 255], amount);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      unsigned long long above = 0, nd = *need;
      int d = 255;
      for (; d > 0; --d) {
        if (above + sh.hist[d] >= nd) break;
        above += sh.hist[d];
      }
      sh.bcast_u64[0] = prefix | (static_cast<unsigned long long>(d) << shift);
      sh.bcast_u64[1] = nd - above;
    }
    __syncthreads();
    prefix = sh.bcast_u64[0];
    *need = sh.bcast_u64[1];
    mask |= 255ull << shift;
    __syncthreads();
  }
  return prefix;
}

// The index of the `nth` (1-based) element in index order for which pred(i) holds.
template <class F>
__device__ int64_t nth_in_order(int64_t n, unsigned long long nth, Shared& sh, F&& pred) {
  unsigned long long carry = 0;
  for (int64_t base = 0; base < n; base += blockDim.x) {
    const int64_t i = base + threadIdx.x;
    const unsigned long long f = (i < n && pred(i)) ? 1 : 0;
    unsigned long long total;
    const unsigned long long inc = block_scan_u64(f, &total, sh);
    if (threadIdx.x == 0) sh.bcast_i64[0] = -1;
    __syncthreads();
    if (f && carry + inc == nth) sh.bcast_i64[0] = i;
    __syncthreads();
    const long long hit = sh.bcast_i64[0];
    __syncthreads();
    if (hit >= 0) return hit;
    carry += total;
  }
  return n - 1;  // not reached when nth <= the count
}

template <typename T>
__global__ void __launch_bounds__(kSampleThreads) sample_kernel(const SampleParams p) {
  __shared__ Shared sh;
  pdl_begin();
  const float t = p.temperature;
  const uint64_t seed = uint64_t(p.seed_offset[0]), offset = uint64_t(p.seed_offset[1]);
  for (int64_t r = blockIdx.x; r < p.rows; r += gridDim.x) {
    const T* row = static_cast<const T*>(p.logits) + r * p.vocab;
    const int64_t V = p.vocab;
    // 1. validity, max z, finite count
    int bad = 0;
    float zmax = -INFINITY;
    unsigned long long finite = 0;
    for (int64_t i = threadIdx.x; i < V; i += blockDim.x) {
      const float x = Dt<T>::to_f(row[i]);
      const float z = scaled_logit(x, t);
      bad |= (x != x) || z == INFINITY;  // NaN, +inf, or z overflowing to +inf
      if (z > -INFINITY) {
        ++finite;
        zmax = fmaxf(zmax, z);
      }
    }
    bad = block_or(bad, sh);
    zmax = block_max_f(zmax, sh);
    finite = block_sum_u64(finite, sh);
    if (bad || finite == 0) {
      if (threadIdx.x == 0) {
        p.out[r] = 0;
        if (p.valid) p.valid[r] = 0;
      }
      __syncthreads();
      continue;
    }
    // 2. top-k: key threshold and tie cut-off
    const bool use_k = p.top_k > 0 && finite > static_cast<unsigned long long>(p.top_k);
    unsigned long long kkey = 0;
    int64_t k_tie_last = V;
    if (use_k) {
      unsigned long long need = static_cast<unsigned long long>(p.top_k);
      kkey = radix_select<32>(V, &need, sh, [&](int64_t i, unsigned long long* key, unsigned long long* amount) {
        const float z = z_at(row, i, t);
        *key = smp::order_key(z);
        *amount = 1;
        return z > -INFINITY;
      });
      k_tie_last = nth_in_order(V, need, sh, [&](int64_t i) {
        const float z = z_at(row, i, t);
        return z > -INFINITY && smp::order_key(z) == kkey;
      });
    }
    auto member = [&](int64_t i, float z) {
      if (!(z > -INFINITY)) return false;
      if (!use_k) return true;
      const unsigned long long key = smp::order_key(z);
      return key > kkey || (key == kkey && i <= k_tie_last);
    };
    auto weight = [&](float z) { return static_cast<unsigned long long>(smp::to_weight(smp::sample_exp(z - zmax))); };
    // 3. total weight of the candidates
    unsigned long long W = 0;
    for (int64_t i = threadIdx.x; i < V; i += blockDim.x) {
      const float z = z_at(row, i, t);
      if (member(i, z)) W += weight(z);
    }
    W = block_sum_u64(W, sh);
    // 4. top-p: weight threshold and tie cut-off
    bool use_p = p.top_p < 1.0;
    unsigned long long wstar = 0, w_kept = W;
    int64_t p_tie_last = V;
    if (use_p) {
      long long target = static_cast<long long>(ceil(p.top_p * double(W)));
      target = min(max(target, 1ll), static_cast<long long>(W));
      unsigned long long need = static_cast<unsigned long long>(target);
      wstar = radix_select<48>(V, &need, sh, [&](int64_t i, unsigned long long* key, unsigned long long* amount) {
        const float z = z_at(row, i, t);
        if (!member(i, z)) return false;
        *key = *amount = weight(z);
        return true;
      });
      // mass above w* is target - need (< target); ties needed: ceil(need / w*)
      const unsigned long long ties = wstar > 0 ? (need + wstar - 1) / wstar : 0;
      w_kept = static_cast<unsigned long long>(target) - need + ties * wstar;
      p_tie_last = nth_in_order(V, ties, sh, [&](int64_t i) {
        const float z = z_at(row, i, t);
        return member(i, z) && weight(z) == wstar;
      });
    }
    auto kept_weight = [&](int64_t i) -> unsigned long long {
      const float z = z_at(row, i, t);
      if (!member(i, z)) return 0;
      const unsigned long long w = weight(z);
      if (use_p && (w < wstar || (w == wstar && i > p_tie_last))) return 0;
      return w;
    };
    // 5. the draw: first kept id (index order) whose running weight exceeds c
    const unsigned long long c = smp::scale_draw(smp::row_draw(seed, offset, uint64_t(r)), w_kept);
    unsigned long long carry = 0;
    int64_t chosen = -1, last_kept = -1;
    for (int64_t base = 0; base < V && chosen < 0; base += blockDim.x) {
      const int64_t i = base + threadIdx.x;
      const unsigned long long w = i < V ? kept_weight(i) : 0;
      unsigned long long total;
      const unsigned long long inc = block_scan_u64(w, &total, sh);
      if (threadIdx.x == 0) sh.bcast_i64[0] = -1, sh.bcast_i64[1] = -1;
      __syncthreads();
      // the first thread whose running sum crosses c (running sums increase with the thread id)
      if (w > 0 && carry + inc > c && carry + inc - w <= c) sh.bcast_i64[0] = i;
      if (w > 0) atomicMax(&sh.bcast_i64[1], static_cast<long long>(i));
      __syncthreads();
      chosen = sh.bcast_i64[0];
      if (sh.bcast_i64[1] >= 0) last_kept = sh.bcast_i64[1];
      __syncthreads();
      carry += total;
    }
    if (threadIdx.x == 0) {
      p.out[r] = chosen >= 0 ? chosen : last_kept;
      if (p.valid) p.valid[r] = 1;
    }
    __syncthreads();
  }
}

}  // namespace

void sample_cuda(const void* args, ks_stream_t stream) {
  const auto& a = *static_cast<const ops::SampleArgs*>(args);
  const int dev = a.logits.device.device_id;
  DeviceGuard g(dev, "sample");
  const DeviceProps& dp = device_props(dev);
  const SampleParams p = sample_params(a);
  const unsigned grid = unsigned(std::min<int64_t>(a.rows, int64_t(dp.sm_count) * 2));
  const auto s = static_cast<cudaStream_t>(stream);
  with_float_type(a.logits.dtype, [&](auto tag) {
    launch_kernel("sample", sample_kernel<decltype(tag)>, dim3(grid), dim3(kSampleThreads), 0, s, 1, dp.pdl, p);
  });
  check_launch("sample");
  record_launch("sample", "cta_per_row threads=%lld grid=%lld", {kSampleThreads, grid});
}

}  // namespace ks::cuda
