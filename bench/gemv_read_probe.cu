// How fast can anything *read* a decode GEMV's packed weight matrix from HBM, at the matrix's
// own size, timed as bench_ops times quant_matmul (graph replay, sets rotated past L2, median of
// 7, µs per call)? quant_matmul_a8 reaches 82% of the copy bandwidth at Q8_0 14336 x 4096 but
// 33-50% at 4096 x 4096 (10.5-17.8 MB; docs/perf/h200_quant_a8.md), where a kernel's fixed
// costs weigh. This probe separates the fixed cost of a size from the kernels' own: kernels that
// only read the bytes and discard them (an XOR kept live by a sink store that never happens).
//
//   ring  cuda_a8_bulk_stream's streaming skeleton with no arithmetic: the library's
//         bulk_ring_begin (one producer lane's bulk copies into a ring of stages, 16 consumer
//         warps waiting on each stage's mbarrier and releasing it), a CTA per SM, planned by the
//         library's a8_bulk_plan for the format (stages of 64 KB Q4, 32 KB Q8_0, 4 KB copies);
//         `ring2`: the same with two CTAs per SM (each at most half the SM's shared memory,
//         32 KB stages), so that one CTA's start overlaps the other's stream;
//   flat  every thread streams 16-byte ld.global.nc loads, U in flight, over its CTA's
//         contiguous share of the matrix; C CTAs of T threads per SM;
//   copy  cudaMemcpyAsync of the same bytes (device to device; GB/s counts read + write);
//   empty the launch alone: an empty kernel shaped as the ring's (544 threads, its shared
//         memory) or as 132 CTAs of 256 threads.
// PDL: launched with programmatic stream serialization; `wait` kernels trigger their dependents
// after griddepcontrol.wait as the library's kernels do (pdl_begin: grids of at most one CTA per
// SM), `entry` ones at their first instruction, `nopdl` without the attribute. The reads are
// issued before griddepcontrol.wait (weights are read-only, as cuda_a8_bulk_stream's copies).
//
// usage: gemv_read_probe [--csv FILE]
#include <cuda_runtime.h>
#include "cuda_check.hpp"
#include "graph_time.hpp"
#include "backends/cuda/common.cuh"  // the bulk ring of the library's GEMV kernels

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

