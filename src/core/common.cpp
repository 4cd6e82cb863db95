#include "core/common.hpp"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <sstream>

#include "registry/registry.hpp"

namespace ks::detail {

namespace {
thread_local std::string g_last_error;
}

void set_last_error(const std::string& msg) { g_last_error = msg; }
void clear_last_error() { g_last_error.clear(); }
const char* last_error_cstr() { return g_last_error.c_str(); }

[[noreturn]] void fail(ks_status_t status, const std::string& op, const std::string& msg) {
  throw Failure{status, op + ": " + msg};
}

DType dtype_of(const DLTensor* t) {
  const DLDataType d = t->dtype;
  if (d.lanes != 1) return DType::Other;
  if (d.code == kDLFloat && d.bits == 16) return DType::F16;
  if (d.code == kDLFloat && d.bits == 32) return DType::F32;
  if (d.code == kDLBfloat && d.bits == 16) return DType::BF16;
  if (d.code == kDLInt && d.bits == 32) return DType::I32;
  if (d.code == kDLInt && d.bits == 64) return DType::I64;
  if (d.code == kDLUInt && d.bits == 8) return DType::U8;
  return DType::Other;
}

const char* dtype_name(DType d) {
  switch (d) {
    case DType::F16: return "fp16";
    case DType::BF16: return "bf16";
    case DType::F32: return "fp32";
    case DType::I32: return "int32";
    case DType::I64: return "int64";
    case DType::U8: return "uint8";
    default: return "unsupported";
  }
}

std::string shape_str(const Shape& s) {
  std::ostringstream o;
  o << "(";
  for (size_t i = 0; i < s.size(); ++i) o << (i ? ", " : "") << s[i];
  if (s.size() == 1) o << ",";
  o << ")";
  return o.str();
}

int64_t View::rows() const {
  int64_t r = 1;
  for (size_t i = 0; i + 1 < shape.size(); ++i) r *= shape[i];
  return r;
}

namespace {
// Whether strides lay shape out row-major and compact (a size-1 dimension's stride is any value).
bool row_major_compact(const Shape& shape, const int64_t* strides) {
  int64_t expect = 1;
  for (int i = int(shape.size()) - 1; i >= 0; --i) {
    if (shape[i] != 1 && strides[i] != expect) return false;
    expect *= shape[i];
  }
  return true;
}
}  // namespace

View view_of(const char* op, const char* arg, const DLTensor* t) {
  if (t == nullptr) fail(KS_ERROR_INVALID_ARGUMENT, op, std::string(arg) + " is NULL");
  if (t->ndim < 0 || t->ndim > 16)
    fail(KS_ERROR_INVALID_ARGUMENT, op,
         std::string(arg) + " has " + std::to_string(t->ndim) + " dims; kernscope takes 0 to 16 (" +
             (t->ndim < 0 ? "a negative count is not a shape" : "fold leading dims into fewer") + ")");
  if (t->ndim > 0 && t->shape == nullptr)
    fail(KS_ERROR_INVALID_ARGUMENT, op, std::string(arg) + " has a NULL shape");
  View v;
  v.dtype = dtype_of(t);
  if (v.dtype == DType::Other) {
    // a readable name for the usual DLPack types (float64, int8, bool, ...); the raw fields only
    // for the others (a user should not need DLPack's codes to read the message)
    const int code = int(t->dtype.code), bits = int(t->dtype.bits);
    const char* kind = code == kDLFloat ? "float" : code == kDLInt ? "int" : code == kDLUInt ? "uint"
                     : code == kDLBfloat ? "bfloat" : code == kDLComplex ? "complex" : code == 6 /* kDLBool */ ? "bool"
                     : nullptr;
    std::ostringstream o;
    o << arg << " has unsupported dtype ";
    if (kind && t->dtype.lanes == 1)
      o << kind << (code == 6 ? "" : std::to_string(bits));
    else
      o << "(DLPack code " << code << ", bits " << bits << ", lanes " << t->dtype.lanes << ")";
    o << "; kernscope takes float16, bfloat16 and float32 values, int32 / int64 indices and uint8 packed blocks, "
         "each where the op's argument is one";
    if (code == kDLFloat && bits == 64) o << " (convert float64 values to float32 first, or float64 indices to int64)";
    fail(KS_ERROR_UNSUPPORTED_DTYPE, op, o.str());
  }
  // The device type is read as the integer the caller stored: a value outside
  // DLPack's enumerators is rejected here, before anything compares it as an enum.
  int32_t device_type = 0;
  static_assert(sizeof(t->device.device_type) == sizeof(device_type));
  std::memcpy(&device_type, &t->device.device_type, sizeof(device_type));
  if (device_type < 1 || device_type > 31)
    fail(KS_ERROR_UNSUPPORTED_DEVICE, op, std::string(arg) + " has an unknown DLPack device type " + std::to_string(device_type));
  v.device = t->device;
  v.shape = Shape(t->shape, t->ndim);
  bool empty = false;
  for (int i = 0; i < t->ndim; ++i) {
    if (v.shape[i] < 0)
      fail(KS_ERROR_INVALID_ARGUMENT, op, std::string(arg) + " has a negative dimension " + shape_str(v.shape));
    empty = empty || v.shape[i] == 0;
  }
  // Element and byte counts must fit in int64 (a zero dimension anywhere makes the
  // tensor empty, however large the others are).
  int64_t n = empty ? 0 : 1;
  const int64_t max_elems = std::numeric_limits<int64_t>::max() / dtype_bytes(v.dtype);
  for (int i = 0; i < t->ndim && !empty; ++i) {
    if (n > max_elems / v.shape[i])
      fail(KS_ERROR_INVALID_ARGUMENT, op, std::string(arg) + " has more than 2^63 bytes " + shape_str(v.shape));
    n *= v.shape[i];
  }
  v.numel = n;
  if (t->strides != nullptr && n > 0 && !row_major_compact(v.shape, t->strides)) {
    std::ostringstream o;
    o << arg << " must be contiguous (row-major); got shape " << shape_str(v.shape) << " strides (";
    bool broadcast = false;  // a stride of 0 over more than one element: an expanded view
    for (int j = 0; j < t->ndim; ++j) {
      o << (j ? ", " : "") << t->strides[j];
      broadcast = broadcast || (t->strides[j] == 0 && v.shape[j] > 1);
    }
    o << ")" << (broadcast ? "; a stride of 0 is a broadcast (expanded) view" : "")
      << ": copy it to a contiguous tensor first";
    fail(KS_ERROR_INVALID_ARGUMENT, op, o.str());
  }
  if (n > 0 && t->data == nullptr)
    fail(KS_ERROR_INVALID_ARGUMENT, op, std::string(arg) + " has NULL data");
  // data + byte_offset and the tensor's bytes after it must end below 2^63: no 64-bit platform
  // maps user or device memory above (x86-64 and AArch64 user space end at 2^47..2^57), so a
  // byte_offset that reaches there (a producer's uint64_t, e.g. 2^63, or one that wraps the
  // address) is a broken header, refused before anything is read (n * element bytes < 2^63 is
  // checked above)
  if (n > 0) {
    const uint64_t base = uint64_t(reinterpret_cast<uintptr_t>(t->data)), limit = uint64_t(1) << 63;
    const uint64_t bytes = uint64_t(n) * uint64_t(dtype_bytes(v.dtype));
    if (base >= limit || t->byte_offset > limit - base || bytes > limit - base - t->byte_offset)
      fail(KS_ERROR_INVALID_ARGUMENT, op, std::string(arg) + " has data " + std::to_string(base) + " + byte_offset " +
                                              std::to_string(t->byte_offset) + ": its bytes do not end below 2^63");
  }
  v.data = t->data ? static_cast<char*>(t->data) + t->byte_offset : nullptr;
  return v;
}

RowsView rows_view_of(const char* op, const char* arg, const DLTensor* t) {
  if (t != nullptr && t->ndim == 3 && t->strides != nullptr && t->shape != nullptr) {
    // Validate everything but the strides through view_of on a compact copy of the header.
    DLTensor compact = *t;
    compact.strides = nullptr;
    RowsView r;
    r.v = view_of(op, arg, &compact);
    const int64_t R = r.v.dim(0), H = r.v.dim(1), D = r.v.dim(2);
    const int64_t rs = t->strides[0], hs = t->strides[1], ds = t->strides[2];
    if (r.v.numel == 0) return as_rows(r.v);  // nothing is addressed: the strides are never used
    auto bad = [&](const std::string& why) {
      std::ostringstream o;
      o << arg << " " << why << "; got shape " << shape_str(r.v.shape) << " strides (" << rs << ", " << hs << ", "
        << ds << ")";
      fail(KS_ERROR_INVALID_ARGUMENT, op, o.str());
    };
    if (D > 1 && ds != 1) bad("must be contiguous in its last dimension");
    if ((R > 1 && rs < 0) || (H > 1 && hs < 0)) bad("must have non-negative strides");
    if (H > 1 && hs < D) bad("has overlapping heads (head stride < head_dim)");
    // Every offset of the view, (R-1)*rs + (H-1)*hs + D elements, must stay addressable in
    // int64 bytes; checked term by term so that no product or sum can overflow (a wrapped
    // head or row offset would land on other elements of the view, or outside it).
    const int64_t es = dtype_bytes(r.v.dtype), lim = std::numeric_limits<int64_t>::max() / es;
    if (H > 1 && hs > (lim - D) / (H - 1)) bad("spans more than 2^63 bytes");
    const int64_t row_extent = (H > 1 ? (H - 1) * hs : 0) + D;  // <= lim
    if (R > 1 && rs < row_extent) bad("has overlapping rows (row stride < the heads' extent)");
    if (R > 1 && rs > (lim - row_extent) / (R - 1)) bad("spans more than 2^63 bytes");
    // a size-1 dimension's stride is ignored (any value), as in view_of: the compact value
    r.head_stride = H > 1 ? hs : D;
    r.row_stride = R > 1 ? rs : row_extent;
    return r;
  }
  if (t != nullptr && t->ndim != 3 && t->strides != nullptr && t->shape != nullptr) {
    // a strided view of another rank: its rank is the problem (the strided form is 3-D only),
    // not a layout to copy away
    DLTensor compact = *t;
    compact.strides = nullptr;
    const View v = view_of(op, arg, &compact);
    if (v.numel > 0 && !row_major_compact(v.shape, t->strides))
      fail(KS_ERROR_INVALID_ARGUMENT, op,
           std::string(arg) + " is a strided view of " + std::to_string(t->ndim) + " dims " + shape_str(v.shape) +
               ": a strided " + arg + " must have 3 dims [tokens, heads, head_dim] (any other rank must be contiguous)");
  }
  return as_rows(view_of(op, arg, t));
}

RowsView as_rows(const View& v) {
  RowsView r;
  r.v = v;
  const int64_t D = v.ndim() >= 1 ? v.dim(-1) : 1, H = v.ndim() >= 2 ? v.dim(-2) : 1;
  r.head_stride = D;
  r.row_stride = H * D;
  return r;
}

int64_t RowsView::span_elems() const {
  if (v.numel == 0) return 0;
  if (v.ndim() != 3) return v.numel;
  return (v.dim(0) - 1) * row_stride + (v.dim(1) - 1) * head_stride + v.dim(2);
}

bool rows_overlap(const RowsView& a, const RowsView& b) {
  if (a.v.numel == 0 || b.v.numel == 0) return false;
  if (a.v.device.device_type != b.v.device.device_type || a.v.device.device_id != b.v.device.device_id) return false;
  // Spans in bytes (< 2^63 each, as validated) and start addresses as unsigned 64-bit
  // values: all address arithmetic below is modulo 2^64, so nothing can overflow.
  const uint64_t ea = uint64_t(dtype_bytes(a.v.dtype)), eb = uint64_t(dtype_bytes(b.v.dtype));
  const uint64_t a0 = reinterpret_cast<uintptr_t>(a.v.data), b0 = reinterpret_cast<uintptr_t>(b.v.data);
  const uint64_t a_span = uint64_t(a.span_elems()) * ea, b_span = uint64_t(b.span_elems()) * eb;
  // b starts ab bytes after a, a starts ba bytes after b (on the circle of 2^64 addresses)
  const uint64_t ab = b0 - a0, ba = a0 - b0;
  if (ab >= a_span && ba >= b_span) return false;  // spans disjoint
  // Same row pitch in bytes and rows that fit in it: element sets are the rows'
  // extents repeated every pitch; they meet iff the extents meet modulo the pitch.
  // (Only for spans that do not wrap past the top of the address space, where the
  // repetition would not hold.)
  const uint64_t top = std::numeric_limits<uint64_t>::max();
  if (a.v.ndim() == 3 && b.v.ndim() == 3 && a.row_stride > 0 &&
      uint64_t(a.row_stride) * ea == uint64_t(b.row_stride) * eb && a_span <= top - a0 && b_span <= top - b0) {
    const uint64_t pitch = uint64_t(a.row_stride) * ea;
    const uint64_t xa = uint64_t((a.v.dim(1) - 1) * a.head_stride + a.v.dim(2)) * ea;
    const uint64_t xb = uint64_t((b.v.dim(1) - 1) * b.head_stride + b.v.dim(2)) * eb;
    if (xa <= pitch && xb <= pitch) {
      // b's row start within a's pitch
      const uint64_t d = b0 >= a0 ? (b0 - a0) % pitch : (pitch - (a0 - b0) % pitch) % pitch;
      return d < xa || pitch - d < xb;
    }
  }
  return true;  // conservative
}

void require_rows_disjoint(const char* op, const char* a_arg, const RowsView& a, const char* b_arg,
                           const RowsView& b) {
  if (rows_overlap(a, b))
    fail(KS_ERROR_INVALID_ARGUMENT, op, std::string(a_arg) + " and " + b_arg + " overlap in memory; they must not");
}

void require_dtype(const char* op, const char* arg, const View& v, std::initializer_list<DType> ok) {
  for (DType d : ok)
    if (v.dtype == d) return;
  std::string names;
  for (DType d : ok) names += std::string(names.empty() ? "" : ", ") + dtype_name(d);
  fail(KS_ERROR_UNSUPPORTED_DTYPE, op,
       std::string(arg) + " has dtype " + dtype_name(v.dtype) + "; expected one of: " + names);
}

void require_same_dtype(const char* op, const char* arg, const View& v, const char* ref_arg, const View& ref) {
  if (v.dtype != ref.dtype)
    fail(KS_ERROR_UNSUPPORTED_DTYPE, op,
         std::string(arg) + " has dtype " + dtype_name(v.dtype) + " but " + ref_arg + " has " +
             dtype_name(ref.dtype) + "; they must match");
}

std::string num_str(double v) {
  // the value as passed (std::to_string prints 1e-9 as 0.000000): 9 significant digits, or as
  // many more as it takes to read back the same double (1 + 2^-52 is not "1")
  char b[40];
  for (int digits = 9; digits <= 17; ++digits) {
    std::snprintf(b, sizeof b, "%.*g", digits, v);
    if (std::strtod(b, nullptr) == v || v != v) break;
  }
  return b;
}

static std::string device_str(DLDevice d) {
  switch (d.device_type) {
    case kDLCPU: return d.device_id == 0 ? std::string("cpu") : "cpu:" + std::to_string(d.device_id);
    case kDLCUDA: return "cuda:" + std::to_string(d.device_id);
    case kDLCUDAHost: return "cuda_host";
    case kDLCUDAManaged: return "cuda_managed:" + std::to_string(d.device_id);
    default: return "device_type " + std::to_string(int(d.device_type));
  }
}

void require_same_device(const char* op, const char* arg, const View& v, const char* ref_arg, const View& ref) {
  if (v.device.device_type != ref.device.device_type || v.device.device_id != ref.device.device_id)
    fail(KS_ERROR_UNSUPPORTED_DEVICE, op,
         std::string(arg) + " is on " + device_str(v.device) + " but " + ref_arg + " is on " +
             device_str(ref.device) + "; they must share a device");
}

void require_same_dtypes(const char* op, std::initializer_list<NamedView> args, const char* ref_arg, const View& ref) {
  for (const NamedView& a : args) require_same_dtype(op, a.arg, a.v, ref_arg, ref);
}

void require_same_devices(const char* op, std::initializer_list<NamedView> args, const char* ref_arg, const View& ref) {
  for (const NamedView& a : args) require_same_device(op, a.arg, a.v, ref_arg, ref);
}

void require_like(const char* op, std::initializer_list<NamedView> args, const char* ref_arg, const View& ref) {
  require_same_dtypes(op, args, ref_arg, ref);
  require_same_devices(op, args, ref_arg, ref);
}

void require_ndim(const char* op, const char* arg, const View& v, int ndim) {
  if (v.ndim() != ndim)
    fail(KS_ERROR_INVALID_ARGUMENT, op,
         std::string(arg) + " must have " + std::to_string(ndim) + " dims; got shape " + shape_str(v.shape));
}

void require_min_ndim(const char* op, const char* arg, const View& v, int ndim) {
  if (v.ndim() < ndim)
    fail(KS_ERROR_INVALID_ARGUMENT, op,
         std::string(arg) + " must have at least " + std::to_string(ndim) + " dims; got shape " +
             shape_str(v.shape));
}

void require_shape(const char* op, const char* arg, const View& v, const Shape& shape, const char* why) {
  if (v.shape != shape)
    fail(KS_ERROR_INVALID_ARGUMENT, op,
         std::string(arg) + " must have shape " + shape_str(shape) + " (" + why + "); got " + shape_str(v.shape));
}

void require_nonempty_last(const char* op, const char* arg, const View& v) {
  if (v.ndim() == 0 || v.shape.back() == 0)
    fail(KS_ERROR_INVALID_ARGUMENT, op,
         std::string(arg) + " must have a non-empty last dimension; got shape " + shape_str(v.shape));
}

bool overlaps(const View& a, const View& b) {
  if (a.numel == 0 || b.numel == 0) return false;
  if (a.device.device_type != b.device.device_type || a.device.device_id != b.device.device_id) return false;
  const auto a0 = reinterpret_cast<uintptr_t>(a.data), b0 = reinterpret_cast<uintptr_t>(b.data);
  return a0 < b0 + b.nbytes() && b0 < a0 + a.nbytes();
}

bool same_region(const View& a, const View& b) {
  return a.data == b.data && a.nbytes() == b.nbytes() && a.dtype == b.dtype;
}

void require_no_overlap(const char* op, const char* a_arg, const View& a, const char* b_arg, const View& b) {
  if (overlaps(a, b))
    fail(KS_ERROR_INVALID_ARGUMENT, op,
         std::string(a_arg) + " and " + b_arg + " overlap in memory; they must not");
}

void require_inplace_or_disjoint(const char* op, const char* out_arg, const View& out, const char* in_arg,
                                 const View& in) {
  if (same_region(out, in)) return;
  if (overlaps(out, in))
    fail(KS_ERROR_INVALID_ARGUMENT, op,
         std::string(out_arg) + " partially overlaps " + in_arg + "; it must be exactly " + in_arg +
             " (in place) or disjoint from it");
}

float checked_eps(const char* op, double eps) {
  if (!std::isfinite(eps) || !(eps > 0.0))
    fail(KS_ERROR_INVALID_ARGUMENT, op, "eps must be finite and > 0; got " + num_str(eps));
  const float e = static_cast<float>(eps);
  if (!(e > 0.f) || !std::isfinite(e))
    fail(KS_ERROR_INVALID_ARGUMENT, op,
         "eps must be representable as a positive finite fp32 value; got " + num_str(eps) +
             (e == 0.f ? " (0 in fp32)" : " (inf in fp32)"));
  return e;
}

ks_backend_t resolve_backend(const char* op, ks_backend_t backend, const View& first) {
  const auto dev = first.device.device_type;
  const bool on_cpu = on_host(first);
  const bool on_cuda = dev == kDLCUDA || dev == kDLCUDAManaged;
  // Compare as int: a C caller may pass any value, outside the enum's range.
  const int b = static_cast<int>(backend);
  if (b != KS_BACKEND_AUTO && b != KS_BACKEND_CPU && b != KS_BACKEND_CUDA)
    fail(KS_ERROR_INVALID_ARGUMENT, op,
         "backend must be KS_BACKEND_AUTO, KS_BACKEND_CPU or KS_BACKEND_CUDA; got " + std::to_string(b));
  if (!on_cpu && !on_cuda)
    fail(KS_ERROR_UNSUPPORTED_DEVICE, op, "tensors on " + device_str(first.device) + " are not supported");
  if (backend == KS_BACKEND_AUTO) backend = on_cuda ? KS_BACKEND_CUDA : KS_BACKEND_CPU;
  if (backend == KS_BACKEND_CPU && !on_cpu)
    fail(KS_ERROR_UNSUPPORTED_DEVICE, op, "backend cpu needs host tensors; got " + device_str(first.device));
  if (backend == KS_BACKEND_CUDA) {
    if (!on_cuda)
      fail(KS_ERROR_UNSUPPORTED_DEVICE, op, "backend cuda needs CUDA device tensors; got " + device_str(first.device));
    if (!ks_backend_available(KS_BACKEND_CUDA))
      fail(KS_ERROR_BACKEND_UNAVAILABLE, op, std::string("the CUDA backend is not available: ") + ks::cuda::unavailable_reason());
  }
  return backend;
}

}  // namespace ks::detail
