// ks_kv_cache_append: bit-exact row copies into a paged cache by slot_mapping; slot -1
// skipped; the token count comes from slot_mapping (extra k/v rows ignored); any slot
// outside [-1, num_blocks * block_size) rejected before anything is written.
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

const char* kOp = "kv_cache_append";

ks_status_t run_append(Buf& kc, Buf& vc, Buf& k, Buf& v, Buf& slots, ks_backend_t be = KS_BACKEND_AUTO) {
  DLTensor a = kc.dl(), b = vc.dl(), c = k.dl(), d = v.dl(), s = slots.dl();
  return ks_kv_cache_append(&a, &b, &c, &d, &s, be, nullptr);
}

struct KvCase {
  DType dt = DType::F16;
  DType sdt = DType::I64;
  int64_t blocks = 5, bs = 16, kvh = 2, hd = 64;
  int64_t tokens = 9, k_rows = 9;  // k_rows >= tokens: extra rows must be ignored
  int skipped = 2;                 // how many tokens get slot -1
  size_t off = 0;
};

void run_case_one(const KvCase& c) {
  Buf kc(c.dt, {c.blocks, c.bs, c.kvh, c.hd}, c.off), vc(c.dt, {c.blocks, c.bs, c.kvh, c.hd}, c.off + 1);
  Buf k(c.dt, {c.k_rows, c.kvh, c.hd}, c.off + 2), v(c.dt, {c.k_rows, c.kvh, c.hd}, c.off);
  Buf slots(c.sdt, {c.tokens}, c.off + 3);
  fill_bytes(kc);  // any bits: NaN payloads, sNaN, subnormals must survive the copy
  fill_bytes(vc);
  fill_bytes(k);
  fill_bytes(v);
  const int64_t nslots = c.blocks * c.bs;
  ASSERT_LE(c.tokens, nslots);
  std::vector<int64_t> perm(static_cast<size_t>(nslots));
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng());
  // Distinct slots; the very last slot goes first and slot 0 last.
  std::swap(perm[0], *std::find(perm.begin(), perm.end(), nslots - 1));
  if (c.tokens > 1) std::swap(perm[size_t(c.tokens - 1)], *std::find(perm.begin(), perm.end(), int64_t(0)));
  std::vector<int64_t> sm(perm.begin(), perm.begin() + c.tokens);
  for (int i = 0; i < c.skipped && i < c.tokens; ++i) sm[size_t((3 * i + 1) % c.tokens)] = -1;
  for (int64_t t = 0; t < c.tokens; ++t) set_i(slots, t, sm[size_t(t)]);
  const auto kc0 = kc.raw, vc0 = vc.raw;
  Snap in{&k, &v, &slots};
  KS_RUN_OR_SKIP(run_append(kc, vc, k, v, slots));
  // Expected cache: the original bytes with rows replaced at mapped slots.
  const size_t row = size_t(c.kvh * c.hd) * ks::dtype_size(c.dt);
  auto want_k = kc0, want_v = vc0;
  for (int64_t t = 0; t < c.tokens; ++t) {
    if (sm[size_t(t)] < 0) continue;
    std::memcpy(want_k.data() + kc.offset + size_t(sm[size_t(t)]) * row,
                static_cast<const uint8_t*>(k.data()) + size_t(t) * row, row);
    std::memcpy(want_v.data() + vc.offset + size_t(sm[size_t(t)]) * row,
                static_cast<const uint8_t*>(v.data()) + size_t(t) * row, row);
  }
  const std::string what = dt_name(c.dt) + " slots " + dt_name(c.sdt) + " blocks " + std::to_string(c.blocks) +
                           " bs " + std::to_string(c.bs) + " tokens " + std::to_string(c.tokens) + " k_rows " +
                           std::to_string(c.k_rows);
  for (int64_t s = 0; s < nslots; ++s) {
    EXPECT_EQ(0, std::memcmp(kc.raw.data() + kc.offset + size_t(s) * row, want_k.data() + kc.offset + size_t(s) * row, row))
        << "k_cache slot " << s << " " << what;
    EXPECT_EQ(0, std::memcmp(vc.raw.data() + vc.offset + size_t(s) * row, want_v.data() + vc.offset + size_t(s) * row, row))
        << "v_cache slot " << s << " " << what;
  }
  EXPECT_TRUE(kc.guards_intact() && vc.guards_intact()) << what;
  EXPECT_TRUE(in.same()) << "inputs modified: " << what;
}

