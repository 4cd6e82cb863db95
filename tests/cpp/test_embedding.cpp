// ks_embedding: dense tables (rows copied bit-exactly, whatever the bits), packed GGUF
// tables (decoded per an independent FP64 decoder, rounded once to out's dtype), ids int32
// and int64 of any shape, out-of-range ids rejected before anything is written, and every
// validation rule.
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

const char* kOp = "embedding";

ks_status_t run_emb(Buf& out, Buf& ids, Buf& table, ks_qtype_t fmt, ks_backend_t be = KS_BACKEND_AUTO) {
  DLTensor o = out.dl(), i = ids.dl(), t = table.dl();
  return ks_embedding(&o, &i, &t, fmt, be, nullptr);
}

std::vector<int64_t> with_hidden(std::vector<int64_t> s, int64_t h) {
  s.push_back(h);
  return s;
}

// Random ids in [0, vocab), always including 0 and vocab - 1 when there is room, and repeats.
void fill_ids(Buf& ids, int64_t vocab) {
  std::uniform_int_distribution<int64_t> d(0, vocab - 1);
  const int64_t n = ids.numel();
  for (int64_t i = 0; i < n; ++i) set_i(ids, i, d(rng()));
  if (n > 0) set_i(ids, 0, vocab - 1);
  if (n > 1) set_i(ids, n - 1, 0);
  if (n > 3) set_i(ids, 2, get_i(ids, 1));
}

// Dense: every output row must be the table row's bytes, exactly.
void check_dense(DType dt, DType idt, std::vector<int64_t> ids_shape, int64_t vocab, int64_t hidden, size_t off_out,
                 size_t off_ids, size_t off_table) {
  Buf table(dt, {vocab, hidden}, off_table);
  fill_bytes(table);  // NaN payloads, signaling NaNs, subnormals, infinities: all must survive
  Buf ids(idt, ids_shape, off_ids);
  fill_ids(ids, vocab);
  Buf out(dt, with_hidden(ids_shape, hidden), off_out);
  out.poison();
  Snap in{&table, &ids};
  KS_RUN_OR_SKIP(run_emb(out, ids, table, KS_QTYPE_NONE));
  const size_t row = size_t(hidden) * ks::dtype_size(dt);
  for (int64_t i = 0; i < ids.numel(); ++i) {
    const int64_t id = get_i(ids, i);
    EXPECT_EQ(0, std::memcmp(static_cast<const uint8_t*>(out.data()) + size_t(i) * row,
                             static_cast<const uint8_t*>(table.data()) + size_t(id) * row, row))
        << dt_name(dt) << " ids " << dt_name(idt) << ": output row " << i << " (id " << id << ") is not bit-exact";
  }
  EXPECT_TRUE(out.guards_intact());
  EXPECT_TRUE(in.same()) << "inputs modified";
}

TEST(Embedding, DenseRowsAreBitExact) {
  FOR_EACH_VARIANT(kOp)
  for (DType dt : kFloatTypes())
    for (DType idt : {DType::I32, DType::I64}) {
      check_dense(dt, idt, {5}, 11, 64, 0, 0, 0);
      check_dense(dt, idt, {2, 3}, 7, 33, 0, 0, 0);    // ids of shape (2, 3): out (2, 3, hidden)
      check_dense(dt, idt, {1}, 1, 1, 0, 0, 0);        // one row, one column
      check_dense(dt, idt, {37}, 50, 4099, 1, 3, 2);   // misaligned views, wide odd rows
      check_dense(dt, idt, {2, 2, 2}, 9, 17, 3, 1, 1); // 3-D ids
    }
}

TEST(Embedding, ScalarIdGivesOneRow) {
  // ids 0-d: out has shape (hidden,).
  FOR_EACH_VARIANT(kOp)
  for (DType idt : {DType::I32, DType::I64}) [&] {
    Buf table(DType::F32, {6, 10});
    kstest::fill_normal(table);
    Buf ids(idt, {});
    set_i(ids, 0, 4);
    Buf out(DType::F32, {10});
    out.poison();
    KS_RUN_OR_SKIP(run_emb(out, ids, table, KS_QTYPE_NONE));
    EXPECT_EQ(0, std::memcmp(out.data(), static_cast<const float*>(table.data()) + 40, 40));
    EXPECT_TRUE(out.guards_intact());
  }();
}

