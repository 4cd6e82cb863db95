// Shared helpers for the operator tests: host buffers of any dtype, random fill,
// poisoning, FP64 views of data, tolerance checks against FP64 references, and the
// whole-word search used to check that error messages name an op or argument.
#pragma once

#include <gtest/gtest.h>
#include <kernscope/kernscope.h>
#include <kernscope/kernscope.hpp>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "core/half.hpp"

namespace kstest {

using ks::DType;

// Pins op to variant (ks_force_variant) for a scope and releases the pin on every exit, also
// when an ASSERT returns early or a call throws; status(): the pin's result (check it). An
// empty or null variant leaves the routing as it is.
struct ScopedVariant {
  ScopedVariant(const char* op, const char* variant) : op_(op) {
    status_ = variant && *variant ? ks_force_variant(op, variant) : KS_SUCCESS;
  }
  ~ScopedVariant() { ks_force_variant(op_.c_str(), nullptr); }
  ScopedVariant(const ScopedVariant&) = delete;
  ScopedVariant& operator=(const ScopedVariant&) = delete;
  ks_status_t status() const { return status_; }

 private:
  std::string op_;
  ks_status_t status_;
};

// Sets an environment variable for a scope and restores its previous state (set or unset)
// on exit, also when an ASSERT returns early or a call throws, so a switch never leaks into
// the tests that follow in the same process.
struct ScopedEnv {
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) had_ = true, old_ = old;
    setenv(name, value, 1);
  }
  ~ScopedEnv() { had_ ? (void)setenv(name_.c_str(), old_.c_str(), 1) : (void)unsetenv(name_.c_str()); }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  std::string name_, old_;
  bool had_ = false;
};

// A host buffer with padding bytes before and after, so offset/misaligned views
// and out-of-bounds writes can be tested. `offset_bytes` shifts the data start.
struct Buf {
  DType dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> raw;  // pad | data | pad
  size_t offset;
  static constexpr size_t kPad = 64;

  Buf(DType dt, std::vector<int64_t> s, size_t offset_bytes = 0) : dtype(dt), shape(std::move(s)), offset(kPad + offset_bytes) {
    raw.assign(kPad + offset_bytes + nbytes() + kPad, 0xA5);
  }
  int64_t numel() const {
    int64_t n = 1;
    for (auto d : shape) n *= d;
    return n;
  }
  size_t nbytes() const { return size_t(numel()) * ks::dtype_size(dtype); }
  void* data() { return raw.data() + offset; }
  const void* data() const { return raw.data() + offset; }
  ks::TensorView view() { return ks::TensorView(data(), dtype, shape); }
  DLTensor dl() {  // shape storage is this->shape (keep Buf alive)
    DLTensor t{};
    t.data = data();
    t.device = {kDLCPU, 0};
    t.ndim = int(shape.size());
    t.dtype = ks::to_dl(dtype);
    t.shape = shape.data();
    return t;
  }
  // Value i as double (float dtypes and ints).
  double get(int64_t i) const {
    const uint8_t* p = static_cast<const uint8_t*>(data());
    switch (dtype) {
      case DType::F32: { float f; std::memcpy(&f, p + 4 * i, 4); return f; }
      case DType::F16: { uint16_t h; std::memcpy(&h, p + 2 * i, 2); return ks::half_to_float(h); }
      case DType::BF16: { uint16_t h; std::memcpy(&h, p + 2 * i, 2); return ks::bf16_to_float(h); }
      case DType::I32: { int32_t v; std::memcpy(&v, p + 4 * i, 4); return v; }
      case DType::I64: { int64_t v; std::memcpy(&v, p + 8 * i, 8); return double(v); }
      case DType::U8: return p[i];
    }
    return 0;
  }
  // Stores v rounded to the dtype (round to nearest even).
  void set(int64_t i, double v) {
    uint8_t* p = static_cast<uint8_t*>(data());
    switch (dtype) {
      case DType::F32: { float f = float(v); std::memcpy(p + 4 * i, &f, 4); break; }
      case DType::F16: { uint16_t h = ks::float_to_half(float(v)); std::memcpy(p + 2 * i, &h, 2); break; }
      case DType::BF16: { uint16_t h = ks::float_to_bf16(float(v)); std::memcpy(p + 2 * i, &h, 2); break; }
      case DType::I32: { int32_t x = int32_t(v); std::memcpy(p + 4 * i, &x, 4); break; }
      case DType::I64: { int64_t x = int64_t(v); std::memcpy(p + 8 * i, &x, 8); break; }
      case DType::U8: p[i] = uint8_t(v); break;
    }
  }
  std::vector<double> values() const {
    std::vector<double> v(static_cast<size_t>(numel()));
    for (int64_t i = 0; i < numel(); ++i) v[i] = get(i);
    return v;
  }
  // Fills data with a NaN-ish byte pattern so unwritten outputs are caught.
  void poison() { std::memset(data(), 0xFF, nbytes()); }
  std::vector<uint8_t> snapshot() const { return raw; }
  // True if the padding around the data is still intact.
  bool guards_intact() const {
    for (size_t i = 0; i < offset; ++i)
      if (raw[i] != 0xA5) return false;
    for (size_t i = offset + nbytes(); i < raw.size(); ++i)
      if (raw[i] != 0xA5) return false;
    return true;
  }
};

