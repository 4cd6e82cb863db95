// Internal helpers shared by every op: errors, dtypes, tensor validation.
// Validation throws ks::detail::Failure; the C ABI boundary (ks_guard) turns it
// into a ks_status_t and the thread-local message. Nothing here writes outputs.
#pragma once

#include <kernscope/kernscope.h>

#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <string>
#include <vector>

#include "core/half.hpp"

namespace ks {
// Bytes of one GGUF block of 32 weights of the integer formats (Q4_0 18, Q4_1 20, Q8_0 34): the
// formats with kernels that walk blocks (quant_matmul's CUDA kernels, quant_matmul_a8 everywhere).
KS_HD constexpr int64_t q_block_bytes(ks_qtype_t q) { return q == KS_QTYPE_Q4_0 ? 18 : q == KS_QTYPE_Q4_1 ? 20 : 34; }
// The dense weight formats (one value per element: F32, F16, BF16), which no kernel walks by blocks.
KS_HD constexpr bool qtype_is_dense(ks_qtype_t q) { return q == KS_QTYPE_F32 || q == KS_QTYPE_F16 || q == KS_QTYPE_BF16; }
}  // namespace ks

namespace ks::cuda {
bool device_present();             // the CUDA runtime sees a device (false without the backend)
const char* unavailable_reason();  // why the CUDA backend is unavailable, for error messages
}  // namespace ks::cuda

namespace ks::detail {

struct Failure {
  ks_status_t status;
  std::string message;
};

[[noreturn]] void fail(ks_status_t status, const std::string& op, const std::string& msg);
void set_last_error(const std::string& msg);
void clear_last_error();

// Runs body (which validates, then computes) and converts exceptions to status.
template <class F>
ks_status_t guard(const char* op, F&& body) noexcept {
  try {
    clear_last_error();
    return body();
  } catch (const Failure& f) {
    // (a routing table that cannot be used fails the call before its kernel: the message names
    // the table, and the op is named in front of it as for every other error)
    set_last_error(f.message.rfind("routing: ", 0) == 0 ? std::string(op) + ": " + f.message : f.message);
    return f.status;
  } catch (const std::bad_alloc&) {
    set_last_error(std::string(op) + ": out of host memory");
    return KS_ERROR_OUT_OF_MEMORY;
  } catch (const std::exception& e) {
    set_last_error(std::string(op) + ": internal error: " + e.what());
    return KS_ERROR_INTERNAL;
  } catch (...) {
    set_last_error(std::string(op) + ": internal error");
    return KS_ERROR_INTERNAL;
  }
}

enum class DType { F16, BF16, F32, I32, I64, U8, Other };

DType dtype_of(const DLTensor* t);
const char* dtype_name(DType d);
inline bool is_float(DType d) { return d == DType::F16 || d == DType::BF16 || d == DType::F32; }
inline int dtype_bytes(DType d) {
  switch (d) {
    case DType::F16: case DType::BF16: return 2;
    case DType::F32: case DType::I32: return 4;
    case DType::I64: return 8;
    case DType::U8: return 1;
    default: return 0;
  }
}

// A tensor shape of at most 16 dims, stored inline (validation allocates nothing
// on the hot path). Offers the std::vector operations the ops use.
class Shape {
 public:
  static constexpr int kMax = 16;
  Shape() = default;
  Shape(std::initializer_list<int64_t> l) {
    for (int64_t x : l) push_back(x);
  }
  Shape(const int64_t* d, int n) {
    for (int i = 0; i < n; ++i) push_back(d[i]);
  }
  size_t size() const { return size_t(n_); }
  bool empty() const { return n_ == 0; }
  int64_t operator[](size_t i) const { return d_[i]; }
  int64_t& operator[](size_t i) { return d_[i]; }
  int64_t back() const { return d_[n_ - 1]; }
  int64_t& back() { return d_[n_ - 1]; }
  // Past kMax dimensions the shape is marked overflowed: it then equals no shape,
  // so a derived expected shape that does not fit can never validate.
  void push_back(int64_t x) {
    if (n_ < kMax) d_[n_++] = x;
    else overflow_ = true;
  }
  const int64_t* begin() const { return d_; }
  const int64_t* end() const { return d_ + n_; }
  bool operator==(const Shape& o) const {
    if (n_ != o.n_ || overflow_ || o.overflow_) return false;
    for (int i = 0; i < n_; ++i)
      if (d_[i] != o.d_[i]) return false;
    return true;
  }
  bool operator!=(const Shape& o) const { return !(*this == o); }

