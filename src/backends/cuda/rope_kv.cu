// rotary_embedding and kv_cache_append on CUDA (contracts in docs/contracts.md).
//
// rotary_embedding: a CTA owns a token at a time (grid-stride over tokens). The
//   inverse frequencies fp32(theta^(-2i/rotary_dim)) come from the host (the CPU
//   reference's function, passed as a kernel parameter) and are staged in shared memory
//   before the dependency wait (they read no memory); per
//   token, cos and sin of fp32(fp32(pos) * inv_freq[i]) are computed once into
//   shared memory (sincosf: full range reduction, so large positions stay
//   accurate) and every head of q and k reuses them. q and k may be strided views
//   (token and head strides in elements; the last dimension contiguous). Features
//   past rotary_dim are never touched.
// kv_cache_append: a CTA copies a token's k and v rows to their slot (16-byte
//   accesses when every pointer and the row allow). Device slot_mapping is not
//   range-checked on the host (that would need a synchronisation): a slot outside
//   [0, num_slots) is skipped on the device, as -1 is, so nothing outside the
//   cache is ever written.
#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>

#include "backends/cuda/common.cuh"
#include "backends/cuda/rope_common.cuh"
#include "ops/args.hpp"

namespace ks::cuda {

struct RopeParams {
  void* q;
  void* k;
  const void* pos;
  bool pos64;
  int64_t tokens, heads, kv_heads, rotary_half;
  int64_t q_ts, q_hs, k_ts, k_hs;
  double theta;
};

// Shared memory per CTA: inv_freq, cos, sin (3 * rotary_dim / 2 floats).
constexpr int64_t kRopeMaxHalf = 4096;  // 48 KB of shared memory
constexpr int kRopeThreads = 128;
// The inverse frequencies: RopeTable (rope_common.cuh) for rotary_dim <= 1024; wider: device
// FP64 pow.
template <typename T, bool NEOX>
__global__ void __launch_bounds__(kRopeThreads) rope_kernel(const RopeParams p, const RopeTable table) {
  extern __shared__ float rope_sh[];
  const int64_t half = p.rotary_half;
  float* inv = rope_sh;
  float* cs = rope_sh + half;
  float* sn = rope_sh + 2 * half;
  for (int64_t i = threadIdx.x; i < half; i += blockDim.x)
    inv[i] = half <= kRopeParamHalf ? table.inv[i] : float(pow(p.theta, -double(2 * i) / double(2 * half)));
  pdl_begin();
  for (int64_t tok = blockIdx.x; tok < p.tokens; tok += gridDim.x) {
    const int64_t pi = p.pos64 ? static_cast<const int64_t*>(p.pos)[tok] : static_cast<const int32_t*>(p.pos)[tok];
    const float pos = float(pi);
    __syncthreads();  // the previous token's cos / sin are no longer read (and inv is complete)
    for (int64_t i = threadIdx.x; i < half; i += blockDim.x) {
      float s, c;
      sincosf(pos * inv[i], &s, &c);
      cs[i] = c;
      sn[i] = s;
    }
    __syncthreads();
    // thread -> (pair i, first head): i = t mod half, heads t / half, t / half + hpi, ...
    // (no division per element; half > blockDim: every thread also strides over i)
    const int64_t heads = p.heads + p.kv_heads;
    const int hpi = half < blockDim.x ? int(blockDim.x / half) : 1;
    const int64_t i_first = half < blockDim.x ? int64_t(threadIdx.x % unsigned(half)) : int64_t(threadIdx.x);
    const int64_t h_first = half < blockDim.x ? int64_t(threadIdx.x / unsigned(half)) : 0;
    const bool idle = half < blockDim.x && h_first >= hpi;  // the last partial group of threads
    if (!idle)
      for (int64_t i = i_first; i < half; i += (half < blockDim.x ? half : blockDim.x)) {
        const float c = cs[i], s = sn[i];
        const int64_t i0 = NEOX ? i : 2 * i, i1 = NEOX ? i + half : 2 * i + 1;
        for (int64_t h = h_first; h < heads; h += hpi) {
          T* base = h < p.heads ? static_cast<T*>(p.q) + tok * p.q_ts + h * p.q_hs
                                : static_cast<T*>(p.k) + tok * p.k_ts + (h - p.heads) * p.k_hs;
          float r0, r1;
          rope_rotate(Dt<T>::to_f(base[i0]), Dt<T>::to_f(base[i1]), c, s, r0, r1);
          base[i0] = Dt<T>::from_f(r0);
          base[i1] = Dt<T>::from_f(r1);
        }
      }
  }
}

// Variant cuda_vec16: a thread owns (token, chunk of up to 8 heads, PAIRS consecutive pairs):
// 16-byte loads (NeoX: the two halves, one vector each; interleaved: one vector holding
// PAIRS adjacent pairs), all of the chunk's loads issued before the rotations, and its own
// sincosf of the PAIRS angles (computed once for the chunk's heads). Same FP32 angle and
// rotation formulas as rope_kernel. Taken when every pointer and stride is a multiple of
// 16 bytes and rotary_dim / 2 a multiple of PAIRS (rope_vec_can_implement); otherwise the
// registry falls back to cuda_token_cta (rope_kernel).
constexpr int kRopeHeadChunk = 8;

template <typename T, bool NEOX>
__global__ void __launch_bounds__(kRopeThreads) rope_vec_kernel(const RopeParams p, const RopeTable table) {
  constexpr int VEC = 16 / int(sizeof(T));
  constexpr int PAIRS = NEOX ? VEC : VEC / 2;
  using V = Vec<T, VEC>;
  extern __shared__ float rope_sh[];
  const int64_t half = p.rotary_half;
  for (int64_t i = threadIdx.x; i < half; i += blockDim.x)
    rope_sh[i] = half <= kRopeParamHalf ? table.inv[i] : float(pow(p.theta, -double(2 * i) / double(2 * half)));
  __syncthreads();
  pdl_begin();
  const unsigned groups = unsigned(half / PAIRS);
  const int64_t heads = p.heads + p.kv_heads;
  const unsigned chunks = unsigned((heads + kRopeHeadChunk - 1) / kRopeHeadChunk);
  const unsigned items = unsigned(p.tokens) * chunks * groups;  // < 2^31 (rope_vec_can_implement)
  for (unsigned it = blockIdx.x * blockDim.x + threadIdx.x; it < items; it += gridDim.x * blockDim.x) {
    const unsigned gi = it % groups, rest = it / groups;
    const unsigned ch = rest % chunks;
    const int64_t tok = rest / chunks;
    const int64_t i0 = int64_t(gi) * PAIRS;  // first pair
    const int64_t pi = p.pos64 ? static_cast<const int64_t*>(p.pos)[tok] : static_cast<const int32_t*>(p.pos)[tok];
    const float pos = float(pi);
    T* ptr[kRopeHeadChunk];
    V a[kRopeHeadChunk], b[kRopeHeadChunk];
#pragma unroll
    for (int j = 0; j < kRopeHeadChunk; ++j) {
      const int64_t h = int64_t(ch) * kRopeHeadChunk + j;
      ptr[j] = nullptr;
      if (h < heads) {
        ptr[j] = h < p.heads ? static_cast<T*>(p.q) + tok * p.q_ts + h * p.q_hs
                             : static_cast<T*>(p.k) + tok * p.k_ts + (h - p.heads) * p.k_hs;
        if (NEOX) {
          a[j] = load_vec<T, VEC>(ptr[j] + i0);
          b[j] = load_vec<T, VEC>(ptr[j] + half + i0);
        } else {
          a[j] = load_vec<T, VEC>(ptr[j] + 2 * i0);
        }
      }
    }
    float c[PAIRS], sn[PAIRS];
#pragma unroll
    for (int e = 0; e < PAIRS; ++e) sincosf(pos * rope_sh[i0 + e], &sn[e], &c[e]);
#pragma unroll
    for (int j = 0; j < kRopeHeadChunk; ++j) {
      if (!ptr[j]) continue;
      if (NEOX) {
        OutVec<T, VEC> oa, ob;
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          float r0, r1;
          rope_rotate(a[j].f(e), b[j].f(e), c[e], sn[e], r0, r1);
          oa.set(e, r0);
          ob.set(e, r1);
        }
        store_vec(ptr[j] + i0, oa);
        store_vec(ptr[j] + half + i0, ob);
      } else {
        OutVec<T, VEC> oa;
#pragma unroll
        for (int e = 0; e < PAIRS; ++e) {
          float r0, r1;
          rope_rotate(a[j].f(2 * e), a[j].f(2 * e + 1), c[e], sn[e], r0, r1);
          oa.set(2 * e, r0);
          oa.set(2 * e + 1, r1);
        }
        store_vec(ptr[j] + 2 * i0, oa);
      }
    }
  }
}