// Every case runs under each CPU variant (automatic choice first).
void run_case(const KvCase& c) {
  FOR_EACH_VARIANT(kOp) run_case_one(c);
}

TEST(KvCacheAppend, BitExactCopiesAllDtypes) {
  for (DType dt : kFloatTypes())
    for (DType sdt : {DType::I32, DType::I64}) {
      KvCase c;
      c.dt = dt;
      c.sdt = sdt;
      run_case(c);
    }
}

TEST(KvCacheAppend, BlockSizes) {
  for (int64_t bs : {1, 7, 16})
    for (DType dt : kFloatTypes()) {
      KvCase c;
      c.dt = dt;
      c.bs = bs;
      c.blocks = bs == 1 ? 23 : 4;
      c.tokens = bs == 1 ? 20 : 11;
      c.k_rows = c.tokens;
      c.kvh = 3;
      c.hd = 40;
      run_case(c);
    }
}

TEST(KvCacheAppend, OddRowSizesAndMisalignedViews) {
  for (DType dt : kFloatTypes())
    for (int64_t hd : {1, 3, 17, 129}) {
      KvCase c;
      c.dt = dt;
      c.hd = hd;
      c.kvh = 1;
      c.off = 1;
      c.blocks = 3;
      c.bs = 7;
      c.tokens = 13;
      c.k_rows = 13;
      run_case(c);
    }
}

TEST(KvCacheAppend, TokenCountComesFromSlotMapping) {
  // k and v hold more rows than slot_mapping (e.g. a padded CUDA-graph batch): only the
  // first slot_mapping.size() rows are written, the padding rows go nowhere.
  for (DType dt : kFloatTypes())
    for (int64_t extra : {1, 5, 32}) {
      KvCase c;
      c.dt = dt;
      c.tokens = 6;
      c.k_rows = 6 + extra;
      run_case(c);
    }
}

TEST(KvCacheAppend, AllSkippedLeavesCacheUntouched) {
  for (DType sdt : {DType::I32, DType::I64}) {
    KvCase c;
    c.sdt = sdt;
    c.tokens = 4;
    c.k_rows = 4;
    c.skipped = 4;  // every token -1 (positions 1, 0, 3, 2)
    run_case(c);
  }
}

TEST(KvCacheAppend, EmptySlotMappingIsANoOp) {
  Buf kc(DType::F32, {2, 4, 2, 8}), vc(DType::F32, {2, 4, 2, 8}), k(DType::F32, {3, 2, 8}), v(DType::F32, {3, 2, 8});
  Buf slots(DType::I32, {0});
  kstest::fill_normal(kc);
  kstest::fill_normal(vc);
  kstest::fill_normal(k);
  kstest::fill_normal(v);
  Snap s{&kc, &vc, &k, &v, &slots};
  EXPECT_EQ(run_append(kc, vc, k, v, slots), KS_SUCCESS) << ks_last_error();
  EXPECT_TRUE(s.same());
  // Zero tokens still validate: a cache with the wrong head_dim is rejected.
  Buf bad(DType::F32, {2, 4, 2, 9});
  Snap s2{&kc, &bad, &k, &v, &slots};
  EXPECT_TRUE(fails_cleanly(run_append(kc, bad, k, v, slots), KS_ERROR_INVALID_ARGUMENT, kOp, "v_cache", s2));
}

