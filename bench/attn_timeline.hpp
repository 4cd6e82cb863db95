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

// The stamps of a timeline build (-DKS_ATTN_TIMELINE=ON) when environment variable `env` is "1":
// `entries` of them read out (and cleared) through the library's `symbol`
// (ks_debug_attention_timeline, ks_debug_qmm_timeline); empty, with a line saying why where the
// library has no such symbol or the read-out fails, and without one where `env` is not set.
inline std::vector<unsigned long long> read_timeline(const char* env, const char* symbol, size_t entries,
                                                     const std::string& label) {
  const char* on = std::getenv(env);
  if (!on || std::strcmp(on, "1") != 0) return {};
  using ReadOut = long long (*)(unsigned long long*, size_t);
  const auto read_out = reinterpret_cast<ReadOut>(dlsym(RTLD_DEFAULT, symbol));
  if (!read_out) {
    std::printf("timeline %s: the library has no timeline (build with -DKS_ATTN_TIMELINE=ON)\n", label.c_str());
    return {};
  }
  std::vector<unsigned long long> tl(entries, 0);
  if (read_out(tl.data(), tl.size()) < 0) {
    std::printf("timeline %s: read-out failed\n", label.c_str());
    return {};
  }
  return tl;
}

inline void report_attention_timeline(const std::string& label, double us_per_call) {
  constexpr int kBlocks = 512, kWarps = 16, kEvents = 16;
  const std::vector<unsigned long long> tl =
      read_timeline("KS_ATTN_TIMELINE", "ks_debug_attention_timeline", size_t(kBlocks) * kWarps * kEvents, label);
  if (tl.empty()) return;
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
  // finish_unit's first barrier passed, the warps' factors made, state written, exit; and, in
  // the CTAs that merged their unit's split states, each step of the merge after the state
  const char* names[] = {"entry", "wait", "tile0", "loop_min", "loop_max", "fin_bar", "fin_fact", "state", "exit"};
  constexpr int kCols = 9;
  const char* mnames[] = {"counted", "loaded", "factors", "stored", "exit"};
  constexpr int kMerge = 5;
  // the CTAs of a cluster's merge (15 = 2): its steps, us after the warps' factors (event 9)
  const char* cnames[] = {"pre_sync", "synced", "outputs", "last_bar", "state"};
  std::vector<std::vector<double>> col(kCols), mcol(kMerge), ccol(kMerge);
  int ctas = 0;
  auto rel = [&](unsigned long long t) { return t ? double(t - t0) * 1e-3 : -1.0; };
  // CTA b's merge steps (events 10-13, then `last`), us after its event `ref`
  auto merge_steps = [&](int b, int ref, int last, std::vector<std::vector<double>>& cols) {
    const int ev[kMerge] = {10, 11, 12, 13, last};
    for (int k = 0; k < kMerge; ++k)
      if (at(b, 0, ev[k])) cols[size_t(k)].push_back(double(at(b, 0, ev[k]) - at(b, 0, ref)) * 1e-3);
  };
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
      if (f) {
        std::fprintf(f, "%s,%d,%d", label.c_str(), b, w);
        for (int e = 0; e < 15; ++e) std::fprintf(f, ",%.3f", rel(at(b, w, e)));
        std::fprintf(f, ",%llu\n", at(b, w, 15));
      }
    }
    const double v[kCols] = {rel(e0), rel(at(b, 0, 1)), e2 == ~0ull ? -1 : rel(e2), e3lo == ~0ull ? -1 : rel(e3lo),
                             rel(e3hi), rel(at(b, 0, 8)), rel(at(b, 0, 9)), rel(at(b, 0, 5)), rel(at(b, 0, 6))};
    for (int c = 0; c < kCols; ++c)
      if (v[c] >= 0) col[size_t(c)].push_back(v[c]);
    if (at(b, 0, 15) == 1 && at(b, 0, 5)) merge_steps(b, 5, 6, mcol);  // a split's merging CTA: after its state
    if (at(b, 0, 15) == 2 && at(b, 0, 9)) merge_steps(b, 9, 5, ccol);  // a cluster's merge: after the warps' factors
  }
  if (f) std::fclose(f);
  std::printf("timeline %s: %d CTAs, %.2f us per call in the timing; last launch, us from the first entry "
              "(min / median / max over CTAs):\n", label.c_str(), ctas, us_per_call);
  auto show = [](const char* name, std::vector<double>& x) {
    if (x.empty()) return;
    std::sort(x.begin(), x.end());
    std::printf("  %-9s %7.2f %7.2f %7.2f\n", name, x.front(), x[x.size() / 2], x.back());
  };
  for (int c = 0; c < kCols; ++c) show(names[c], col[size_t(c)]);
  auto show_steps = [&](const char* head, const char* const* step_names, std::vector<std::vector<double>>& cols) {
    if (cols[0].empty()) return;
    std::printf(head, cols[0].size());
    for (int k = 0; k < kMerge; ++k) show(step_names[k], cols[size_t(k)]);
  };
  show_steps("  merging CTAs (%zu), us after their state:\n", mnames, mcol);
  show_steps("  cluster merge (%zu CTAs), us after their warps' factors:\n", cnames, ccol);
}

}  // namespace ks_bench