// Why the vector kernel cannot take a call ("" when it can): variant cuda_vec16.
std::string rope_vec_can_implement(const void* args) {
  const auto& a = *static_cast<const ops::RotaryArgs*>(args);
  const int64_t vec = 16 / detail::dtype_bytes(a.q.dtype), pairs = a.neox ? vec : vec / 2;
  const int64_t half = a.rotary_dim / 2;
  if (half % pairs != 0)
    return "rotary_dim / 2 must be a multiple of " + std::to_string(pairs) + " (the pairs in 16 bytes)";
  if (half > kRopeMaxHalf) return "rotary_dim > 8192";
  if (!aligned16(a.q.data) || a.q_token_stride % vec != 0 || a.q_head_stride % vec != 0)
    return "q's pointer, token stride and head stride must be multiples of 16 bytes";
  if (a.has_k && (!aligned16(a.k.data) || a.k_token_stride % vec != 0 || a.k_head_stride % vec != 0))
    return "k's pointer, token stride and head stride must be multiples of 16 bytes";
  const int64_t heads = a.num_heads + (a.has_k ? a.num_kv_heads : 0);
  const int64_t items = a.num_tokens * ((heads + kRopeHeadChunk - 1) / kRopeHeadChunk) * (half / pairs);
  if (items >= int64_t(INT32_MAX) - int64_t(kRopeThreads) * 132 * 64) return "more than 2^31 work items";
  return "";
}

