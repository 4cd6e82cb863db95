// Shared harness of the op tests that check every CPU variant and every generic DLTensor
// argument rule: integer buffer access, rounding to a dtype, the variant runner
// (FOR_EACH_VARIANT / KS_RUN_OR_SKIP), clean-failure checks (Snap, fails_cleanly), a
// mutable DLTensor (Dl) and check_common_rules, which runs the argument-validation rules
// shared by all ops for every argument of one op.
//
// A test file says `using namespace kstest::harness;` inside its anonymous namespace; that
// also brings in Buf, rng, kU32 and DType.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "test_util.hpp"

namespace kstest::harness {

using kstest::Buf;
using kstest::has_word;
using kstest::kU32;
using kstest::rng;
using ks::DType;

inline const std::vector<DType>& kFloatTypes() { return kstest::float_dtypes(); }

inline std::string dt_name(DType d) { return ks::dtype_name(d); }

// Random bytes (any bit pattern: NaN payloads, infinities, subnormals).
inline void fill_bytes(Buf& b) {
  std::uniform_int_distribution<int> d(0, 255);
  auto* p = static_cast<uint8_t*>(b.data());
  for (size_t i = 0; i < b.nbytes(); ++i) p[i] = uint8_t(d(rng()));
}

// Exact integer store / load for int32 / int64 buffers.
inline void set_i(Buf& b, int64_t i, int64_t v) {
  auto* p = static_cast<uint8_t*>(b.data());
  if (b.dtype == DType::I32) {
    const int32_t x = int32_t(v);
    std::memcpy(p + 4 * i, &x, 4);
  } else {
    std::memcpy(p + 8 * i, &v, 8);
  }
}
inline int64_t get_i(const Buf& b, int64_t i) {
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

// v rounded to dtype d (through fp32), as a double.
inline double round_to(DType d, double v) {
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
inline thread_local std::string g_variant;  // "" = automatic selection
inline thread_local int g_ran = 0, g_declined = 0;

inline std::vector<std::string> variants_of(const char* op) {
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
  // file/line: where FOR_EACH_VARIANT stands (the trace points at the test, not here).
  Pin(const char* o, const std::string& v, const char* file, int line)
      : op(o), trace(file, line, "variant " + (v.empty() ? std::string("auto") : v)) {
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

#define FOR_EACH_VARIANT(op)                                                \
  for (const std::string& ks_variant_ : ::kstest::harness::variants_of(op)) \
    for (::kstest::harness::Pin ks_pin_(op, ks_variant_, __FILE__, __LINE__); ks_pin_.once();)

// In a void function: run the call; skip the rest if a pinned variant declines it.
#define KS_RUN_OR_SKIP(expr)                                                                            \
  do {                                                                                                  \
    const ks_status_t ks_st_ = (expr);                                                                  \
    const std::string& ks_var_ = ::kstest::harness::g_variant;                                          \
    if (ks_st_ == KS_ERROR_BACKEND_UNAVAILABLE && !ks_var_.empty()) {                                   \
      ++::kstest::harness::g_declined;                                                                  \
      return;                                                                                           \
    }                                                                                                   \
    ++::kstest::harness::g_ran;                                                                         \
    ASSERT_EQ(ks_st_, KS_SUCCESS) << ks_last_error() << " [variant "                                    \
                                  << (ks_var_.empty() ? std::string("auto") : ks_var_) << "]";          \
  } while (0)

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
inline ::testing::AssertionResult fails_cleanly(ks_status_t got, ks_status_t want, const char* op, const std::string& arg,
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
      named = named || has_word(msg, one);
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

inline std::vector<int64_t> compact_strides(const std::vector<int64_t>& shape) {
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
// NULL data, a byte_offset that reaches 2^63, negative dim, ndim -1, NULL shape,
// lanes 2, fp64, the listed wrong dtypes,
// non-contiguous strides, another device; then whole-call rules (CUDA/OpenCL devices,
// unknown backend). Every failure must leave every buffer byte-identical. Explicit
// compact strides (size-1 dims with junk strides) and byte_offset must give the baseline.
inline void check_common_rules(const char* op, std::vector<ArgSpec> args, const Call& call) {
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
    if (numel > 0) {
      expect_fail(n + " NULL data", INV, n, [&](auto& d, auto&) { d[i].t.data = nullptr; }, KS_BACKEND_AUTO);
      // a byte_offset that puts the bytes at 2^63 or past the address space's end (a broken
      // producer's header; it crashed the Python package before the check)
      expect_fail(n + " byte_offset 2^63", INV, n, [&](auto& d, auto&) { d[i].t.byte_offset = uint64_t(1) << 63; },
                  KS_BACKEND_AUTO);
      expect_fail(n + " byte_offset to the address space's end", INV, n,
                  [&](auto& d, auto&) {
                    d[i].t.byte_offset = ~uint64_t(0) - uint64_t(reinterpret_cast<uintptr_t>(d[i].t.data));
                  },
                  KS_BACKEND_AUTO);
    }
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
inline DLDataType other_float(DType d) {
  switch (d) {
    case DType::F16: return DLDataType{kDLBfloat, 16, 1};
    case DType::BF16: return DLDataType{kDLFloat, 16, 1};
    default: return DLDataType{kDLInt, 32, 1};
  }
}
inline const DLDataType kI32{kDLInt, 32, 1}, kI64{kDLInt, 64, 1}, kU8{kDLUInt, 8, 1}, kF16{kDLFloat, 16, 1},
    kBF16{kDLBfloat, 16, 1}, kF32{kDLFloat, 32, 1}, kI16{kDLInt, 16, 1}, kU32t{kDLUInt, 32, 1};

}  // namespace kstest::harness
