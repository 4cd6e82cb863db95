// kernscope C++ API: a header-only wrapper over the C ABI (kernscope.h).
// Errors become typed exceptions derived from ks::Error; tensors are light
// views (TensorView) or host-owning buffers (Tensor). See kernscope.h and
// docs/contracts.md for each op's shapes, dtypes and numerical contract.
#pragma once

#include <kernscope/kernscope.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace ks {

// ---- errors ---------------------------------------------------------------
class Error : public std::runtime_error {
 public:
  Error(ks_status_t status, const std::string& msg) : std::runtime_error(msg), status_(status) {}
  ks_status_t status() const noexcept { return status_; }

 private:
  ks_status_t status_;
};
#define KS_DEFINE_ERROR(Name) \
  class Name : public Error { \
   public: \
    using Error::Error; \
  };
KS_DEFINE_ERROR(InvalidArgument)
KS_DEFINE_ERROR(UnsupportedDtype)
KS_DEFINE_ERROR(UnsupportedDevice)
KS_DEFINE_ERROR(BackendUnavailable)
KS_DEFINE_ERROR(CudaError)
KS_DEFINE_ERROR(OutOfMemory)
KS_DEFINE_ERROR(InternalError)
#undef KS_DEFINE_ERROR

// Throws the typed exception for a failing status, with ks_last_error()'s message.
inline void check(ks_status_t s) {
  if (s == KS_SUCCESS) return;
  const std::string msg = ks_last_error();
  switch (s) {
    case KS_ERROR_INVALID_ARGUMENT: throw InvalidArgument(s, msg);
    case KS_ERROR_UNSUPPORTED_DTYPE: throw UnsupportedDtype(s, msg);
    case KS_ERROR_UNSUPPORTED_DEVICE: throw UnsupportedDevice(s, msg);
    case KS_ERROR_BACKEND_UNAVAILABLE: throw BackendUnavailable(s, msg);
    case KS_ERROR_CUDA: throw CudaError(s, msg);
    case KS_ERROR_OUT_OF_MEMORY: throw OutOfMemory(s, msg);
    default: throw InternalError(s, msg);
  }
}

enum class Backend { Auto = KS_BACKEND_AUTO, Cpu = KS_BACKEND_CPU, Cuda = KS_BACKEND_CUDA };
enum class QType {
  None = KS_QTYPE_NONE, F32 = KS_QTYPE_F32, F16 = KS_QTYPE_F16, BF16 = KS_QTYPE_BF16,
  Q4_0 = KS_QTYPE_Q4_0, Q4_1 = KS_QTYPE_Q4_1, Q8_0 = KS_QTYPE_Q8_0
};

// ---- dtypes ---------------------------------------------------------------
enum class DType { F16, BF16, F32, I32, I64, U8 };

inline DLDataType to_dl(DType d) {
  switch (d) {
    case DType::F16: return {kDLFloat, 16, 1};
    case DType::BF16: return {kDLBfloat, 16, 1};
    case DType::F32: return {kDLFloat, 32, 1};
    case DType::I32: return {kDLInt, 32, 1};
    case DType::I64: return {kDLInt, 64, 1};
    case DType::U8: return {kDLUInt, 8, 1};
  }
  return {kDLFloat, 32, 1};
}
inline size_t dtype_size(DType d) {
  switch (d) {
    case DType::F16: case DType::BF16: return 2;
    case DType::F32: case DType::I32: return 4;
    case DType::I64: return 8;
    case DType::U8: return 1;
  }
  return 0;
}
inline const char* dtype_name(DType d) {
  switch (d) {
    case DType::F16: return "fp16";
    case DType::BF16: return "bf16";
    case DType::F32: return "fp32";
    case DType::I32: return "int32";
    case DType::I64: return "int64";
    case DType::U8: return "uint8";
  }
  return "?";
}

