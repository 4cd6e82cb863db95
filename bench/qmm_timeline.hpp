// bench_ops' read-out of cuda_a8_resident's timeline (a library built with -DKS_ATTN_TIMELINE=ON,
// which also builds quant_a8.cu with KS_QMM_TIMELINE; see ks_qmm_tl in src/backends/cuda/quant_a8.cu).
// Under KS_QMM_TIMELINE=1, after each quant_matmul_a8 row, report_qmm_timeline groups the last
// CTAs each SM ran into calls (entries in time order; a call's CTAs all enter before the next
// call's, which launches once every one of them has triggered, and consecutive calls write
// different outputs under the rotated sets) and prints, as medians over the complete calls, where
// a call's time goes: the period between calls' ends, how early the next call's CTAs enter, when
// their copies are issued, how long after the previous call's end the dependency wait returns,
// x's staging, the wait for the rows after it, and the sums. KS_QMM_TIMELINE_CSV=path appends every
// CTA's stamps (us from the earliest entry) there. A library built without it: nothing printed.
#pragma once
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "attn_timeline.hpp"  // read_timeline

namespace ks_bench {

inline void report_qmm_timeline(const std::string& label, double us_per_call) {
  constexpr int kSms = 160, kSlots = 64, kEvents = 24;
  const std::vector<unsigned long long> tl =
      read_timeline("KS_QMM_TIMELINE", "ks_debug_qmm_timeline", size_t(kSms) * kSlots * kEvents, label);
  if (tl.empty()) return;
  struct Cta {
    int sm;
    unsigned long long entry, block, out, issued, waited, staged, synced, done_min, done_max;
  };
  std::vector<Cta> ctas;
  for (int sm = 0; sm < kSms; ++sm)
    for (int s = 0; s < kSlots; ++s) {
      const unsigned long long* e = &tl[(size_t(sm) * kSlots + size_t(s)) * kEvents];
      if (!e[0] || !e[6]) continue;
      unsigned long long lo = ~0ull, hi = 0;
      for (int w = 8; w < kEvents; ++w)
        if (e[w]) lo = std::min(lo, e[w]), hi = std::max(hi, e[w]);
      if (!hi) continue;
      ctas.push_back(Cta{sm, e[0], e[1], e[2], e[3], e[4], e[5], e[6], lo, hi});
    }
  if (ctas.empty()) {
    std::printf("timeline %s: nothing recorded (not cuda_a8_resident?)\n", label.c_str());
    return;
  }
  std::sort(ctas.begin(), ctas.end(), [](const Cta& a, const Cta& b) { return a.entry < b.entry; });
  const unsigned long long t0 = ctas.front().entry;
  if (const char* csv = std::getenv("KS_QMM_TIMELINE_CSV")) {
    if (FILE* f = std::fopen(csv, "a")) {
      auto rel = [&](unsigned long long t) { return double(t - t0) * 1e-3; };
      for (const Cta& c : ctas)
        std::fprintf(f, "%s,%d,%llu,%llx,%.3f,%.3f,%.3f,%.3f,%.3f,%.3f,%.3f\n", label.c_str(), c.sm, c.block, c.out,
                     rel(c.entry), rel(c.issued), rel(c.waited), rel(c.staged), rel(c.synced), rel(c.done_min),
                     rel(c.done_max));
      std::fclose(f);
    }
  }
  // calls: runs of entries with one output pointer
  std::vector<std::pair<size_t, size_t>> calls;  // [begin, end) into ctas
  for (size_t i = 0; i < ctas.size();) {
    size_t j = i;
    while (j < ctas.size() && ctas[j].out == ctas[i].out) ++j;
    calls.emplace_back(i, j);
    i = j;
  }
  std::map<size_t, int> sizes;  // the complete calls have the most common size (the grid)
  for (const auto& c : calls) ++sizes[c.second - c.first];
  size_t grid = 0;
  int most = 0;
  for (const auto& [n, k] : sizes)
    if (k > most || (k == most && n > grid)) grid = n, most = k;
  auto median = [](std::vector<double> v) {
    if (v.empty()) return -1.0;
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  struct Call {
    size_t index;  // in calls (complete or not): consecutive complete calls pair only where adjacent
    double first_entry, last_entry, issued, wait_min, wait_med, wait_max, staged, synced_med, synced_max, done_med, end;
  };
  std::vector<Call> cs;
  for (size_t ci = 0; ci < calls.size(); ++ci) {
    const auto [b, e] = calls[ci];
    if (e - b != grid) continue;
    std::vector<double> issued, waited, staged, synced, done;
    Call c{};
    c.index = ci;
    c.first_entry = 1e30;
    for (size_t i = b; i < e; ++i) {
      const Cta& x = ctas[i];
      c.first_entry = std::min(c.first_entry, double(x.entry - t0) * 1e-3);
      c.last_entry = std::max(c.last_entry, double(x.entry - t0) * 1e-3);
      issued.push_back(double(x.issued - x.entry) * 1e-3);
      waited.push_back(double(x.waited - t0) * 1e-3);
      staged.push_back(double(x.staged - x.waited) * 1e-3);
      synced.push_back(double(x.synced - t0) * 1e-3);
      done.push_back(double(x.done_max - t0) * 1e-3);
      c.end = std::max(c.end, double(x.done_max - t0) * 1e-3);
    }
    c.issued = median(issued);
    c.wait_min = *std::min_element(waited.begin(), waited.end());
    c.wait_max = *std::max_element(waited.begin(), waited.end());
    c.wait_med = median(waited);
    c.staged = median(staged);
    c.synced_med = median(synced);
    c.synced_max = *std::max_element(synced.begin(), synced.end());
    c.done_med = median(done);
    cs.push_back(c);
  }
  if (cs.size() < 3) {  // (and below: medians of empty samples print -1)
    std::printf("timeline %s: %zu CTAs in %zu calls, too few complete calls of %zu CTAs\n", label.c_str(), ctas.size(),
                calls.size(), grid);
    return;
  }
  // medians over consecutive complete calls (the first has no predecessor)
  std::vector<double> period, span, lead, issued, release, wspread, staged, rows_med, rows_max, sums_med, tail;
  for (size_t i = 1; i < cs.size(); ++i) {
    const Call &p = cs[i - 1], &c = cs[i];
    if (c.index != p.index + 1) continue;  // (an incomplete call between them)
    period.push_back(c.end - p.end);
    span.push_back(c.last_entry - c.first_entry);
    lead.push_back(p.end - c.first_entry);
    issued.push_back(c.issued);
    release.push_back(c.wait_min - p.end);
    wspread.push_back(c.wait_max - c.wait_min);
    staged.push_back(c.staged);
    rows_med.push_back(c.synced_med - c.wait_med - c.staged);
    rows_max.push_back(c.synced_max - c.wait_min);
    sums_med.push_back(c.done_med - c.synced_med);
    tail.push_back(c.end - c.synced_max);
  }
  std::printf("timeline %s: %.2f us per call in the timing; %zu complete calls of %zu CTAs; medians, us:\n"
              "  period %.2f | next call's entries span %.2f, first %.2f before this call's end | copies issued %.2f "
              "after entry\n"
              "  wait returns %.2f after the previous end (spread %.2f) | x staged %.2f | rows after x %.2f (last CTA's "
              "barrier %.2f after the first wait) | sums %.2f (last CTA ends %.2f after the last barrier)\n",
              label.c_str(), us_per_call, cs.size(), grid, median(period), median(span), median(lead), median(issued),
              median(release), median(wspread), median(staged), median(rows_med), median(rows_max), median(sums_med),
              median(tail));
}

}  // namespace ks_bench