// Unit roundoff of binary32 (2^-24).
constexpr double kU32 = 0x1p-24;

// True if `w` occurs in `s` as a whole identifier (so "x" does not match "max").
inline bool has_word(const std::string& s, const std::string& w) {
  auto ident = [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; };
  for (size_t p = s.find(w); p != std::string::npos; p = s.find(w, p + 1)) {
    const bool l = p == 0 || !ident(s[p - 1]);
    const bool r = p + w.size() >= s.size() || !ident(s[p + w.size()]);
    if (l && r) return true;
  }
  return false;
}

inline std::mt19937_64& rng() {
  static std::mt19937_64 g(0x5EED1234ULL);
  return g;
}

inline void fill_normal(Buf& b, double stddev = 1.0, double mean = 0.0) {
  std::normal_distribution<double> d(mean, stddev);
  for (int64_t i = 0; i < b.numel(); ++i) b.set(i, d(rng()));
}
inline void fill_uniform(Buf& b, double lo, double hi) {
  std::uniform_real_distribution<double> d(lo, hi);
  for (int64_t i = 0; i < b.numel(); ++i) b.set(i, d(rng()));
}

// Per-dtype tolerance against FP64 (from the Kernscope seed).
inline double tol(DType d) {
  switch (d) {
    case DType::F16: return 1e-3;
    case DType::BF16: return 1e-2;
    default: return 1e-6;
  }
}

// |got - ref| <= atol + rtol * |ref| elementwise; NaN must match NaN; inf must match.
inline ::testing::AssertionResult allclose(const std::vector<double>& got, const std::vector<double>& ref, double rtol,
                                           double atol) {
  if (got.size() != ref.size()) return ::testing::AssertionFailure() << "size " << got.size() << " vs " << ref.size();
  for (size_t i = 0; i < got.size(); ++i) {
    const double g = got[i], r = ref[i];
    if (std::isnan(r) || std::isnan(g)) {
      if (std::isnan(r) && std::isnan(g)) continue;
      return ::testing::AssertionFailure() << "at " << i << ": got " << g << ", want " << r;
    }
    if (std::isinf(r) || std::isinf(g)) {
      if (g == r) continue;
      return ::testing::AssertionFailure() << "at " << i << ": got " << g << ", want " << r;
    }
    if (std::fabs(g - r) > atol + rtol * std::fabs(r))
      return ::testing::AssertionFailure() << "at " << i << ": got " << g << ", want " << r << " (diff "
                                           << std::fabs(g - r) << ")";
  }
  return ::testing::AssertionSuccess();
}