TEST(Embedding, PackedTablesAllFormats) {
  FOR_EACH_VARIANT(kOp) {
  int idx = 0;
  for (const auto& f : all_qfmts())
    for (DType dt : kFloatTypes())
      for (DType idt : {DType::I32, DType::I64}) [&] {
        const int64_t hidden = f.block == 1 ? (idx % 2 ? 33 : 96) : (idx % 2 ? 576 : 64);
        const int64_t vocab = 13;
        ++idx;
        Buf table = make_packed(f.q, vocab, hidden, nullptr, size_t(idx % 3), 0.5 + idx % 4);
        const auto ref = decode_all(f.q, table, hidden);
        std::vector<int64_t> ids_shape = idx % 3 == 0 ? std::vector<int64_t>{2, 3} : std::vector<int64_t>{7};
        Buf ids(idt, ids_shape, size_t(idx % 2));
        fill_ids(ids, vocab);
        Buf out(dt, with_hidden(ids_shape, hidden), size_t(idx % 4));
        out.poison();
        Snap in{&table, &ids};
        KS_RUN_OR_SKIP(run_emb(out, ids, table, f.q));
        for (int64_t i = 0; i < ids.numel(); ++i) {
          const int64_t id = get_i(ids, i);
          for (int64_t j = 0; j < hidden; ++j) {
            const double want = round_to(dt, ref[size_t(id * hidden + j)]);
            const double got = out.get(i * hidden + j);
            ASSERT_EQ(got, want) << f.name << " -> " << dt_name(dt) << " ids " << dt_name(idt) << " row " << i
                                 << " (id " << id << ") col " << j;
          }
        }
        EXPECT_TRUE(out.guards_intact());
        EXPECT_TRUE(in.same());
      }();
  }
}

TEST(Embedding, PackedKnownQ8_0Row) {
  // One Q8_0 block per row, d = 0.5 (0x3800), q_j = j - 16 for row 0 and 16 - j for row 1.
  Buf table(DType::U8, {2, 34});
  auto* p = static_cast<uint8_t*>(table.data());
  for (int r = 0; r < 2; ++r) {
    p[34 * r] = 0x00;
    p[34 * r + 1] = 0x38;
    for (int j = 0; j < 32; ++j) p[34 * r + 2 + j] = uint8_t(int8_t(r == 0 ? j - 16 : 16 - j));
  }
  Buf ids(DType::I64, {3});
  set_i(ids, 0, 1);
  set_i(ids, 1, 0);
  set_i(ids, 2, 1);
  FOR_EACH_VARIANT(kOp)
  for (DType dt : kFloatTypes()) [&] {
    Buf out(dt, {3, 32}, 1);
    out.poison();
    KS_RUN_OR_SKIP(run_emb(out, ids, table, KS_QTYPE_Q8_0));
    for (int j = 0; j < 32; ++j) {
      EXPECT_EQ(out.get(j), 0.5 * (16 - j)) << dt_name(dt);
      EXPECT_EQ(out.get(32 + j), 0.5 * (j - 16)) << dt_name(dt);
      EXPECT_EQ(out.get(64 + j), 0.5 * (16 - j)) << dt_name(dt);
    }
  }();
}