// ---- tensors --------------------------------------------------------------
// A non-owning, contiguous view: data pointer, dtype, shape (up to 16 dims, the C ABI's limit), device.
class TensorView {
 public:
  static constexpr int kMaxDims = 16;
  TensorView() = default;
  TensorView(void* data, DType dtype, std::initializer_list<int64_t> shape, DLDevice device = {kDLCPU, 0})
      : TensorView(data, dtype, std::vector<int64_t>(shape), device) {}
  TensorView(void* data, DType dtype, const std::vector<int64_t>& shape, DLDevice device = {kDLCPU, 0})
      : data_(data), dtype_(dtype), ndim_(int(shape.size())), device_(device) {
    if (ndim_ > kMaxDims) throw InvalidArgument(KS_ERROR_INVALID_ARGUMENT, "TensorView: more than 16 dims");
    for (int i = 0; i < ndim_; ++i) shape_[i] = shape[i];
  }
  void* data() const { return data_; }
  template <class T>
  T* data_as() const { return static_cast<T*>(data_); }
  DType dtype() const { return dtype_; }
  int ndim() const { return ndim_; }
  int64_t size(int i) const { return shape_[i < 0 ? ndim_ + i : i]; }
  std::vector<int64_t> shape() const { return {shape_.begin(), shape_.begin() + ndim_}; }
  int64_t numel() const {
    int64_t n = 1;
    for (int i = 0; i < ndim_; ++i) n *= shape_[i];
    return n;
  }
  size_t nbytes() const { return size_t(numel()) * dtype_size(dtype_); }
  DLDevice device() const { return device_; }
  // False only for a default-constructed view (no data, no dims): an optional argument left out.
  // A 0-d view with data (one value, e.g. sample's valid flag for a 1-d logits) is present.
  bool present() const { return ndim_ > 0 || data_ != nullptr; }
  // Rows [start, start + count) of the first dimension. Throws InvalidArgument when the view has
  // no dimensions or the range is not within [0, size(0)].
  TensorView slice(int64_t start, int64_t count) const {
    if (ndim_ < 1) throw InvalidArgument(KS_ERROR_INVALID_ARGUMENT, "TensorView::slice: the view has no dimensions");
    if (start < 0 || count < 0 || start > shape_[0] || count > shape_[0] - start)
      throw InvalidArgument(KS_ERROR_INVALID_ARGUMENT,
                            "TensorView::slice: rows [" + std::to_string(start) + ", " + std::to_string(start) + " + " +
                                std::to_string(count) + ") are not within the first dimension's " +
                                std::to_string(shape_[0]));
    TensorView v = *this;
    const int64_t row = ndim_ ? numel() / (shape_[0] ? shape_[0] : 1) : 1;
    v.data_ = static_cast<char*>(data_) + size_t(start * row) * dtype_size(dtype_);
    v.shape_[0] = count;
    return v;
  }
  // The same elements under another shape (row-major). Throws InvalidArgument when a size is
  // negative, the sizes' product overflows int64 or the element count differs (as torch.reshape;
  // no -1 inference).
  TensorView reshape(std::initializer_list<int64_t> shape) const {
    bool zero = false;
    for (int64_t d : shape) {
      if (d < 0) throw InvalidArgument(KS_ERROR_INVALID_ARGUMENT, "TensorView::reshape: a negative size (" + std::to_string(d) + ")");
      zero = zero || d == 0;
    }
    int64_t n = zero ? 0 : 1;
    bool overflow = false;
    for (int64_t d : shape)
      if (!zero && !overflow) {
        overflow = n > INT64_MAX / d;
        n = overflow ? n : n * d;
      }
    if (overflow || n != numel()) {  // (the message is built only here: reshape runs on every model step)
      std::string dims;
      for (int64_t d : shape) dims += (dims.empty() ? "" : ", ") + std::to_string(d);
      throw InvalidArgument(KS_ERROR_INVALID_ARGUMENT, "TensorView::reshape: shape (" + dims + ") has " +
                                                           (overflow ? std::string("more than 2^63 - 1") : std::to_string(n)) +
                                                           " elements; the view has " + std::to_string(numel()));
    }
    return TensorView(data_, dtype_, std::vector<int64_t>(shape), device_);
  }
  // A DLTensor pointing at this view's shape storage (valid while *this lives).
  DLTensor dl() const {
    DLTensor t{};
    t.data = data_;
    t.device = device_;
    t.ndim = ndim_;
    t.dtype = to_dl(dtype_);
    t.shape = const_cast<int64_t*>(shape_.data());
    t.strides = nullptr;
    t.byte_offset = 0;
    return t;
  }

 private:
  void* data_ = nullptr;
  DType dtype_ = DType::F32;
  int ndim_ = 0;
  std::array<int64_t, kMaxDims> shape_{};
  DLDevice device_{kDLCPU, 0};
};

