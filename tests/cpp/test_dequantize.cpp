// ks_dequantize: GGUF block decoding (F32, F16, BF16, Q4_0, Q4_1, Q8_0) into fp16/bf16/fp32.
// Expected values come from a test-side encoder and an independent FP64 decoder; the
// decoded value of every supported block is exact in FP32 (d, m are f16; d*q needs at most
// 19 bits; d*q + m stays exact for the blocks built here), so the output must equal the
// FP64 value rounded once to the output dtype, bit for bit.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "validation_harness.hpp"
#include "gguf_blocks_fp64.hpp"

namespace {

using namespace kstest::harness;
using namespace kstest::gguf;

const char* kOp = "dequantize";

ks_status_t run_dequant(Buf& out, Buf& packed, ks_qtype_t q, ks_backend_t be = KS_BACKEND_AUTO) {
  DLTensor o = out.dl(), p = packed.dl();
  return ks_dequantize(&o, &p, q, be, nullptr);
}

// out must hold exactly round(ref) per element (NaN matches any NaN; zero signs must match).
::testing::AssertionResult equals_rounded(const Buf& out, const std::vector<double>& ref) {
  for (int64_t i = 0; i < out.numel(); ++i) {
    const double want = round_to(out.dtype, ref[size_t(i)]), got = out.get(i);
    if (std::isnan(want) && std::isnan(got)) continue;
    if (!(got == want) || std::signbit(got) != std::signbit(want))
      return ::testing::AssertionFailure() << "element " << i << ": got " << got << ", want " << want
                                           << " (FP64 " << ref[size_t(i)] << ", dtype " << dt_name(out.dtype) << ")";
  }
  return ::testing::AssertionSuccess();
}

// One row holding one hand-built block; checked against literal values.
void check_block(ks_qtype_t q, const std::vector<uint8_t>& bytes, const std::vector<double>& want) {
  const int64_t cols = int64_t(want.size());
  ASSERT_EQ(int64_t(bytes.size()), q_row_bytes(q, cols));
  FOR_EACH_VARIANT(kOp)
  for (DType dt : kFloatTypes())
    for (size_t off : {size_t(0), size_t(1)}) [&] {
      Buf packed(DType::U8, {1, int64_t(bytes.size())}, off);
      std::memcpy(packed.data(), bytes.data(), bytes.size());
      Buf out(dt, {1, cols}, off * 3);
      out.poison();
      KS_RUN_OR_SKIP(run_dequant(out, packed, q));
      EXPECT_TRUE(equals_rounded(out, want)) << qfmt(q).name << " -> " << dt_name(dt) << " offset " << off;
      EXPECT_TRUE(out.guards_intact());
      EXPECT_TRUE(packed.guards_intact());
    }();
}

TEST(Dequantize, Q4_0KnownBlock) {
  // d = 0.5 (f16 0x3800, stored little endian); byte j = j | (15 - j) << 4:
  // element j (< 16) is the low nibble j -> 0.5 * (j - 8); element j + 16 is 15 - j -> 0.5 * (7 - j).
  std::vector<uint8_t> b{0x00, 0x38};
  for (int j = 0; j < 16; ++j) b.push_back(uint8_t(j | ((15 - j) << 4)));
  std::vector<double> want(32);
  for (int j = 0; j < 16; ++j) {
    want[size_t(j)] = 0.5 * (j - 8);
    want[size_t(j + 16)] = 0.5 * (7 - j);
  }
  check_block(KS_QTYPE_Q4_0, b, want);
  // Negative scale d = -0.5 (0xB800) flips every sign; -0 * 8 stays a signed zero (q = 8 -> -0.0).
  b[1] = 0xB8;
  for (auto& w : want) w = -w;
  check_block(KS_QTYPE_Q4_0, b, want);
}

TEST(Dequantize, Q4_1KnownBlock) {
  // d = 0.5 (0x3800), m = -1 (0xBC00): w = 0.5 * q - 1.
  std::vector<uint8_t> b{0x00, 0x38, 0x00, 0xBC};
  for (int j = 0; j < 16; ++j) b.push_back(uint8_t(j | ((15 - j) << 4)));
  std::vector<double> want(32);
  for (int j = 0; j < 16; ++j) {
    want[size_t(j)] = 0.5 * j - 1.0;
    want[size_t(j + 16)] = 0.5 * (15 - j) - 1.0;
  }
  check_block(KS_QTYPE_Q4_1, b, want);
  // d = 2^-10 (0x1400), m = 1000 (0x63D0): 1000 + q/1024 is exact in fp32, rounds in fp16/bf16.
  std::vector<uint8_t> c{0x00, 0x14, 0xD0, 0x63};
  for (int j = 0; j < 16; ++j) c.push_back(uint8_t(j | ((15 - j) << 4)));
  for (int j = 0; j < 16; ++j) {
    want[size_t(j)] = 1000.0 + j / 1024.0;
    want[size_t(j + 16)] = 1000.0 + (15 - j) / 1024.0;
  }
  check_block(KS_QTYPE_Q4_1, c, want);
}

TEST(Dequantize, Q8_0KnownBlock) {
  // d = 0.25 (0x3400); q_j = 8j - 128 covers -128 (never produced by encoders, but valid) .. 120.
  std::vector<uint8_t> b{0x00, 0x34};
  std::vector<double> want;
  for (int j = 0; j < 32; ++j) {
    b.push_back(uint8_t(int8_t(8 * j - 128)));
    want.push_back(0.25 * (8 * j - 128));
  }
  check_block(KS_QTYPE_Q8_0, b, want);
  // d = 65504 (f16 max, 0x7BFF): |d*q| up to 8.4e6 overflows fp16 output to +-inf.
  b[0] = 0xFF;
  b[1] = 0x7B;
  for (int j = 0; j < 32; ++j) want[size_t(j)] = 65504.0 * (8 * j - 128);
  check_block(KS_QTYPE_Q8_0, b, want);
  // d = 2^-24 (smallest f16 subnormal, 0x0001).
  b[0] = 0x01;
  b[1] = 0x00;
  for (int j = 0; j < 32; ++j) want[size_t(j)] = std::ldexp(double(8 * j - 128), -24);
  check_block(KS_QTYPE_Q8_0, b, want);
}

TEST(Dequantize, DenseFormatsKnownBits) {
  {  // F16: 1, -2, 2^-24, 65504, -0, +inf, 0.333251953125, -inf
    const uint16_t h[] = {0x3C00, 0xC000, 0x0001, 0x7BFF, 0x8000, 0x7C00, 0x3555, 0xFC00};
    const double w[] = {1.0, -2.0, std::ldexp(1.0, -24), 65504.0, -0.0, INFINITY, 0.333251953125, -INFINITY};
    std::vector<uint8_t> b;
    for (uint16_t x : h) b.push_back(uint8_t(x)), b.push_back(uint8_t(x >> 8));
    check_block(KS_QTYPE_F16, b, std::vector<double>(std::begin(w), std::end(w)));
  }
  {  // BF16: 1, -3, 2^-133 (subnormal), 3.3895e38 (max), -inf, 0.1 (0x3DCD)
    const uint16_t h[] = {0x3F80, 0xC040, 0x0001, 0x7F7F, 0xFF80, 0x3DCD};
    const double w[] = {1.0, -3.0, std::ldexp(1.0, -133), std::ldexp(255.0, 120), -INFINITY,
                        std::ldexp(205.0, -11)};
    std::vector<uint8_t> b;
    for (uint16_t x : h) b.push_back(uint8_t(x)), b.push_back(uint8_t(x >> 8));
    check_block(KS_QTYPE_BF16, b, std::vector<double>(std::begin(w), std::end(w)));
  }
  {  // F32: 1.5, -0.1f, 1e-40 (subnormal), FLT_MAX (inf in fp16), 70000 (inf in fp16), 2^-20
    const float f[] = {1.5f, -0.1f, 1e-40f, std::numeric_limits<float>::max(), 70000.f, std::ldexp(1.f, -20)};
    std::vector<uint8_t> b(sizeof f);
    std::memcpy(b.data(), f, sizeof f);
    std::vector<double> w(std::begin(f), std::end(f));
    check_block(KS_QTYPE_F32, b, w);
  }
  {  // NaN passes through as NaN in every output dtype.
    for (ks_qtype_t q : {KS_QTYPE_F16, KS_QTYPE_BF16, KS_QTYPE_F32}) {
      std::vector<uint8_t> b;
      std::vector<double> w{1.0, NAN, -1.0, NAN};
      if (q == KS_QTYPE_F32) {
        const float f[] = {1.f, std::numeric_limits<float>::quiet_NaN(), -1.f, std::numeric_limits<float>::quiet_NaN()};
        b.resize(16);
        std::memcpy(b.data(), f, 16);
      } else {
        const uint16_t h16[] = {0x3C00, 0x7E00, 0xBC00, 0xFE01};
        const uint16_t hb[] = {0x3F80, 0x7FC0, 0xBF80, 0xFFC1};
        for (int i = 0; i < 4; ++i) {
          const uint16_t x = q == KS_QTYPE_F16 ? h16[i] : hb[i];
          b.push_back(uint8_t(x)), b.push_back(uint8_t(x >> 8));
        }
      }
      check_block(q, b, w);
    }
  }
}

// Multi-block rows: every block decodes with its own scale (catches reuse of block 0's d).
TEST(Dequantize, BlocksUseTheirOwnScale) {
  for (ks_qtype_t q : {KS_QTYPE_Q4_0, KS_QTYPE_Q4_1, KS_QTYPE_Q8_0}) {
    const int64_t cols = 96;
    std::vector<double> x(static_cast<size_t>(cols));
    for (int64_t i = 0; i < cols; ++i) x[size_t(i)] = std::sin(0.37 * double(i)) * std::pow(4.0, double(i / 32));
    std::vector<uint8_t> b(size_t(q_row_bytes(q, cols)));
    encode_row(q, x.data(), cols, b.data());
    std::vector<double> w(static_cast<size_t>(cols));
    decode_row(q, b.data(), cols, w.data());
    check_block(q, b, w);
  }
}

// The test encoder must itself be sane: decoded values close to the source values.
TEST(Dequantize, TestEncoderSanity) {
  for (const auto& f : all_qfmts()) {
    std::vector<double> orig;
    Buf p = make_packed(f.q, 5, 64, &orig);
    auto w = decode_all(f.q, p, 64);
    for (size_t i = 0; i < w.size(); ++i) {
      const double amax_bound = f.block == 1 ? 1e-2 * std::fabs(orig[i]) + 1e-30 : 0.15 * 4.0;
      EXPECT_LE(std::fabs(w[i] - orig[i]), amax_bound) << f.name << " element " << i;
    }
  }
}

TEST(Dequantize, RandomRowsAllFormatsAllDtypes) {
  const int64_t rows_list[] = {1, 3, 17};
  const int64_t cols_q[] = {32, 64, 576, 1536};
  const int64_t cols_dense[] = {1, 7, 33, 576};
  FOR_EACH_VARIANT(kOp) {
  int idx = 0;
  for (const auto& f : all_qfmts())
    for (DType dt : kFloatTypes())
      for (int64_t rows : rows_list)
        for (int ci = 0; ci < 4; ++ci) [&] {
          const int64_t cols = f.block == 1 ? cols_dense[ci] : cols_q[ci];
          const size_t poff = size_t(idx % 3), ooff = size_t((idx / 3) % 4);  // misaligned views too
          ++idx;
          Buf packed = make_packed(f.q, rows, cols, nullptr, poff, 1.0 + double(idx % 5));
          const auto ref = decode_all(f.q, packed, cols);
          Buf out(dt, {rows, cols}, ooff);
          out.poison();
          Snap in{&packed};
          KS_RUN_OR_SKIP(run_dequant(out, packed, f.q));
          EXPECT_TRUE(equals_rounded(out, ref)) << f.name << " -> " << dt_name(dt) << " rows " << rows << " cols "
                                                << cols;
          EXPECT_TRUE(out.guards_intact());
          EXPECT_TRUE(in.same()) << "packed input modified";
        }();
  }
}

// A large row count takes the multi-threaded path in some backends; the result must not change.
TEST(Dequantize, ManyRowsMatchSingleRowCalls) {
  const int64_t rows = 301, cols = 320;
  FOR_EACH_VARIANT(kOp)
  for (ks_qtype_t q : {KS_QTYPE_Q4_1, KS_QTYPE_Q8_0})
    for (DType dt : kFloatTypes()) [&] {
      Buf packed = make_packed(q, rows, cols);
      const auto ref = decode_all(q, packed, cols);
      Buf out(dt, {rows, cols}, 2);
      out.poison();
      KS_RUN_OR_SKIP(run_dequant(out, packed, q));
      EXPECT_TRUE(equals_rounded(out, ref)) << dt_name(dt);
      EXPECT_TRUE(out.guards_intact());
    }();
}

TEST(Dequantize, ZeroRowsIsANoOp) {
  for (const auto& f : all_qfmts()) {
    Buf packed(DType::U8, {0, q_row_bytes(f.q, 64)});
    Buf out(DType::F16, {0, 64});
    Snap s{&out, &packed};
    EXPECT_EQ(run_dequant(out, packed, f.q), KS_SUCCESS) << ks_last_error();
    EXPECT_TRUE(s.same());
    // NULL data is fine for empty tensors.
    DLTensor o = out.dl(), p = packed.dl();
    o.data = nullptr;
    p.data = nullptr;
    EXPECT_EQ(ks_dequantize(&o, &p, f.q, KS_BACKEND_AUTO, nullptr), KS_SUCCESS) << ks_last_error();
  }
  // Zero rows still validate: wrong bytes per row is rejected.
  Buf packed(DType::U8, {0, 17});
  Buf out(DType::F32, {0, 32});
  Snap s{&out, &packed};
  EXPECT_TRUE(fails_cleanly(run_dequant(out, packed, KS_QTYPE_Q4_0), KS_ERROR_INVALID_ARGUMENT, kOp, "packed", s));
}

TEST(Dequantize, CommonTensorRules) {
  for (DType dt : kFloatTypes()) {
    Buf packed = make_packed(KS_QTYPE_Q4_1, 3, 64);
    Buf out(dt, {3, 64});
    out.poison();
    check_common_rules(kOp,
                       {{"out", &out, false, {kI32, kU8, kI16}},
                        {"packed", &packed, false, {kF16, DLDataType{kDLInt, 8, 1}, kBF16, DLDataType{kDLComplex, 16, 1}}}},
                       [&](std::vector<DLTensor*>& t, ks_backend_t be) {
                         return ks_dequantize(t[0], t[1], KS_QTYPE_Q4_1, be, nullptr);
                       });
  }
}

TEST(Dequantize, RejectsBadQtype) {
  Buf packed = make_packed(KS_QTYPE_Q8_0, 2, 32);
  Buf out(DType::F32, {2, 32});
  out.poison();
  for (int q : {0, 7, -1, 100}) {
    Snap s{&out, &packed};
    EXPECT_TRUE(fails_cleanly(run_dequant(out, packed, static_cast<ks_qtype_t>(q)), KS_ERROR_INVALID_ARGUMENT, kOp,
                              "qtype", s))
        << "qtype " << q;
  }
}

TEST(Dequantize, RejectsBadShapes) {
  const ks_status_t INV = KS_ERROR_INVALID_ARGUMENT;
  auto expect = [&](Buf& out, Buf& packed, ks_qtype_t q, const char* arg, const char* what) {
    out.poison();
    Snap s{&out, &packed};
    EXPECT_TRUE(fails_cleanly(run_dequant(out, packed, q), INV, kOp, arg, s)) << what;
  };
  {  // cols not a multiple of the block size
    Buf packed(DType::U8, {2, 18});
    Buf out(DType::F32, {2, 48});
    expect(out, packed, KS_QTYPE_Q4_0, "packed|out", "48 columns for Q4_0");
  }
  {  // bytes per row off by one, each direction, each format
    for (const auto& f : all_qfmts())
      for (int delta : {-1, 1}) {
        Buf packed(DType::U8, {2, q_row_bytes(f.q, 64) + delta});
        Buf out(DType::F16, {2, 64});
        expect(out, packed, f.q, "packed", f.name);
      }
  }
  {  // row counts differ
    Buf packed(DType::U8, {3, 34});
    Buf out(DType::F32, {2, 32});
    expect(out, packed, KS_QTYPE_Q8_0, "packed|out", "rows 3 vs 2");
  }
  {  // out must be 2-D
    Buf packed(DType::U8, {2, 34});
    Buf out1(DType::F32, {64});
    expect(out1, packed, KS_QTYPE_Q8_0, "out", "out 1-D");
    Buf out3(DType::F32, {2, 1, 32});
    expect(out3, packed, KS_QTYPE_Q8_0, "out", "out 3-D");
  }
  {  // packed must be 2-D
    Buf packed1(DType::U8, {68});
    Buf out(DType::F32, {2, 32});
    expect(out, packed1, KS_QTYPE_Q8_0, "packed", "packed 1-D");
    Buf packed3(DType::U8, {2, 1, 34});
    expect(out, packed3, KS_QTYPE_Q8_0, "packed", "packed 3-D");
  }
}

TEST(Dequantize, ZeroColumnsNeverWrites) {
  Buf packed(DType::U8, {2, 0});
  Buf out(DType::F32, {2, 0});
  Snap s{&out, &packed};
  const ks_status_t st = run_dequant(out, packed, KS_QTYPE_Q8_0);
  EXPECT_TRUE(st == KS_SUCCESS || st == KS_ERROR_INVALID_ARGUMENT) << ks_status_name(st);
  EXPECT_TRUE(s.same());
}

TEST(Dequantize, RejectsOverlap) {
  // out's bytes overlap packed's bytes in one allocation.
  Buf store(DType::U8, {2 * 34 + 2 * 32 * 4});
  fill_bytes(store);
  DLTensor p = store.dl(), o = store.dl();
  int64_t ps[2] = {2, 34}, os[2] = {2, 32};
  p.ndim = 2;
  p.shape = ps;
  o.ndim = 2;
  o.shape = os;
  o.dtype = kF32;
  o.data = static_cast<char*>(store.data()) + 40;  // inside packed's 68 bytes
  Snap s{&store};
  EXPECT_TRUE(fails_cleanly(ks_dequantize(&o, &p, KS_QTYPE_Q8_0, KS_BACKEND_AUTO, nullptr), KS_ERROR_INVALID_ARGUMENT,
                            kOp, "out|packed", s));
  // Adjacent but disjoint is fine.
  o.data = static_cast<char*>(store.data()) + 68;
  EXPECT_EQ(ks_dequantize(&o, &p, KS_QTYPE_Q8_0, KS_BACKEND_AUTO, nullptr), KS_SUCCESS) << ks_last_error();
}

}  // namespace
