// How fast can a decode-attention kernel's *read pattern* stream a KV cache from HBM into
// shared memory, with no arithmetic at all? Decode attention at batch 32 (32/8 heads of 128,
// 8K keys, bf16: 1.07 GB of K and V) is a pure stream; paged_attention's cuda_mma_cluster
// reaches 4.06 TB/s there and torch SDPA (cuDNN) 4.46 (docs/perf/h200_attention.md). Nsight
// Compute put the gap in how the reads reach DRAM (83% against 91.5% busy), so this probe
// times the read patterns alone, each as a kernel that only copies (cp.async) and discards:
//
//   layout  nhd:    the paged cache, [slot][kv head][head_dim]: a kv head's row of a key is 256
//                   bytes at a stride of num_kv_heads * 256 (2 KB), as paged_attention reads it;
//           contig: each (sequence, kv head) owns T consecutive 256-byte rows (torch SDPA's
//                   [batch, heads, T, head_dim] layout);
//   tiling  warp16: cuda_mma_cluster's: each of a CTA's 4 warps streams its own 16-key tiles
//                   (w, w + 4, ...) through a ring of 3 stages (K and V rows of a tile, padded
//                   by 16 bytes as cuda_mma_cluster's were until 7d1de62), waiting only for its
//                   own copies;
//           cta64:  the 4 warps copy one 64-key tile together (K, then V) through a ring of 3
//                   stages, a CTA barrier per tile (the shape of cuDNN's kernel, which loads
//                   128-key tiles with every thread);
//   order   kv:     a copy pass issues K's piece, then V's (cuda_mma_cluster); kfirst: the
//                   tile's K rows, then its V rows;
//   hint    none / 128 / 256: cp.async's L2 prefetch size (.L2::128B, .L2::256B).
// And the warp16 tiles of the paged rows landing in other ways (see Method: swizzled rows,
// cp.async.ca, ld.global.nc then st.shared, bulk copies of rows; tma_kernel: tensor copies of
// cuda_mma_tma's 16-row boxes or of single half-rows).
// Plus `flat`: every thread streams 16-byte loads (ld.global.nc) over both caches, the read
// ceiling of this probe. One CTA per (sequence, kv head), 128 threads, as both kernels above.
// Time: CUDA events around 20 launches, median of 9; the caches (2 x 512 MB) are 20x L2.
//
// usage: kv_read_probe [--batch 32] [--keys 8192] [--csv FILE] [--only PATTERN]
// (--only: the patterns whose name, as printed, contains PATTERN; e.g. for a profiler run)
#include <cuda_runtime.h>
#include "cuda_check.hpp"
#include "backends/cuda/common.cuh"  // the mbarrier and bulk-copy helpers of the library's kernels

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

using ks::cuda::bulk_copy_g2s;
using ks::cuda::mbar_arrive_expect_tx;
using ks::cuda::mbar_init;
using ks::cuda::mbar_init_fence;
using ks::cuda::mbar_wait;
using ks::cuda::tensor_map_encoder;
using ks::cuda::tma_load_4d;

constexpr int kKvHeads = 8, kRowBytes = 256, kPad = 16, kThreads = 128, kStages = 3;

enum Tiling { kWarp16 = 0, kCta64 = 1 };
// how warp16's rows land in shared memory: cp.async.cg into rows padded by 16 bytes
// (cuda_mma_cluster until 7d1de62); cp.async.cg into unpadded rows, 16-byte chunks XOR-swizzled
// by the row (as cuda_mma_cluster since 7d1de62, in 256-byte rows here); cp.async.ca (through L1); ld.global.nc into registers, a
// tile (kLdg1) or two (kLdg2) ahead, then st.shared; cp.async.bulk of each 256-byte row (the
// TMA unit, one row per lane) completing on the stage's mbarrier, into unpadded rows or rows padded by
// 16 bytes (kBulkRowsPadded)
// kStreamK: kCgSwizzled's copies by a grid of 2 CTAs per SM, each CTA an equal share of the
// tiles of every (sequence, kv head) in order (a share may span two or more of them), where the
// others run one CTA per (sequence, kv head): at batch 32 that is 256 CTAs on the H200's 264 slots
enum Method { kCg = 0, kCgSwizzled = 1, kCa = 2, kLdg1 = 3, kLdg2 = 4, kBulkRows = 5, kBulkRowsPadded = 6, kStreamK = 7 };