TEST(Embedding, OutOfRangeIdsRejectedNothingWritten) {
  const int64_t vocab = 10, hidden = 32;
  for (DType idt : {DType::I32, DType::I64})
    for (ks_qtype_t fmt : {KS_QTYPE_NONE, KS_QTYPE_Q4_1}) {
      std::vector<int64_t> bad{-1, vocab, vocab + 1, std::numeric_limits<int32_t>::min(),
                               std::numeric_limits<int32_t>::max()};
      if (idt == DType::I64) {
        bad.push_back((int64_t(1) << 32) + 1);  // truncates to 1 as int32: must still be rejected
        bad.push_back(std::numeric_limits<int64_t>::min());
        bad.push_back(std::numeric_limits<int64_t>::max());
        bad.push_back(-(int64_t(1) << 32));     // truncates to 0 as int32
      }
      for (int64_t b : bad)
        for (int pos : {0, 5}) {  // first id, or the last id after valid ones
          Buf table = fmt == KS_QTYPE_NONE ? Buf(DType::F16, {vocab, hidden}) : make_packed(fmt, vocab, hidden);
          if (fmt == KS_QTYPE_NONE) kstest::fill_normal(table);
          Buf ids(idt, {2, 3});
          fill_ids(ids, vocab);
          set_i(ids, pos, b);
          Buf out(DType::F16, {2, 3, hidden});
          out.poison();
          Snap s{&out, &ids, &table};
          EXPECT_TRUE(fails_cleanly(run_emb(out, ids, table, fmt), KS_ERROR_INVALID_ARGUMENT, kOp, "ids", s))
              << "id " << b << " at " << pos << " (" << dt_name(idt) << ", format " << int(fmt) << ")";
        }
    }
}

TEST(Embedding, EmptyIdsIsANoOp) {
  for (ks_qtype_t fmt : {KS_QTYPE_NONE, KS_QTYPE_Q8_0}) {
    Buf table = fmt == KS_QTYPE_NONE ? Buf(DType::BF16, {4, 32}) : make_packed(fmt, 4, 32);
    Buf ids(DType::I32, {0});
    Buf out(DType::BF16, {0, 32});
    Snap s{&out, &table, &ids};
    EXPECT_EQ(run_emb(out, ids, table, fmt), KS_SUCCESS) << ks_last_error();
    EXPECT_TRUE(s.same());
    // Empty table (vocab 0) and no ids.
    Buf t0 = fmt == KS_QTYPE_NONE ? Buf(DType::BF16, {0, 32}) : Buf(DType::U8, {0, 34});
    EXPECT_EQ(run_emb(out, ids, t0, fmt), KS_SUCCESS) << ks_last_error();
    // Zero ids still validate: a table/out dtype mismatch is rejected.
    if (fmt == KS_QTYPE_NONE) {
      Buf out32(DType::F32, {0, 32});
      EXPECT_TRUE(fails_cleanly(run_emb(out32, ids, table, fmt), KS_ERROR_UNSUPPORTED_DTYPE, kOp, "table|out", s));
    }
  }
  // Any id into an empty table is out of range.
  Buf t0(DType::F32, {0, 8});
  Buf ids(DType::I64, {1});
  set_i(ids, 0, 0);
  Buf out(DType::F32, {1, 8});
  out.poison();
  Snap s{&out};
  EXPECT_TRUE(fails_cleanly(run_emb(out, ids, t0, KS_QTYPE_NONE), KS_ERROR_INVALID_ARGUMENT, kOp, "ids", s));
}

TEST(Embedding, CommonTensorRulesDense) {
  for (DType dt : kFloatTypes())
    for (DType idt : {DType::I32, DType::I64}) {
      Buf table(dt, {9, 16});
      kstest::fill_normal(table);
      Buf ids(idt, {2, 3});
      fill_ids(ids, 9);
      Buf out(dt, {2, 3, 16});
      out.poison();
      check_common_rules(kOp,
                         {{"out", &out, false, {kI32, other_float(dt), kU8}},
                          {"ids", &ids, false, {kF32, kU8, kI16, kU32t, kF16}},
                          {"table", &table, false, {other_float(dt), kU8}}},
                         [&](std::vector<DLTensor*>& t, ks_backend_t be) {
                           return ks_embedding(t[0], t[1], t[2], KS_QTYPE_NONE, be, nullptr);
                         });
    }
}

