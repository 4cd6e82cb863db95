// ks_sample on the CPU: the reference. Sorting-based and simple; every decision is
// made on exact integers (fixed-point weights), so the CUDA kernel reproduces it
// bit for bit (docs/contracts.md#sample).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

#include "core/sampling_math.hpp"
#include "ops/args.hpp"
#include "registry/registry.hpp"

namespace ks::cpu {
namespace {

using ks::detail::DType;
namespace smp = ks::sampling;

void sample_ref(const void* p, ks_stream_t) {
  const auto& a = *static_cast<const ks::ops::SampleArgs*>(p);
  const DType dt = a.logits.dtype;
  // (load_index copies the bytes: the contract lets seed_offset have any alignment)
  const uint64_t seed = uint64_t(ks::detail::load_index(a.seed_offset.data, DType::I64, 0)),
                 offset = uint64_t(ks::detail::load_index(a.seed_offset.data, DType::I64, 1));
  std::vector<float> z(size_t(a.vocab));
  std::vector<int64_t> idx, w(size_t(a.vocab));
  idx.reserve(size_t(a.vocab));  // (every allocation before the first row's write: out of memory writes nothing)
  for (int64_t r = 0; r < a.rows; ++r) {
    bool bad = false, any = false;
    for (int64_t i = 0; i < a.vocab; ++i) {
      const float x = ks::detail::load_f(a.logits.data, dt, r * a.vocab + i);
      z[size_t(i)] = x / a.temperature;  // IEEE FP32 division
      // NaN, +inf, or a finite logit whose z overflows to +inf: no distribution
      bad = bad || std::isnan(x) || z[size_t(i)] == INFINITY;
      any = any || z[size_t(i)] > -INFINITY;
    }
    if (bad || !any) {
      ks::detail::st<int64_t>(a.out.data, r, 0);
      if (a.has_valid) ks::detail::st<uint8_t>(a.valid.data, r, 0);
      continue;
    }
    // candidates: finite scores (z = -inf weighs nothing); top_k keeps the largest,
    // ties to the lower index
    idx.clear();
    for (int64_t i = 0; i < a.vocab; ++i)
      if (z[size_t(i)] > -INFINITY) idx.push_back(i);
    if (a.top_k > 0 && int64_t(idx.size()) > a.top_k) {
      std::stable_sort(idx.begin(), idx.end(), [&](int64_t u, int64_t v) {
        return smp::order_key(z[size_t(u)]) > smp::order_key(z[size_t(v)]);
      });
      idx.resize(size_t(a.top_k));
    }
    float m = -INFINITY;
    for (int64_t i : idx) m = std::max(m, z[size_t(i)]);
    int64_t total = 0;
    for (int64_t i : idx) total += (w[size_t(i)] = smp::to_weight(smp::sample_exp(z[size_t(i)] - m)));
    if (a.top_p < 1.0) {
      // the shortest prefix of (weight desc, index asc) whose mass reaches ceil(top_p * total)
      int64_t target = int64_t(std::ceil(a.top_p * double(total)));
      target = std::min(std::max<int64_t>(target, 1), total);
      std::stable_sort(idx.begin(), idx.end(), [&](int64_t u, int64_t v) {
        return w[size_t(u)] > w[size_t(v)] || (w[size_t(u)] == w[size_t(v)] && u < v);
      });
      int64_t acc = 0;
      size_t keep = 0;
      while (keep < idx.size() && acc < target) acc += w[size_t(idx[keep++])];
      idx.resize(keep);
      total = acc;
    }
    std::sort(idx.begin(), idx.end());  // the draw walks the kept ids in index order
    const uint64_t c = smp::scale_draw(smp::row_draw(seed, offset, uint64_t(r)), uint64_t(total));
    int64_t chosen = idx.back();
    uint64_t run = 0;
    for (int64_t i : idx) {
      run += uint64_t(w[size_t(i)]);
      if (run > c) {
        chosen = i;
        break;
      }
    }
    ks::detail::st<int64_t>(a.out.data, r, chosen);
    if (a.has_valid) ks::detail::st<uint8_t>(a.valid.data, r, 1);
  }
}

}  // namespace
}  // namespace ks::cpu

namespace ks::registry {
void register_cpu_sampling(std::vector<Variant>& v) {
  v.push_back({"sample", KS_BACKEND_CPU, "cpu_reference", kFloatDTypes, 0,
               "sorts; fixed-point weights, Philox4x32-10 draws (bit-identical to CUDA)", nullptr, nullptr,
               ks::cpu::sample_ref});
}
}  // namespace ks::registry
