// The benchmarks' timing method (../shared/anchors' method): graph replay of `inner` rounds over
// `sets` input sets (enough to rotate past the 60 MB L2: nsets), the median of `reps` replays,
// µs per call; the device-to-device copy bandwidth of the run; a device buffer. Shared by
// bench_ops and the probes, so their numbers are measured the same way.
#pragma once

#include <cuda_runtime.h>
#include "cuda_check.hpp"

#include <algorithm>
#include <functional>
#include <vector>

namespace ks_bench {

struct Dev {
  void* p = nullptr;
  size_t n = 0;
  explicit Dev(size_t bytes) : n(bytes) { CK(cudaMalloc(&p, bytes ? bytes : 16)); }
  ~Dev() { cudaFree(p); }
  Dev(const Dev&) = delete;
};

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Per-call µs of `call(set)` over `sets` sets, by graph replay.
inline double graph_time(int sets, const std::function<void(int, cudaStream_t)>& call, cudaStream_t s, int inner = 20,
                  int reps = 7) {
  for (int i = 0; i < sets; ++i) call(i, s);  // warm-up, eager
  CK(cudaStreamSynchronize(s));
  cudaGraph_t g;
  cudaGraphExec_t ge;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  for (int r = 0; r < inner; ++r)
    for (int i = 0; i < sets; ++i) call(i, s);
  CK(cudaStreamEndCapture(s, &g));
  CK(cudaGraphInstantiate(&ge, g, 0));
  CK(cudaGraphLaunch(ge, s));
  CK(cudaStreamSynchronize(s));
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    CK(cudaEventRecord(a, s));
    CK(cudaGraphLaunch(ge, s));
    CK(cudaEventRecord(b, s));
    CK(cudaEventSynchronize(b));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(double(ms) * 1e3 / (inner * sets));
  }
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  CK(cudaGraphExecDestroy(ge));
  CK(cudaGraphDestroy(g));
  return median(t);
}

inline double copy_bandwidth(cudaStream_t s) {
  const size_t bytes = size_t(2) << 30;
  Dev a(bytes), b(bytes);
  CK(cudaMemset(a.p, 1, bytes));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  std::vector<double> t;
  for (int i = 0; i < 23; ++i) {
    CK(cudaEventRecord(e0, s));
    CK(cudaMemcpyAsync(b.p, a.p, bytes, cudaMemcpyDeviceToDevice, s));
    CK(cudaEventRecord(e1, s));
    CK(cudaEventSynchronize(e1));
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    if (i >= 3) t.push_back(ms * 1e-3);
  }
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  return 2.0 * double(bytes) / median(t) / 1e9;
}

inline int nsets(size_t bytes) { return int(std::max<size_t>(1, std::min<size_t>(16, size_t(3 * 60e6) / std::max<size_t>(bytes, 1) + 1))); }

}  // namespace ks_bench