TEST(KvCacheAppend, OutOfRangeSlotRejectedNothingWritten) {
  const int64_t blocks = 3, bs = 4, nslots = blocks * bs;
  for (DType sdt : {DType::I32, DType::I64}) {
    std::vector<int64_t> bad{nslots, nslots + 1, -2, std::numeric_limits<int32_t>::min(),
                             std::numeric_limits<int32_t>::max()};
    if (sdt == DType::I64) {
      bad.push_back(int64_t(1) << 32);         // 0 if truncated to int32
      bad.push_back((int64_t(1) << 32) - 1);   // -1 if truncated to int32
      bad.push_back(std::numeric_limits<int64_t>::min());
      bad.push_back(std::numeric_limits<int64_t>::max());
    }
    for (int64_t b : bad)
      for (int at : {0, 4}) {  // first token, or after valid tokens
        Buf kc(DType::BF16, {blocks, bs, 2, 8}), vc(DType::BF16, {blocks, bs, 2, 8});
        Buf k(DType::BF16, {5, 2, 8}), v(DType::BF16, {5, 2, 8});
        Buf slots(sdt, {5});
        kstest::fill_normal(kc);
        kstest::fill_normal(vc);
        kstest::fill_normal(k);
        kstest::fill_normal(v);
        for (int t = 0; t < 5; ++t) set_i(slots, t, 2 * t + 1);
        set_i(slots, at, b);
        Snap s{&kc, &vc, &k, &v, &slots};
        EXPECT_TRUE(fails_cleanly(run_append(kc, vc, k, v, slots), KS_ERROR_INVALID_ARGUMENT, kOp, "slot_mapping", s))
            << "slot " << b << " at token " << at << " (" << dt_name(sdt) << ")";
      }
  }
  // An invalid slot in a padding row of k (past slot_mapping's length) does not exist: the
  // check only concerns slot_mapping entries. A zero-block cache only accepts -1.
  Buf kc(DType::F16, {0, 4, 1, 8}), vc(DType::F16, {0, 4, 1, 8}), k(DType::F16, {2, 1, 8}), v(DType::F16, {2, 1, 8});
  Buf slots(DType::I64, {2});
  kstest::fill_normal(k);
  kstest::fill_normal(v);
  set_i(slots, 0, -1);
  set_i(slots, 1, -1);
  EXPECT_EQ(run_append(kc, vc, k, v, slots), KS_SUCCESS) << ks_last_error();
  set_i(slots, 1, 0);
  Snap s{&kc, &vc, &k, &v, &slots};
  EXPECT_TRUE(fails_cleanly(run_append(kc, vc, k, v, slots), KS_ERROR_INVALID_ARGUMENT, kOp, "slot_mapping", s));
}

TEST(KvCacheAppend, CommonTensorRules) {
  for (DType dt : kFloatTypes()) {
    Buf kc(dt, {3, 4, 2, 8}), vc(dt, {3, 4, 2, 8}), k(dt, {5, 2, 8}), v(dt, {5, 2, 8}), slots(DType::I64, {5});
    kstest::fill_normal(kc);
    kstest::fill_normal(vc);
    kstest::fill_normal(k);
    kstest::fill_normal(v);
    for (int t = 0; t < 5; ++t) set_i(slots, t, t == 2 ? -1 : 11 - 2 * t);
    check_common_rules(kOp,
                       {{"k_cache", &kc, false, {other_float(dt), kI32}},
                        {"v_cache", &vc, false, {other_float(dt), kU8}},
                        {"k", &k, false, {kI32, kU8}},
                        {"v", &v, false, {other_float(dt), kI16}},
                        {"slot_mapping", &slots, false, {kF32, kU32t, kI16, DLDataType{kDLFloat, 64, 1}}}},
                       [&](std::vector<DLTensor*>& t, ks_backend_t be) {
                         return ks_kv_cache_append(t[0], t[1], t[2], t[3], t[4], be, nullptr);
                       });
  }
}