namespace {

using ks::cuda::BulkPlan;
using ks::cuda::kBulkMaxSlots;
using ks::cuda::kBulkWarps;

constexpr unsigned kNever = 0x9e3779b9u;  // the XOR of the bytes read is never this in practice
constexpr int kRingThreads = 32 * (kBulkWarps + 1);

enum Pdl { kWait = 0, kEntry = 1, kNoPdl = 2 };
const char* pdl_name(int m) { return m == kWait ? "wait" : m == kEntry ? "entry" : "nopdl"; }

__device__ __forceinline__ uint4 ldg_nc(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
// The end every probe kernel shares: the dependency wait (and the library's trigger rule), then
// the store that keeps the reads live.
__device__ __forceinline__ void finish(int pdl, unsigned acc, unsigned* sink) {
  if (pdl == kWait) ks::cuda::pdl_begin();
  else if (pdl == kEntry) ks::cuda::pdl_wait();
  if (acc == kNever) sink[threadIdx.x] = acc;
}

template <int U>
__global__ void flat_kernel(const uint4* w, int64_t n16, unsigned* sink, int pdl) {
  if (pdl == kEntry) ks::cuda::pdl_trigger();
  const int64_t a = int64_t(blockIdx.x) * n16 / gridDim.x, e = (int64_t(blockIdx.x) + 1) * n16 / gridDim.x;
  unsigned acc = 0;
  for (int64_t i = a + threadIdx.x; i < e; i += int64_t(U) * blockDim.x) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t j = i + int64_t(u) * blockDim.x;
      v[u] = j < e ? ldg_nc(w + j) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  finish(pdl, acc, sink);
}

__global__ void __launch_bounds__(kRingThreads, 1)
    ring_kernel(const uint8_t* w, int64_t N, int64_t RB, int rps, int S, int slot_bytes, int chunk, unsigned* sink,
                int pdl) {
  extern __shared__ __align__(16) unsigned char ring_sm[];
  __shared__ uint64_t full[kBulkMaxSlots], empty[kBulkMaxSlots];
  if (pdl == kEntry) ks::cuda::pdl_trigger();
  int64_t r0, r1;
  int nst;
  if (!ks::cuda::bulk_ring_begin(w, N, RB, rps, S, slot_bytes, ring_sm, full, empty, true, chunk, kBulkWarps, r0, r1,
                                 nst))
    return;
  unsigned acc = 0;
  for (int i = 0; i < nst; ++i) {
    const int s = i % S;
    ks::cuda::mbar_wait(&full[s], unsigned(i / S) & 1u);
    acc ^= reinterpret_cast<const unsigned*>(ring_sm + int64_t(s) * slot_bytes)[threadIdx.x];
    ks::cuda::mbar_arrive(&empty[s]);
  }
  finish(pdl, acc, sink);
}

__global__ void empty_kernel(unsigned* sink, int pdl) {
  if (pdl == kEntry) ks::cuda::pdl_trigger();
  finish(pdl, 0, sink);
}

template <typename... A>
void launch(void (*k)(A...), unsigned grid, unsigned threads, size_t smem, cudaStream_t s, int pdl, A... args) {
  cudaLaunchConfig_t c = {};
  c.gridDim = dim3(grid);
  c.blockDim = dim3(threads);
  c.dynamicSmemBytes = smem;
  c.stream = s;
  cudaLaunchAttribute at[1];
  at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  at[0].val.programmaticStreamSerializationAllowed = 1;
  c.attrs = at;
  c.numAttrs = pdl == kNoPdl ? 0 : 1;
  CK(cudaLaunchKernelEx(&c, k, args...));
}

struct Shape {
  const char* name;  // the quant_matmul shape whose packed bytes this is
  int64_t rows, row_bytes;
};

}  // namespace

int main(int argc, char** argv) {
  const char* csv_path = nullptr;
  for (int i = 1; i < argc; ++i)
    if (!std::strcmp(argv[i], "--csv") && i + 1 < argc) csv_path = argv[++i];
  int dev = 0, sms = 0, smem_optin = 0, rt = 0, drv = 0;
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  CK(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  CK(cudaRuntimeGetVersion(&rt));
  CK(cudaDriverGetVersion(&drv));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, dev));
  cudaFuncAttributes fa;
  CK(cudaFuncGetAttributes(&fa, ring_kernel));
  smem_optin -= int(fa.sharedSizeBytes);  // the dynamic part's limit: the opt-in less the static barriers
  CK(cudaFuncSetAttribute(ring_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_optin));
  CK(cudaFuncSetAttribute(empty_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_optin));
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const double copy_gbs = ks_bench::copy_bandwidth(s);
  const char* commit = std::getenv("KS_COMMIT");
  FILE* csv = csv_path ? std::fopen(csv_path, "w") : nullptr;
  if (csv)
    std::fprintf(csv, "gpu,driver,cuda,commit,shape,bytes,pattern,config,pdl,us,gbs,pct_copy\n");
  std::printf("%s, %d SMs, copy %.0f GB/s (2 GiB device-to-device)\n", prop.name, sms, copy_gbs);
  ks_bench::Dev sink(4096);
  CK(cudaMemset(sink.p, 0, 4096));
  auto* sk = static_cast<unsigned*>(sink.p);

