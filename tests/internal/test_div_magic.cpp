// The division by block_size that paged_attention's cuda_gqa_cluster kernel does by a
// multiply and a shift (attention_params.cuh, div_magic): exact for every 31-bit numerator.
// Checked here on the host against '/': small divisors exhaustively over edge numerators,
// random divisors and numerators, and every numerator for a few divisors.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>

#include "backends/cuda/attention_params.cuh"

namespace {

int64_t quotient(uint32_t n, uint32_t mul, int shift) { return int64_t((uint64_t(n) * mul) >> shift); }

TEST(DivMagic, SmallDivisorsAndEdgeNumerators) {
  for (int64_t d = 1; d <= 4097; ++d) {
    uint32_t mul;
    int shift;
    ks::cuda::div_magic(d, &mul, &shift);
    for (int64_t n : {int64_t(0), int64_t(1), d - 1, d, d + 1, 2 * d - 1, 2 * d, int64_t(1) << 30,
                      (int64_t(1) << 31) - 1, (int64_t(1) << 31) - d, ((int64_t(1) << 31) - 1) / d * d,
                      ((int64_t(1) << 31) - 1) / d * d - 1})
      if (n >= 0 && n < (int64_t(1) << 31)) ASSERT_EQ(quotient(uint32_t(n), mul, shift), n / d) << "d=" << d << " n=" << n;
  }
}

TEST(DivMagic, RandomDivisorsAndNumerators) {
  std::mt19937_64 g(7);
  for (int i = 0; i < 200000; ++i) {
    const int64_t d = 1 + int64_t(g() % ((uint64_t(1) << (1 + g() % 31)) - 1));
    const int64_t n = int64_t(g() % (uint64_t(1) << 31));
    uint32_t mul;
    int shift;
    ks::cuda::div_magic(d, &mul, &shift);
    ASSERT_EQ(quotient(uint32_t(n), mul, shift), n / d) << "d=" << d << " n=" << n;
  }
}

TEST(DivMagic, EveryNumeratorUpTo2Pow24) {
  for (int64_t d : {3, 7, 16, 17, 48, 1000}) {
    uint32_t mul;
    int shift;
    ks::cuda::div_magic(d, &mul, &shift);
    for (int64_t n = 0; n < (int64_t(1) << 24); ++n) ASSERT_EQ(quotient(uint32_t(n), mul, shift), n / d) << d;
  }
}

}  // namespace