TEST(KvCacheAppend, RejectsBadShapes) {
  const ks_status_t INV = KS_ERROR_INVALID_ARGUMENT;
  auto expect = [&](Buf& kc, Buf& vc, Buf& k, Buf& v, Buf& slots, const char* arg, const char* what) {
    Snap s{&kc, &vc, &k, &v, &slots};
    EXPECT_TRUE(fails_cleanly(run_append(kc, vc, k, v, slots), INV, kOp, arg, s)) << what;
  };
  const DType f = DType::F32;
  Buf kc(f, {3, 4, 2, 8}), vc(f, {3, 4, 2, 8}), k(f, {5, 2, 8}), v(f, {5, 2, 8}), slots(DType::I32, {5});
  for (Buf* b : {&kc, &vc, &k, &v}) kstest::fill_normal(*b);
  for (int t = 0; t < 5; ++t) set_i(slots, t, t);
  {
    Buf s6(DType::I32, {6});
    for (int t = 0; t < 6; ++t) set_i(s6, t, t);
    expect(kc, vc, k, v, s6, "k|slot_mapping", "6 slots for 5 rows of k");
    Buf s2(DType::I32, {5, 1});
    expect(kc, vc, k, v, s2, "slot_mapping", "slot_mapping 2-D");
  }
  {
    Buf v4(f, {4, 2, 8});
    expect(kc, vc, k, v4, slots, "v", "v has 4 rows, k 5");
    Buf vh(f, {5, 1, 8});
    expect(kc, vc, k, vh, slots, "v", "v heads");
    Buf vd(f, {5, 2, 4});
    expect(kc, vc, k, vd, slots, "v", "v head_dim");
  }
  {
    Buf k2(f, {5, 16});
    Buf v2(f, {5, 16});
    expect(kc, vc, k2, v2, slots, "k", "k 2-D");
  }
  {
    Buf kch(f, {3, 4, 1, 8});
    expect(kch, vc, k, v, slots, "k_cache", "k_cache heads");
    Buf kcd(f, {3, 4, 2, 16});
    expect(kcd, vc, k, v, slots, "k_cache", "k_cache head_dim");
    Buf kc3(f, {12, 2, 8});
    expect(kc3, vc, k, v, slots, "k_cache", "k_cache 3-D");
    Buf kc5(f, {1, 3, 4, 2, 8});
    expect(kc5, vc, k, v, slots, "k_cache", "k_cache 5-D");
    Buf vcb(f, {4, 3, 2, 8});  // same row size and count, different (blocks, block_size)
    expect(kc, vcb, k, v, slots, "v_cache", "v_cache (4, 3) vs k_cache (3, 4)");
    Buf vcn(f, {2, 4, 2, 8});
    expect(kc, vcn, k, v, slots, "v_cache", "v_cache fewer blocks");
  }
}

TEST(KvCacheAppend, RejectsMixedDtypes) {
  for (DType a : kFloatTypes())
    for (DType b : kFloatTypes()) {
      if (a == b) continue;
      for (int which = 0; which < 3; ++which) {  // v, k_cache, v_cache in dtype b
        Buf kc(which == 1 ? b : a, {2, 4, 1, 8}), vc(which == 2 ? b : a, {2, 4, 1, 8});
        Buf k(a, {3, 1, 8}), v(which == 0 ? b : a, {3, 1, 8}), slots(DType::I64, {3});
        for (int t = 0; t < 3; ++t) set_i(slots, t, t);
        Snap s{&kc, &vc, &k, &v, &slots};
        const char* arg = which == 0 ? "v" : which == 1 ? "k_cache" : "v_cache";
        EXPECT_TRUE(fails_cleanly(run_append(kc, vc, k, v, slots), KS_ERROR_UNSUPPORTED_DTYPE, kOp, arg, s))
            << dt_name(a) << " vs " << dt_name(b) << " in " << arg;
      }
    }
}