// FP64 paged attention (decode or prefill rows): q [T, H, D], the caches' values as rows
// [slots, KVH, D], slot(t, j) the cache slot of token t's key j < ctx[t], G = H / KVH query heads
// per kv head. With each output, the first-order bound of an FP32 computation in any order
// (docs/contracts.md): each score's FP32 dot error (the larger of the sequential sum's and
// 8 sqrt(D) times the products' magnitudes) and rounding, the exponentials' spread and the
// weighted sums' own rounding, all relative to sum_j p_j |v_j|. Scores of large magnitude (q
// and k of a real model's projections) widen it: a fixed tolerance would fail them.
struct AttnRef {
  std::vector<double> val, bound;
};
inline AttnRef paged_attention_fp64(const std::vector<double>& qv, const std::vector<double>& kv,
                                    const std::vector<double>& vv, int64_t T, int64_t H, int64_t KVH, int64_t D,
                                    const std::vector<int64_t>& ctx, double scale,
                                    const std::function<int64_t(int64_t, int64_t)>& slot) {
  const int64_t group = H / KVH;
  AttnRef r;
  r.val.assign(size_t(T * H * D), 0.0);
  r.bound.assign(size_t(T * H * D), 0.0);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t L = ctx[size_t(t)], kvh = h / group, qo = (t * H + h) * D;
      if (L <= 0) continue;  // zero row
      std::vector<double> sc(static_cast<size_t>(L));
      std::vector<int64_t> vo(static_cast<size_t>(L));
      double E = 0, mx = -INFINITY;
      for (int64_t j = 0; j < L; ++j) {
        const int64_t ko = (slot(t, j) * KVH + kvh) * D;
        vo[size_t(j)] = ko;
        double dot = 0, err = 0, mag = 0;
        for (int64_t e = 0; e < D; ++e) {
          const double p = qv[size_t(qo + e)] * kv[size_t(ko + e)];
          dot += p;
          err += std::fabs(p) + std::fabs(dot);
          mag += std::fabs(p);
        }
        err = std::max(err, 8.0 * std::sqrt(double(D)) * mag);
        sc[size_t(j)] = scale * dot;
        E = std::max(E, kU32 * (err * std::fabs(scale) + std::fabs(sc[size_t(j)])));
        mx = std::max(mx, sc[size_t(j)]);
      }
      double sum = 0, spread = 0;
      for (int64_t j = 0; j < L; ++j) {
        spread = std::max(spread, mx - sc[size_t(j)]);
        sc[size_t(j)] = std::exp(sc[size_t(j)] - mx);
        sum += sc[size_t(j)];
      }
      const double rel = 2 * (2 * E + kU32 * spread + 2 * kU32) + double(L + 4) * kU32 + 8.0 * std::sqrt(double(L)) * kU32;
      for (int64_t e = 0; e < D; ++e) {
        double o = 0, mag = 0;
        for (int64_t j = 0; j < L; ++j) {
          const double p = sc[size_t(j)] / sum, v = vv[size_t(vo[size_t(j)] + e)];
          o += p * v;
          mag += p * std::fabs(v);
        }
        r.val[size_t(qo + e)] = o;
        r.bound[size_t(qo + e)] = rel * mag;
      }
    }
  return r;
}
// out [T, H, D] against paged_attention_fp64's r: a context-0 row exactly 0, every other element
// within out's dtype tolerance plus the bound.
inline ::testing::AssertionResult attention_matches(const Buf& out, const AttnRef& r, const std::vector<int64_t>& ctx,
                                                    int64_t H, int64_t D) {
  const double t = tol(out.dtype);
  for (int64_t i = 0; i < out.numel(); ++i) {
    const double g = out.get(i), w = r.val[size_t(i)];
    const int64_t tok = i / (H * D), head = (i / D) % H;
    if (ctx[size_t(tok)] <= 0) {
      if (g != 0.0)
        return ::testing::AssertionFailure() << "token " << tok << " (context 0) head " << head << ": got " << g
                                             << ", want 0";
      continue;
    }
    const double lim = t + t * std::fabs(w) + (1 + t) * r.bound[size_t(i)];
    if (!(std::fabs(g - w) <= lim))
      return ::testing::AssertionFailure() << "token " << tok << " head " << head << " dim " << i % D << ": got " << g
                                           << ", want " << w << " (|diff| " << std::fabs(g - w) << " > " << lim << ")";
  }
  return ::testing::AssertionSuccess();
}

// FP64 out[m, n] = sum_k a[m, k] * b[n, k] (a [M, K], b [N, K], row-major), summed in k
// order, and per output the first-order magnitude of the error of an FP32 sum of the same
// products in any order: max(sum_k (|p_k| + |s_k|), 8 sqrt(K) sum_k |p_k|) (s_k: partial
// sums; the second term is docs/contracts.md's allowance for an unspecified order). An FP32
// accumulation is within 2^-24 times that of val.
struct MatmulRef {
  std::vector<double> val, mag;
};
inline MatmulRef matmul_nt_ref(const std::vector<double>& a, const std::vector<double>& b, int64_t M, int64_t N,
                               int64_t K) {
  MatmulRef r;
  r.val.resize(size_t(M * N));
  r.mag.resize(size_t(M * N));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double s = 0, err = 0, mag = 0;
      for (int64_t k = 0; k < K; ++k) {
        const double p = a[size_t(m * K + k)] * b[size_t(n * K + k)];
        s += p;
        err += std::fabs(p) + std::fabs(s);
        mag += std::fabs(p);
      }
      r.val[size_t(m * N + n)] = s;
      r.mag[size_t(m * N + n)] = std::max(err, 8.0 * std::sqrt(double(K)) * mag);
    }
  return r;
}

inline const std::vector<DType>& float_dtypes() {
  static const std::vector<DType> d{DType::F16, DType::BF16, DType::F32};
  return d;
}

}  // namespace kstest