  const Shape shapes[] = {{"q4_1 4096x4096", 4096, 4096 / 32 * 20},  {"q8_0 4096x4096", 4096, 4096 / 32 * 34},
                          {"q4_1 14336x4096", 14336, 4096 / 32 * 20}, {"q8_0 14336x4096", 14336, 4096 / 32 * 34},
                          {"q4_1 49152x576", 49152, 576 / 32 * 20}};
  for (const Shape& sh : shapes) {
    const size_t bytes = size_t(sh.rows * sh.row_bytes);
    const int sets = ks_bench::nsets(bytes);
    std::vector<std::unique_ptr<ks_bench::Dev>> w, dst;
    for (int i = 0; i < sets; ++i) {
      w.emplace_back(new ks_bench::Dev(bytes));
      CK(cudaMemset(w.back()->p, 0x5a + i, bytes));
    }
    const auto row = [&](const char* pattern, const std::string& config, int pdl, double us, double read_bytes) {
      const double gbs = read_bytes / us * 1e-3;
      std::printf("%-16s %-6s %-40s %-5s %8.2f us %7.0f GB/s %5.1f%% copy\n", sh.name, pattern, config.c_str(),
                  pdl_name(pdl), us, gbs, 100 * gbs / copy_gbs);
      if (csv)
        std::fprintf(csv, "%s,%d,%d,%s,%s,%zu,%s,%s,%s,%.3f,%.1f,%.1f\n", prop.name, drv, rt, commit ? commit : "",
                     sh.name, bytes, pattern, config.c_str(), pdl_name(pdl), us, gbs, 100 * gbs / copy_gbs);
    };
    // ring: the library's plan for the format, one CTA per SM; ring2: two per SM
    const bool q8 = sh.row_bytes % 34 == 0;
    for (int per_sm : {1, 2}) {
      const int64_t limit = per_sm == 1 ? smem_optin : (int64_t(prop.sharedMemPerMultiprocessor) / 2 - 2048);
      const int64_t target = per_sm == 1 ? (q8 ? 32 : 64) * 1024 : 32 * 1024;
      const BulkPlan plan = ks::cuda::a8_bulk_plan(sh.rows, sh.row_bytes / (q8 ? 34 : 20) * 32, sh.row_bytes,
                                                   sms * per_sm, limit, target, 48, q8 ? 34 : 20);
      if (plan.slots < 1) continue;
      char cfg[160];
      std::snprintf(cfg, sizeof cfg, "rows_per_stage=%d slots=%d grid=%u smem=%zu", plan.rps, plan.slots, plan.grid,
                    plan.smem);
      for (int pdl : {kWait, kEntry, kNoPdl}) {
        const auto call = [&](int i, cudaStream_t st) {
          launch(ring_kernel, plan.grid, kRingThreads, plan.smem, st, pdl, static_cast<const uint8_t*>(w[i]->p),
                 int64_t(sh.rows), int64_t(sh.row_bytes), plan.rps, plan.slots, plan.slot_bytes, 4096, sk, pdl);
        };
        row(per_sm == 1 ? "ring" : "ring2", cfg, pdl, ks_bench::graph_time(sets, call, s), double(bytes));
      }
      for (int pdl : {kWait, kNoPdl}) {
        const auto call = [&](int, cudaStream_t st) {
          launch(empty_kernel, plan.grid, kRingThreads, plan.smem, st, pdl, sk, pdl);
        };
        row("empty", std::string("as ") + (per_sm == 1 ? "ring" : "ring2"), pdl, ks_bench::graph_time(sets, call, s),
            0);
      }
    }
    // flat: C CTAs of T threads per SM, U 16-byte loads in flight per thread
    struct Flat {
      int ctas_per_sm, threads, u;
    };
    for (const Flat f : {Flat{1, 1024, 4}, Flat{2, 512, 4}, Flat{4, 256, 4}, Flat{4, 256, 8}, Flat{8, 128, 8},
                         Flat{16, 128, 4}}) {
      const unsigned grid = unsigned(f.ctas_per_sm * sms);
      char cfg[96];
      std::snprintf(cfg, sizeof cfg, "ctas_per_sm=%d threads=%d loads_in_flight=%d", f.ctas_per_sm, f.threads, f.u);
      for (int pdl : {kWait, kEntry, kNoPdl}) {
        const auto call = [&](int i, cudaStream_t st) {
          const auto* p = static_cast<const uint4*>(w[i]->p);
          if (f.u == 8) launch(flat_kernel<8>, grid, f.threads, 0, st, pdl, p, int64_t(bytes / 16), sk, pdl);
          else launch(flat_kernel<4>, grid, f.threads, 0, st, pdl, p, int64_t(bytes / 16), sk, pdl);
        };
        row("flat", cfg, pdl, ks_bench::graph_time(sets, call, s), double(bytes));
      }
    }
    {
      const auto call = [&](int, cudaStream_t st) { launch(empty_kernel, unsigned(sms), 256, 0, st, kWait, sk, int(kWait)); };
      row("empty", "grid=SMs threads=256", kWait, ks_bench::graph_time(sets, call, s), 0);
    }
    for (int i = 0; i < sets; ++i) dst.emplace_back(new ks_bench::Dev(bytes));
    const auto copy = [&](int i, cudaStream_t st) {
      CK(cudaMemcpyAsync(dst[i]->p, w[i]->p, bytes, cudaMemcpyDeviceToDevice, st));
    };
    row("copy", "cudaMemcpyAsync", kNoPdl, ks_bench::graph_time(sets, copy, s), 2.0 * double(bytes));
  }
  if (csv) std::fclose(csv);
  CK(cudaStreamDestroy(s));
  return 0;
}
