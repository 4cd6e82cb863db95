// Host cost per eager call on the GPU machine: kernscope's C ABI (validation,
// variant selection, launch-configuration choice and the launch) next to the
// CUDA runtime's own launch cost for an empty kernel, so the library's share of
// the Python overhead (python/bench_overhead.py) can be told from the driver's.
//
// Each case: bursts of --burst calls (default 100, below the launch-queue depth),
// each starting with an idle device and timed on the host without waiting for
// the device; median over --repeats bursts, in µs per call.
//
// usage: launch_overhead [--burst 100] [--repeats 51]
#include <cuda_runtime.h>
#include "cuda_check.hpp"
#include <kernscope/kernscope.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

namespace {


__global__ void empty_kernel(const void*, void*, long long, float) {}

double host_us(const std::function<void()>& call, cudaStream_t s, int burst, int repeats) {
  for (int i = 0; i < 2 * burst; ++i) call();  // warm-up (first-call caches, module load)
  CK(cudaStreamSynchronize(s));
  std::vector<double> v;
  for (int r = 0; r < repeats; ++r) {
    CK(cudaStreamSynchronize(s));
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < burst; ++i) call();
    const auto t1 = std::chrono::steady_clock::now();
    v.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count() / burst);
  }
  CK(cudaStreamSynchronize(s));
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

DLTensor dl(void* p, int ndim, int64_t* shape, uint8_t code, uint8_t bits) {
  DLTensor t{};
  t.data = p;
  t.device = {kDLCUDA, 0};
  t.ndim = ndim;
  t.dtype = {code, bits, 1};
  t.shape = shape;
  return t;
}

}  // namespace

int main(int argc, char** argv) {
  int burst = 100, repeats = 51;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--burst")) burst = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--repeats")) repeats = std::atoi(argv[i + 1]);
  }
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const int64_t H = 4096;
  void *x, *w, *y;
  CK(cudaMalloc(&x, H * 2));
  CK(cudaMalloc(&w, H * 2));
  CK(cudaMalloc(&y, H * 2));
  CK(cudaMemset(x, 0x3c, H * 2));
  CK(cudaMemset(w, 0x3c, H * 2));
  int64_t xs[2] = {1, H}, ws[1] = {H};
  DLTensor tx = dl(x, 2, xs, kDLBfloat, 16), tw = dl(w, 1, ws, kDLBfloat, 16), ty = dl(y, 2, xs, kDLBfloat, 16);

  struct Case {
    const char* name;
    std::function<void()> call;
  };
  std::vector<Case> cases;
  cases.push_back({"empty kernel <<<1, 128>>>", [&] { empty_kernel<<<1, 128, 0, s>>>(x, y, H, 1e-6f); }});
  cases.push_back({"empty kernel cudaLaunchKernelEx + PDL", [&] {
                     cudaLaunchConfig_t cfg{};
                     cfg.gridDim = dim3(1);
                     cfg.blockDim = dim3(128);
                     cfg.stream = s;
                     cudaLaunchAttribute a[1];
                     a[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
                     a[0].val.programmaticStreamSerializationAllowed = 1;
                     cfg.attrs = a;
                     cfg.numAttrs = 1;
                     CK(cudaLaunchKernelEx(&cfg, empty_kernel, static_cast<const void*>(x), y, (long long)H, 1e-6f));
                   }});
  cases.push_back({"ks_rms_norm 1x4096 bf16 (C ABI)", [&] {
                     if (ks_rms_norm(&ty, &tx, &tw, 1e-6, KS_BACKEND_CUDA, s) != KS_SUCCESS) {
                       std::fprintf(stderr, "ks_rms_norm: %s\n", ks_last_error());
                       std::exit(1);
                     }
                   }});
  cases.push_back({"ks_rms_norm validation error (no launch)", [&] {
                     (void)ks_rms_norm(&ty, &tx, &tx, 1e-6, KS_BACKEND_CUDA, s);  // weight shape wrong
                   }});
  std::printf("host time per eager call, bursts of %d, median of %d (µs)\n", burst, repeats);
  for (auto& c : cases) std::printf("%-44s %8.3f\n", c.name, host_us(c.call, s, burst, repeats));
  CK(cudaFree(x));
  CK(cudaFree(w));
  CK(cudaFree(y));
  CK(cudaStreamDestroy(s));
  return 0;
}
