// ks_gemm: out[M, N] = a[M, K] @ b[N, K]^T with FP32 accumulation, against an FP64
// reference. Tolerance: the seed's per-dtype rtol/atol plus the larger of the allowance in
// docs/contracts.md for sums in an unspecified order, 8 sqrt(K) u sum_k |p_k|, and the
// first-order bound of a left-to-right FP32 sum, u (sum_k |p_k| + sum_k |s_k|) (p_k the
// products, s_k the running partial sums, u = 2^-24).
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
namespace {

const char* kOp = "gemm";

ks_status_t run_gemm(Buf& out, Buf& a, Buf& b, ks_backend_t be = KS_BACKEND_AUTO) {
  DLTensor o = out.dl(), x = a.dl(), y = b.dl();
  return ks_gemm(&o, &x, &y, be, nullptr);
}

struct Ref {
  std::vector<double> val, bound;
};

// FP64 a @ b^T from the stored (already rounded) inputs, with the FP32 accumulation bound.
Ref reference(const Buf& a, const Buf& b, int64_t M, int64_t N, int64_t K) {
  Ref r;
  r.val.resize(size_t(M * N));
  r.bound.resize(size_t(M * N));
  const auto av = a.values(), bv = b.values();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double s = 0, err = 0, mag = 0;
      for (int64_t k = 0; k < K; ++k) {
        const double p = av[size_t(m * K + k)] * bv[size_t(n * K + k)];
        s += p;
        err += std::fabs(p) + std::fabs(s);
        mag += std::fabs(p);
      }
      r.val[size_t(m * N + n)] = s;
      r.bound[size_t(m * N + n)] = kU32 * std::max(err, 8.0 * std::sqrt(double(K)) * mag);
    }
  return r;
}

::testing::AssertionResult close(const Buf& out, const Ref& r) {
  const double t = kstest::tol(out.dtype);
  for (int64_t i = 0; i < out.numel(); ++i) {
    const double got = out.get(i), want = r.val[size_t(i)];
    const double lim = t + t * std::fabs(want) + (1 + t) * r.bound[size_t(i)];
    if (!(std::fabs(got - want) <= lim))
      return ::testing::AssertionFailure() << "element " << i << ": got " << got << ", want " << want << " (|diff| "
                                           << std::fabs(got - want) << " > " << lim << ", " << dt_name(out.dtype)
                                           << ")";
  }
  return ::testing::AssertionSuccess();
}

void check_case(DType dt, int64_t M, int64_t N, int64_t K, size_t off_o, size_t off_a, size_t off_b,
                double mean = 0.0) {
  Buf a(dt, {M, K}, off_a), b(dt, {N, K}, off_b), out(dt, {M, N}, off_o);
  kstest::fill_normal(a, 1.0, mean);
  kstest::fill_normal(b, 1.0, mean);
  out.poison();
  Snap in{&a, &b};
  KS_RUN_OR_SKIP(run_gemm(out, a, b));
  EXPECT_TRUE(close(out, reference(a, b, M, N, K))) << dt_name(dt) << " M " << M << " N " << N << " K " << K;
  EXPECT_TRUE(out.guards_intact()) << "wrote outside out";
  EXPECT_TRUE(in.same()) << "inputs modified";
}

TEST(Gemm, OddShapesAllDtypes) {
  const int64_t shapes[][3] = {{1, 1, 1},   {3, 5, 1},    {1, 7, 3},     {7, 13, 33},  {17, 9, 127},
                               {5, 3, 8},   {16, 16, 16}, {33, 17, 65},  {1, 31, 1536}, {2, 3, 4097},
                               {65, 1, 7},  {1, 129, 64}, {31, 33, 576}};
  FOR_EACH_VARIANT(kOp) {
    int idx = 0;
    for (DType dt : kFloatTypes())
      for (auto& s : shapes) {
        ++idx;
        check_case(dt, s[0], s[1], s[2], 0, 0, 0);
        check_case(dt, s[0], s[1], s[2], size_t(idx % 4 + 1), size_t(idx % 3 + 1), size_t(idx % 2 + 1));  // misaligned
      }
  }
}