TEST(Embedding, CommonTensorRulesPacked) {
  for (DType dt : kFloatTypes()) {
    Buf table = make_packed(KS_QTYPE_Q4_0, 9, 64);
    Buf ids(DType::I64, {4});
    fill_ids(ids, 9);
    Buf out(dt, {4, 64});
    out.poison();
    check_common_rules(kOp,
                       {{"out", &out, false, {kI32, kU8}},
                        {"ids", &ids, false, {kF32, kU8, kU32t}},
                        {"table", &table, false, {kF16, DLDataType{kDLInt, 8, 1}}}},
                       [&](std::vector<DLTensor*>& t, ks_backend_t be) {
                         return ks_embedding(t[0], t[1], t[2], KS_QTYPE_Q4_0, be, nullptr);
                       });
  }
}

TEST(Embedding, RejectsBadShapes) {
  const ks_status_t INV = KS_ERROR_INVALID_ARGUMENT;
  auto expect = [&](Buf& out, Buf& ids, Buf& table, ks_qtype_t fmt, ks_status_t want, const char* arg,
                    const char* what) {
    out.poison();
    Snap s{&out, &ids, &table};
    EXPECT_TRUE(fails_cleanly(run_emb(out, ids, table, fmt), want, kOp, arg, s)) << what;
  };
  Buf ids(DType::I32, {2, 3});
  fill_ids(ids, 5);
  {  // out flattened to (6, H) instead of ids.shape + (H,)
    Buf table(DType::F32, {5, 8});
    kstest::fill_normal(table);
    Buf out(DType::F32, {6, 8});
    expect(out, ids, table, KS_QTYPE_NONE, INV, "out", "out (6, 8) for ids (2, 3)");
    Buf out2(DType::F32, {2, 3, 9});
    expect(out2, ids, table, KS_QTYPE_NONE, INV, "table|out", "hidden 9 vs table 8");
    Buf out3(DType::F32, {3, 2, 8});
    expect(out3, ids, table, KS_QTYPE_NONE, INV, "out", "out (3, 2, 8)");
  }
  {  // table not 2-D
    Buf t1(DType::F32, {40});
    Buf t3(DType::F32, {5, 1, 8});
    Buf out(DType::F32, {2, 3, 8});
    expect(out, ids, t1, KS_QTYPE_NONE, INV, "table", "table 1-D");
    expect(out, ids, t3, KS_QTYPE_NONE, INV, "table", "table 3-D");
  }
  {  // out 0-d
    Buf table(DType::F32, {5, 1});
    Buf ids0(DType::I32, {});
    set_i(ids0, 0, 1);
    Buf out(DType::F32, {});
    expect(out, ids0, table, KS_QTYPE_NONE, INV, "out", "out 0-d");
  }
  {  // hidden 0
    Buf table(DType::F32, {5, 0});
    Buf out(DType::F32, {2, 3, 0});
    expect(out, ids, table, KS_QTYPE_NONE, INV, "out|table", "hidden 0");
  }
  {  // dense table dtype differs from out
    Buf table(DType::BF16, {5, 8});
    kstest::fill_normal(table);
    Buf out(DType::F16, {2, 3, 8});
    expect(out, ids, table, KS_QTYPE_NONE, KS_ERROR_UNSUPPORTED_DTYPE, "table|out", "bf16 table, fp16 out");
  }
  {  // packed: hidden not a multiple of 32, wrong bytes per row, float table
    Buf t(DType::U8, {5, 34});
    Buf out(DType::F32, {2, 3, 48});
    expect(out, ids, t, KS_QTYPE_Q8_0, INV, "table|out", "Q8_0 hidden 48");
    for (const auto& f : all_qfmts()) {
      Buf tb(DType::U8, {5, q_row_bytes(f.q, 64) + 1});
      Buf o(DType::F32, {2, 3, 64});
      expect(o, ids, tb, f.q, INV, "table", f.name);
    }
    Buf tf(DType::F32, {5, 17});  // 68 bytes would be Q8_0 64 columns, but the dtype is float
    Buf o(DType::F32, {2, 3, 64});
    expect(o, ids, tf, KS_QTYPE_Q8_0, KS_ERROR_UNSUPPORTED_DTYPE, "table", "float table for Q8_0");
  }
}