// A host tensor that owns 64-byte aligned storage.
class Tensor {
 public:
  Tensor() = default;
  // Throws InvalidArgument for a negative dimension or a byte size past SIZE_MAX.
  Tensor(DType dtype, std::vector<int64_t> shape) : dtype_(dtype), shape_(std::move(shape)) {
    size_t bytes = dtype_size(dtype_);
    bool empty = false;
    for (int64_t s : shape_) {
      if (s < 0) throw InvalidArgument(KS_ERROR_INVALID_ARGUMENT, "Tensor: negative dimension");
      empty = empty || s == 0;
    }
    for (int64_t s : shape_) {
      if (empty) {
        bytes = 0;
        break;
      }
      if (bytes > SIZE_MAX / size_t(s)) throw InvalidArgument(KS_ERROR_INVALID_ARGUMENT, "Tensor: byte size overflows size_t");
      bytes *= size_t(s);
    }
    storage_.reset(static_cast<std::byte*>(::operator new[](bytes ? bytes : 1, std::align_val_t{64})));
    nbytes_ = bytes;
  }
  TensorView view() const { return TensorView(storage_.get(), dtype_, shape_); }
  operator TensorView() const { return view(); }
  template <class T>
  T* data() const { return reinterpret_cast<T*>(storage_.get()); }
  size_t nbytes() const { return nbytes_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  DType dtype() const { return dtype_; }

 private:
  struct AlignedDelete {
    void operator()(std::byte* p) const { ::operator delete[](p, std::align_val_t{64}); }
  };
  DType dtype_ = DType::F32;
  std::vector<int64_t> shape_;
  std::unique_ptr<std::byte[], AlignedDelete> storage_;
  size_t nbytes_ = 0;
};

// ---- operators (see kernscope.h for each contract) -------------------------
namespace detail {
inline ks_backend_t be(Backend b) { return static_cast<ks_backend_t>(b); }
}  // namespace detail

inline void rms_norm(const TensorView& out, const TensorView& x, const TensorView& weight, double eps = 1e-6,
                     Backend backend = Backend::Auto, ks_stream_t stream = nullptr) {
  DLTensor o = out.dl(), a = x.dl(), w = weight.dl();
  check(ks_rms_norm(&o, &a, &w, eps, detail::be(backend), stream));
}
inline void fused_add_rms_norm(const TensorView& x, const TensorView& residual, const TensorView& weight,
                               double eps = 1e-6, Backend backend = Backend::Auto, ks_stream_t stream = nullptr) {
  DLTensor a = x.dl(), r = residual.dl(), w = weight.dl();
  check(ks_fused_add_rms_norm(&a, &r, &w, eps, detail::be(backend), stream));
}
inline void silu_and_mul(const TensorView& out, const TensorView& x, Backend backend = Backend::Auto,
                         ks_stream_t stream = nullptr) {
  DLTensor o = out.dl(), a = x.dl();
  check(ks_silu_and_mul(&o, &a, detail::be(backend), stream));
}
inline void gemv(const TensorView& out, const TensorView& x, const TensorView& weight,
                 Backend backend = Backend::Auto, ks_stream_t stream = nullptr) {
  DLTensor o = out.dl(), a = x.dl(), w = weight.dl();
  check(ks_gemv(&o, &a, &w, detail::be(backend), stream));
}
inline void softmax(const TensorView& out, const TensorView& x, Backend backend = Backend::Auto,
                    ks_stream_t stream = nullptr) {
  DLTensor o = out.dl(), a = x.dl();
  check(ks_softmax(&o, &a, detail::be(backend), stream));
}
inline void embedding(const TensorView& out, const TensorView& ids, const TensorView& table,
                      QType table_format = QType::None, Backend backend = Backend::Auto,
                      ks_stream_t stream = nullptr) {
  DLTensor o = out.dl(), i = ids.dl(), t = table.dl();
  check(ks_embedding(&o, &i, &t, static_cast<ks_qtype_t>(table_format), detail::be(backend), stream));
}
inline void dequantize(const TensorView& out, const TensorView& packed, QType qtype,
                       Backend backend = Backend::Auto, ks_stream_t stream = nullptr) {
  DLTensor o = out.dl(), p = packed.dl();
  check(ks_dequantize(&o, &p, static_cast<ks_qtype_t>(qtype), detail::be(backend), stream));
}
inline void gemm(const TensorView& out, const TensorView& a, const TensorView& b, Backend backend = Backend::Auto,
                 ks_stream_t stream = nullptr) {
  DLTensor o = out.dl(), x = a.dl(), y = b.dl();
  check(ks_gemm(&o, &x, &y, detail::be(backend), stream));
}
inline void quant_matmul(const TensorView& out, const TensorView& x, const TensorView& weight, QType qtype,
                         Backend backend = Backend::Auto, ks_stream_t stream = nullptr) {
  DLTensor o = out.dl(), a = x.dl(), w = weight.dl();
  check(ks_quant_matmul(&o, &a, &w, static_cast<ks_qtype_t>(qtype), detail::be(backend), stream));
}
// x quantized to int8 per block of 32 (W4A8 / W8A8; ks_quant_matmul_a8 in kernscope.h).
inline void quant_matmul_a8(const TensorView& out, const TensorView& x, const TensorView& weight, QType qtype,
                            Backend backend = Backend::Auto, ks_stream_t stream = nullptr) {
  DLTensor o = out.dl(), a = x.dl(), w = weight.dl();
  check(ks_quant_matmul_a8(&o, &a, &w, static_cast<ks_qtype_t>(qtype), detail::be(backend), stream));
}
// x and residual_out may be empty TensorViews (data == nullptr, ndim == 0): the plain rms_norm
// of residual then feeds the matmul (ks_fused_add_rms_norm_quant_matmul in kernscope.h).
inline void fused_add_rms_norm_quant_matmul(const TensorView& out, const TensorView& residual_out,
                                            const TensorView& x, const TensorView& residual,
                                            const TensorView& norm_weight, double eps, const TensorView& weight,
                                            QType qtype, Backend backend = Backend::Auto,
                                            ks_stream_t stream = nullptr) {
  DLTensor o = out.dl(), ro = residual_out.dl(), a = x.dl(), r = residual.dl(), nw = norm_weight.dl(),
           w = weight.dl();
  const bool has_x = x.present();
  check(ks_fused_add_rms_norm_quant_matmul(&o, residual_out.present() ? &ro : nullptr, has_x ? &a : nullptr, &r,
                                           &nw, eps, &w, static_cast<ks_qtype_t>(qtype), detail::be(backend),
                                           stream));
}
inline void silu_and_mul_quant_matmul(const TensorView& out, const TensorView& gate_up, const TensorView& weight,
                                      QType qtype, Backend backend = Backend::Auto, ks_stream_t stream = nullptr) {
  DLTensor o = out.dl(), g = gate_up.dl(), w = weight.dl();
  check(ks_silu_and_mul_quant_matmul(&o, &g, &w, static_cast<ks_qtype_t>(qtype), detail::be(backend), stream));
}
// k may be an empty TensorView (data == nullptr, ndim == 0) to rotate q only.
inline void rotary_embedding(const TensorView& q, const TensorView& k, const TensorView& positions,
                             int64_t rotary_dim, double theta, bool is_neox, Backend backend = Backend::Auto,
                             ks_stream_t stream = nullptr) {
  DLTensor qq = q.dl(), kk = k.dl(), p = positions.dl();
  const bool has_k = k.present();
  check(ks_rotary_embedding(&qq, has_k ? &kk : nullptr, &p, rotary_dim, theta, is_neox ? 1 : 0,
                            detail::be(backend), stream));
}
inline void rotary_embedding_kv_append(const TensorView& q, const TensorView& k, const TensorView& v,
                                       const TensorView& positions, int64_t rotary_dim, double theta, bool is_neox,
                                       const TensorView& k_cache, const TensorView& v_cache,
                                       const TensorView& slot_mapping, Backend backend = Backend::Auto,
                                       ks_stream_t stream = nullptr) {
  DLTensor qq = q.dl(), kk = k.dl(), vv = v.dl(), p = positions.dl(), kc = k_cache.dl(), vc = v_cache.dl(),
           sm = slot_mapping.dl();
  check(ks_rotary_embedding_kv_append(&qq, &kk, &vv, &p, rotary_dim, theta, is_neox ? 1 : 0, &kc, &vc, &sm,
                                      detail::be(backend), stream));
}
// One token's norm + q/k/v matmul, RoPE and cache append (x and residual_out may be empty
// TensorViews, as in fused_add_rms_norm_quant_matmul);
// ks_fused_add_rms_norm_quant_matmul_rope_kv_append in kernscope.h.
inline void fused_add_rms_norm_quant_matmul_rope_kv_append(
    const TensorView& out, const TensorView& residual_out, const TensorView& x, const TensorView& residual,
    const TensorView& norm_weight, double eps, const TensorView& weight, QType qtype, int64_t num_heads,
    int64_t num_kv_heads, const TensorView& positions, int64_t rotary_dim, double theta, bool is_neox,
    const TensorView& k_cache, const TensorView& v_cache, const TensorView& slot_mapping,
    Backend backend = Backend::Auto, ks_stream_t stream = nullptr) {
  DLTensor o = out.dl(), ro = residual_out.dl(), a = x.dl(), r = residual.dl(), nw = norm_weight.dl(),
           w = weight.dl(), p = positions.dl(), kc = k_cache.dl(), vc = v_cache.dl(), sm = slot_mapping.dl();
  const bool has_x = x.present();
  check(ks_fused_add_rms_norm_quant_matmul_rope_kv_append(
      &o, residual_out.present() ? &ro : nullptr, has_x ? &a : nullptr, &r, &nw, eps, &w,
      static_cast<ks_qtype_t>(qtype), num_heads, num_kv_heads, &p, rotary_dim, theta, is_neox ? 1 : 0, &kc, &vc, &sm,
      detail::be(backend), stream));
}
inline void kv_cache_append(const TensorView& k_cache, const TensorView& v_cache, const TensorView& k,
                            const TensorView& v, const TensorView& slot_mapping, Backend backend = Backend::Auto,
                            ks_stream_t stream = nullptr) {
  DLTensor kc = k_cache.dl(), vc = v_cache.dl(), kk = k.dl(), vv = v.dl(), s = slot_mapping.dl();
  check(ks_kv_cache_append(&kc, &vc, &kk, &vv, &s, detail::be(backend), stream));
}
// seq_ids may be an empty TensorView (token t uses block_tables row t).
inline void paged_attention(const TensorView& out, const TensorView& q, const TensorView& k_cache,
                            const TensorView& v_cache, const TensorView& block_tables, const TensorView& seq_ids,
                            const TensorView& context_lens, double scale, Backend backend = Backend::Auto,
                            ks_stream_t stream = nullptr) {
  DLTensor o = out.dl(), qq = q.dl(), kc = k_cache.dl(), vc = v_cache.dl(), bt = block_tables.dl(),
           si = seq_ids.dl(), cl = context_lens.dl();
  const bool has_seq = seq_ids.present();
  check(ks_paged_attention(&o, &qq, &kc, &vc, &bt, has_seq ? &si : nullptr, &cl, scale, detail::be(backend),
                           stream));
}
// paged_attention right after the call that appended the step's keys on the same stream, with
// the caller's promise about what that call wrote (fresh_keys >= 1; 0: none):
// ks_paged_attention_after_append in kernscope.h. The same bits as paged_attention.
inline void paged_attention_after_append(const TensorView& out, const TensorView& q, const TensorView& k_cache,
                                         const TensorView& v_cache, const TensorView& block_tables,
                                         const TensorView& seq_ids, const TensorView& context_lens, double scale,
                                         int64_t fresh_keys, Backend backend = Backend::Auto,
                                         ks_stream_t stream = nullptr) {
  DLTensor o = out.dl(), qq = q.dl(), kc = k_cache.dl(), vc = v_cache.dl(), bt = block_tables.dl(),
           si = seq_ids.dl(), cl = context_lens.dl();
  const bool has_seq = seq_ids.present();
  check(ks_paged_attention_after_append(&o, &qq, &kc, &vc, &bt, has_seq ? &si : nullptr, &cl, scale, fresh_keys,
                                        detail::be(backend), stream));
}
// One decode step's RoPE, cache append and paged attention (seq_ids may be an empty TensorView,
// as in paged_attention); ks_rotary_embedding_kv_append_paged_attention in kernscope.h.
inline void rotary_embedding_kv_append_paged_attention(
    const TensorView& out, const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& positions,
    int64_t rotary_dim, double theta, bool is_neox, const TensorView& k_cache, const TensorView& v_cache,
    const TensorView& slot_mapping, const TensorView& block_tables, const TensorView& seq_ids,
    const TensorView& context_lens, double scale, Backend backend = Backend::Auto, ks_stream_t stream = nullptr) {
  DLTensor o = out.dl(), qq = q.dl(), kk = k.dl(), vv = v.dl(), p = positions.dl(), kc = k_cache.dl(),
           vc = v_cache.dl(), sm = slot_mapping.dl(), bt = block_tables.dl(), si = seq_ids.dl(), cl = context_lens.dl();
  const bool has_seq = seq_ids.present();
  check(ks_rotary_embedding_kv_append_paged_attention(&o, &qq, &kk, &vv, &p, rotary_dim, theta, is_neox ? 1 : 0, &kc,
                                                      &vc, &sm, &bt, has_seq ? &si : nullptr, &cl, scale,
                                                      detail::be(backend), stream));
}
inline void argmax(const TensorView& out, const TensorView& x, Backend backend = Backend::Auto,
                   ks_stream_t stream = nullptr) {
  DLTensor o = out.dl(), a = x.dl();
  check(ks_argmax(&o, &a, detail::be(backend), stream));
}
inline void varlen_attention(const TensorView& out, const TensorView& q, const TensorView& k, const TensorView& v,
                             const TensorView& cu_seqlens_q, const TensorView& cu_seqlens_k, double scale, bool causal,
                             Backend backend = Backend::Auto, ks_stream_t stream = nullptr) {
  DLTensor o = out.dl(), qq = q.dl(), kk = k.dl(), vv = v.dl(), cq = cu_seqlens_q.dl(), ck = cu_seqlens_k.dl();
  check(ks_varlen_attention(&o, &qq, &kk, &vv, &cq, &ck, scale, causal ? 1 : 0, detail::be(backend), stream));
}
// valid may be a default-constructed TensorView (no validity flags wanted); a 0-d valid (1-d logits) is written.
inline void sample(const TensorView& out, const TensorView& valid, const TensorView& logits,
                   const TensorView& seed_offset, double temperature, int64_t top_k = 0, double top_p = 1.0,
                   Backend backend = Backend::Auto, ks_stream_t stream = nullptr) {
  DLTensor o = out.dl(), v = valid.dl(), l = logits.dl(), so = seed_offset.dl();
  check(ks_sample(&o, valid.present() ? &v : nullptr, &l, &so, temperature, top_k, top_p, detail::be(backend),
                  stream));
}

// ---- library --------------------------------------------------------------
inline std::string version() { return ks_version(); }
inline bool backend_available(Backend b) { return ks_backend_available(detail::be(b)) != 0; }

struct Which {
  std::string variant, reason;
};
inline Which which(const std::string& op, const std::string& dtype, Backend backend = Backend::Auto) {
  const char* v = nullptr;
  const char* r = nullptr;
  check(ks_which(op.c_str(), dtype.c_str(), detail::be(backend), &v, &r));
  return {v, r};
}
// For a call of shape (rows, cols) as the routing table keys it; see ks_which_shape.
inline Which which(const std::string& op, const std::string& dtype, Backend backend, int64_t rows, int64_t cols) {
  const char* v = nullptr;
  const char* r = nullptr;
  check(ks_which_shape(op.c_str(), dtype.c_str(), detail::be(backend), rows, cols, &v, &r));
  return {v, r};
}

// Pins op to a variant on this thread (empty variant: automatic again); see ks_force_variant.
inline void force_variant(const std::string& op, const std::string& variant = "") {
  check(ks_force_variant(op.c_str(), variant.empty() ? nullptr : variant.c_str()));
}
// The variant pinned for op on this thread ("" when none); see ks_forced_variant.
inline std::string forced_variant(const std::string& op) {
  const char* v = nullptr;
  check(ks_forced_variant(op.c_str(), &v));
  return v ? v : "";
}
// Deterministic (batch-invariant) mode, process-wide; see ks_set_deterministic.
inline void set_deterministic(bool enabled) { check(ks_set_deterministic(enabled ? 1 : 0)); }
inline bool deterministic() { return ks_deterministic() != 0; }

// The active routing table as JSON (see ks_routing_table).
inline std::string routing_table() {
  const char* json = nullptr;
  check(ks_routing_table(&json));
  return json;
}

inline std::vector<ks_variant_info_t> variants() {
  std::vector<ks_variant_info_t> out(ks_variant_count());
  for (size_t i = 0; i < out.size(); ++i) check(ks_variant_info(i, &out[i]));
  return out;
}

}  // namespace ks