TEST(Gemm, KOneIsOneRoundedProduct) {
  // With K = 1 each output is a single product: exactly round(a*b) for every dtype.
  FOR_EACH_VARIANT(kOp) {
    for (DType dt : kFloatTypes()) [&] {
      Buf a(dt, {9, 1}, 1), b(dt, {11, 1}, 3), out(dt, {9, 11}, 2);
      kstest::fill_normal(a, 3.0);
      kstest::fill_normal(b, 3.0);
      out.poison();
      KS_RUN_OR_SKIP(run_gemm(out, a, b));
      for (int64_t m = 0; m < 9; ++m)
        for (int64_t n = 0; n < 11; ++n)
          EXPECT_EQ(out.get(m * 11 + n), round_to(dt, a.get(m) * b.get(n))) << dt_name(dt) << " " << m << "," << n;
      EXPECT_TRUE(out.guards_intact());
    }();
  }
}

TEST(Gemm, NonZeroMeanLongK) {
  // Large positive sums: accumulation must be FP32 (an fp16 accumulator would lose or overflow).
  FOR_EACH_VARIANT(kOp) {
    for (DType dt : kFloatTypes()) check_case(dt, 3, 5, 1536, 1, 0, 2, 1.5);
  }
}

TEST(Gemm, Fp16OutputOverflowsToInf) {
  // 64 * 40 * 40 = 102400 > 65504: the FP32 sum is fine, the fp16 output is +inf.
  FOR_EACH_VARIANT(kOp)[&] {
    Buf a(DType::F16, {1, 64}), b(DType::F16, {2, 64}), out(DType::F16, {1, 2});
    for (int k = 0; k < 64; ++k) {
      a.set(k, 40.0);
      b.set(k, 40.0);
      b.set(64 + k, k % 2 ? 40.0 : -40.0);
    }
    out.poison();
    KS_RUN_OR_SKIP(run_gemm(out, a, b));
    EXPECT_EQ(out.get(0), INFINITY);
    EXPECT_EQ(out.get(1), 0.0);
  }();
}

TEST(Gemm, IntermediateSumsPastFp16Range) {
  // Partial sums reach 180000 (> 65504) but the result is 7: FP32 accumulation gives exactly
  // 7 in every dtype; an fp16 accumulator would give inf/NaN.
  FOR_EACH_VARIANT(kOp)
  for (DType dt : kFloatTypes()) [&] {
    Buf a(dt, {2, 5}, 1), b(dt, {1, 5}, 2), out(dt, {2, 1});
    const double av[] = {300, 300, -300, -300, 1}, bv[] = {300, 300, 300, 300, 7};
    for (int k = 0; k < 5; ++k) {
      a.set(k, av[k]);
      a.set(5 + k, -av[k]);
      b.set(k, bv[k]);
    }
    out.poison();
    KS_RUN_OR_SKIP(run_gemm(out, a, b));
    EXPECT_EQ(out.get(0), 7.0) << dt_name(dt);
    EXPECT_EQ(out.get(1), -7.0) << dt_name(dt);
  }();
}

TEST(Gemm, SameStorageForAAndB) {
  // a and b may be the same read-only tensor: out = a @ a^T (symmetric).
  FOR_EACH_VARIANT(kOp)
  for (DType dt : kFloatTypes()) [&] {
    Buf a(dt, {7, 19}, 1), out(dt, {7, 7});
    kstest::fill_normal(a);
    out.poison();
    DLTensor o = out.dl(), x = a.dl(), y = a.dl();
    KS_RUN_OR_SKIP(ks_gemm(&o, &x, &y, KS_BACKEND_AUTO, nullptr));
    EXPECT_TRUE(close(out, reference(a, a, 7, 7, 19)));
    for (int i = 0; i < 7; ++i)
      for (int j = 0; j < 7; ++j) EXPECT_EQ(out.get(i * 7 + j), out.get(j * 7 + i));
  }();
}