TEST(Embedding, RejectsUnknownTableFormat) {
  Buf table = make_packed(KS_QTYPE_Q8_0, 4, 32);
  Buf ids(DType::I32, {2});
  fill_ids(ids, 4);
  Buf out(DType::F32, {2, 32});
  out.poison();
  for (int fmt : {7, -1, 99}) {
    Snap s{&out, &ids, &table};
    EXPECT_TRUE(fails_cleanly(run_emb(out, ids, table, static_cast<ks_qtype_t>(fmt)), KS_ERROR_INVALID_ARGUMENT, kOp,
                              "table_format", s))
        << "table_format " << fmt;
  }
}

TEST(Embedding, RejectsOverlap) {
  // out inside the table
  Buf store(DType::F32, {64});
  kstest::fill_normal(store);
  Buf ids(DType::I32, {2});
  set_i(ids, 0, 1);
  set_i(ids, 1, 2);
  DLTensor t = store.dl(), o = store.dl(), i = ids.dl();
  int64_t ts[2] = {8, 4}, os[2] = {2, 4};
  t.ndim = 2;
  t.shape = ts;
  o.ndim = 2;
  o.shape = os;
  o.data = static_cast<float*>(store.data()) + 28;  // overlaps table row 7
  Snap s{&store, &ids};
  EXPECT_TRUE(fails_cleanly(ks_embedding(&o, &i, &t, KS_QTYPE_NONE, KS_BACKEND_AUTO, nullptr),
                            KS_ERROR_INVALID_ARGUMENT, kOp, "out|table", s));
  // out just past the table is fine.
  o.data = static_cast<float*>(store.data()) + 32;
  EXPECT_EQ(ks_embedding(&o, &i, &t, KS_QTYPE_NONE, KS_BACKEND_AUTO, nullptr), KS_SUCCESS) << ks_last_error();
  EXPECT_EQ(0, std::memcmp(static_cast<float*>(store.data()) + 32, static_cast<float*>(store.data()) + 4, 32));
  // out overlapping ids
  Buf both(DType::I32, {16});
  set_i(both, 0, 0);
  set_i(both, 1, 1);
  DLTensor ii = both.dl(), oo = both.dl(), tt = store.dl();
  int64_t is[1] = {2}, oos[2] = {2, 4};
  ii.shape = is;
  oo.ndim = 2;
  oo.shape = oos;
  oo.dtype = kF32;
  oo.data = static_cast<int32_t*>(both.data()) + 1;
  tt.ndim = 2;
  tt.shape = ts;
  Snap s2{&store, &both};
  EXPECT_TRUE(fails_cleanly(ks_embedding(&oo, &ii, &tt, KS_QTYPE_NONE, KS_BACKEND_AUTO, nullptr),
                            KS_ERROR_INVALID_ARGUMENT, kOp, "out|ids", s2));
}

// A batch big enough for threaded paths: every row still exact.
void large_batch_case() {
  const int64_t vocab = 257, hidden = 1536, n = 300;
  Buf table = make_packed(KS_QTYPE_Q4_0, vocab, hidden);
  const auto ref = decode_all(KS_QTYPE_Q4_0, table, hidden);
  Buf ids(DType::I64, {n});
  fill_ids(ids, vocab);
  Buf out(DType::BF16, {n, hidden}, 2);
  out.poison();
  KS_RUN_OR_SKIP(run_emb(out, ids, table, KS_QTYPE_Q4_0));
  int bad = 0;
  for (int64_t i = 0; i < n && bad < 5; ++i)
    for (int64_t j = 0; j < hidden; ++j) {
      const double want = round_to(DType::BF16, ref[size_t(get_i(ids, i) * hidden + j)]);
      if (out.get(i * hidden + j) != want) {
        ADD_FAILURE() << "row " << i << " col " << j << ": got " << out.get(i * hidden + j) << " want " << want;
        ++bad;
        break;
      }
    }
  EXPECT_TRUE(out.guards_intact());
}

TEST(Embedding, LargeBatchPacked) {
  FOR_EACH_VARIANT(kOp) large_batch_case();
}

}  // namespace
