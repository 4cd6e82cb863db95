// CK(call): a failing CUDA runtime call in a benchmark prints where and why, then exits.
// driver_version(api): the benchmarks' CSV driver column.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#define CK(x)                                                                                \
  do {                                                                                       \
    cudaError_t e_ = (x);                                                                    \
    if (e_ != cudaSuccess) {                                                                 \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                          \
    }                                                                                        \
  } while (0)

// The CSV's driver column: KS_DRIVER (gpu_check.sh sets it from nvidia-smi), else the kernel
// module's version from /proc/driver/nvidia/version: the first token after "Kernel Module" that
// starts with a digit ("... Kernel Module  580.159.04 ..." and the open module's "... Open Kernel
// Module for x86_64  580.159.04 ...", where the first token, "for", was taken before), else
// the CUDA driver API version cudaDriverGetVersion gives (e.g. "api13000", marked so that it is
// not read as the driver's own version, as the bare 13000 was).
inline std::string driver_version(int api, const char* proc = "/proc/driver/nvidia/version") {
  if (const char* e = std::getenv("KS_DRIVER"); e && *e) return e;
  if (FILE* f = std::fopen(proc, "r")) {
    char line[512] = {0};
    const bool got = std::fgets(line, sizeof line, f) != nullptr;
    std::fclose(f);
    const char* k = got ? std::strstr(line, "Kernel Module") : nullptr;
    if (k) {
      k += std::strlen("Kernel Module");
      while (*k) {
        while (*k == ' ' || *k == '\t') ++k;
        std::string v;
        while (*k && *k != ' ' && *k != '\t' && *k != '\n' && *k != ',') v += *k++;
        if (!v.empty() && v[0] >= '0' && v[0] <= '9') return v;
        if (*k == '\n') break;
      }
    }
  }
  return "api" + std::to_string(api);
}
