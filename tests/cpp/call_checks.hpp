// Shared checks of the op tests that build their calls by hand (rms_norm, fused_add_rms_norm,
// gemv, silu_and_mul, softmax): success and clean rejection of one call, raw DLTensors over
// any storage, an independent rounding to fp16/bf16/fp32, and the pieces of the per-op
// validation harness (a `Call` that owns its buffers and DLTensors, and expect_reject).
//
// A test file says `using namespace kstest::checks;` inside its anonymous namespace; that
// also brings in Buf, allclose, fill_normal, fill_uniform, tol, kU32 and DType. It then binds the
// checks to its op:
//   const RejectionCheck rejected{kOp};
//   struct Call : XOutCall { ...; ks_status_t call(); };   (or XWeightOutCall, or ShapeStore
//                                                           with its own buffers and bufs())
//   const ExpectReject<Call> expect_reject{rejected};
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "test_util.hpp"

namespace kstest::checks {

using kstest::allclose;
using kstest::Buf;
using kstest::fill_normal;
using kstest::fill_uniform;
using kstest::has_word;
using kstest::kU32;
using kstest::tol;
using ks::DType;

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// Raw bytes (data and guard padding) of each buffer, to compare after a failed call.
inline std::vector<std::vector<uint8_t>> snap(const std::vector<Buf*>& bufs) {
  std::vector<std::vector<uint8_t>> s;
  for (Buf* b : bufs) s.push_back(b->raw);
  return s;
}

// A failed call of `op`: exact status, the message names the op and every listed
// argument, and every buffer (data and guard bytes) is byte-identical.
struct RejectionCheck {
  const char* op;
  ::testing::AssertionResult operator()(ks_status_t got, ks_status_t want, const std::vector<std::string>& args,
                                        const std::vector<Buf*>& bufs,
                                        const std::vector<std::vector<uint8_t>>& before) const {
    const std::string msg = ks_last_error();
    if (got != want)
      return ::testing::AssertionFailure() << "status " << ks_status_name(got) << ", want " << ks_status_name(want)
                                           << " (message: '" << msg << "')";
    if (!has_word(msg, op)) return ::testing::AssertionFailure() << "message does not name the op: '" << msg << "'";
    for (const auto& a : args)
      if (!has_word(msg, a))
        return ::testing::AssertionFailure() << "message does not name '" << a << "': '" << msg << "'";
    for (size_t i = 0; i < bufs.size(); ++i)
      if (bufs[i]->raw != before[i])
        return ::testing::AssertionFailure() << "buffer #" << i << " changed by a failed call ('" << msg << "')";
    return ::testing::AssertionSuccess();
  }
};

inline ::testing::AssertionResult ok(ks_status_t st) {
  if (st == KS_SUCCESS) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << ks_status_name(st) << ": " << ks_last_error();
}

// A CPU DLTensor over any storage (shape storage is `shape`: keep it alive).
inline DLTensor make_dl(void* data, DType dt, std::vector<int64_t>& shape) {
  DLTensor t{};
  t.data = data;
  t.device = {kDLCPU, 0};
  t.ndim = int(shape.size());
  t.dtype = ks::to_dl(dt);
  t.shape = shape.data();
  return t;
}

inline DType other_float(DType d) { return d == DType::F32 ? DType::F16 : DType::F32; }

// Same bytes in the data regions of two buffers.
inline bool same_bytes(const Buf& a, const Buf& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.data(), b.data(), a.nbytes()) == 0;
}

// Rounds a double to fp16 / bf16 / fp32, round to nearest even, overflow to inf.
// Written independently of the library's converters (ldexp + nearbyint).
inline double round_to(double v, DType d) {
  if (std::isnan(v) || std::isinf(v) || v == 0.0) return v;
  if (d == DType::F32) return double(float(v));
  const int man = d == DType::F16 ? 10 : 7;       // explicit mantissa bits
  const int emin = d == DType::F16 ? -14 : -126;  // smallest normal exponent
  const double maxfin = d == DType::F16 ? 65504.0 : std::ldexp(255.0, 120);
  const double a = std::fabs(v);
  int e;
  std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
  const int E = std::max(e - 1, emin);
  double q = std::ldexp(std::nearbyint(std::ldexp(a, man - E)), E - man);
  if (q > maxfin) q = kInf;
  return std::copysign(q, v);
}

inline std::string dt_param_name(const ::testing::TestParamInfo<DType>& i) { return ks::dtype_name(i.param); }

// ---- the per-op validation harness ---------------------------------------------------
// Storage for replacement shapes/strides that a mutated DLTensor points at.
struct ShapeStore {
  std::deque<std::vector<int64_t>> keep;
  int64_t* vec(std::vector<int64_t> v) {
    keep.push_back(std::move(v));
    return keep.back().data();
  }
};

// A valid `x -> out` call (silu_and_mul, softmax): x ~ N(0, 1), out poisoned. The
// DLTensors tx / tout (and the pointers px / pout passed to the op) may be broken before
// the derived Call's call().
struct XOutCall : ShapeStore {
  Buf x, out;
  DLTensor tx, tout;
  DLTensor *px, *pout;
  ks_backend_t be = KS_BACKEND_AUTO;
  XOutCall(DType dt, std::vector<int64_t> x_shape, std::vector<int64_t> out_shape)
      : x(dt, std::move(x_shape)), out(dt, std::move(out_shape)) {
    fill_normal(x);
    out.poison();
    tx = x.dl();
    tout = out.dl();
    px = &tx;
    pout = &tout;
  }
  std::vector<Buf*> bufs() { return {&x, &out}; }
};

// A valid `x, weight -> out` call (rms_norm, gemv): x, w ~ N(0, 1), out poisoned.
struct XWeightOutCall : ShapeStore {
  Buf x, w, out;
  DLTensor tx, tw, tout;
  DLTensor *px, *pw, *pout;
  ks_backend_t be = KS_BACKEND_AUTO;
  XWeightOutCall(DType dt, std::vector<int64_t> x_shape, std::vector<int64_t> w_shape, std::vector<int64_t> out_shape)
      : x(dt, std::move(x_shape)), w(dt, std::move(w_shape)), out(dt, std::move(out_shape)) {
    fill_normal(x);
    fill_normal(w);
    out.poison();
    tx = x.dl();
    tw = w.dl();
    tout = out.dl();
    px = &tx;
    pw = &tw;
    pout = &tout;
  }
  std::vector<Buf*> bufs() { return {&x, &w, &out}; }
};

template <class C>
void set_shape(DLTensor& t, C& c, std::vector<int64_t> s) {
  t.ndim = int(s.size());
  t.shape = c.vec(std::move(s));
}

// expect_reject(dt, mutate, want, args): builds a valid C(dt), lets `mutate` break one
// thing, and checks the rejection (every buffer in c.bufs() must stay byte-identical).
template <class C>
struct ExpectReject {
  RejectionCheck rejected;
  void operator()(DType dt, const std::function<void(C&)>& mutate, ks_status_t want,
                  const std::vector<std::string>& args) const {
    C c(dt);
    mutate(c);
    const std::vector<Buf*> bufs = c.bufs();
    const auto before = snap(bufs);
    EXPECT_TRUE(rejected(c.call(), want, args, bufs, before));
  }
};

}  // namespace kstest::checks
