// Built when the CUDA backend is off: no CUDA variants, no device.
#include <vector>

#include "registry/registry.hpp"
#include "registry/routing.hpp"

namespace ks::cuda {
bool device_present() { return false; }
const char* unavailable_reason() {
  return "this build of kernscope has no CUDA backend (nvcc was not found, or KS_WITH_CUDA=OFF)";
}
}  // namespace ks::cuda

namespace ks::registry {
void register_cuda_variants(std::vector<Variant>&) {}
std::string cuda_arch_name(int) { return ""; }
}  // namespace ks::registry

#include <kernscope/kernscope.h>
extern "C" const char* ks_last_launch_config(const char*) { return ""; }