template <int HINT, bool CA = false>
__device__ __forceinline__ void cp16(void* smem, const void* gmem) {
  const unsigned dst = unsigned(__cvta_generic_to_shared(smem));
  if constexpr (CA)
    asm volatile("cp.async.ca.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem) : "memory");
  else if constexpr (HINT == 256)
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem) : "memory");
  else if constexpr (HINT == 128)
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem) : "memory");
  else
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem) : "memory");
}
__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wait_group() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// The cp.async ring every copy-based pattern runs over its n tiles: S - 1 tiles in flight, then
// per tile the copies of the tile S - 1 ahead (issue commits its group), the wait for tile i,
// `sync` (the warp's or the CTA's barrier), its use, and `sync` again before the stage is reused.
template <int S, typename Issue, typename Sync, typename Use>
__device__ __forceinline__ void cp_ring(int n, Issue&& issue, Sync&& sync, Use&& use) {
  for (int i = 0; i < S - 1; ++i) {
    if (i < n) issue(i);
    else commit();
  }
  for (int i = 0; i < n; ++i) {
    if (i + S - 1 < n) issue(i + S - 1);
    else commit();
    wait_group<S - 1>();
    sync();
    use(i % S);
    sync();
  }
  wait_group<0>();
}

// The mbarrier ring of the bulk- and tensor-copy patterns, per warp: S barriers (one arrival
// each, lane 0's expect_tx in `issue`), S - 1 tiles in flight, then per tile the copies of the
// tile S - 1 ahead, the wait for tile i's bytes, its use and a warp barrier before the stage is reused.
template <int S, typename Issue, typename Use>
__device__ __forceinline__ void mbar_ring(uint64_t* bars, int n, int lane, Issue&& issue, Use&& use) {
  if (lane == 0) {
    for (int st = 0; st < S; ++st) mbar_init(bars + st, 1);
    mbar_init_fence();
  }
  __syncwarp();
  for (int i = 0; i < S - 1 && i < n; ++i) issue(i);
  for (int i = 0; i < n; ++i) {
    if (i + S - 1 < n) issue(i + S - 1);
    mbar_wait(bars + i % S, unsigned(i / S) & 1u);
    use(i % S);
    __syncwarp();
  }
}

struct Probe {
  const unsigned char* k;
  const unsigned char* v;
  unsigned* sink;
  int keys;       // T
  bool nhd;       // layout (see the header)
  int units;      // sequences * kv heads (kStreamK's share)
};

// the byte offset of key j's row for (seq, kvh)
__device__ __forceinline__ size_t row_at(const Probe& p, int seq, int kvh, int j) {
  return p.nhd ? ((size_t(seq) * p.keys + j) * kKvHeads + kvh) * kRowBytes
               : ((size_t(seq) * kKvHeads + kvh) * p.keys + j) * kRowBytes;
}