TEST(KvCacheAppend, RejectsOverlap) {
  const int64_t n = 2 * 4 * 1 * 8;  // one cache's elements
  Buf store(DType::F16, {3 * n});
  kstest::fill_normal(store);
  Buf k(DType::F16, {3, 1, 8}), v(DType::F16, {3, 1, 8}), slots(DType::I32, {3});
  kstest::fill_normal(k);
  kstest::fill_normal(v);
  for (int t = 0; t < 3; ++t) set_i(slots, t, t);
  auto cache_at = [&](int64_t elem) {
    Dl d(store);
    d.set_shape({2, 4, 1, 8});
    d.t.data = static_cast<uint16_t*>(store.data()) + elem;
    return d;
  };
  DLTensor kk = k.dl(), vv = v.dl(), ss = slots.dl();
  Snap s{&store, &k, &v, &slots};
  {
    Dl kc = cache_at(0), vc = cache_at(0);  // the same cache for k and v
    EXPECT_TRUE(fails_cleanly(ks_kv_cache_append(kc.p(), vc.p(), &kk, &vv, &ss, KS_BACKEND_AUTO, nullptr),
                              KS_ERROR_INVALID_ARGUMENT, kOp, "k_cache|v_cache", s));
  }
  {
    Dl kc = cache_at(0), vc = cache_at(n - 1);  // one element shared
    EXPECT_TRUE(fails_cleanly(ks_kv_cache_append(kc.p(), vc.p(), &kk, &vv, &ss, KS_BACKEND_AUTO, nullptr),
                              KS_ERROR_INVALID_ARGUMENT, kOp, "k_cache|v_cache", s));
  }
  {  // k inside k_cache; v inside v_cache; slot_mapping inside a cache
    Dl kc = cache_at(0), vc = cache_at(n);
    Dl kin(store);
    kin.set_shape({3, 1, 8});
    kin.t.data = static_cast<uint16_t*>(store.data()) + 8;
    EXPECT_TRUE(fails_cleanly(ks_kv_cache_append(kc.p(), vc.p(), kin.p(), &vv, &ss, KS_BACKEND_AUTO, nullptr),
                              KS_ERROR_INVALID_ARGUMENT, kOp, "k_cache|k", s));
    Dl vin(store);
    vin.set_shape({3, 1, 8});
    vin.t.data = static_cast<uint16_t*>(store.data()) + n + 40;
    EXPECT_TRUE(fails_cleanly(ks_kv_cache_append(kc.p(), vc.p(), &kk, vin.p(), &ss, KS_BACKEND_AUTO, nullptr),
                              KS_ERROR_INVALID_ARGUMENT, kOp, "v_cache|v", s));
    Dl kx(store);  // k inside v_cache
    kx.set_shape({3, 1, 8});
    kx.t.data = static_cast<uint16_t*>(store.data()) + n + 2;
    EXPECT_TRUE(fails_cleanly(ks_kv_cache_append(kc.p(), vc.p(), kx.p(), &vv, &ss, KS_BACKEND_AUTO, nullptr),
                              KS_ERROR_INVALID_ARGUMENT, kOp, "v_cache|k", s));
    Dl sin_(store);
    sin_.set_shape({3});
    sin_.t.dtype = kI32;
    sin_.t.data = static_cast<uint16_t*>(store.data()) + 4;
    EXPECT_TRUE(fails_cleanly(ks_kv_cache_append(kc.p(), vc.p(), &kk, &vv, sin_.p(), KS_BACKEND_AUTO, nullptr),
                              KS_ERROR_INVALID_ARGUMENT, kOp, "k_cache|slot_mapping", s));
  }
  {  // adjacent, disjoint caches are fine
    Dl kc = cache_at(0), vc = cache_at(n);
    EXPECT_EQ(ks_kv_cache_append(kc.p(), vc.p(), &kk, &vv, &ss, KS_BACKEND_AUTO, nullptr), KS_SUCCESS)
        << ks_last_error();
  }
}

TEST(KvCacheAppend, ManyTokens) {
  // A prefill-sized append: every row lands, nothing else moves.
  KvCase c;
  c.dt = DType::BF16;
  c.blocks = 40;
  c.bs = 16;
  c.kvh = 8;
  c.hd = 128;
  c.tokens = 600;
  c.k_rows = 611;
  c.skipped = 7;
  c.off = 1;
  run_case(c);
}

}  // namespace