TEST(Gemm, ZeroMOrNIsANoOp) {
  for (DType dt : kFloatTypes()) {
    {
      Buf a(dt, {0, 5}), b(dt, {3, 5}), out(dt, {0, 3});
      kstest::fill_normal(b);
      Snap s{&a, &b, &out};
      EXPECT_EQ(run_gemm(out, a, b), KS_SUCCESS) << ks_last_error();
      EXPECT_TRUE(s.same());
    }
    {
      Buf a(dt, {4, 5}), b(dt, {0, 5}), out(dt, {4, 0});
      kstest::fill_normal(a);
      Snap s{&a, &b, &out};
      EXPECT_EQ(run_gemm(out, a, b), KS_SUCCESS) << ks_last_error();
      EXPECT_TRUE(s.same());
    }
    {  // empty tensors may have NULL data
      Buf a(dt, {0, 5}), b(dt, {0, 5}), out(dt, {0, 0});
      DLTensor o = out.dl(), x = a.dl(), y = b.dl();
      o.data = x.data = y.data = nullptr;
      EXPECT_EQ(ks_gemm(&o, &x, &y, KS_BACKEND_AUTO, nullptr), KS_SUCCESS) << ks_last_error();
    }
    {  // M = 0 still validates: K mismatch is rejected
      Buf a(dt, {0, 5}), b(dt, {3, 6}), out(dt, {0, 3});
      Snap s{&a, &b, &out};
      EXPECT_TRUE(fails_cleanly(run_gemm(out, a, b), KS_ERROR_INVALID_ARGUMENT, kOp, "b", s));
    }
    {  // N = 0 still validates: out shape is checked
      Buf a(dt, {4, 5}), b(dt, {0, 5}), out(dt, {0, 4});
      Snap s{&a, &b, &out};
      EXPECT_TRUE(fails_cleanly(run_gemm(out, a, b), KS_ERROR_INVALID_ARGUMENT, kOp, "out", s));
    }
  }
}

TEST(Gemm, ZeroKIsRejected) {
  // K > 0 (an empty feature dimension is rejected), nothing written.
  Buf a(DType::F32, {2, 0}), b(DType::F32, {3, 0}), out(DType::F32, {2, 3});
  out.poison();
  Snap s{&out, &a, &b};
  EXPECT_TRUE(fails_cleanly(run_gemm(out, a, b), KS_ERROR_INVALID_ARGUMENT, kOp, "a", s));
}

void batch_invariance_case(DType dt) {
  // Row m of an M-row call equals the 1-row call on a[m], bit for bit (contract: a row's
  // result does not depend on the number of rows in the call).
  const int64_t M = 37, N = 19, K = 300;
  Buf a(dt, {M, K}), b(dt, {N, K}), out(dt, {M, N});
  kstest::fill_normal(a);
  kstest::fill_normal(b);
  out.poison();
  KS_RUN_OR_SKIP(run_gemm(out, a, b));
  const size_t es = ks::dtype_size(dt);
  for (int64_t m : {int64_t(0), int64_t(17), M - 1}) {
    Buf a1(dt, {1, K}, 3), o1(dt, {1, N}, 1);
    std::memcpy(a1.data(), static_cast<uint8_t*>(a.data()) + size_t(m * K) * es, size_t(K) * es);
    o1.poison();
    KS_RUN_OR_SKIP(run_gemm(o1, a1, b));
    EXPECT_EQ(0, std::memcmp(o1.data(), static_cast<uint8_t*>(out.data()) + size_t(m * N) * es, size_t(N) * es))
        << dt_name(dt) << " row " << m;
  }
}

TEST(Gemm, RowsAreIndependentOfBatch) {
  FOR_EACH_VARIANT(kOp) {
    for (DType dt : kFloatTypes()) batch_invariance_case(dt);
  }
}

TEST(Gemm, CommonTensorRules) {
  for (DType dt : kFloatTypes()) {
    Buf a(dt, {3, 5}), b(dt, {4, 5}), out(dt, {3, 4});
    kstest::fill_normal(a);
    kstest::fill_normal(b);
    out.poison();
    check_common_rules(kOp,
                       {{"out", &out, false, {other_float(dt), kI32}},
                        {"a", &a, false, {kI32, kU8}},
                        {"b", &b, false, {other_float(dt), kI32}}},
                       [&](std::vector<DLTensor*>& t, ks_backend_t be) { return ks_gemm(t[0], t[1], t[2], be, nullptr); });
  }
}

