// varlen_attention on the CPU: the reference (docs/contracts.md#varlen_attention).
// Per query row: find its sequence, FP32 scores over the keys it may see, FP32 softmax
// (max-subtracted), FP32 weighted sum of V in pairwise order (pairwise.hpp), one rounding.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "backends/cpu/pairwise.hpp"
#include "ops/args.hpp"
#include "registry/registry.hpp"

namespace ks::cpu {
namespace {

using ks::detail::DType;
using ks::detail::load_f;
using ks::detail::load_index;
using ks::detail::store_f;

void varlen_attention_ref(const void* p, ks_stream_t) {
  const auto& a = *static_cast<const ks::ops::VarlenAttentionArgs*>(p);
  const DType dt = a.q.dtype;
  const int64_t D = a.head_dim, G = a.num_heads / a.num_kv_heads;
  std::vector<int64_t> cq(size_t(a.num_seqs + 1)), ck(size_t(a.num_seqs + 1));
  for (int64_t i = 0; i <= a.num_seqs; ++i) {
    cq[size_t(i)] = load_index(a.cu_q.data, DType::I32, i);
    ck[size_t(i)] = load_index(a.cu_k.data, DType::I32, i);
  }
  std::vector<float> qv(static_cast<size_t>(D)), acc(static_cast<size_t>(D)), sc;
  std::vector<float> levels(static_cast<size_t>(PairwiseAccumulator::kLevels * D));
  int64_t longest = 0;  // (the scores' room taken before the first write: out of memory writes nothing)
  for (int64_t s = 0; s < a.num_seqs; ++s) longest = std::max(longest, ck[size_t(s + 1)] - ck[size_t(s)]);
  sc.reserve(static_cast<size_t>(longest));
  for (int64_t s = 0; s < a.num_seqs; ++s) {
    const int64_t q0 = cq[size_t(s)], lq = cq[size_t(s + 1)] - q0, k0 = ck[size_t(s)], lk = ck[size_t(s + 1)] - k0;
    for (int64_t i = 0; i < lq; ++i)
      for (int64_t h = 0; h < a.num_heads; ++h) {
        const int64_t row = (q0 + i) * a.num_heads + h, kvh = h / G;
        // keys visible to query i: all, or (causal) j <= i + lk - lq
        const int64_t visible = a.causal ? std::min(lk, std::max<int64_t>(0, i + lk - lq + 1)) : lk;
        for (int64_t d = 0; d < D; ++d) qv[size_t(d)] = load_f(a.q.data, dt, row * D + d);
        sc.assign(static_cast<size_t>(visible), 0.f);
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < visible; ++j) {
          const int64_t koff = ((k0 + j) * a.num_kv_heads + kvh) * D;
          float dot = 0.f;
          for (int64_t d = 0; d < D; ++d) dot += qv[size_t(d)] * load_f(a.k.data, dt, koff + d);
          sc[size_t(j)] = dot * a.scale;
          mx = std::max(mx, sc[size_t(j)]);
        }
        for (int64_t j = 0; j < visible; ++j) sc[size_t(j)] = std::exp(sc[size_t(j)] - mx);
        const float sum = pairwise_sum(sc.data(), visible);
        // the weighted V rows in groups of 8 keys, the groups summed pairwise (pairwise.hpp)
        PairwiseAccumulator pv(levels.data(), D);
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t j = 0; j < visible; ++j) {
          const int64_t voff = ((k0 + j) * a.num_kv_heads + kvh) * D;
          const float w = sc[size_t(j)] / sum;
          for (int64_t d = 0; d < D; ++d) acc[size_t(d)] += w * load_f(a.v.data, dt, voff + d);
          if ((j + 1) % 8 == 0 || j + 1 == visible) {
            pv.add(acc.data());
            std::fill(acc.begin(), acc.end(), 0.f);
          }
        }
        pv.sum(acc.data());  // (0 where no key is visible)
        for (int64_t d = 0; d < D; ++d) store_f(a.out.data, dt, row * D + d, acc[size_t(d)]);
      }
  }
}

}  // namespace
}  // namespace ks::cpu

namespace ks::registry {
void register_cpu_attention(std::vector<Variant>& v) {
  v.push_back({"varlen_attention", KS_BACKEND_CPU, "cpu_reference", kFloatDTypes, 0,
               "portable FP32 loops: scores, max-subtracted softmax, weighted V", nullptr, nullptr,
               ks::cpu::varlen_attention_ref});
}
}  // namespace ks::registry