template <int TILING, int HINT, bool KFIRST>
__global__ void __launch_bounds__(kThreads) stream_kernel(const Probe p) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int seq = blockIdx.x / kKvHeads, kvh = blockIdx.x % kKvHeads;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  constexpr int RB = kRowBytes + kPad;
  unsigned keep = 0;
  if constexpr (TILING == kWarp16) {
    constexpr int K = 16, stage_bytes = 2 * K * RB;
    unsigned char* ring = smem + warp * kStages * stage_bytes;
    const int ntiles = p.keys / K, mine = (ntiles - warp + 3) / 4;
    const int ch = lane & 15;
    auto issue = [&](int i) {
      unsigned char* st = ring + (i % kStages) * stage_bytes;
      const int j0 = (warp + 4 * i) * K;
      if constexpr (KFIRST) {
#pragma unroll
        for (int pass = 0; pass < 16; ++pass) {
          const int row = (pass & 7) * 2 + (lane >> 4);
          const unsigned char* src = (pass < 8 ? p.k : p.v) + row_at(p, seq, kvh, j0 + row) + ch * 16;
          cp16<HINT>(st + ((pass < 8 ? 0 : K) + row) * RB + ch * 16, src);
        }
      } else {
#pragma unroll
        for (int pass = 0; pass < 8; ++pass) {
          const int row = pass * 2 + (lane >> 4);
          const size_t off = row_at(p, seq, kvh, j0 + row) + ch * 16;
          cp16<HINT>(st + row * RB + ch * 16, p.k + off);
          cp16<HINT>(st + (K + row) * RB + ch * 16, p.v + off);
        }
      }
      commit();
    };
    cp_ring<kStages>(mine, issue, [] { __syncwarp(); }, [&](int stage) {
      keep += *reinterpret_cast<const unsigned*>(ring + stage * stage_bytes + lane * 4);
    });
  } else {
    constexpr int K = 64, stage_bytes = 2 * K * RB;
    const int ntiles = p.keys / K;
    const int ch = threadIdx.x & 15, r0 = threadIdx.x >> 4;  // 8 rows per pass of the CTA
    auto issue = [&](int i) {
      unsigned char* st = smem + (i % kStages) * stage_bytes;
      const int j0 = i * K;
#pragma unroll
      for (int pass = 0; pass < 16; ++pass) {  // K's 64 rows, then V's (kv order: alternating)
        const bool is_v = KFIRST ? pass >= 8 : (pass & 1);
        const int row = (KFIRST ? (pass & 7) : (pass >> 1)) * 8 + r0;
        cp16<HINT>(st + ((is_v ? K : 0) + row) * RB + ch * 16, (is_v ? p.v : p.k) + row_at(p, seq, kvh, j0 + row) + ch * 16);
      }
      commit();
    };
    cp_ring<kStages>(ntiles, issue, [] { __syncthreads(); }, [&](int stage) {
      keep += *reinterpret_cast<const unsigned*>(smem + stage * stage_bytes + threadIdx.x * 4);
    });
  }
  if (keep == 0x9e3779b9u) p.sink[0] = keep;  // (keeps the reads of shared memory)
}

// warp16 tiling over the paged (nhd) rows, each tile's rows landing by METHOD (see Method)
template <int METHOD, int HINT = 0>
__global__ void __launch_bounds__(kThreads) method_kernel(const Probe p) {
  extern __shared__ __align__(1024) unsigned char smem[];
  constexpr int K = 16;
  constexpr bool padded = METHOD == kCg || METHOD == kCa || METHOD == kBulkRowsPadded;
  constexpr int RB = padded ? kRowBytes + kPad : kRowBytes, stage_bytes = 2 * K * RB;
  constexpr int S = METHOD == kLdg1 || METHOD == kLdg2 ? 2 : kStages;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  unsigned char* ring = smem + warp * S * stage_bytes;
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + 4 * S * stage_bytes) + warp * S;
  const int ntiles = p.keys / K;
  // the CTA's tiles t0 .. t1 - 1 of the units' tiles in order (unit u's tile j: u * ntiles + j)
  int64_t t0 = int64_t(blockIdx.x) * ntiles, t1 = t0 + ntiles;
  if constexpr (METHOD == kStreamK) {
    const int64_t total = int64_t(p.units) * ntiles;
    t0 = total * blockIdx.x / gridDim.x;
    t1 = total * (blockIdx.x + 1) / gridDim.x;
  }
  const int n = int(t1 - t0), mine = n > warp ? (n - warp + 3) / 4 : 0;
  const int ch = lane & 15;
  // shared-memory offset of 16-byte chunk c of row r (r: K rows 0..15, V rows 16..31)
  auto at = [&](int r, int c) {
    return r * RB + (METHOD == kCgSwizzled || METHOD == kStreamK ? ((c & 8) | ((c ^ r) & 7)) : c) * 16;
  };
  auto src = [&](bool v, int i, int row) {
    const int64_t g = t0 + warp + 4 * i;
    const int unit = int(g / ntiles), j = int(g % ntiles);
    return (v ? p.v : p.k) + row_at(p, unit / kKvHeads, unit % kKvHeads, j * K + row) + ch * 16;
  };
  unsigned keep = 0;
  auto consume = [&](int stage) {
    keep += *reinterpret_cast<const unsigned*>(ring + stage * stage_bytes + lane * 4);
  };
  if constexpr (METHOD == kLdg1 || METHOD == kLdg2) {
    constexpr int DEPTH = METHOD == kLdg1 ? 1 : 2;
    uint4 r[DEPTH][16];
    auto load = [&](int i, uint4 (&dst)[16]) {
#pragma unroll
      for (int pass = 0; pass < 8; ++pass) {
        const int row = pass * 2 + (lane >> 4);
        const uint4* a = reinterpret_cast<const uint4*>(src(false, i, row));
        const uint4* b = reinterpret_cast<const uint4*>(src(true, i, row));
        asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(dst[2 * pass].x), "=r"(dst[2 * pass].y), "=r"(dst[2 * pass].z), "=r"(dst[2 * pass].w) : "l"(a));
        asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(dst[2 * pass + 1].x), "=r"(dst[2 * pass + 1].y), "=r"(dst[2 * pass + 1].z), "=r"(dst[2 * pass + 1].w) : "l"(b));
      }
    };
