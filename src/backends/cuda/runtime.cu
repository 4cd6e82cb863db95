// CUDA backend runtime: device discovery and variant registration. The CUDA
// operator kernels register here (none yet: every op falls back to an explicit
// BACKEND_UNAVAILABLE error on device tensors until they land).
#include <cuda_runtime.h>

#include <vector>

#include "registry/registry.hpp"

namespace ks::cuda {

// True when the runtime sees at least one CUDA device. Cached; never throws.
bool device_present() {
  static const bool present = [] {
    int n = 0;
    const cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();  // clear the sticky "no device" error
      return false;
    }
    return n > 0;
  }();
  return present;
}

}  // namespace ks::cuda

namespace ks::registry {
void register_cuda_variants(std::vector<Variant>&) {}
}  // namespace ks::registry
