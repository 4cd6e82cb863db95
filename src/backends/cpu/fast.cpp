// CPU fast paths (registry variants above the reference). Filled in below.
#include <vector>

#include "registry/registry.hpp"

namespace ks::registry {
void register_cpu_fast(std::vector<Variant>&) {}
}  // namespace ks::registry