#pragma unroll
    for (int d = 0; d < DEPTH; ++d)
      if (d < mine) load(d, r[d]);
    for (int i = 0; i < mine; i += DEPTH) {
#pragma unroll
      for (int d = 0; d < DEPTH; ++d) {
        if (i + d >= mine) break;
        const int stage = (i + d) % S;
#pragma unroll
        for (int pass = 0; pass < 8; ++pass) {
          const int row = pass * 2 + (lane >> 4);
          *reinterpret_cast<uint4*>(ring + stage * stage_bytes + at(row, ch)) = r[d][2 * pass];
          *reinterpret_cast<uint4*>(ring + stage * stage_bytes + at(K + row, ch)) = r[d][2 * pass + 1];
        }
        if (i + d + DEPTH < mine) load(i + d + DEPTH, r[d]);
        __syncwarp();
        consume(stage);
        __syncwarp();
      }
    }
  } else if constexpr (METHOD == kBulkRows || METHOD == kBulkRowsPadded) {
    auto issue = [&](int i) {
      const int stage = i % S;
      if (lane == 0) mbar_arrive_expect_tx(bars + stage, unsigned(2 * K * kRowBytes));
      __syncwarp();
      const int row = lane & 15;
      const bool v = lane >= 16;
      bulk_copy_g2s(ring + stage * stage_bytes + (v ? K + row : row) * RB,
                    src(v, i, row) - ch * 16, kRowBytes, bars + stage);  // (the row's start)
    };
    mbar_ring<S>(bars, mine, lane, issue, consume);
  } else {
    auto issue = [&](int i) {
      unsigned char* st = ring + (i % S) * stage_bytes;
#pragma unroll
      for (int pass = 0; pass < 8; ++pass) {
        const int row = pass * 2 + (lane >> 4);
        cp16<HINT, METHOD == kCa>(st + at(row, ch), src(false, i, row));
        cp16<HINT, METHOD == kCa>(st + at(K + row, ch), src(true, i, row));
      }
      commit();
    };
    cp_ring<S>(mine, issue, [] { __syncwarp(); }, consume);
  }
  if (keep == 0x9e3779b9u) p.sink[0] = keep;
}