 private:
  int64_t d_[kMax] = {};
  int n_ = 0;
  bool overflow_ = false;
};

// A shape without its last dim ([..., n] -> [...]): the per-row outputs of row reductions.
inline Shape leading_dims(const Shape& s) {
  Shape r;
  for (size_t i = 0; i + 1 < s.size(); ++i) r.push_back(s[i]);
  return r;
}

// x's leading dims + (n,): a linear layer's output ([..., K] -> [..., n]).
inline Shape linear_out_shape(const Shape& x, int64_t n) {
  Shape r = leading_dims(x);
  r.push_back(n);
  return r;
}

// Representation of a validated tensor argument.
struct View {
  void* data = nullptr;       // data + byte_offset
  DType dtype = DType::Other;
  DLDevice device{};
  Shape shape;
  int64_t numel = 0;
  int64_t rows() const;       // product of all dims but the last (1 for 0-d)
  int64_t cols() const { return shape.empty() ? 1 : shape.back(); }
  int64_t dim(int i) const { return shape[i < 0 ? shape.size() + i : i]; }
  int ndim() const { return int(shape.size()); }
  size_t nbytes() const { return size_t(numel) * size_t(dtype_bytes(dtype)); }
};

// Checks: non-null, lanes == 1, ndim >= 0, dims >= 0, contiguous, product fits
// int64, data non-null when numel > 0. Names the op and argument on failure.
View view_of(const char* op, const char* arg, const DLTensor* t);

// A 3-D [rows, heads, dim] view whose last dimension is contiguous and whose
// leading strides (in elements, >= 0) may be anything that keeps the elements
// distinct: dim <= head stride (heads > 1) and heads' extent <= row stride (rows > 1),
// with the whole span addressable in int64 bytes (no offset computation can wrap).
// A size-1 (or empty) dimension's stride is replaced by its compact value.
// (In-place ops on slices of a fused buffer, e.g. q and k of a packed qkv.)
struct RowsView {
  View v;                     // data, dtype, device, shape; numel counts the viewed elements
  int64_t row_stride = 0;     // elements between consecutive rows
  int64_t head_stride = 0;    // elements between consecutive heads of a row
  int64_t span_elems() const;  // from the first to one past the last viewed element
};
RowsView rows_view_of(const char* op, const char* arg, const DLTensor* t);
// Whether two such views (or a view and a contiguous one) may share an element. When
// both have the same row pitch in bytes, exact at the granularity of a row's extent
// (first head's first element to last head's last; slices of one fused buffer);
// otherwise by their spans (conservative).
bool rows_overlap(const RowsView& a, const RowsView& b);
void require_rows_disjoint(const char* op, const char* a_arg, const RowsView& a, const char* b_arg,
                           const RowsView& b);
RowsView as_rows(const View& v);  // a contiguous view as a RowsView (1 row of its elements if not 3-D)

void require_dtype(const char* op, const char* arg, const View& v, std::initializer_list<DType> ok);
void require_same_dtype(const char* op, const char* arg, const View& v, const char* ref_arg,
                        const View& ref);
void require_same_device(const char* op, const char* arg, const View& v, const char* ref_arg,
                         const View& ref);
// An op's argument by name, for the checks that take several at once.
struct NamedView {
  const char* arg;
  const View& v;
};
// require_same_dtype / require_same_device for each of `args` against ref, in the list's order.
void require_same_dtypes(const char* op, std::initializer_list<NamedView> args, const char* ref_arg, const View& ref);
void require_same_devices(const char* op, std::initializer_list<NamedView> args, const char* ref_arg, const View& ref);
// Both: every dtype first, then every device (so a dtype mismatch is named before a device one).
void require_like(const char* op, std::initializer_list<NamedView> args, const char* ref_arg, const View& ref);
void require_ndim(const char* op, const char* arg, const View& v, int ndim);
void require_min_ndim(const char* op, const char* arg, const View& v, int ndim);
void require_shape(const char* op, const char* arg, const View& v, const Shape& shape, const char* why);
void require_nonempty_last(const char* op, const char* arg, const View& v);

bool overlaps(const View& a, const View& b);
bool same_region(const View& a, const View& b);  // identical data pointer, dtype and numel
void require_no_overlap(const char* op, const char* a_arg, const View& a, const char* b_arg,
                        const View& b);
// out may be exactly in (in-place) but must not partially overlap it.
void require_inplace_or_disjoint(const char* op, const char* out_arg, const View& out,
                                 const char* in_arg, const View& in);

// eps: finite, > 0, and still > 0 and finite after rounding to fp32.
float checked_eps(const char* op, double eps);

// Host-readable memory (plain CPU or CUDA pinned host): index tensors there are
// range-checked before any launch.
inline bool on_host(const View& v) {
  return v.device.device_type == kDLCPU || v.device.device_type == kDLCUDAHost;
}

// Resolves AUTO to CPU/CUDA by the tensors' device, and checks that the device
// matches the backend. Returns the concrete backend.
ks_backend_t resolve_backend(const char* op, ks_backend_t backend, const View& first);

std::string shape_str(const Shape& s);
std::string num_str(double v);  // a scalar argument for an error message, %.9g

// Element load/store with conversion to/from fp32. Offset views may leave data
// at any byte alignment, so every access goes through memcpy (a plain move on
// x86-64; no misaligned typed access anywhere).
template <class T>
inline T ld(const void* p, int64_t i) {
  T v;
  std::memcpy(&v, static_cast<const char*>(p) + i * int64_t(sizeof(T)), sizeof(T));
  return v;
}
template <class T>
inline void st(void* p, int64_t i, T v) {
  std::memcpy(static_cast<char*>(p) + i * int64_t(sizeof(T)), &v, sizeof(T));
}
inline float load_f(const void* p, DType d, int64_t i) {
  switch (d) {
    case DType::F32: return ld<float>(p, i);
    case DType::F16: return half_to_float(ld<uint16_t>(p, i));
    case DType::BF16: return bf16_to_float(ld<uint16_t>(p, i));
    default: return 0.f;
  }
}
inline void store_f(void* p, DType d, int64_t i, float v) {
  switch (d) {
    case DType::F32: st<float>(p, i, v); break;
    case DType::F16: st<uint16_t>(p, i, float_to_half(v)); break;
    case DType::BF16: st<uint16_t>(p, i, float_to_bf16(v)); break;
    default: break;
  }
}
// Rounds v to dtype d and back (the value a store then load would give).
inline float round_to(DType d, float v) {
  switch (d) {
    case DType::F16: return half_to_float(float_to_half(v));
    case DType::BF16: return bf16_to_float(float_to_bf16(v));
    default: return v;
  }
}
inline int64_t load_index(const void* p, DType d, int64_t i) {
  return d == DType::I32 ? int64_t(ld<int32_t>(p, i)) : ld<int64_t>(p, i);
}

}  // namespace ks::detail
