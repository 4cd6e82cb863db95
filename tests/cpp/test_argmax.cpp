// ks_argmax: out[r] = first index of the maximum of x[r, :] (int64). Ties -> lowest index;
// a row holding NaN -> index of its first NaN (torch.argmax); -inf rows -> 0.
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
#include <thread>
namespace {

const char* kOp = "argmax";

ks_status_t run_argmax(Buf& out, Buf& x, ks_backend_t be = KS_BACKEND_AUTO) {
  DLTensor o = out.dl(), a = x.dl();
  return ks_argmax(&o, &a, be, nullptr);
}

// Reference on the stored values (as doubles: exact for every float dtype).
int64_t ref_argmax(const Buf& x, int64_t r, int64_t V) {
  int64_t best = 0;
  double bv = x.get(r * V);
  for (int64_t i = 0; i < V; ++i) {
    const double v = x.get(r * V + i);
    if (std::isnan(v)) return i;
    if (v > bv) bv = v, best = i;
  }
  return best;
}

void check_rows_one(Buf& x, size_t off_out, const std::string& what) {
  const int64_t rows = x.shape[0], V = x.shape[1];
  Buf out(DType::I64, {rows}, off_out);
  out.poison();
  Snap in{&x};
  KS_RUN_OR_SKIP(run_argmax(out, x));
  for (int64_t r = 0; r < rows; ++r)
    EXPECT_EQ(get_i(out, r), ref_argmax(x, r, V)) << what << " row " << r << " (" << dt_name(x.dtype) << ")";
  EXPECT_TRUE(out.guards_intact()) << what;
  EXPECT_TRUE(in.same()) << "x modified: " << what;
}

// Under each CPU variant (automatic choice first).
void check_rows(Buf& x, size_t off_out, const std::string& what) {
  FOR_EACH_VARIANT(kOp) check_rows_one(x, off_out, what);
}

// Build a [rows, V] tensor from explicit rows (values set with rounding to the dtype).
Buf rows_of(DType dt, const std::vector<std::vector<double>>& rows, size_t off = 0) {
  const int64_t V = int64_t(rows[0].size());
  Buf x(dt, {int64_t(rows.size()), V}, off);
  for (size_t r = 0; r < rows.size(); ++r)
    for (int64_t i = 0; i < V; ++i) x.set(int64_t(r) * V + i, rows[r][size_t(i)]);
  return x;
}

const double kInf = std::numeric_limits<double>::infinity();
const double kNaN = std::numeric_limits<double>::quiet_NaN();

void expect_rows_one(DType dt, const std::vector<std::vector<double>>& rows, const std::vector<int64_t>& want,
                     const std::string& what) {
  Buf x = rows_of(dt, rows, 1);
  Buf out(DType::I64, {int64_t(rows.size())}, 3);
  out.poison();
  KS_RUN_OR_SKIP(run_argmax(out, x));
  for (size_t r = 0; r < rows.size(); ++r)
    EXPECT_EQ(get_i(out, int64_t(r)), want[r]) << what << " row " << r << " (" << dt_name(dt) << ")";
  EXPECT_TRUE(out.guards_intact());
}

void expect_rows(DType dt, const std::vector<std::vector<double>>& rows, const std::vector<int64_t>& want,
                 const std::string& what) {
  FOR_EACH_VARIANT(kOp) expect_rows_one(dt, rows, want, what);
}

TEST(Argmax, RandomRows) {
  for (DType dt : kFloatTypes())
    for (int64_t V : {1, 2, 3, 31, 32, 33, 255, 1000, 4097}) {
      Buf x(dt, {7, V}, size_t(V % 3));
      kstest::fill_normal(x, 3.0);
      check_rows(x, size_t(V % 5), "V " + std::to_string(V));
    }
}

TEST(Argmax, TiesTakeTheLowestIndex) {
  for (DType dt : kFloatTypes()) {
    expect_rows(dt,
                {{1, 5, 2, 5, 5},
                 {5, 5, 5, 5, 5},
                 {-3, -1, -2, -1, -7},
                 {0, 0, 0, 0, 0},
                 {-0.0, 0.0, -0.0, 0.0, -1},  // -0 == +0: a tie
                 {0.0, -0.0, 0.0, -0.0, -1},
                 {1, 2, 3, 4, 4}},
                {1, 0, 1, 0, 0, 0, 3}, "ties");
    // Values that only tie after rounding to the dtype (fp16 / bf16 ulp at 1000).
    Buf x(dt, {1, 4});
    x.set(0, 999.0);
    x.set(1, 1000.2);
    x.set(2, 1000.0);
    x.set(3, 1000.4);
    check_rows(x, 0, "rounding ties");
  }
}

TEST(Argmax, NaNRowGivesFirstNaN) {
  for (DType dt : kFloatTypes()) {
    expect_rows(dt,
                {{1, kNaN, 5, kNaN},
                 {kNaN, 1, 2, 3},
                 {1, 2, 3, kNaN},
                 {kInf, kNaN, kInf, 0},
                 {9, 8, kNaN, kNaN},
                 {-kInf, -kInf, -kInf, kNaN},
                 {kNaN, kNaN, kNaN, kNaN}},
                {1, 0, 3, 1, 2, 3, 0}, "NaN");
    // A negative NaN (sign bit set) and a NaN with a payload are NaNs too.
    Buf x(dt, {2, 3});
    fill_bytes(x);
    for (int i = 0; i < 6; ++i) x.set(i, double(i));
    auto* p = static_cast<uint8_t*>(x.data());
    const size_t es = ks::dtype_size(dt);
    if (dt == DType::F32) {
      const uint32_t nneg = 0xFFC00001u, snan = 0x7F800001u;
      std::memcpy(p + 1 * es, &nneg, 4);
      std::memcpy(p + 5 * es, &snan, 4);
    } else if (dt == DType::F16) {
      const uint16_t nneg = 0xFE01, snan = 0x7C01;
      std::memcpy(p + 1 * es, &nneg, 2);
      std::memcpy(p + 5 * es, &snan, 2);
    } else {
      const uint16_t nneg = 0xFFC1, snan = 0x7F81;
      std::memcpy(p + 1 * es, &nneg, 2);
      std::memcpy(p + 5 * es, &snan, 2);
    }
    Buf out(DType::I64, {2});
    out.poison();
    ASSERT_EQ(run_argmax(out, x), KS_SUCCESS) << ks_last_error();
    EXPECT_EQ(get_i(out, 0), 1) << dt_name(dt) << " negative NaN";
    EXPECT_EQ(get_i(out, 1), 2) << dt_name(dt) << " signaling NaN";
  }
}

TEST(Argmax, InfinitiesAndExtremes) {
  for (DType dt : kFloatTypes()) {
    expect_rows(dt,
                {{-kInf, -kInf, -kInf, -kInf},
                 {-kInf, -kInf, -5, -kInf},
                 {1, kInf, kInf, 2},
                 {kInf, 1, 2, kInf},
                 {-kInf, -60000, -60000, -kInf}},
                {0, 2, 1, 0, 1}, "inf");
  }
  // Largest finite vs. infinity, subnormals.
  Buf h(DType::F16, {1, 3});
  h.set(0, 65504.0);
  h.set(1, kInf);
  h.set(2, 65504.0);
  check_rows(h, 0, "fp16 max vs inf");
  Buf s(DType::F32, {1, 4});
  s.set(0, 1e-45);
  s.set(1, 3e-45);
  s.set(2, 0.0);
  s.set(3, -1e-45);
  check_rows(s, 0, "fp32 subnormals");
  EXPECT_EQ(ref_argmax(s, 0, 4), 1);
}

TEST(Argmax, VocabWideRow128256) {
  const int64_t V = 128256;
  for (DType dt : kFloatTypes()) {
    Buf x(dt, {4, V}, 2);
    kstest::fill_uniform(x, -8.0, 8.0);
    // Row 0: unique max at the very end. Row 1: unique max at V/2 + 1. Row 2: equal maxima at
    // 70001 and 128255 (lowest wins). Row 3: the max at 0 and again at V-1.
    x.set(0 * V + V - 1, 100.0);
    x.set(1 * V + V / 2 + 1, 100.0);
    x.set(2 * V + 70001, 100.0);
    x.set(2 * V + V - 1, 100.0);
    x.set(3 * V + 0, 100.0);
    x.set(3 * V + V - 1, 100.0);
    Buf out(DType::I64, {4}, 1);
    out.poison();
    ASSERT_EQ(run_argmax(out, x), KS_SUCCESS) << ks_last_error();
    EXPECT_EQ(get_i(out, 0), V - 1) << dt_name(dt);
    EXPECT_EQ(get_i(out, 1), V / 2 + 1) << dt_name(dt);
    EXPECT_EQ(get_i(out, 2), 70001) << dt_name(dt);
    EXPECT_EQ(get_i(out, 3), 0) << dt_name(dt);
    EXPECT_TRUE(out.guards_intact());
    // Without planted values: many near-ties among random fp16/bf16 values; a NaN far out.
    Buf y(dt, {2, V});
    kstest::fill_normal(y, 2.0);
    y.set(1 * V + 120000, kNaN);
    check_rows(y, 0, "wide random");
  }
}

TEST(Argmax, ManyRows) {
  for (DType dt : kFloatTypes()) {
    Buf x(dt, {300, 513}, 1);
    kstest::fill_normal(x);
    check_rows(x, 1, "300 rows");
  }
}

TEST(Argmax, ZeroRowsIsANoOp) {
  for (DType dt : kFloatTypes()) {
    Buf x(dt, {0, 8}), out(DType::I64, {0});
    Snap s{&x, &out};
    EXPECT_EQ(run_argmax(out, x), KS_SUCCESS) << ks_last_error();
    EXPECT_TRUE(s.same());
    DLTensor o = out.dl(), a = x.dl();
    o.data = a.data = nullptr;
    EXPECT_EQ(ks_argmax(&o, &a, KS_BACKEND_AUTO, nullptr), KS_SUCCESS) << ks_last_error();
    // Zero rows still validate: int32 out is rejected.
    Buf o32(DType::I32, {0});
    EXPECT_TRUE(fails_cleanly(run_argmax(o32, x), KS_ERROR_UNSUPPORTED_DTYPE, kOp, "out", s));
  }
}

TEST(Argmax, CommonTensorRules) {
  for (DType dt : kFloatTypes()) {
    Buf x(dt, {3, 17}), out(DType::I64, {3});
    kstest::fill_normal(x);
    out.poison();
    check_common_rules(kOp,
                       {{"out", &out, false, {kI32, kF32, DLDataType{kDLUInt, 64, 1}, kF16}},
                        {"x", &x, false, {kI32, kU8, kI64, kI16}}},
                       [&](std::vector<DLTensor*>& t, ks_backend_t be) { return ks_argmax(t[0], t[1], be, nullptr); });
  }
}

TEST(Argmax, RejectsBadShapes) {
  const ks_status_t INV = KS_ERROR_INVALID_ARGUMENT;
  auto expect = [&](Buf&& out, Buf&& x, const char* arg, const char* what) {
    kstest::fill_normal(x);
    out.poison();
    Snap s{&out, &x};
    EXPECT_TRUE(fails_cleanly(run_argmax(out, x), INV, kOp, arg, s)) << what;
  };
  expect(Buf(DType::I64, {1}), Buf(DType::F32, {9}), "x", "x 1-D");
  expect(Buf(DType::I64, {2}), Buf(DType::F32, {2, 3, 4}), "x", "x 3-D");
  expect(Buf(DType::I64, {}), Buf(DType::F32, {}), "x", "x 0-d");
  expect(Buf(DType::I64, {3}), Buf(DType::F32, {3, 0}), "x", "V = 0");
  expect(Buf(DType::I64, {4}), Buf(DType::F32, {3, 5}), "out", "out too long");
  expect(Buf(DType::I64, {2}), Buf(DType::F32, {3, 5}), "out", "out too short");
  expect(Buf(DType::I64, {3, 1}), Buf(DType::F32, {3, 5}), "out", "out 2-D");
  expect(Buf(DType::I64, {}), Buf(DType::F32, {1, 5}), "out", "out 0-d");
}

TEST(Argmax, RejectsOverlap) {
  Buf store(DType::F32, {40});
  kstest::fill_normal(store);
  Dl x(store), o(store);
  x.set_shape({3, 8});
  o.set_shape({3});
  o.t.dtype = kI64;
  o.t.data = static_cast<float*>(store.data()) + 20;  // inside x (24 floats)
  Snap s{&store};
  EXPECT_TRUE(fails_cleanly(ks_argmax(o.p(), x.p(), KS_BACKEND_AUTO, nullptr), KS_ERROR_INVALID_ARGUMENT, kOp, "out|x", s));
  o.t.data = static_cast<float*>(store.data()) + 24;  // right after x
  EXPECT_EQ(ks_argmax(o.p(), x.p(), KS_BACKEND_AUTO, nullptr), KS_SUCCESS) << ks_last_error();
}

TEST(Argmax, LastErrorIsPerThread) {
  Buf x(DType::F32, {2, 3}), bad_out(DType::I32, {2}), out(DType::I64, {2});
  kstest::fill_normal(x);
  ASSERT_EQ(run_argmax(bad_out, x), KS_ERROR_UNSUPPORTED_DTYPE);
  const std::string mine = ks_last_error();
  EXPECT_NE(mine.find("argmax"), std::string::npos);
  std::string other_before, other_after_fail;
  std::thread th([&] {
    other_before = ks_last_error();  // nothing has failed on this thread
    Buf x2(DType::F32, {1, 0}), o2(DType::I64, {1});
    (void)run_argmax(o2, x2);
    other_after_fail = ks_last_error();
    Buf x3(DType::F32, {1, 4}), o3(DType::I64, {1});
    kstest::fill_normal(x3);
    EXPECT_EQ(run_argmax(o3, x3), KS_SUCCESS);
    EXPECT_STREQ(ks_last_error(), "");
  });
  th.join();
  EXPECT_EQ(other_before, "");
  EXPECT_NE(other_after_fail.find("argmax"), std::string::npos);
  EXPECT_EQ(std::string(ks_last_error()), mine) << "another thread changed this thread's last error";
  ASSERT_EQ(run_argmax(out, x), KS_SUCCESS);
  EXPECT_STREQ(ks_last_error(), "");
}

}  // namespace