// warp16 tiling over the paged (nhd) rows by the TMA unit's tensor copies through a map of each
// cache ({64 elements, rows, 2 halves, 8 kv heads}, the 128-byte swizzle), landing as
// cuda_mma_cluster's tiles: [half][16 rows][128 bytes] per K or V tile. ROWS = false: lane 0
// issues one copy of K and one of V per tile (box {64, 16, 2, 1}: cuda_mma_tma's, which asks for
// the 16 rows' first halves, then their second halves); ROWS = true: each lane copies one
// half-row of K and of V (box {64, 1, 1, 1}: 64 copies of 128 bytes per tile, in row order, the
// hardware placing each by its destination's address bits as the whole box would).
struct Maps {
  CUtensorMap k, v;
};
template <bool ROWS>
__global__ void __launch_bounds__(kThreads) tma_kernel(const Probe p, const __grid_constant__ Maps maps) {
  extern __shared__ __align__(1024) unsigned char smem[];
  constexpr int K = 16, stage_bytes = 2 * K * kRowBytes, S = kStages;
  const int seq = blockIdx.x / kKvHeads, kvh = blockIdx.x % kKvHeads;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  // the ring on a 1024-byte boundary (the swizzle's period), the barriers after the 4 warps' rings
  const unsigned pad = (1024u - (unsigned(__cvta_generic_to_shared(smem)) & 1023u)) & 1023u;
  unsigned char* ring = smem + pad + warp * S * stage_bytes;
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + pad + 4 * S * stage_bytes) + warp * S;
  const int ntiles = p.keys / K, mine = (ntiles - warp + 3) / 4;
  auto issue = [&](int i) {
    const int stage = i % S;
    unsigned char* st = ring + stage * stage_bytes;
    const int row0 = seq * p.keys + (warp + 4 * i) * K;
    if (lane == 0) mbar_arrive_expect_tx(bars + stage, unsigned(stage_bytes));
    if constexpr (ROWS) {
      __syncwarp();
      const int r = lane & 15, h = lane >> 4;
      tma_load_4d(st + h * (K * 128) + r * 128, &maps.k, 0, row0 + r, h, kvh, bars + stage);
      tma_load_4d(st + K * kRowBytes + h * (K * 128) + r * 128, &maps.v, 0, row0 + r, h, kvh, bars + stage);
    } else if (lane == 0) {
      tma_load_4d(st, &maps.k, 0, row0, 0, kvh, bars + stage);
      tma_load_4d(st + K * kRowBytes, &maps.v, 0, row0, 0, kvh, bars + stage);
    }
  };
  unsigned keep = 0;
  mbar_ring<S>(bars, mine, lane, issue, [&](int stage) {
    keep += *reinterpret_cast<const unsigned*>(ring + stage * stage_bytes + lane * 4);
  });
  if (keep == 0x9e3779b9u) p.sink[0] = keep;
}

__global__ void flat_kernel(const uint4* k, const uint4* v, size_t n16, unsigned* sink) {
  unsigned keep = 0;
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n16; i += size_t(gridDim.x) * blockDim.x) {
    uint4 a, b;
    asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(a.x), "=r"(a.y), "=r"(a.z), "=r"(a.w) : "l"(k + i));
    asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(b.x), "=r"(b.y), "=r"(b.z), "=r"(b.w) : "l"(v + i));
    keep ^= a.x ^ b.w;
  }
  if (keep == 0x9e3779b9u) sink[0] = keep;
}

