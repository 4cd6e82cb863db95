// GGUF block formats for the op tests: a test-side encoder (F32, F16, BF16, Q4_0, Q4_1,
// Q8_0) and an independent FP64 decoder, with independent FP64 decoders of fp16 / bf16,
// written without the library's converters for decoding.
//
// A test file says `using namespace kstest::gguf;` inside its anonymous namespace.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <stdexcept>
#include <vector>

#include "test_util.hpp"

namespace kstest::gguf {

// Independent decoders of the 16-bit float formats (to FP64).
inline double f16_to_double(uint16_t h) {
  const int s = h >> 15, e = (h >> 10) & 0x1F, m = h & 0x3FF;
  double v;
  if (e == 0x1F) v = m ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  else if (e == 0) v = std::ldexp(double(m), -24);
  else v = std::ldexp(double(m + 1024), e - 25);
  return s ? -v : v;
}
inline double bf16_to_double(uint16_t h) {
  const uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return double(f);
}

// ---- block formats: sizes, a test-side encoder and an FP64 decoder -------------------
struct QFmt {
  ks_qtype_t q;
  const char* name;
  int64_t block, bytes;
};
inline const std::vector<QFmt>& all_qfmts() {
  static const std::vector<QFmt> f{{KS_QTYPE_F32, "F32", 1, 4},   {KS_QTYPE_F16, "F16", 1, 2},
                                   {KS_QTYPE_BF16, "BF16", 1, 2}, {KS_QTYPE_Q4_0, "Q4_0", 32, 18},
                                   {KS_QTYPE_Q4_1, "Q4_1", 32, 20}, {KS_QTYPE_Q8_0, "Q8_0", 32, 34}};
  return f;
}
inline const QFmt& qfmt(ks_qtype_t q) {
  for (const auto& f : all_qfmts())
    if (f.q == q) return f;
  throw std::runtime_error("unknown qtype");
}
inline int64_t q_row_bytes(ks_qtype_t q, int64_t cols) { return cols / qfmt(q).block * qfmt(q).bytes; }

inline void put16(uint8_t* p, uint16_t v) {
  p[0] = uint8_t(v & 0xFF);
  p[1] = uint8_t(v >> 8);
}
inline uint16_t get16(const uint8_t* p) { return uint16_t(p[0] | (p[1] << 8)); }
inline uint16_t to_f16(double v) { return ks::float_to_half(float(v)); }
inline uint16_t to_bf16(double v) { return ks::float_to_bf16(float(v)); }

// Quantizes n values (n a multiple of the block size) into dst (row_bytes bytes).
inline void encode_row(ks_qtype_t q, const double* x, int64_t n, uint8_t* dst) {
  switch (q) {
    case KS_QTYPE_F32:
      for (int64_t i = 0; i < n; ++i) {
        const float f = float(x[i]);
        std::memcpy(dst + 4 * i, &f, 4);  // little-endian host
      }
      return;
    case KS_QTYPE_F16:
      for (int64_t i = 0; i < n; ++i) put16(dst + 2 * i, to_f16(x[i]));
      return;
    case KS_QTYPE_BF16:
      for (int64_t i = 0; i < n; ++i) put16(dst + 2 * i, to_bf16(x[i]));
      return;
    default:
      break;
  }
  for (int64_t b = 0; b < n / 32; ++b) {
    const double* v = x + 32 * b;
    if (q == KS_QTYPE_Q4_0) {  // d = (value of largest magnitude) / -8; q = x/d + 8 in [0, 15]
      uint8_t* blk = dst + 18 * b;
      double mx = 0;
      for (int j = 0; j < 32; ++j)
        if (std::fabs(v[j]) > std::fabs(mx)) mx = v[j];
      const uint16_t dh = to_f16(mx / -8.0);
      const double d = f16_to_double(dh);
      put16(blk, dh);
      int qv[32];
      for (int j = 0; j < 32; ++j) qv[j] = d == 0 ? 8 : std::clamp(int(std::floor(v[j] / d + 8.5)), 0, 15);
      for (int j = 0; j < 16; ++j) blk[2 + j] = uint8_t(qv[j] | (qv[j + 16] << 4));
    } else if (q == KS_QTYPE_Q4_1) {  // d = (max - min) / 15, m = min; q = (x - m)/d in [0, 15]
      uint8_t* blk = dst + 20 * b;
      double lo = v[0], hi = v[0];
      for (int j = 1; j < 32; ++j) lo = std::min(lo, v[j]), hi = std::max(hi, v[j]);
      const uint16_t dh = to_f16((hi - lo) / 15.0), mh = to_f16(lo);
      const double d = f16_to_double(dh), m = f16_to_double(mh);
      put16(blk, dh);
      put16(blk + 2, mh);
      int qv[32];
      for (int j = 0; j < 32; ++j) qv[j] = d == 0 ? 0 : std::clamp(int(std::lround((v[j] - m) / d)), 0, 15);
      for (int j = 0; j < 16; ++j) blk[4 + j] = uint8_t(qv[j] | (qv[j + 16] << 4));
    } else {  // Q8_0: d = max|x| / 127; q = round(x / d)
      uint8_t* blk = dst + 34 * b;
      double amax = 0;
      for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(v[j]));
      const uint16_t dh = to_f16(amax / 127.0);
      const double d = f16_to_double(dh);
      put16(blk, dh);
      for (int j = 0; j < 32; ++j) {
        const int qi = d == 0 ? 0 : std::clamp(int(std::lround(v[j] / d)), -127, 127);
        blk[2 + j] = uint8_t(int8_t(qi));
      }
    }
  }
}