std::string rope_can_implement(const void* args) {
  const auto& a = *static_cast<const ops::RotaryArgs*>(args);
  if (a.rotary_dim / 2 > kRopeMaxHalf) return "rotary_dim > 8192 (the cos/sin table would exceed 48 KB of shared memory)";
  return "";
}

// What both variants' launchers share: the device guard, the kernel parameters with the
// inverse frequencies from the CPU reference's function, then launch(a, dp, p, table, stream)
// and the launch check.
template <class Launch>
void rope_launch(const void* args, ks_stream_t stream, Launch&& launch) {
  const auto& a = *static_cast<const ops::RotaryArgs*>(args);
  const int dev = a.q.device.device_id;
  DeviceGuard g(dev, "rotary_embedding");
  const RopeParams p{a.q.data,         a.has_k ? a.k.data : nullptr,
                     a.positions.data, a.positions.dtype == detail::DType::I64,
                     a.num_tokens,     a.num_heads,
                     a.has_k ? a.num_kv_heads : 0,
                     a.rotary_dim / 2, a.q_token_stride,
                     a.q_head_stride,  a.k_token_stride,
                     a.k_head_stride,  a.theta};
  RopeTable table{};
  if (p.rotary_half <= kRopeParamHalf) cpu::rope_inv_freq(a.rotary_dim, a.theta, table.inv);
  launch(a, device_props(dev), p, table, static_cast<cudaStream_t>(stream));
  check_launch("rotary_embedding");
}

// Variant cuda_vec16 (rope_vec_can_implement holds).
void rotary_vec_cuda(const void* args, ks_stream_t stream) {
  rope_launch(args, stream, [](const ops::RotaryArgs& a, const DeviceProps& dp, const RopeParams& p,
                               const RopeTable& table, cudaStream_t s) {
    const int64_t vec = 16 / detail::dtype_bytes(a.q.dtype), pairs = a.neox ? vec : vec / 2;
    const int64_t heads = p.heads + p.kv_heads;
    const int64_t items = a.num_tokens * ((heads + kRopeHeadChunk - 1) / kRopeHeadChunk) * (p.rotary_half / pairs);
    // KS_ROPE_ITEMS_PER_THREAD=n (experiments): a grid of items / (n threads) CTAs, e.g. one wave
    // instead of two at 4096 tokens; the same values whatever the grid.
    static const int64_t per_thread = std::max<long long>(1, env_number("KS_ROPE_ITEMS_PER_THREAD", 1));
    const int64_t grid = std::max<int64_t>(
        1, std::min<int64_t>((items + kRopeThreads * per_thread - 1) / (kRopeThreads * per_thread),
                             int64_t(dp.sm_count) * 16));
    const size_t smem = size_t(p.rotary_half) * sizeof(float);
    with_float_type(a.q.dtype, [&](auto tag) {
      using T = decltype(tag);
      launch_kernel("rotary_embedding", a.neox ? rope_vec_kernel<T, true> : rope_vec_kernel<T, false>,
                    dim3(unsigned(grid)), dim3(kRopeThreads), smem, s, 1, dp.pdl, p, table);
    });
    record_launch("rotary_embedding", "vec16 threads=%lld head_chunk=%lld grid=%lld",
                  {kRopeThreads, kRopeHeadChunk, grid});
  });
}

