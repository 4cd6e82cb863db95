// ks_dequantize: GGUF block decoding (F32, F16, BF16, Q4_0, Q4_1, Q8_0) into fp16/bf16/fp32.
// Expected values come from a test-side encoder and an independent FP64 decoder; the
// decoded value of every supported block is exact in FP32 (d, m are f16; d*q needs at most
// 19 bits; d*q + m stays exact for the blocks built here), so the output must equal the
// FP64 value rounded once to the output dtype, bit for bit.
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