// FP64 decode of one packed row of n elements.
inline void decode_row(ks_qtype_t q, const uint8_t* src, int64_t n, double* out) {
  switch (q) {
    case KS_QTYPE_F32:
      for (int64_t i = 0; i < n; ++i) {
        float f;
        std::memcpy(&f, src + 4 * i, 4);
        out[i] = f;
      }
      return;
    case KS_QTYPE_F16:
      for (int64_t i = 0; i < n; ++i) out[i] = f16_to_double(get16(src + 2 * i));
      return;
    case KS_QTYPE_BF16:
      for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_double(get16(src + 2 * i));
      return;
    default:
      break;
  }
  for (int64_t b = 0; b < n / 32; ++b) {
    double* o = out + 32 * b;
    if (q == KS_QTYPE_Q4_0) {
      const uint8_t* blk = src + 18 * b;
      const double d = f16_to_double(get16(blk));
      for (int j = 0; j < 32; ++j) {
        const int nib = j < 16 ? (blk[2 + j] & 15) : (blk[2 + j - 16] >> 4);
        o[j] = d * (nib - 8);
      }
    } else if (q == KS_QTYPE_Q4_1) {
      const uint8_t* blk = src + 20 * b;
      const double d = f16_to_double(get16(blk)), m = f16_to_double(get16(blk + 2));
      for (int j = 0; j < 32; ++j) {
        const int nib = j < 16 ? (blk[4 + j] & 15) : (blk[4 + j - 16] >> 4);
        o[j] = d * nib + m;
      }
    } else {
      const uint8_t* blk = src + 34 * b;
      const double d = f16_to_double(get16(blk));
      for (int j = 0; j < 32; ++j) o[j] = d * double(int8_t(blk[2 + j]));
    }
  }
}

// A packed table [rows, row_bytes] from random normal rows; `orig` gets the FP64 source values.
inline Buf make_packed(ks_qtype_t q, int64_t rows, int64_t cols, std::vector<double>* orig = nullptr, size_t offset = 0,
                double stddev = 1.0) {
  Buf p(DType::U8, {rows, q_row_bytes(q, cols)}, offset);
  std::normal_distribution<double> nd(0.0, stddev);
  std::vector<double> x(size_t(rows * cols));
  for (auto& v : x) v = nd(rng());
  for (int64_t r = 0; r < rows; ++r)
    encode_row(q, x.data() + r * cols, cols, static_cast<uint8_t*>(p.data()) + r * q_row_bytes(q, cols));
  if (orig) *orig = x;
  return p;
}

inline std::vector<double> decode_all(ks_qtype_t q, const Buf& p, int64_t cols) {
  const int64_t rows = p.shape[0], rb = p.shape[1];
  std::vector<double> w(size_t(rows * cols));
  for (int64_t r = 0; r < rows; ++r)
    decode_row(q, static_cast<const uint8_t*>(p.data()) + r * rb, cols, w.data() + r * cols);
  return w;
}

}  // namespace kstest::gguf
