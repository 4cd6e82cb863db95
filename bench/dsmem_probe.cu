// Distributed-shared-memory latency on the GPU it runs on: one warp per CTA of a cluster of
// `C` chases a dependent chain of indices through another CTA's shared memory, by generic loads
// (cluster.map_shared_rank: what finish_unit's merge does), by ld.shared::cluster on a mapa
// address, and through its own shared memory; the cycles and ns per load are printed. Also the
// cost of one cluster barrier (arrive.release + wait.acquire) with every CTA present.
// Usage: dsmem_probe   (built by CMake with KS_BUILD_TOOLS; a measurement, not a test; launched
// in clusters of 4, two clusters)
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#include "cuda_check.hpp"

namespace cg = cooperative_groups;

[[maybe_unused]] constexpr int kN = 4096;
constexpr int kSteps = 256;

__global__ void chase(unsigned long long* out, int mode) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900  // (clusters: sm_90; the compute_80 pass has none)
  __shared__ int buf[kN];
  cg::cluster_group cl = cg::this_cluster();
  for (int i = threadIdx.x; i < kN; i += blockDim.x) buf[i] = (i + 97) % kN;  // a chain of strided steps
  cl.sync();
  const unsigned r = (cl.block_rank() + 1) % cl.num_blocks();
  int idx = int(threadIdx.x);
  unsigned long long c0 = 0, c1 = 0, g0 = 0, g1 = 0;
  if (threadIdx.x < 32) {
    if (mode == 0) {
      const int* p = cl.map_shared_rank(buf, r);
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g0));
      c0 = clock64();
      for (int s = 0; s < kSteps; ++s) idx = p[idx];
    } else if (mode == 1) {
      unsigned a;
      asm volatile("mapa.shared::cluster.u32 %0, %1, %2;"
                   : "=r"(a) : "r"(unsigned(__cvta_generic_to_shared(buf))), "r"(r));
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g0));
      c0 = clock64();
      for (int s = 0; s < kSteps; ++s) asm volatile("ld.shared::cluster.u32 %0, [%1];" : "=r"(idx) : "r"(a + 4u * unsigned(idx)));
    } else if (mode == 2) {
      volatile int* p = buf;
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g0));
      c0 = clock64();
      for (int s = 0; s < kSteps; ++s) idx = p[idx];
    } else {  // cluster barriers back to back
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g0));
      c0 = clock64();
    }
    c1 = clock64();
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g1));
  }
  if (mode == 3) {
    __syncthreads();
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g0));
    c0 = clock64();
    for (int s = 0; s < kSteps; ++s) {
      asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
      asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
    }
    c1 = clock64();
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g1));
  }
  cl.sync();  // no CTA leaves while another reads its shared memory
  if (threadIdx.x == 0 && blockIdx.x == 0) {
    out[0] = c1 - c0;
    out[1] = g1 - g0;
    out[2] = unsigned(idx);
  }
#endif
}

int main() {
  unsigned long long* d = nullptr;
  CK(cudaMalloc(&d, 4 * sizeof(unsigned long long)));
  const char* names[] = {"generic load (map_shared_rank)", "ld.shared::cluster (mapa)", "own shared memory (volatile)",
                         "cluster barrier (arrive.release + wait.acquire)"};
  for (int mode = 0; mode < 4; ++mode) {
    for (int rep = 0; rep < 3; ++rep) {
      cudaLaunchConfig_t cfg = {};
      cfg.gridDim = dim3(8);
      cfg.blockDim = dim3(128);
      cudaLaunchAttribute attr[1];
      attr[0].id = cudaLaunchAttributeClusterDimension;
      attr[0].val.clusterDim.x = 4;
      attr[0].val.clusterDim.y = 1;
      attr[0].val.clusterDim.z = 1;
      cfg.attrs = attr;
      cfg.numAttrs = 1;
      CK(cudaLaunchKernelEx(&cfg, chase, d, mode));
      CK(cudaDeviceSynchronize());
    }
    unsigned long long h[3];
    CK(cudaMemcpy(h, d, sizeof h, cudaMemcpyDeviceToHost));
    std::printf("dsmem_probe %-48s %7.1f cycles %7.1f ns per step\n", names[mode], double(h[0]) / kSteps,
                double(h[1]) / kSteps);
  }
  CK(cudaFree(d));
  return 0;
}