// Variant cuda_token_cta: any strides.
void rotary_cuda(const void* args, ks_stream_t stream) {
  rope_launch(args, stream, [](const ops::RotaryArgs& a, const DeviceProps& dp, const RopeParams& p,
                               const RopeTable& table, cudaStream_t s) {
    const int64_t grid = std::min<int64_t>(a.num_tokens, int64_t(dp.sm_count) * 16);
    const size_t smem = size_t(3 * p.rotary_half) * sizeof(float);
    if (smem > 48 * 1024) return;  // excluded by rope_can_implement
    with_float_type(a.q.dtype, [&](auto tag) {
      using T = decltype(tag);
      launch_kernel("rotary_embedding", a.neox ? rope_kernel<T, true> : rope_kernel<T, false>, dim3(unsigned(grid)),
                    dim3(kRopeThreads), smem, s, 1, dp.pdl, p, table);
    });
    record_launch("rotary_embedding", "threads=%lld grid=%lld smem=%lld", {kRopeThreads, grid, (long long)smem});
  });
}

// ---- kv_cache_append ------------------------------------------------------------
struct KvParams {
  char* k_cache;
  char* v_cache;
  const char* k;
  const char* v;
  const void* slots;
  bool slots64;
  int64_t tokens, num_slots, row_bytes;
};

template <int B>  // bytes per access: 16, or 1 for unaligned rows
__global__ void __launch_bounds__(256) kv_append_kernel(const KvParams p) {
  using R = std::conditional_t<B == 16, uint4, unsigned char>;
  pdl_begin();
  const int64_t n = p.row_bytes / B;
  for (int64_t t = blockIdx.x; t < p.tokens; t += gridDim.x) {
    const int64_t slot = p.slots64 ? static_cast<const int64_t*>(p.slots)[t] : static_cast<const int32_t*>(p.slots)[t];
    if (slot < 0 || slot >= p.num_slots) continue;  // -1 (padding) or out of range: skipped
    const R* ks = reinterpret_cast<const R*>(p.k + t * p.row_bytes);
    const R* vs = reinterpret_cast<const R*>(p.v + t * p.row_bytes);
    R* kd = reinterpret_cast<R*>(p.k_cache + slot * p.row_bytes);
    R* vd = reinterpret_cast<R*>(p.v_cache + slot * p.row_bytes);
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      kd[i] = ks[i];
      vd[i] = vs[i];
    }
  }
}

void kv_cache_append_cuda(const void* args, ks_stream_t stream) {
  const auto& a = *static_cast<const ops::KvCacheAppendArgs*>(args);
  const int dev = a.k.device.device_id;
  DeviceGuard g(dev, "kv_cache_append");
  const DeviceProps& dp = device_props(dev);
  const int64_t row_bytes = a.num_kv_heads * a.head_dim * detail::dtype_bytes(a.k.dtype);
  KvParams p{static_cast<char*>(a.k_cache.data),
             static_cast<char*>(a.v_cache.data),
             static_cast<const char*>(a.k.data),
             static_cast<const char*>(a.v.data),
             a.slot_mapping.data,
             a.slot_mapping.dtype == detail::DType::I64,
             a.num_tokens,
             a.num_slots,
             row_bytes};
  const bool vec = row_bytes % 16 == 0 && aligned16(p.k_cache) && aligned16(p.v_cache) && aligned16(p.k) &&
                   aligned16(p.v);
  const int64_t grid = std::min<int64_t>(a.num_tokens, int64_t(dp.sm_count) * 16);
  const auto s = static_cast<cudaStream_t>(stream);
  if (vec)
    launch_kernel("kv_cache_append", kv_append_kernel<16>, dim3(unsigned(grid)), dim3(256), 0, s, 1, dp.pdl, p);
  else
    launch_kernel("kv_cache_append", kv_append_kernel<1>, dim3(unsigned(grid)), dim3(256), 0, s, 1, dp.pdl, p);
  check_launch("kv_cache_append");
  record_launch("kv_cache_append", "bytes_per_access=%lld grid=%lld", {vec ? 16 : 1, grid});
}

