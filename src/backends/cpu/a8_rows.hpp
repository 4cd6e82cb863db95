// quant_matmul_a8 on the CPU, the parts every CPU variant shares (docs/contracts.md#quant_matmul_a8,
// core/a8_quant.hpp): x's rows quantized per block of 32, and per output the block values and the
// contract's summation order from the blocks' exact integer sums S, which each variant forms its
// own way (one code at a time, or VNNI dot products). The integers are exact, so every variant
// gives the same bits.
#pragma once

#include <kernscope/kernscope.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "backends/cpu/quant_blocks.hpp"
#include "backends/cpu/scratch.hpp"
#include "core/a8_quant.hpp"
#include "core/common.hpp"
#include "ops/args.hpp"

namespace ks::cpu {

// f(std::integral_constant<ks_qtype_t, Q>) for the op's three formats
template <class F>
void with_a8_format(ks_qtype_t q, F&& f) {
  if (q == KS_QTYPE_Q4_0)
    f(std::integral_constant<ks_qtype_t, KS_QTYPE_Q4_0>{});
  else if (q == KS_QTYPE_Q4_1)
    f(std::integral_constant<ks_qtype_t, KS_QTYPE_Q4_1>{});
  else
    f(std::integral_constant<ks_qtype_t, KS_QTYPE_Q8_0>{});
}

// x [M, K] quantized: codes q [M, K], scales d and code sums qsum [M, K / 32].
struct A8Rows {
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int> qsum;
};
inline A8Rows a8_quantize_rows(const ops::QuantMatmulArgs& a) {
  const detail::DType dt = a.x.dtype;
  const int64_t nb = a.k / 32;
  A8Rows r{std::vector<int8_t>(size_t(a.m * a.k)), std::vector<float>(size_t(a.m * nb)),
           std::vector<int>(size_t(a.m * nb))};
  for (int64_t m = 0; m < a.m; ++m)
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t base = m * a.k + b * 32;
      float amax = 0.f;
      bool bad = false;
      for (int i = 0; i < 32; ++i) {
        const float v = std::fabs(detail::load_f(a.x.data, dt, base + i));
        bad |= !(v <= std::numeric_limits<float>::max());
        if (v <= std::numeric_limits<float>::max()) amax = std::max(amax, v);
      }
      const A8Scale sc = a8_scale(amax, bad);
      int sum = 0;
      for (int i = 0; i < 32; ++i) {
        const int c = bad ? 0 : a8_code(detail::load_f(a.x.data, dt, base + i), sc.inv);
        r.q[size_t(base + i)] = int8_t(c);
        sum += c;
      }
      r.d[size_t(m * nb + b)] = sc.d;
      r.qsum[size_t(m * nb + b)] = sum;
    }
  return r;
}

// out = x @ dequant(weight)^T by the contract: x quantized once, then for every output (n, m)
// sums(row n's blocks, row m's codes, nb, S) fills the nb blocks' exact sums S_b = sum c_i q_i
// (c_i the stored codes), and the block values are summed in a8_row_sum's order. Outputs are
// split over weight rows (OpenMP, past kParallelWork elements).
template <ks_qtype_t Q, class Sums>
void a8_matmul(const ops::QuantMatmulArgs& a, Sums&& sums) {
  const A8Rows x = a8_quantize_rows(a);
  const int64_t nb = a.k / 32;
  const bool par = a.m * a.n * a.k > kParallelWork;
  const Scratch scratch(par, size_t(nb), 2);
  team(par, [&] {
    float* v = scratch.get(0);
    int* S = reinterpret_cast<int*>(scratch.get(1));
#pragma omp for schedule(static)
    for (int64_t n = 0; n < a.n; ++n) {
      const uint8_t* row = static_cast<const uint8_t*>(a.weight.data) + n * a.row_bytes;
      for (int64_t m = 0; m < a.m; ++m) {
        sums(row, x.q.data() + m * a.k, nb, S);
        for (int64_t b = 0; b < nb; ++b) {
          const uint8_t* blk = row + b * q_block_bytes(Q);
          const float dw = half_to_float(rd_u16(blk));
          const float mw = Q == KS_QTYPE_Q4_1 ? half_to_float(rd_u16(blk + 2)) : 0.f;
          const float db = x.d[size_t(m * nb + b)];
          const int qb = x.qsum[size_t(m * nb + b)];
          v[b] = a8_block_value<Q>(dw, mw, db, a8_dq(db, qb), S[b], qb);
        }
        detail::store_f(a.out.data, a.x.dtype, m * a.n + n, a8_row_sum(v, nb));
      }
    }
  });
}

}  // namespace ks::cpu
