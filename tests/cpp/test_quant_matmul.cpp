// ks_quant_matmul: out[M, N] = x[M, K] @ dequant(W)^T from packed GGUF blocks, against an
// FP64 reference built from a test-side encoder and an independent FP64 decoder.
// Tolerance: the seed's per-dtype rtol/atol plus the larger of the allowance in
// docs/contracts.md for sums in an unspecified order, 8 sqrt(K) u sum_k |p_k|, and the
// first-order bound of a left-to-right FP32 sum, u (sum_k |p_k| + sum_k |s_k|), u = 2^-24
// (the dequantized weights are exact in FP32: products and sums are the only roundings).
// ---- helpers local to this file -------------------------------------------------
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

#include "test_util.hpp"

namespace {

using kstest::Buf;
using kstest::rng;
using ks::DType;

constexpr double kU32 = 1.0 / 16777216.0;  // unit roundoff of fp32 (2^-24)

const std::vector<DType>& kFloatTypes() { return kstest::float_dtypes(); }

[[maybe_unused]] std::string dt_name(DType d) { return ks::dtype_name(d); }

// Random bytes (any bit pattern: NaN payloads, infinities, subnormals).
[[maybe_unused]] void fill_bytes(Buf& b) {
  std::uniform_int_distribution<int> d(0, 255);
  auto* p = static_cast<uint8_t*>(b.data());
  for (size_t i = 0; i < b.nbytes(); ++i) p[i] = uint8_t(d(rng()));
}

// Exact integer store / load for int32 / int64 buffers.
[[maybe_unused]] void set_i(Buf& b, int64_t i, int64_t v) {
  auto* p = static_cast<uint8_t*>(b.data());
  if (b.dtype == DType::I32) {
    const int32_t x = int32_t(v);
    std::memcpy(p + 4 * i, &x, 4);
  } else {
    std::memcpy(p + 8 * i, &v, 8);
  }
}
[[maybe_unused]] int64_t get_i(const Buf& b, int64_t i) {
  const auto* p = static_cast<const uint8_t*>(b.data());
  if (b.dtype == DType::I32) {
    int32_t x;
    std::memcpy(&x, p + 4 * i, 4);
    return x;
  }
  int64_t x;
  std::memcpy(&x, p + 8 * i, 8);
  return x;
}

// Independent decoders of the 16-bit float formats (to FP64).
[[maybe_unused]] double f16_to_double(uint16_t h) {
  const int s = h >> 15, e = (h >> 10) & 0x1F, m = h & 0x3FF;
  double v;
  if (e == 0x1F) v = m ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  else if (e == 0) v = std::ldexp(double(m), -24);
  else v = std::ldexp(double(m + 1024), e - 25);
  return s ? -v : v;
}
[[maybe_unused]] double bf16_to_double(uint16_t h) {
  const uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return double(f);
}

// v rounded to dtype d (through fp32), as a double.
[[maybe_unused]] double round_to(DType d, double v) {
  const float f = float(v);
  switch (d) {
    case DType::F16: return ks::half_to_float(ks::float_to_half(f));
    case DType::BF16: return ks::bf16_to_float(ks::float_to_bf16(f));
    default: return f;
  }
}

// ---- running every CPU variant of an op ---------------------------------------------
// The automatic choice first, then (when an op has more than one CPU variant) each variant
// pinned with ks_force_variant. A pinned variant may decline a call it cannot run
// (KS_ERROR_BACKEND_UNAVAILABLE); KS_RUN_OR_SKIP then skips that case.
thread_local std::string g_variant;  // "" = automatic selection
thread_local int g_ran = 0, g_declined = 0;

[[maybe_unused]] std::vector<std::string> variants_of(const char* op) {
  std::vector<std::string> names;
  for (size_t i = 0; i < ks_variant_count(); ++i) {
    ks_variant_info_t info;
    if (ks_variant_info(i, &info) == KS_SUCCESS && std::string(info.op) == op && std::string(info.backend) == "cpu")
      names.push_back(info.name);
  }
  std::vector<std::string> v{""};
  if (names.size() > 1) v.insert(v.end(), names.begin(), names.end());
  return v;
}

struct Pin {
  const char* op;
  bool done = false;
  ::testing::ScopedTrace trace;
  Pin(const char* o, const std::string& v)
      : op(o), trace(__FILE__, __LINE__, "variant " + (v.empty() ? std::string("auto") : v)) {
    g_variant = v;
    g_ran = g_declined = 0;
    if (!v.empty()) {
      EXPECT_EQ(ks_force_variant(op, v.c_str()), KS_SUCCESS) << ks_last_error();
    }
  }
  ~Pin() {
    if (std::getenv("KS_TEST_VERBOSE"))
      std::printf("  [%s] variant %s: %d calls ran, %d declined\n", op, g_variant.empty() ? "auto" : g_variant.c_str(),
                  g_ran, g_declined);
    ks_force_variant(op, nullptr);
    g_variant.clear();
  }
  bool once() { return !done && (done = true); }
};

#define FOR_EACH_VARIANT(op)                            \
  for (const std::string& ks_variant_ : variants_of(op)) \
    for (Pin ks_pin_(op, ks_variant_); ks_pin_.once();)

// In a void function: run the call; skip the rest if a pinned variant declines it.
#define KS_RUN_OR_SKIP(expr)                                                                          \
  do {                                                                                                \
    const ks_status_t ks_st_ = (expr);                                                                \
    if (ks_st_ == KS_ERROR_BACKEND_UNAVAILABLE && !g_variant.empty()) {                               \
      ++g_declined;                                                                                   \
      return;                                                                                         \
    }                                                                                                 \
    ++g_ran;                                                                                          \
    ASSERT_EQ(ks_st_, KS_SUCCESS) << ks_last_error() << " [variant "                                  \
                                  << (g_variant.empty() ? std::string("auto") : g_variant) << "]"; \
  } while (0)

// True if msg contains w as a whole word (not inside a longer identifier).
[[maybe_unused]] bool names_word(const std::string& msg, const std::string& w) {
  auto ident = [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; };
  for (size_t pos = msg.find(w); pos != std::string::npos; pos = msg.find(w, pos + 1)) {
    const bool before = pos == 0 || !ident(msg[pos - 1]);
    const bool after = pos + w.size() >= msg.size() || !ident(msg[pos + w.size()]);
    if (before && after) return true;
  }
  return false;
}

// Byte snapshot of buffers (data and guard padding) that a failing call must not touch.
struct Snap {
  std::vector<std::pair<const Buf*, std::vector<uint8_t>>> s;
  Snap() = default;
  Snap(std::initializer_list<const Buf*> bs) {
    for (auto* b : bs) add(b);
  }
  void add(const Buf* b) { s.push_back({b, b->raw}); }
  ::testing::AssertionResult same() const {
    for (size_t i = 0; i < s.size(); ++i) {
      const auto& now = s[i].first->raw;
      const auto& then = s[i].second;
      for (size_t j = 0; j < now.size(); ++j)
        if (now[j] != then[j])
          return ::testing::AssertionFailure() << "buffer #" << i << " changed at raw byte " << j << " (data byte "
                                               << int64_t(j) - int64_t(s[i].first->offset) << ")";
    }
    return ::testing::AssertionSuccess();
  }
};

// The call failed with `want`, the message names the op and (if given) the argument as a
// word, and every snapshotted buffer is byte-identical.
[[maybe_unused]] ::testing::AssertionResult fails_cleanly(ks_status_t got, ks_status_t want, const char* op, const std::string& arg,
                                         const Snap& snap) {
  const std::string msg = ks_last_error();  // read before any other kernscope call
  if (got != want)
    return ::testing::AssertionFailure() << "status " << ks_status_name(got) << ", want " << ks_status_name(want)
                                         << " (message: \"" << msg << "\")";
  if (msg.find(op) == std::string::npos)
    return ::testing::AssertionFailure() << "message does not name op '" << op << "': \"" << msg << "\"";
  if (!arg.empty()) {  // arg may list alternatives: "a|b"
    bool named = false;
    size_t start = 0;
    while (start <= arg.size()) {
      const size_t bar = arg.find('|', start);
      const std::string one = arg.substr(start, bar == std::string::npos ? std::string::npos : bar - start);
      named = named || names_word(msg, one);
      if (bar == std::string::npos) break;
      start = bar + 1;
    }
    if (!named)
      return ::testing::AssertionFailure() << "message does not name argument '" << arg << "': \"" << msg << "\"";
  }
  return snap.same();
}

// An owned DLTensor over a Buf whose shape/strides can be mutated.
struct Dl {
  std::vector<int64_t> shape, strides;
  DLTensor t{};
  Dl() = default;
  explicit Dl(Buf& b) : shape(b.shape) {
    t = b.dl();
    fix();
  }
  Dl(const Dl& o) : shape(o.shape), strides(o.strides), t(o.t) { fix(); }
  Dl& operator=(const Dl& o) {
    shape = o.shape;
    strides = o.strides;
    t = o.t;
    fix();
    return *this;
  }
  void fix() {
    t.shape = shape.data();
    t.strides = strides.empty() ? nullptr : strides.data();
  }
  void set_shape(std::vector<int64_t> s) {
    shape = std::move(s);
    t.ndim = int(shape.size());
    fix();
  }
  void set_strides(std::vector<int64_t> s) {
    strides = std::move(s);
    fix();
  }
  DLTensor* p() { return &t; }
};

[[maybe_unused]] std::vector<int64_t> compact_strides(const std::vector<int64_t>& shape) {
  std::vector<int64_t> st(shape.size());
  int64_t e = 1;
  for (int i = int(shape.size()) - 1; i >= 0; --i) {
    st[size_t(i)] = e;
    e *= shape[size_t(i)];
  }
  return st;
}

// ---- generic DLTensor rules, run for every argument of an op -----------------------
struct ArgSpec {
  const char* name;
  Buf* buf;
  bool optional;                       // NULL is a valid value
  std::vector<DLDataType> bad_dtypes;  // each must be rejected with UNSUPPORTED_DTYPE
};
using Call = std::function<ks_status_t(std::vector<DLTensor*>&, ks_backend_t)>;

// Runs `call` once as a baseline (must succeed), then, one argument at a time: NULL tensor,
// NULL data, negative dim, ndim -1, NULL shape, lanes 2, fp64, the listed wrong dtypes,
// non-contiguous strides, another device; then whole-call rules (CUDA/OpenCL devices,
// unknown backend). Every failure must leave every buffer byte-identical. Explicit
// compact strides (size-1 dims with junk strides) and byte_offset must give the baseline.
[[maybe_unused]] void check_common_rules(const char* op, std::vector<ArgSpec> args, const Call& call) {
  std::vector<std::vector<uint8_t>> init;
  for (auto& a : args) init.push_back(a.buf->raw);
  auto restore = [&] {
    for (size_t i = 0; i < args.size(); ++i) args[i].buf->raw = init[i];
  };
  auto make = [&] {
    std::vector<Dl> d;
    d.reserve(args.size());
    for (auto& a : args) d.emplace_back(*a.buf);
    return d;
  };
  auto ptrs = [](std::vector<Dl>& d) {
    std::vector<DLTensor*> p;
    for (auto& x : d) p.push_back(&x.t);
    return p;
  };
  auto snap_all = [&] {
    Snap s;
    for (auto& a : args) s.add(a.buf);
    return s;
  };
  restore();
  {
    auto d = make();
    auto p = ptrs(d);
    ASSERT_EQ(call(p, KS_BACKEND_AUTO), KS_SUCCESS) << op << " baseline: " << ks_last_error();
    EXPECT_STREQ(ks_last_error(), "") << op << ": a successful call must clear the last error";
  }
  std::vector<std::vector<uint8_t>> base;
  for (auto& a : args) {
    EXPECT_TRUE(a.buf->guards_intact()) << op << " baseline wrote outside " << a.name;
    base.push_back(a.buf->raw);
  }
  auto expect_ok_same = [&](const std::string& what, const std::function<void(std::vector<Dl>&)>& mut,
                            ks_backend_t be) {
    restore();
    auto d = make();
    mut(d);
    auto p = ptrs(d);
    const ks_status_t st = call(p, be);
    EXPECT_EQ(st, KS_SUCCESS) << op << " " << what << ": " << ks_last_error();
    for (size_t i = 0; i < args.size(); ++i)
      EXPECT_TRUE(args[i].buf->raw == base[i]) << op << " " << what << ": " << args[i].name
                                               << " differs from the baseline call";
  };
  auto expect_fail = [&](const std::string& what, ks_status_t want, const std::string& arg,
                         const std::function<void(std::vector<Dl>&, std::vector<DLTensor*>&)>& mut, ks_backend_t be) {
    restore();
    auto d = make();
    auto p = ptrs(d);
    mut(d, p);
    Snap s = snap_all();
    const ks_status_t st = call(p, be);
    if (std::getenv("KS_TEST_VERBOSE")) std::printf("  [%s] %s -> %s: %s\n", op, what.c_str(), ks_status_name(st), ks_last_error());
    EXPECT_TRUE(fails_cleanly(st, want, op, arg, s)) << op << ": " << what;
  };
  const ks_status_t INV = KS_ERROR_INVALID_ARGUMENT, DT = KS_ERROR_UNSUPPORTED_DTYPE,
                    DEV = KS_ERROR_UNSUPPORTED_DEVICE;
  for (size_t i = 0; i < args.size(); ++i) {
    const ArgSpec& a = args[i];
    const std::string n = a.name;
    const std::vector<int64_t> shp = a.buf->shape;
    const int64_t numel = a.buf->numel();
    if (!a.optional)
      expect_fail(n + " NULL", INV, n, [&](auto&, auto& p) { p[i] = nullptr; }, KS_BACKEND_AUTO);
    if (numel > 0)
      expect_fail(n + " NULL data", INV, n, [&](auto& d, auto&) { d[i].t.data = nullptr; }, KS_BACKEND_AUTO);
    if (!shp.empty()) {
      expect_fail(n + " negative dim", INV, n, [&](auto& d, auto&) { d[i].shape[0] = -1; }, KS_BACKEND_AUTO);
      expect_fail(n + " NULL shape", INV, n, [&](auto& d, auto&) { d[i].t.shape = nullptr; }, KS_BACKEND_AUTO);
    }
    expect_fail(n + " ndim -1", INV, n, [&](auto& d, auto&) { d[i].t.ndim = -1; }, KS_BACKEND_AUTO);
    expect_fail(n + " ndim 17", INV, n,
                [&](auto& d, auto&) {
                  std::vector<int64_t> s17(17, 1);
                  d[i].set_shape(s17);
                },
                KS_BACKEND_AUTO);
    if (shp.size() >= 2)  // element count past 2^63
      expect_fail(n + " element count overflow", INV, n,
                  [&](auto& d, auto&) {
                    d[i].shape[0] = int64_t(1) << 62;
                    d[i].shape[1] = 5;
                  },
                  KS_BACKEND_AUTO);
    expect_fail(n + " lanes 2", DT, n, [&](auto& d, auto&) { d[i].t.dtype.lanes = 2; }, KS_BACKEND_AUTO);
    expect_fail(n + " fp64", DT, n, [&](auto& d, auto&) { d[i].t.dtype = DLDataType{kDLFloat, 64, 1}; },
                KS_BACKEND_AUTO);
    for (DLDataType bad : a.bad_dtypes)
      expect_fail(n + " dtype code " + std::to_string(bad.code) + " bits " + std::to_string(bad.bits), DT, n,
                  [&](auto& d, auto&) { d[i].t.dtype = bad; }, KS_BACKEND_AUTO);
    // Non-contiguous: the innermost dim of size > 1 gets twice its compact stride.
    {
      auto st = compact_strides(shp);
      int k = -1;
      for (int j = int(shp.size()) - 1; j >= 0; --j)
        if (shp[size_t(j)] > 1) {
          k = j;
          break;
        }
      if (k >= 0 && numel > 0) {
        st[size_t(k)] *= 2;
        expect_fail(n + " non-contiguous", INV, n, [&](auto& d, auto&) { d[i].set_strides(st); }, KS_BACKEND_AUTO);
      }
      if (shp.size() >= 2 && shp[0] > 1 && shp[1] > 1 && numel > 0) {  // transposed (column-major) strides
        auto tr = compact_strides(shp);
        std::swap(tr[0], tr[1]);
        tr[0] = 1;
        tr[1] = shp[0];
        expect_fail(n + " transposed strides", INV, n, [&](auto& d, auto&) { d[i].set_strides(tr); },
                    KS_BACKEND_AUTO);
      }
    }
    if (args.size() > 1)
      expect_fail(n + " on kDLCUDA alone", DEV, n, [&](auto& d, auto&) { d[i].t.device = DLDevice{kDLCUDA, 0}; },
                  KS_BACKEND_AUTO);
  }
  // Whole-call device/backend rules.
  if (!ks_backend_available(KS_BACKEND_CUDA))
    expect_fail("all tensors on kDLCUDA without a CUDA backend", KS_ERROR_BACKEND_UNAVAILABLE, "",
                [&](auto& d, auto&) {
                  for (auto& x : d) x.t.device = DLDevice{kDLCUDA, 0};
                },
                KS_BACKEND_AUTO);
  expect_fail("all tensors on kDLCUDA with backend CPU", DEV, "",
              [&](auto& d, auto&) {
                for (auto& x : d) x.t.device = DLDevice{kDLCUDA, 0};
              },
              KS_BACKEND_CPU);
  expect_fail("all tensors on kDLOpenCL", DEV, "",
              [&](auto& d, auto&) {
                for (auto& x : d) x.t.device = DLDevice{kDLOpenCL, 0};
              },
              KS_BACKEND_AUTO);
  expect_fail("unknown backend 9", INV, "backend", [](auto&, auto&) {}, static_cast<ks_backend_t>(9));
  {  // CUDA backend asked for host tensors: either status is a correct refusal.
    restore();
    auto d = make();
    auto p = ptrs(d);
    Snap s = snap_all();
    const ks_status_t st = call(p, KS_BACKEND_CUDA);
    const std::string msg = ks_last_error();
    EXPECT_TRUE(st == KS_ERROR_UNSUPPORTED_DEVICE || st == KS_ERROR_BACKEND_UNAVAILABLE)
        << op << " backend CUDA with host tensors: " << ks_status_name(st) << " " << msg;
    EXPECT_NE(msg.find(op), std::string::npos) << msg;
    EXPECT_TRUE(s.same()) << op << " backend CUDA with host tensors wrote";
  }
  // Layouts that must be accepted and give the baseline bit for bit.
  expect_ok_same("backend CPU", [](auto&) {}, KS_BACKEND_CPU);
  expect_ok_same("explicit compact strides",
                 [&](std::vector<Dl>& d) {
                   for (auto& x : d) {
                     auto st = compact_strides(x.shape);
                     for (size_t j = 0; j < st.size(); ++j)
                       if (x.shape[j] == 1) st[j] = 12345;  // a size-1 dim's stride is ignored
                     x.set_strides(st);
                   }
                 },
                 KS_BACKEND_AUTO);
  expect_ok_same("byte_offset 7",
                 [&](std::vector<Dl>& d) {
                   for (auto& x : d)
                     if (x.t.data) {
                       x.t.data = static_cast<char*>(x.t.data) - 7;
                       x.t.byte_offset = 7;
                     }
                 },
                 KS_BACKEND_AUTO);
  restore();
}

// A float tensor's dtype with another float dtype of the same element size (or smaller).
[[maybe_unused]] DLDataType other_float(DType d) {
  switch (d) {
    case DType::F16: return DLDataType{kDLBfloat, 16, 1};
    case DType::BF16: return DLDataType{kDLFloat, 16, 1};
    default: return DLDataType{kDLInt, 32, 1};
  }
}
const DLDataType kI32{kDLInt, 32, 1}, kI64{kDLInt, 64, 1}, kU8{kDLUInt, 8, 1}, kF16{kDLFloat, 16, 1},
    kBF16{kDLBfloat, 16, 1}, kF32{kDLFloat, 32, 1}, kI16{kDLInt, 16, 1}, kU32t{kDLUInt, 32, 1};

}  // namespace
// ---- GGUF block formats: a test-side encoder and an independent FP64 decoder ------
namespace {

struct QFmt {
  ks_qtype_t q;
  const char* name;
  int64_t block, bytes;
};
const std::vector<QFmt>& all_qfmts() {
  static const std::vector<QFmt> f{{KS_QTYPE_F32, "F32", 1, 4},   {KS_QTYPE_F16, "F16", 1, 2},
                                   {KS_QTYPE_BF16, "BF16", 1, 2}, {KS_QTYPE_Q4_0, "Q4_0", 32, 18},
                                   {KS_QTYPE_Q4_1, "Q4_1", 32, 20}, {KS_QTYPE_Q8_0, "Q8_0", 32, 34}};
  return f;
}
const QFmt& qfmt(ks_qtype_t q) {
  for (const auto& f : all_qfmts())
    if (f.q == q) return f;
  throw std::runtime_error("unknown qtype");
}
[[maybe_unused]] int64_t q_row_bytes(ks_qtype_t q, int64_t cols) { return cols / qfmt(q).block * qfmt(q).bytes; }

[[maybe_unused]] void put16(uint8_t* p, uint16_t v) {
  p[0] = uint8_t(v & 0xFF);
  p[1] = uint8_t(v >> 8);
}
[[maybe_unused]] uint16_t get16(const uint8_t* p) { return uint16_t(p[0] | (p[1] << 8)); }
[[maybe_unused]] uint16_t to_f16(double v) { return ks::float_to_half(float(v)); }
[[maybe_unused]] uint16_t to_bf16(double v) { return ks::float_to_bf16(float(v)); }

// Quantizes n values (n a multiple of the block size) into dst (row_bytes bytes).
[[maybe_unused]] void encode_row(ks_qtype_t q, const double* x, int64_t n, uint8_t* dst) {
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
[[maybe_unused]] void decode_row(ks_qtype_t q, const uint8_t* src, int64_t n, double* out) {
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
[[maybe_unused]] Buf make_packed(ks_qtype_t q, int64_t rows, int64_t cols, std::vector<double>* orig = nullptr, size_t offset = 0,
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

[[maybe_unused]] std::vector<double> decode_all(ks_qtype_t q, const Buf& p, int64_t cols) {
  const int64_t rows = p.shape[0], rb = p.shape[1];
  std::vector<double> w(size_t(rows * cols));
  for (int64_t r = 0; r < rows; ++r)
    decode_row(q, static_cast<const uint8_t*>(p.data()) + r * rb, cols, w.data() + r * cols);
  return w;
}

}  // namespace
namespace {

const char* kOp = "quant_matmul";

ks_status_t run_qmm(Buf& out, Buf& x, Buf& w, ks_qtype_t q, ks_backend_t be = KS_BACKEND_AUTO) {
  DLTensor o = out.dl(), a = x.dl(), b = w.dl();
  return ks_quant_matmul(&o, &a, &b, q, be, nullptr);
}

::testing::AssertionResult matches_reference(const Buf& out, const Buf& x, const std::vector<double>& w, int64_t M,
                                             int64_t N, int64_t K) {
  const auto xv = x.values();
  const double t = kstest::tol(out.dtype);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double s = 0, err = 0, mag = 0;
      for (int64_t k = 0; k < K; ++k) {
        const double p = xv[size_t(m * K + k)] * w[size_t(n * K + k)];
        s += p;
        err += std::fabs(p) + std::fabs(s);
        mag += std::fabs(p);
      }
      const double got = out.get(m * N + n);
      const double lim = t + t * std::fabs(s) + (1 + t) * kU32 * std::max(err, 8.0 * std::sqrt(double(K)) * mag);
      if (!(std::fabs(got - s) <= lim))
        return ::testing::AssertionFailure() << "out[" << m << ", " << n << "]: got " << got << ", want " << s
                                             << " (|diff| " << std::fabs(got - s) << " > " << lim << ")";
    }
  return ::testing::AssertionSuccess();
}

void check_case(ks_qtype_t q, DType dt, int64_t M, int64_t N, int64_t K, size_t off_o, size_t off_x, size_t off_w) {
  Buf w = make_packed(q, N, K, nullptr, off_w);
  const auto wd = decode_all(q, w, K);
  Buf x(dt, {M, K}, off_x);
  kstest::fill_normal(x);
  Buf out(dt, {M, N}, off_o);
  out.poison();
  Snap in{&x, &w};
  KS_RUN_OR_SKIP(run_qmm(out, x, w, q));
  EXPECT_TRUE(matches_reference(out, x, wd, M, N, K))
      << qfmt(q).name << " x " << dt_name(dt) << " M " << M << " N " << N << " K " << K;
  EXPECT_TRUE(out.guards_intact()) << "wrote outside out";
  EXPECT_TRUE(in.same()) << "inputs modified";
}

TEST(QuantMatmul, AllFormatsShapesDtypes) {
  const int64_t Ms[] = {1, 3, 17};
  const int64_t Ks[] = {32, 64, 576, 1536};
  const int64_t Ns[] = {1, 7, 13};
  FOR_EACH_VARIANT(kOp) {
    int idx = 0;
    for (const auto& f : all_qfmts())
      for (DType dt : kFloatTypes())
        for (int64_t M : Ms)
          for (int64_t K : Ks) {
            const int64_t N = Ns[idx % 3];
            ++idx;
            const size_t off = size_t(idx % 4);  // every fourth case aligned, the rest misaligned
            check_case(f.q, dt, M, N, K, off, (off * 3) % 4, (off + 1) % 3);
          }
  }
}

TEST(QuantMatmul, TileAndPanelEdges) {
  // Row counts around register tiles (1..3 decode rows, 4-row tiles and their remainders)
  // and weight-row counts around 4/8-row panels.
  FOR_EACH_VARIANT(kOp) {
    for (ks_qtype_t q : {KS_QTYPE_Q4_0, KS_QTYPE_Q4_1, KS_QTYPE_Q8_0})
      for (int64_t M : {2, 4, 5, 8, 9})
        for (int64_t N : {3, 4, 8, 9, 17}) check_case(q, DType::F32, M, N, 64, size_t(M % 3), size_t(N % 4), 1);
  }
}

TEST(QuantMatmul, ThreadedSizes) {
  // Work above the threading thresholds, for decode-sized and prefill-sized M.
  FOR_EACH_VARIANT(kOp) {
    for (ks_qtype_t q : {KS_QTYPE_Q4_0, KS_QTYPE_Q8_0}) {
      check_case(q, DType::F32, 2, 67, 1536, 1, 0, 2);
      check_case(q, DType::F32, 19, 29, 576, 0, 3, 1);
    }
    check_case(KS_QTYPE_Q4_1, DType::BF16, 5, 41, 1536, 2, 2, 0);
  }
}

TEST(QuantMatmul, DenseFormatsOddK) {
  // F32 / F16 / BF16 "blocks" hold one element: K need not be a multiple of 32.
  FOR_EACH_VARIANT(kOp) {
    for (ks_qtype_t q : {KS_QTYPE_F32, KS_QTYPE_F16, KS_QTYPE_BF16})
      for (DType dt : kFloatTypes())
        for (int64_t K : {1, 3, 33, 255}) check_case(q, dt, 3, 5, K, 1, 2, 1);
  }
}

void known_q4_0_case(DType dt) {
  // W row n: one Q4_0 block with d = 0.5 (0x3800) and all nibbles = n + 1 -> w = 0.5 * (n - 7).
  // x = 1..32 -> out[m, n] = 0.5 * (n - 7) * 528 * (m + 1) exactly.
  const int64_t N = 5, M = 2, K = 32;
  Buf w(DType::U8, {N, 18}, 1);
  auto* p = static_cast<uint8_t*>(w.data());
  for (int64_t n = 0; n < N; ++n) {
    p[18 * n] = 0x00;
    p[18 * n + 1] = 0x38;
    for (int j = 0; j < 16; ++j) p[18 * n + 2 + j] = uint8_t((n + 1) | ((n + 1) << 4));
  }
  Buf x(dt, {M, K});
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) x.set(m * K + k, double((k + 1) * (m + 1)));
  Buf out(dt, {M, N}, 3);
  out.poison();
  KS_RUN_OR_SKIP(run_qmm(out, x, w, KS_QTYPE_Q4_0));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n)
      EXPECT_EQ(out.get(m * N + n), round_to(dt, 0.5 * double(n - 7) * 528.0 * double(m + 1)))
          << dt_name(dt) << " out[" << m << ", " << n << "]";
}

TEST(QuantMatmul, KnownQ4_0Weights) {
  FOR_EACH_VARIANT(kOp) {
    for (DType dt : kFloatTypes()) known_q4_0_case(dt);
  }
}

void fp16_range_case(ks_qtype_t q, DType dt) {
  // x = (300, 300, -300, -300, 1, 0...) against a row (300, 300, 300, 300, 7, 0...): partial
  // sums reach 180000, the result is exactly 7 (FP32 accumulation).
  const int64_t K = 32;
  std::vector<double> wv(K, 0.0);
  for (int k = 0; k < 4; ++k) wv[size_t(k)] = 300;
  wv[4] = 7;
  Buf w(DType::U8, {1, q_row_bytes(q, K)});
  encode_row(q, wv.data(), K, static_cast<uint8_t*>(w.data()));
  Buf x(dt, {1, K}), out(dt, {1, 1});
  for (int k = 0; k < K; ++k) x.set(k, k < 2 ? 300.0 : k < 4 ? -300.0 : k == 4 ? 1.0 : 0.0);
  out.poison();
  KS_RUN_OR_SKIP(run_qmm(out, x, w, q));
  EXPECT_EQ(out.get(0), 7.0) << qfmt(q).name << " x " << dt_name(dt);
}

TEST(QuantMatmul, IntermediateSumsPastFp16Range) {
  FOR_EACH_VARIANT(kOp) {
    for (ks_qtype_t q : {KS_QTYPE_F16, KS_QTYPE_BF16, KS_QTYPE_F32})
      for (DType dt : kFloatTypes()) fp16_range_case(q, dt);
  }
}

void via_dequantize_case(ks_qtype_t q) {
  // Same result as ks_dequantize to fp32 followed by an FP64 product of the dequantized values.
  const int64_t M = 4, N = 9, K = 96;
  Buf w = make_packed(q, N, K);
  Buf wf(DType::F32, {N, K});
  DLTensor o = wf.dl(), pk = w.dl();
  ASSERT_EQ(ks_dequantize(&o, &pk, q, KS_BACKEND_AUTO, nullptr), KS_SUCCESS) << ks_last_error();
  Buf x(DType::F32, {M, K});
  kstest::fill_normal(x);
  Buf out(DType::F32, {M, N});
  out.poison();
  KS_RUN_OR_SKIP(run_qmm(out, x, w, q));
  EXPECT_TRUE(matches_reference(out, x, wf.values(), M, N, K)) << qfmt(q).name;
}

TEST(QuantMatmul, MatchesDequantizeThenGemm) {
  FOR_EACH_VARIANT(kOp) {
    for (ks_qtype_t q : {KS_QTYPE_Q4_0, KS_QTYPE_Q4_1, KS_QTYPE_Q8_0}) via_dequantize_case(q);
  }
}

void batch_invariance_case(ks_qtype_t q, DType dt) {
  // Row m of an M-row call equals the 1-row call on x[m], bit for bit.
  const int64_t M = 17, N = 11, K = 576;
  Buf w = make_packed(q, N, K);
  Buf x(dt, {M, K});
  kstest::fill_normal(x);
  Buf out(dt, {M, N});
  out.poison();
  KS_RUN_OR_SKIP(run_qmm(out, x, w, q));
  const size_t es = ks::dtype_size(dt);
  for (int64_t m : {int64_t(0), int64_t(8), M - 1}) {
    Buf x1(dt, {1, K}, 1), o1(dt, {1, N}, 2);
    std::memcpy(x1.data(), static_cast<uint8_t*>(x.data()) + size_t(m * K) * es, size_t(K) * es);
    o1.poison();
    KS_RUN_OR_SKIP(run_qmm(o1, x1, w, q));
    EXPECT_EQ(0, std::memcmp(o1.data(), static_cast<uint8_t*>(out.data()) + size_t(m * N) * es, size_t(N) * es))
        << qfmt(q).name << " " << dt_name(dt) << " row " << m;
  }
}

TEST(QuantMatmul, RowsAreIndependentOfBatch) {
  FOR_EACH_VARIANT(kOp) {
    for (ks_qtype_t q : {KS_QTYPE_Q4_1, KS_QTYPE_Q8_0})
      for (DType dt : kFloatTypes()) batch_invariance_case(q, dt);
  }
}

TEST(QuantMatmul, PinnedVariantThatCannotRunWritesNothing) {
  // ks_force_variant: a pinned variant that declines a call fails it with
  // BACKEND_UNAVAILABLE naming the op, and writes nothing; if it accepts, it is correct.
  for (const std::string& v : variants_of(kOp)) {
    if (v.empty() || v == "cpu_reference") continue;
    for (ks_qtype_t q : {KS_QTYPE_F16, KS_QTYPE_Q8_0})
      for (DType dt : {DType::F16, DType::BF16}) {
        Buf w = make_packed(q, 5, 64);
        const auto wd = decode_all(q, w, 64);
        Buf x(dt, {3, 64});
        kstest::fill_normal(x);
        Buf out(dt, {3, 5});
        out.poison();
        ASSERT_EQ(ks_force_variant(kOp, v.c_str()), KS_SUCCESS) << ks_last_error();
        Snap s{&out, &x, &w};
        const ks_status_t st = run_qmm(out, x, w, q);
        const std::string msg = ks_last_error();
        ks_force_variant(kOp, nullptr);
        if (st == KS_SUCCESS) {
          EXPECT_TRUE(matches_reference(out, x, wd, 3, 5, 64)) << v;
        } else {
          EXPECT_EQ(st, KS_ERROR_BACKEND_UNAVAILABLE) << v << ": " << msg;
          EXPECT_NE(msg.find(kOp), std::string::npos) << msg;
          EXPECT_TRUE(s.same()) << v << " declined but wrote";
        }
      }
  }
}

TEST(QuantMatmul, ZeroMOrNIsANoOp) {
  {
    Buf w = make_packed(KS_QTYPE_Q8_0, 3, 64);
    Buf x(DType::F16, {0, 64}), out(DType::F16, {0, 3});
    Snap s{&out, &w, &x};
    EXPECT_EQ(run_qmm(out, x, w, KS_QTYPE_Q8_0), KS_SUCCESS) << ks_last_error();
    EXPECT_TRUE(s.same());
  }
  {
    Buf w(DType::U8, {0, 36});
    Buf x(DType::F32, {2, 64}), out(DType::F32, {2, 0});
    kstest::fill_normal(x);
    Snap s{&out, &w, &x};
    EXPECT_EQ(run_qmm(out, x, w, KS_QTYPE_Q4_0), KS_SUCCESS) << ks_last_error();
    EXPECT_TRUE(s.same());
    // Still validated with zero N: the wrong bytes per row (Q4_1 needs 40) is rejected.
    EXPECT_TRUE(fails_cleanly(run_qmm(out, x, w, KS_QTYPE_Q4_1), KS_ERROR_INVALID_ARGUMENT, kOp, "weight", s));
  }
}

TEST(QuantMatmul, CommonTensorRules) {
  for (DType dt : kFloatTypes()) {
    Buf w = make_packed(KS_QTYPE_Q4_0, 5, 64);
    Buf x(dt, {3, 64});
    kstest::fill_normal(x);
    Buf out(dt, {3, 5});
    out.poison();
    check_common_rules(kOp,
                       {{"out", &out, false, {other_float(dt), kI32}},
                        {"x", &x, false, {kI32, kU8, kI16}},
                        {"weight", &w, false, {DLDataType{kDLInt, 8, 1}, kF16}}},
                       [&](std::vector<DLTensor*>& t, ks_backend_t be) {
                         return ks_quant_matmul(t[0], t[1], t[2], KS_QTYPE_Q4_0, be, nullptr);
                       });
  }
}

TEST(QuantMatmul, RejectsBadArguments) {
  const ks_status_t INV = KS_ERROR_INVALID_ARGUMENT, DT = KS_ERROR_UNSUPPORTED_DTYPE;
  auto expect = [&](Buf& out, Buf& x, Buf& w, ks_qtype_t q, ks_status_t want, const char* arg, const std::string& what) {
    out.poison();
    Snap s{&out, &x, &w};
    EXPECT_TRUE(fails_cleanly(run_qmm(out, x, w, q), want, kOp, arg, s)) << what;
  };
  Buf x(DType::F32, {3, 64});
  kstest::fill_normal(x);
  Buf w = make_packed(KS_QTYPE_Q8_0, 5, 64);
  Buf out(DType::F32, {3, 5});
  for (int q : {0, 7, -3, 1000}) expect(out, x, w, static_cast<ks_qtype_t>(q), INV, "qtype", "qtype " + std::to_string(q));
  for (const auto& f : all_qfmts())
    for (int delta : {-2, 2}) {
      Buf wb(DType::U8, {5, q_row_bytes(f.q, 64) + delta});
      expect(out, x, wb, f.q, INV, "weight", std::string("bytes per row ") + f.name);
    }
  {
    Buf x48(DType::F32, {3, 48});
    kstest::fill_normal(x48);
    Buf w48(DType::U8, {5, 34});
    expect(out, x48, w48, KS_QTYPE_Q8_0, INV, "weight|x", "K 48 not a multiple of 32");
  }
  {
    Buf o2(DType::F32, {5, 3});
    expect(o2, x, w, KS_QTYPE_Q8_0, INV, "out", "out transposed");
    Buf o3(DType::F32, {15});
    expect(o3, x, w, KS_QTYPE_Q8_0, INV, "out", "out 1-D");
  }
  {
    Buf x1(DType::F32, {64});
    kstest::fill_normal(x1);
    Buf o1(DType::F32, {5});
    expect(o1, x1, w, KS_QTYPE_Q8_0, INV, "x", "x 1-D");
    Buf x3(DType::F32, {1, 3, 64});
    kstest::fill_normal(x3);
    Buf o3(DType::F32, {1, 3, 5});
    expect(o3, x3, w, KS_QTYPE_Q8_0, INV, "x", "x 3-D");
  }
  {
    Buf w1(DType::U8, {5 * 68});
    expect(out, x, w1, KS_QTYPE_Q8_0, INV, "weight", "weight 1-D");
  }
  {
    Buf x0(DType::F32, {3, 0});
    Buf w0(DType::U8, {5, 0});
    expect(out, x0, w0, KS_QTYPE_Q8_0, INV, "x", "K = 0");
  }
  for (DType a : kFloatTypes())
    for (DType b : kFloatTypes()) {
      if (a == b) continue;
      Buf xa(a, {3, 64});
      kstest::fill_normal(xa);
      Buf ob(b, {3, 5});
      expect(ob, xa, w, KS_QTYPE_Q8_0, DT, "out|x", "x " + dt_name(a) + " out " + dt_name(b));
    }
}

TEST(QuantMatmul, RejectsOverlap) {
  Buf store(DType::U8, {5 * 34 + 64});
  auto* base = static_cast<uint8_t*>(store.data());
  {
    std::vector<double> v(160);
    for (auto& e : v) e = std::sin(double(&e - v.data()));
    for (int r = 0; r < 5; ++r) encode_row(KS_QTYPE_Q8_0, v.data() + 32 * r, 32, base + 34 * r);
  }
  Buf x(DType::F32, {3, 32});
  kstest::fill_normal(x);
  int64_t ws[2] = {5, 34}, os[2] = {3, 5};
  DLTensor w = store.dl(), o = store.dl(), xx = x.dl();
  w.ndim = 2;
  w.shape = ws;
  o.ndim = 2;
  o.shape = os;
  o.dtype = kF32;
  o.data = base + 160;  // overlaps the last weight row
  Snap s{&store, &x};
  EXPECT_TRUE(fails_cleanly(ks_quant_matmul(&o, &xx, &w, KS_QTYPE_Q8_0, KS_BACKEND_AUTO, nullptr),
                            KS_ERROR_INVALID_ARGUMENT, kOp, "out|weight", s));
  o.data = base + 170;  // right after: fine
  EXPECT_EQ(ks_quant_matmul(&o, &xx, &w, KS_QTYPE_Q8_0, KS_BACKEND_AUTO, nullptr), KS_SUCCESS) << ks_last_error();
  // out overlapping x
  Buf xs(DType::F32, {3 * 32 + 15});
  kstest::fill_normal(xs);
  DLTensor x2 = xs.dl(), o2 = xs.dl();
  int64_t x2s[2] = {3, 32};
  x2.ndim = 2;
  x2.shape = x2s;
  o2.ndim = 2;
  o2.shape = os;
  o2.data = static_cast<float*>(xs.data()) + 90;
  Snap s2{&store, &xs};
  EXPECT_TRUE(fails_cleanly(ks_quant_matmul(&o2, &x2, &w, KS_QTYPE_Q8_0, KS_BACKEND_AUTO, nullptr),
                            KS_ERROR_INVALID_ARGUMENT, kOp, "out|x", s2));
}

}  // namespace