// ---- rotary_embedding_kv_append ---------------------------------------------------
// A CTA per token (grid-stride), in passes of 512: in a pass thread t takes the (head, pair)
// item b + t of q and k, with its own sincosf of the angle (rope_kernel's angle and
// rope_rotate, the inverse frequencies from the host table; a rotated k pair is stored to k
// and to its cache row), and the element b + t of the token's v row and of k's features past
// rotary_dim, copied to the cache rows. Every load of a pass (the pair, the v and k-tail
// elements, the position, the slot) is issued before any of them is used: written as a rotation loop
// and then a copy loop, the pair waited for the position's load and the sincosf (whose slow path
// is a call the compiler does not move loads across), and the copy for the rotation's stores, so
// a one-token step was three memory round trips in a row instead of one. v is read whatever the
// slot (validation keeps v off q, k and the caches); only the cache stores depend on it. Every
// cache element is written by the thread that read its source, so no barrier is needed after
// the inverse frequencies are staged. A slot outside [0, num_slots) is skipped (as
// kv_append_kernel). 512 threads: a one-token step of a small model (SmolLM2: 12 heads x 32
// pairs, v rows of 192) is one pass. 32-bit index arithmetic (the item counts are checked to fit
// by can_implement).
constexpr int kRopeAppendThreads = 512;
template <typename T, bool NEOX>
__global__ void __launch_bounds__(kRopeAppendThreads) rope_append_kernel(const RopeParams p, const RopeTable table,
                                                                   const KvParams kv, const int64_t head_dim) {
  extern __shared__ float rope_sh[];
  const int64_t half = p.rotary_half;
  for (int64_t i = threadIdx.x; i < half; i += blockDim.x) rope_sh[i] = table.inv[i];
  __syncthreads();
  pdl_begin();
  const int half32 = int(half), D32 = int(head_dim);
  const int items = int((p.heads + p.kv_heads) * half), kv_row32 = int(p.kv_heads * head_dim);
  const int64_t D = head_dim;
  for (int64_t tok = blockIdx.x; tok < p.tokens; tok += gridDim.x) {
    const bool has_kv = tok < kv.tokens;
    const T* vs = reinterpret_cast<const T*>(kv.v) + tok * int64_t(kv_row32);
    const T* ks = static_cast<const T*>(p.k) + tok * p.k_ts;
    const int work = max(items, has_kv ? kv_row32 : 0);
    for (int b = 0; b < work; b += blockDim.x) {
      const int it = b + int(threadIdx.x);
      // the loads
      const bool rot = it < items, copy = has_kv && it < kv_row32;
      const int h = rot ? it / half32 : 0, i = it - h * half32;
      const int i0 = NEOX ? i : 2 * i, i1 = NEOX ? i + half32 : 2 * i + 1;
      T* base = h < p.heads ? static_cast<T*>(p.q) + tok * p.q_ts + h * p.q_hs
                            : static_cast<T*>(p.k) + tok * p.k_ts + (h - p.heads) * p.k_hs;
      T x0{}, x1{}, vv{}, kt{};
      if (rot) x0 = base[i0], x1 = base[i1];
      const int hh = copy ? it / D32 : 0, d = it - hh * D32;
      const bool tail = copy && d >= 2 * half32;
      if (copy) vv = vs[it];
      if (tail) kt = ks[hh * p.k_hs + d];
      // the position and the slot after them in the pass (read at the token's start, the
      // compiler used them at once - the cache row's address - and the loads above waited)
      const int64_t pi = p.pos64 ? static_cast<const int64_t*>(p.pos)[tok] : static_cast<const int32_t*>(p.pos)[tok];
      int64_t slot = -1;
      if (has_kv)
        slot = kv.slots64 ? static_cast<const int64_t*>(kv.slots)[tok] : static_cast<const int32_t*>(kv.slots)[tok];
      // then the angle, the rotation and the stores
      T* kc = slot >= 0 && slot < kv.num_slots ? reinterpret_cast<T*>(kv.k_cache + slot * kv.row_bytes) : nullptr;
      if (rot) {
        float sn, c;
        sincosf(float(pi) * rope_sh[i], &sn, &c);
        float f0, f1;
        rope_rotate(Dt<T>::to_f(x0), Dt<T>::to_f(x1), c, sn, f0, f1);
        const T r0 = Dt<T>::from_f(f0), r1 = Dt<T>::from_f(f1);
        base[i0] = r0;
        base[i1] = r1;
        if (h >= p.heads && kc) {
          kc[(h - p.heads) * D + i0] = r0;
          kc[(h - p.heads) * D + i1] = r1;
        }
      }
      if (copy && kc) {
        reinterpret_cast<T*>(kv.v_cache + slot * kv.row_bytes)[it] = vv;
        if (tail) kc[it] = kt;
      }
    }
  }
}

