// FP32 summation orders of the CPU kernels whose error must grow with log2(n), not n
// (docs/contracts.md, "Summation order").
#pragma once

#include <cstdint>
#include <cstring>

namespace ks::cpu {

// Pairwise sum of v[0..n): halves until 8 terms remain, which are added left to right.
inline float pairwise_sum(const float* v, int64_t n) {
  if (n <= 8) {
    float s = 0.f;
    for (int64_t i = 0; i < n; ++i) s += v[i];
    return s;
  }
  const int64_t h = n / 2;
  return pairwise_sum(v, h) + pairwise_sum(v + h, n - h);
}

// A sum of vectors of n floats whose terms arrive one at a time and are not kept (attention's
// weighted V rows, one per key): the caller adds a group of terms left to right into a buffer
// (a few keys; the group's size is the caller's, e.g. 8 or 64) and hands each group's sum to
// add(). The groups merge as a binary counter's carries do: two partials of 2^k groups each become
// one of 2^(k+1) groups. So a term passes through (group size - 1) + log2(groups) + 1 additions,
// as in pairwise_sum, and e.g. 2^21 keys of equal weight in groups of 64 stay within a few hundred
// units of roundoff of their FP32 sum, where one running sum per element drifted by up to
// 2^21 / 2 units (the adversarial run of 2026-12-04: 1.3e-2 relative at 2^19 keys).
// The order depends only on the number of groups, so it is the same for a row alone or in a batch.
class PairwiseAccumulator {
 public:
  // storage: kLevels * n floats of the caller's scratch (uninitialized), held until sum()
  static constexpr int kLevels = 48;  // groups below 2^48
  PairwiseAccumulator(float* storage, int64_t n) : levels_(storage), n_(n) {}

  // Adds one group's sum; `group` (n floats) is used as the carry's buffer and left undefined.
  void add(float* group) {
    int k = 0;
    for (; (count_ >> k) & 1u; ++k) {  // level k holds the 2^k groups before this one's: merge
      const float* older = levels_ + int64_t(k) * n_;
      for (int64_t i = 0; i < n_; ++i) group[i] = older[i] + group[i];
    }
    std::memcpy(levels_ + int64_t(k) * n_, group, size_t(n_) * sizeof(float));
    ++count_;
  }

  // out (n floats) = the sum of every group added: the partials from the latest (lowest level) to
  // the earliest; 0 where none was added.
  void sum(float* out) const {
    for (int64_t i = 0; i < n_; ++i) out[i] = 0.f;
    bool first = true;
    for (int k = 0; k < kLevels; ++k)
      if ((count_ >> k) & 1u) {
        const float* part = levels_ + int64_t(k) * n_;
        for (int64_t i = 0; i < n_; ++i) out[i] = first ? part[i] : part[i] + out[i];
        first = false;
      }
  }

 private:
  float* levels_;
  int64_t n_;
  uint64_t count_ = 0;
};

}  // namespace ks::cpu