template <typename F>
double median_us(F&& launch, int reps, int samples) {
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  for (int i = 0; i < 3; ++i) launch();
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  std::vector<double> v;
  for (int s = 0; s < samples; ++s) {
    CK(cudaEventRecord(e0));
    for (int i = 0; i < reps; ++i) launch();
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float ms = 0.f;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    v.push_back(1000.0 * ms / reps);
  }
  CK(cudaGetLastError());
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int batch = 32, keys = 8192;
  const char* csv_path = nullptr;
  std::string only;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--batch")) batch = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--keys")) keys = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--csv")) csv_path = argv[i + 1];
    else if (!std::strcmp(argv[i], "--only")) only = argv[i + 1];
    else { std::fprintf(stderr, "usage: kv_read_probe [--batch N] [--keys T] [--csv FILE] [--only PATTERN]\n"); return 2; }
  }
  if (batch < 1 || keys < 64 || keys % 64 != 0) {
    std::fprintf(stderr, "kv_read_probe: --batch must be >= 1 and --keys a positive multiple of 64\n");
    return 2;
  }
  const size_t cache = size_t(batch) * keys * kKvHeads * kRowBytes;  // bytes of K (and of V)
  unsigned char *k = nullptr, *v = nullptr;
  unsigned* sink = nullptr;
  CK(cudaMalloc(&k, cache));
  CK(cudaMalloc(&v, cache));
  CK(cudaMalloc(&sink, 4));
  CK(cudaMemset(k, 0x3c, cache));
  CK(cudaMemset(v, 0x3d, cache));
  int dev = 0;
  cudaDeviceProp prop{};
  CK(cudaGetDevice(&dev));
  CK(cudaGetDeviceProperties(&prop, dev));
  const double bytes = 2.0 * cache;
  // copy bandwidth (read + write), as bench_ops measures it: a device-to-device copy of one cache
  const double copy_us = median_us([&] { CK(cudaMemcpyAsync(v, k, cache, cudaMemcpyDeviceToDevice)); }, 10, 9);
  const double copy_gbs = 2.0 * cache / copy_us / 1e3;
  std::printf("device %s, %d SMs; caches 2 x %.0f MB; copy bandwidth %.1f GB/s\n", prop.name, prop.multiProcessorCount,
              cache / 1e6, copy_gbs);
  FILE* csv = csv_path ? std::fopen(csv_path, "w") : nullptr;
  // metadata columns as bench_ops writes them (KS_COMMIT, KS_DRIVER: from scripts/gpu_env.sh)
  int rt = 0, drv = 0;
  CK(cudaRuntimeGetVersion(&rt));
  CK(cudaDriverGetVersion(&drv));
  const char* commit = std::getenv("KS_COMMIT");
  const std::string meta = std::string(prop.name) + "," + driver_version(drv) + "," + std::to_string(rt) +
                           "," + (commit && *commit ? commit : "unknown");
  if (csv) std::fprintf(csv, "gpu,driver,cuda,commit,pattern,batch,keys,us,gbs,pct_copy,copy_gbs\n");
  auto report = [&](const std::string& name, double us) {
    const double gbs = bytes / us / 1e3;
    std::printf("%-28s %10.2f us %8.1f GB/s %6.1f%% of copy\n", name.c_str(), us, gbs, 100.0 * gbs / copy_gbs);
    if (csv)
      std::fprintf(csv, "%s,%s,%d,%d,%.3f,%.1f,%.2f,%.1f\n", meta.c_str(), name.c_str(), batch, keys, us, gbs,
                   100.0 * gbs / copy_gbs, copy_gbs);
  };
  const dim3 grid(unsigned(batch * kKvHeads));
  auto run = [&](auto kernel, int smem, const char* name, bool nhd) {
    const std::string full = std::string(nhd ? "nhd " : "contig ") + name;
    if (full.find(only) == std::string::npos) return;
    CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    const Probe p{k, v, sink, keys, nhd, batch * kKvHeads};
    const double us = median_us([&] { kernel<<<grid, kThreads, smem>>>(p); }, 20, 9);
    report(full, us);
  };
  constexpr int w16 = 4 * kStages * 2 * 16 * (kRowBytes + kPad), c64 = kStages * 2 * 64 * (kRowBytes + kPad);
  for (bool nhd : {true, false}) {
    run(stream_kernel<kWarp16, 0, false>, w16, "warp16 kv", nhd);
    run(stream_kernel<kWarp16, 128, false>, w16, "warp16 kv L2::128B", nhd);
    run(stream_kernel<kWarp16, 256, false>, w16, "warp16 kv L2::256B", nhd);
    run(stream_kernel<kWarp16, 0, true>, w16, "warp16 kfirst", nhd);
    run(stream_kernel<kWarp16, 256, true>, w16, "warp16 kfirst L2::256B", nhd);
    run(stream_kernel<kCta64, 0, false>, c64, "cta64 kv", nhd);
    run(stream_kernel<kCta64, 0, true>, c64, "cta64 kfirst", nhd);
    run(stream_kernel<kCta64, 256, true>, c64, "cta64 kfirst L2::256B", nhd);
  }
  // the warp16 tiles over the paged rows, landing by each Method (nhd only)
  auto run_method = [&](auto kernel, int stages, bool padded, const char* name, dim3 g = dim3(0)) {
    const std::string full = std::string("nhd warp16 ") + name;
    if (full.find(only) == std::string::npos) return;
    const int smem = 4 * stages * 2 * 16 * (kRowBytes + (padded ? kPad : 0)) + 4 * stages * 8;
    CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    const Probe p{k, v, sink, keys, true, batch * kKvHeads};
    const dim3 gr = g.x ? g : grid;
    report(full, median_us([&] { kernel<<<gr, kThreads, smem>>>(p); }, 20, 9));
  };
  run_method(method_kernel<kCgSwizzled>, kStages, false, "cg swizzled");
  run_method(method_kernel<kCgSwizzled, 128>, kStages, false, "cg swizzled L2::128B");
  run_method(method_kernel<kStreamK>, kStages, false, "cg swizzled stream-K 2/SM", dim3(2u * prop.multiProcessorCount));
  run_method(method_kernel<kStreamK>, kStages, false, "cg swizzled stream-K 1/SM", dim3(unsigned(prop.multiProcessorCount)));
  run_method(method_kernel<kCgSwizzled, 256>, kStages, false, "cg swizzled L2::256B");
  run_method(method_kernel<kCa>, kStages, true, "ca");
  run_method(method_kernel<kLdg1>, 2, false, "ldg 1 ahead");
  run_method(method_kernel<kLdg2>, 2, false, "ldg 2 ahead");
  run_method(method_kernel<kBulkRows>, kStages, false, "bulk rows");
  run_method(method_kernel<kBulkRowsPadded>, kStages, true, "bulk rows padded");
  // the tensor copies (last: a driver without the encoder, or a refused map, skips them)
  auto run_tma = [&](auto kernel, const char* name, int box_rows, int box_halves) {
    const std::string full = std::string("nhd warp16 ") + name;
    if (full.find(only) == std::string::npos) return;
    const PFN_cuTensorMapEncodeTiled_v12000 enc = tensor_map_encoder();
    if (!enc) {
      std::printf("%-28s skipped: the driver has no cuTensorMapEncodeTiled\n", full.c_str());
      return;
    }
    Maps maps{};
    const cuuint64_t dims[4] = {64, cuuint64_t(batch) * cuuint64_t(keys), 2, kKvHeads};
    const cuuint64_t strides[3] = {kKvHeads * kRowBytes, 128, kRowBytes};
    const cuuint32_t box[4] = {64, cuuint32_t(box_rows), cuuint32_t(box_halves), 1}, elem[4] = {1, 1, 1, 1};
    for (int m = 0; m < 2; ++m)
      if (enc(m ? &maps.v : &maps.k, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4, m ? v : k, dims, strides, box, elem,
              CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
              CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS) {
        std::printf("%-28s skipped: cuTensorMapEncodeTiled refused the map\n", full.c_str());
        return;
      }
    const int smem = 1024 + 4 * kStages * 2 * 16 * kRowBytes + 4 * kStages * 8;
    CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    const Probe p{k, v, sink, keys, true, batch * kKvHeads};
    report(full, median_us([&] { kernel<<<grid, kThreads, smem>>>(p, maps); }, 20, 9));
  };
  run_tma(tma_kernel<false>, "tma box16", 16, 2);
  run_tma(tma_kernel<true>, "tma rows", 1, 1);
  const size_t n16 = cache / 16;
  if (std::string("flat ld.global.nc").find(only) != std::string::npos) {
    const double flat_us = median_us([&] { flat_kernel<<<prop.multiProcessorCount * 8, 256>>>(
                                              reinterpret_cast<const uint4*>(k), reinterpret_cast<const uint4*>(v), n16, sink); },
                                     20, 9);
    report("flat ld.global.nc", flat_us);
  }
  if (csv) std::fclose(csv);
  CK(cudaFree(k));
  CK(cudaFree(v));
  CK(cudaFree(sink));
  return 0;
}