std::string rope_append_can_implement(const void* args) {
  const auto& a = *static_cast<const ops::RopeKvAppendArgs*>(args);
  if (a.rope.rotary_dim / 2 > kRopeParamHalf) return "rotary_dim > 1024 (the inverse frequencies travel as a parameter)";
  if ((a.rope.num_heads + a.rope.num_kv_heads) * (a.rope.rotary_dim / 2) >= int64_t(INT32_MAX) - kRopeAppendThreads ||
      a.rope.num_kv_heads * a.rope.head_dim >= int64_t(INT32_MAX) - kRopeAppendThreads)
    return "a token's (head, pair) items or kv row exceed 32-bit indexing";
  return "";
}

void rope_kv_append_cuda(const void* args, ks_stream_t stream) {
  const auto& a = *static_cast<const ops::RopeKvAppendArgs*>(args);
  const ops::RotaryArgs& r = a.rope;
  const int dev = r.q.device.device_id;
  DeviceGuard g(dev, "rotary_embedding_kv_append");
  const DeviceProps& dp = device_props(dev);
  const RopeParams p{r.q.data, r.k.data, r.positions.data, r.positions.dtype == detail::DType::I64, r.num_tokens,
                     r.num_heads, r.num_kv_heads, r.rotary_dim / 2, r.q_token_stride, r.q_head_stride,
                     r.k_token_stride, r.k_head_stride, r.theta};
  RopeTable table{};
  cpu::rope_inv_freq(r.rotary_dim, r.theta, table.inv);
  const int64_t row_bytes = a.kv.num_kv_heads * a.kv.head_dim * detail::dtype_bytes(a.kv.k.dtype);
  // kv.tokens 0: nothing appended (kv_cache_append's empty cases), the rotation still runs
  const bool append = a.kv.num_tokens > 0 && row_bytes > 0;
  const KvParams kv{static_cast<char*>(a.kv.k_cache.data), static_cast<char*>(a.kv.v_cache.data),
                    static_cast<const char*>(a.kv.k.data), static_cast<const char*>(a.kv.v.data),
                    a.kv.slot_mapping.data, a.kv.slot_mapping.dtype == detail::DType::I64,
                    append ? a.kv.num_tokens : 0, a.kv.num_slots, row_bytes};
  const int64_t grid = std::min<int64_t>(r.num_tokens, int64_t(dp.sm_count) * 16);
  const size_t smem = size_t(p.rotary_half) * sizeof(float);
  const auto s = static_cast<cudaStream_t>(stream);
  with_float_type(r.q.dtype, [&](auto tag) {
    using T = decltype(tag);
    launch_kernel("rotary_embedding_kv_append", r.neox ? rope_append_kernel<T, true> : rope_append_kernel<T, false>,
                  dim3(unsigned(grid)), dim3(kRopeAppendThreads), smem, s, 1, dp.pdl, p, table, kv, r.head_dim);
  });
  check_launch("rotary_embedding_kv_append");
  record_launch("rotary_embedding_kv_append", "token_cta threads=%lld grid=%lld", {kRopeAppendThreads, grid});
}

}  // namespace ks::cuda
