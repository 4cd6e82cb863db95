// bench_ops' read-out of cuda_mma_cluster's timeline (a library built with
// -DKS_ATTN_TIMELINE=ON; see ks_attn_tl in src/backends/cuda/attention.cu). Under
// KS_ATTN_TIMELINE=1, after each decode-attention row, report_attention_timeline prints where the
// last launch's time went, per CTA (µs from the first CTA's entry; min / median / max over the
// CTAs), and, with KS_ATTN_TIMELINE_CSV=path, appends every (CTA, warp)'s stamps there. With a
// library built without it the symbol is missing and nothing is printed.
#pragma once
#include <dlfcn.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace ks_bench {

inline void report_attention_timeline(const std::string& label, double us_per_call) {
  const char* on = std::getenv("KS_ATTN_TIMELINE");
  if (!on || std::strcmp(on, "1") != 0) return;
  using ReadOut = long long (*)(unsigned long long*, size_t);
  static const auto read_out = reinterpret_cast<ReadOut>(dlsym(RTLD_DEFAULT, "ks_debug_attention_timeline"));
  if (!read_out) {
    std::printf("timeline %s: the library has no timeline (build with -DKS_ATTN_TIMELINE=ON)\n", label.c_str());
    return;
  }
  constexpr int kBlocks = 512, kWarps = 16, kEvents = 8;
  std::vector<unsigned long long> tl(size_t(kBlocks) * kWarps * kEvents, 0);
  if (read_out(tl.data(), tl.size()) < 0) {
    std::printf("timeline %s: read-out failed\n", label.c_str());
    return;
  }
  auto at = [&](int b, int w, int e) { return tl[(size_t(b) * kWarps + size_t(w)) * kEvents + size_t(e)]; };
  unsigned long long t0 = ~0ull;
  for (int b = 0; b < kBlocks; ++b)
    for (int w = 0; w < kWarps; ++w)
      if (at(b, w, 0)) t0 = std::min(t0, at(b, w, 0));
  if (t0 == ~0ull) {
    std::printf("timeline %s: nothing recorded (not cuda_mma_cluster?)\n", label.c_str());
    return;
  }
  // per CTA: entry, wait returned, first tile (earliest warp), loop done (earliest, latest warp),
  // all warps done, state written, exit; and whether it merged the unit's split states
  const char* names[] = {"entry", "wait", "tile0", "loop_min", "loop_max", "synced", "state", "exit"};
  constexpr int kCols = 8;
  std::vector<std::vector<double>> col(kCols);
  std::vector<double> merge;
  int ctas = 0;
  auto rel = [&](unsigned long long t) { return t ? double(t - t0) * 1e-3 : -1.0; };
  const char* csv = std::getenv("KS_ATTN_TIMELINE_CSV");
  FILE* f = csv ? std::fopen(csv, "a") : nullptr;
  for (int b = 0; b < kBlocks; ++b) {
    if (!at(b, 0, 0)) continue;
    ++ctas;
    unsigned long long e0 = ~0ull, e2 = ~0ull, e3lo = ~0ull, e3hi = 0;
    for (int w = 0; w < kWarps; ++w) {
      if (!at(b, w, 0)) continue;
      e0 = std::min(e0, at(b, w, 0));
      if (at(b, w, 2)) e2 = std::min(e2, at(b, w, 2));
      if (at(b, w, 3)) e3lo = std::min(e3lo, at(b, w, 3)), e3hi = std::max(e3hi, at(b, w, 3));
      if (f)
        std::fprintf(f, "%s,%d,%d,%.3f,%.3f,%.3f,%.3f,%.3f,%.3f,%.3f,%llu\n", label.c_str(), b, w, rel(at(b, w, 0)),
                     rel(at(b, w, 1)), rel(at(b, w, 2)), rel(at(b, w, 3)), rel(at(b, w, 4)), rel(at(b, w, 5)),
                     rel(at(b, w, 6)), at(b, w, 7));
    }
    const double v[kCols] = {rel(e0), rel(at(b, 0, 1)), e2 == ~0ull ? -1 : rel(e2), e3lo == ~0ull ? -1 : rel(e3lo),
                             rel(e3hi), rel(at(b, 0, 4)), rel(at(b, 0, 5)), rel(at(b, 0, 6))};
    for (int c = 0; c < kCols; ++c)
      if (v[c] >= 0) col[size_t(c)].push_back(v[c]);
    if (at(b, 0, 7) == 1 && at(b, 0, 6) && at(b, 0, 5)) merge.push_back(double(at(b, 0, 6) - at(b, 0, 5)) * 1e-3);
  }
  if (f) std::fclose(f);
  std::printf("timeline %s: %d CTAs, %.2f us per call in the timing; last launch, us from the first entry "
              "(min / median / max over CTAs):\n", label.c_str(), ctas, us_per_call);
  for (int c = 0; c < kCols; ++c) {
    auto& x = col[size_t(c)];
    if (x.empty()) continue;
    std::sort(x.begin(), x.end());
    std::printf("  %-8s %7.2f %7.2f %7.2f\n", names[c], x.front(), x[x.size() / 2], x.back());
  }
  if (!merge.empty()) {
    std::sort(merge.begin(), merge.end());
    std::printf("  merge (state -> exit in the merging CTAs) %.2f / %.2f / %.2f us, %zu CTAs\n", merge.front(),
                merge[merge.size() / 2], merge.back(), merge.size());
  }
}

}  // namespace ks_bench