TEST(Gemm, RejectsBadShapes) {
  const ks_status_t INV = KS_ERROR_INVALID_ARGUMENT;
  auto expect = [&](Buf&& out, Buf&& a, Buf&& b, const char* arg, const char* what) {
    kstest::fill_normal(a);
    kstest::fill_normal(b);
    out.poison();
    Snap s{&out, &a, &b};
    EXPECT_TRUE(fails_cleanly(run_gemm(out, a, b), INV, kOp, arg, s)) << what;
  };
  const DType f = DType::F32;
  expect(Buf(f, {3, 4}), Buf(f, {3, 5}), Buf(f, {4, 6}), "b", "K 5 vs 6");
  expect(Buf(f, {4, 3}), Buf(f, {3, 5}), Buf(f, {4, 5}), "out", "out transposed");
  expect(Buf(f, {3, 5}), Buf(f, {3, 5}), Buf(f, {4, 5}), "out", "out N wrong");
  expect(Buf(f, {12}), Buf(f, {3, 5}), Buf(f, {4, 5}), "out", "out 1-D");
  expect(Buf(f, {1, 3, 4}), Buf(f, {3, 5}), Buf(f, {4, 5}), "out", "out 3-D");
  expect(Buf(f, {4}), Buf(f, {5}), Buf(f, {4, 5}), "a", "a 1-D");
  expect(Buf(f, {1, 3, 4}), Buf(f, {1, 3, 5}), Buf(f, {4, 5}), "a", "a 3-D (batched)");
  expect(Buf(f, {3, 4}), Buf(f, {3, 5}), Buf(f, {20}), "b", "b 1-D");
  expect(Buf(f, {3, 4}), Buf(f, {3, 5}), Buf(f, {1, 4, 5}), "b", "b 3-D");
}

TEST(Gemm, RejectsMixedDtypes) {
  for (DType x : kFloatTypes())
    for (DType y : kFloatTypes())
      for (DType z : kFloatTypes()) {
        if (x == y && y == z) continue;
        Buf a(x, {2, 3}), b(y, {2, 3}), out(z, {2, 2});
        kstest::fill_normal(a);
        kstest::fill_normal(b);
        out.poison();
        Snap s{&out, &a, &b};
        EXPECT_TRUE(fails_cleanly(run_gemm(out, a, b), KS_ERROR_UNSUPPORTED_DTYPE, kOp, x != y ? "b" : "out", s))
            << dt_name(x) << "/" << dt_name(y) << "/" << dt_name(z);
      }
}

TEST(Gemm, RejectsOverlap) {
  // out's storage inside a, inside b, and straddling the end of a.
  Buf store(DType::F32, {200});
  kstest::fill_normal(store);
  float* base = static_cast<float*>(store.data());
  int64_t as[2] = {4, 8}, bs[2] = {5, 8}, os[2] = {4, 5};
  auto mk = [&](float* p, int64_t* s) {
    DLTensor t = store.dl();
    t.ndim = 2;
    t.shape = s;
    t.data = p;
    return t;
  };
  for (auto [ooff, arg] : {std::pair{0, "out|a"}, {10, "out|a"}, {30, "out|a"}, {40, "out|b"}, {70, "out|b"}}) {
    DLTensor a = mk(base, as), b = mk(base + 32, bs), o = mk(base + ooff, os);
    Snap s{&store};
    EXPECT_TRUE(fails_cleanly(ks_gemm(&o, &a, &b, KS_BACKEND_AUTO, nullptr), KS_ERROR_INVALID_ARGUMENT, kOp, arg, s))
        << "out at +" << ooff;
  }
  DLTensor a = mk(base, as), b = mk(base + 32, bs), o = mk(base + 72, os);  // right after b: fine
  EXPECT_EQ(ks_gemm(&o, &a, &b, KS_BACKEND_AUTO, nullptr), KS_SUCCESS) << ks_last_error();
}

// A big-enough call for threaded/blocked paths must agree with the reference too.
TEST(Gemm, LargerProblem) {
  FOR_EACH_VARIANT(kOp) {
    for (DType dt : kFloatTypes()) check_case(dt, 67, 45, 515, 2, 1, 3);
  }
}

}  // namespace
