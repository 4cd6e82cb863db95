// gemv, gemm, quant_matmul, dequantize: validation, contract, dispatch.
//
// gemv:         out[n] = round(sum_h fp32(weight[n,h]) * fp32(x[h])), FP32 products and sums.
// gemm:         out[m,n] = round(sum_k fp32(a[m,k]) * fp32(b[n,k])).
// dequantize:   each element decoded in FP32 per its block format (docs/contracts.md), then rounded.
// quant_matmul: out[m,n] = round(sum_k fp32(x[m,k]) * w[n,k]) with w the FP32 dequantized weight.
// fused_add_rms_norm_quant_matmul: h = fused_add_rms_norm's (or rms_norm's) rounded row, written
//               nowhere; residual_out = round(x + residual); out = quant_matmul(h, weight).
// silu_and_mul_quant_matmul: h = silu_and_mul(gate_up)'s rounded row; out = quant_matmul(h, weight).
// quant_matmul_a8: quant_matmul with x quantized per block of 32 to int8 (core/a8_quant.hpp).
#include <limits>
#include <string>

#include "ops/args.hpp"
#include "registry/registry.hpp"

using namespace ks::detail;
using namespace ks::ops;

namespace ks::ops {

bool qtype_geometry(ks_qtype_t q, int64_t* block_size, int64_t* block_bytes) {
  int64_t bs = 0, bb = 0;
  switch (q) {
    case KS_QTYPE_F32: bs = 1; bb = 4; break;
    case KS_QTYPE_F16: bs = 1; bb = 2; break;
    case KS_QTYPE_BF16: bs = 1; bb = 2; break;
    case KS_QTYPE_Q4_0: bs = 32; bb = 18; break;
    case KS_QTYPE_Q4_1: bs = 32; bb = 20; break;
    case KS_QTYPE_Q8_0: bs = 32; bb = 34; break;
    default: return false;
  }
  if (block_size) *block_size = bs;
  if (block_bytes) *block_bytes = bb;
  return true;
}

const char* qtype_name(ks_qtype_t q) {
  switch (q) {
    case KS_QTYPE_NONE: return "none";
    case KS_QTYPE_F32: return "F32";
    case KS_QTYPE_F16: return "F16";
    case KS_QTYPE_BF16: return "BF16";
    case KS_QTYPE_Q4_0: return "Q4_0";
    case KS_QTYPE_Q4_1: return "Q4_1";
    case KS_QTYPE_Q8_0: return "Q8_0";
    default: return "unknown";
  }
}

// Checks a packed uint8 [rows, row_bytes] tensor against `cols` elements per row.
void check_packed(const char* op, const char* arg, const View& packed, ks_qtype_t qtype, int64_t cols,
                  const char* qtype_arg, const char* cols_what) {
  int64_t bs, bb;
  if (!qtype_geometry(qtype, &bs, &bb))
    fail(KS_ERROR_INVALID_ARGUMENT, op,
         std::string(qtype_arg) + " = " + std::to_string(int(qtype)) + " is not a known packed format");
  require_dtype(op, arg, packed, {DType::U8});
  require_ndim(op, arg, packed, 2);
  if (cols % bs != 0)
    fail(KS_ERROR_INVALID_ARGUMENT, op,
         std::string(cols_what) + " = " + std::to_string(cols) + " is not a multiple of the " + qtype_name(qtype) +
             " block size " + std::to_string(bs) + " (" + arg + "'s rows are whole blocks)");
  // (checked before the product: a K near 2^63 with an empty x would wrap it and accept a
  // malformed weight)
  if (cols / bs > std::numeric_limits<int64_t>::max() / bb)
    fail(KS_ERROR_INVALID_ARGUMENT, op,
         std::string(cols_what) + " = " + std::to_string(cols) + " is too large: " + arg + "'s rows of " +
             qtype_name(qtype) + " blocks would take more than 2^63 bytes");
  if (packed.cols() != cols / bs * bb)
    fail(KS_ERROR_INVALID_ARGUMENT, op,
         std::string(arg) + " must have " + std::to_string(cols / bs * bb) + " bytes per row for " +
             std::to_string(cols) + " " + qtype_name(qtype) + " columns, from " + cols_what + "; got shape " +
             shape_str(packed.shape));
}

}  // namespace ks::ops

extern "C" ks_status_t ks_qtype_info(ks_qtype_t qtype, int64_t* block_size, int64_t* block_bytes) {
  return guard("qtype_info", [&] {
    if (!qtype_geometry(qtype, block_size, block_bytes))
      fail(KS_ERROR_INVALID_ARGUMENT, "qtype_info", "qtype " + std::to_string(int(qtype)) + " is not a packed format");
    return KS_SUCCESS;
  });
}

extern "C" ks_status_t ks_gemv(DLTensor* out, const DLTensor* x, const DLTensor* weight, ks_backend_t backend,
                               ks_stream_t stream) {
  static const char* op = "gemv";
  return guard(op, [&] {
    GemvArgs a;
    a.x = view_of(op, "x", x);
    a.weight = view_of(op, "weight", weight);
    a.out = view_of(op, "out", out);
    require_dtype(op, "x", a.x, {DType::F16, DType::BF16, DType::F32});
    require_like(op, {{"weight", a.weight}, {"out", a.out}}, "x", a.x);
    require_ndim(op, "x", a.x, 1);
    require_nonempty_last(op, "x", a.x);
    require_ndim(op, "weight", a.weight, 2);
    if (a.weight.dim(1) != a.x.dim(0))
      fail(KS_ERROR_INVALID_ARGUMENT, op,
           "weight must have shape (N, " + std::to_string(a.x.dim(0)) + ") to match x; got " + shape_str(a.weight.shape));
    require_shape(op, "out", a.out, {a.weight.dim(0)}, "weight's row count");
    require_no_overlap(op, "out", a.out, "x", a.x);
    require_no_overlap(op, "out", a.out, "weight", a.weight);
    const ks_backend_t be = resolve_backend(op, backend, a.x);
    a.n = a.weight.dim(0);
    a.h = a.x.dim(0);
    if (a.n == 0) return KS_SUCCESS;
    return ks::registry::dispatch(op, be, a.x.dtype, &a, stream);
  });
}

extern "C" ks_status_t ks_gemm(DLTensor* out, const DLTensor* a_, const DLTensor* b_, ks_backend_t backend,
                               ks_stream_t stream) {
  static const char* op = "gemm";
  return guard(op, [&] {
    GemmArgs a;
    a.a = view_of(op, "a", a_);
    a.b = view_of(op, "b", b_);
    a.out = view_of(op, "out", out);
    require_dtype(op, "a", a.a, {DType::F16, DType::BF16, DType::F32});
    require_like(op, {{"b", a.b}, {"out", a.out}}, "a", a.a);
    // a [..., K] (any leading dims, M = their product; as torch.nn.functional.linear), b [N, K],
    // out [..., N]
    require_min_ndim(op, "a", a.a, 1);
    require_ndim(op, "b", a.b, 2);
    require_nonempty_last(op, "a", a.a);
    if (a.b.dim(1) != a.a.cols())
      fail(KS_ERROR_INVALID_ARGUMENT, op,
           "b must have shape (N, " + std::to_string(a.a.cols()) + ") to match a's K; got " + shape_str(a.b.shape));
    require_shape(op, "out", a.out, linear_out_shape(a.a.shape, a.b.dim(0)), "a's leading dims + (N,)");
    require_no_overlap(op, "out", a.out, "a", a.a);
    require_no_overlap(op, "out", a.out, "b", a.b);
    const ks_backend_t be = resolve_backend(op, backend, a.a);
    a.m = a.a.rows();
    a.n = a.b.dim(0);
    a.k = a.a.cols();
    if (a.m == 0 || a.n == 0) return KS_SUCCESS;
    return ks::registry::dispatch(op, be, a.a.dtype, &a, stream);
  });
}

namespace {
// quant_matmul and quant_matmul_a8 take the same arguments and the same checks.
ks_status_t quant_matmul_entry(const char* op, DLTensor* out, const DLTensor* x, const DLTensor* weight,
                               ks_qtype_t qtype, ks_backend_t backend, ks_stream_t stream, bool a8) {
  return guard(op, [&] {
    QuantMatmulArgs a;
    a.x = view_of(op, "x", x);
    a.weight = view_of(op, "weight", weight);
    a.out = view_of(op, "out", out);
    require_dtype(op, "x", a.x, {DType::F16, DType::BF16, DType::F32});
    require_same_dtype(op, "out", a.out, "x", a.x);
    require_same_devices(op, {{"weight", a.weight}, {"out", a.out}}, "x", a.x);
    // x [..., K] (any leading dims, M = their product; as torch.nn.functional.linear), out [..., N]
    require_min_ndim(op, "x", a.x, 1);
    require_nonempty_last(op, "x", a.x);
    if (a8 && qtype != KS_QTYPE_Q4_0 && qtype != KS_QTYPE_Q4_1 && qtype != KS_QTYPE_Q8_0) {
      // (the note only for the dense formats, which quant_matmul takes; none or an unknown code is not one)
      const bool dense = ks::qtype_is_dense(qtype);
      fail(KS_ERROR_INVALID_ARGUMENT, op,
           "qtype must be an integer block format (Q4_0, Q4_1 or Q8_0); got " +
               (dense ? std::string(qtype_name(qtype)) + " (a dense format: quant_matmul takes it)"
                      : qtype == KS_QTYPE_NONE ? std::string("none") : std::to_string(int(qtype))));
    }
    check_packed(op, "weight", a.weight, qtype, a.x.cols(), "qtype", "x's K (columns)");
    require_shape(op, "out", a.out, linear_out_shape(a.x.shape, a.weight.dim(0)), "x's leading dims + (N,)");
    require_no_overlap(op, "out", a.out, "x", a.x);
    require_no_overlap(op, "out", a.out, "weight", a.weight);
    const ks_backend_t be = resolve_backend(op, backend, a.x);
    a.qtype = qtype;
    a.m = a.x.rows();
    a.n = a.weight.dim(0);
    a.k = a.x.cols();
    a.row_bytes = a.weight.dim(1);
    if (a.m == 0 || a.n == 0) return KS_SUCCESS;
    return ks::registry::dispatch(op, be, a.x.dtype, &a, stream);
  });
}
}  // namespace

extern "C" ks_status_t ks_quant_matmul(DLTensor* out, const DLTensor* x, const DLTensor* weight, ks_qtype_t qtype,
                                       ks_backend_t backend, ks_stream_t stream) {
  return quant_matmul_entry("quant_matmul", out, x, weight, qtype, backend, stream, false);
}

extern "C" ks_status_t ks_quant_matmul_a8(DLTensor* out, const DLTensor* x, const DLTensor* weight, ks_qtype_t qtype,
                                          ks_backend_t backend, ks_stream_t stream) {
  return quant_matmul_entry("quant_matmul_a8", out, x, weight, qtype, backend, stream, true);
}

void ks::ops::validate_norm_quant_matmul(const char* op, NormQuantMatmulArgs& a, DLTensor* out, DLTensor* residual_out,
                                         const DLTensor* x, const DLTensor* residual, const DLTensor* norm_weight,
                                         double eps, const DLTensor* weight, ks_qtype_t qtype, bool leading_dims) {
  a.has_x = x != nullptr;
  if (!a.has_x && residual_out)
    fail(KS_ERROR_INVALID_ARGUMENT, op, "residual_out is given but x is missing: residual_out = x + residual needs x");
  if (a.has_x && !residual_out)
    fail(KS_ERROR_INVALID_ARGUMENT, op, "x is given but residual_out is missing: x + residual must be written somewhere");
  a.residual = view_of(op, "residual", residual);
  a.norm_weight = view_of(op, "norm_weight", norm_weight);
  a.weight = view_of(op, "weight", weight);
  a.out = view_of(op, "out", out);
  require_dtype(op, "residual", a.residual, {DType::F16, DType::BF16, DType::F32});
  // residual [..., K] (any leading dims, M = their product, as quant_matmul's x), or [M, K]
  if (leading_dims)
    require_min_ndim(op, "residual", a.residual, 1);
  else
    require_ndim(op, "residual", a.residual, 2);
  require_nonempty_last(op, "residual", a.residual);
  if (a.has_x) {
    a.x = view_of(op, "x", x);
    a.residual_out = view_of(op, "residual_out", residual_out);
    require_like(op, {{"x", a.x}, {"residual_out", a.residual_out}}, "residual", a.residual);
    require_shape(op, "x", a.x, a.residual.shape, "same as residual");
    require_shape(op, "residual_out", a.residual_out, a.residual.shape, "same as residual");
  }
  require_same_dtypes(op, {{"norm_weight", a.norm_weight}, {"out", a.out}}, "residual", a.residual);
  require_same_devices(op, {{"norm_weight", a.norm_weight}, {"weight", a.weight}, {"out", a.out}}, "residual",
                       a.residual);
  require_shape(op, "norm_weight", a.norm_weight, {a.residual.cols()}, "hidden_size (K) of residual");
  check_packed(op, "weight", a.weight, qtype, a.residual.cols(), "qtype", "residual's K (columns)");
  require_shape(op, "out", a.out, linear_out_shape(a.residual.shape, a.weight.dim(0)), "residual's leading dims + (N,)");
  a.eps = checked_eps(op, eps);
  // out and residual_out are written while every input is still read (by other blocks)
  const std::pair<const char*, const View*> inputs[] = {
      {"residual", &a.residual}, {"norm_weight", &a.norm_weight}, {"weight", &a.weight}, {"x", &a.x}};
  for (const auto& [name, v] : inputs) {
    if (!a.has_x && v == &a.x) continue;
    require_no_overlap(op, "out", a.out, name, *v);
    if (a.has_x) require_no_overlap(op, "residual_out", a.residual_out, name, *v);
  }
  if (a.has_x) require_no_overlap(op, "out", a.out, "residual_out", a.residual_out);
  a.qtype = qtype;
  a.m = a.residual.rows();
  a.n = a.weight.dim(0);
  a.k = a.residual.cols();
  a.row_bytes = a.weight.dim(1);
}

extern "C" ks_status_t ks_fused_add_rms_norm_quant_matmul(DLTensor* out, DLTensor* residual_out, const DLTensor* x,
                                                          const DLTensor* residual, const DLTensor* norm_weight,
                                                          double eps, const DLTensor* weight, ks_qtype_t qtype,
                                                          ks_backend_t backend, ks_stream_t stream) {
  static const char* op = "fused_add_rms_norm_quant_matmul";
  return guard(op, [&] {
    NormQuantMatmulArgs a;
    validate_norm_quant_matmul(op, a, out, residual_out, x, residual, norm_weight, eps, weight, qtype);
    const ks_backend_t be = resolve_backend(op, backend, a.residual);
    if (a.m == 0) return KS_SUCCESS;
    return ks::registry::dispatch(op, be, a.residual.dtype, &a, stream);
  });
}

extern "C" ks_status_t ks_silu_and_mul_quant_matmul(DLTensor* out, const DLTensor* gate_up, const DLTensor* weight,
                                                    ks_qtype_t qtype, ks_backend_t backend, ks_stream_t stream) {
  static const char* op = "silu_and_mul_quant_matmul";
  return guard(op, [&] {
    SiluQuantMatmulArgs a;
    a.gate_up = view_of(op, "gate_up", gate_up);
    a.weight = view_of(op, "weight", weight);
    a.out = view_of(op, "out", out);
    require_dtype(op, "gate_up", a.gate_up, {DType::F16, DType::BF16, DType::F32});
    require_same_dtype(op, "out", a.out, "gate_up", a.gate_up);
    require_same_devices(op, {{"weight", a.weight}, {"out", a.out}}, "gate_up", a.gate_up);
    // gate_up [..., 2K] (any leading dims, M = their product, as quant_matmul's x), out [..., N]
    require_min_ndim(op, "gate_up", a.gate_up, 1);
    require_nonempty_last(op, "gate_up", a.gate_up);
    if (a.gate_up.cols() % 2 != 0)
      fail(KS_ERROR_INVALID_ARGUMENT, op,
           "gate_up's last dimension must be even (gate and up halves); got " + shape_str(a.gate_up.shape));
    check_packed(op, "weight", a.weight, qtype, a.gate_up.cols() / 2, "qtype", "gate_up's K (half its columns)");
    require_shape(op, "out", a.out, linear_out_shape(a.gate_up.shape, a.weight.dim(0)), "gate_up's leading dims + (N,)");
    require_no_overlap(op, "out", a.out, "gate_up", a.gate_up);
    require_no_overlap(op, "out", a.out, "weight", a.weight);
    const ks_backend_t be = resolve_backend(op, backend, a.gate_up);
    a.qtype = qtype;
    a.m = a.gate_up.rows();
    a.n = a.weight.dim(0);
    a.k = a.gate_up.cols() / 2;
    a.row_bytes = a.weight.dim(1);
    if (a.m == 0 || a.n == 0) return KS_SUCCESS;
    return ks::registry::dispatch(op, be, a.gate_up.dtype, &a, stream);
  });
}

extern "C" ks_status_t ks_dequantize(DLTensor* out, const DLTensor* packed, ks_qtype_t qtype, ks_backend_t backend,
                                     ks_stream_t stream) {
  static const char* op = "dequantize";
  return guard(op, [&] {
    DequantizeArgs a;
    a.packed = view_of(op, "packed", packed);
    a.out = view_of(op, "out", out);
    require_dtype(op, "out", a.out, {DType::F16, DType::BF16, DType::F32});
    require_same_device(op, "out", a.out, "packed", a.packed);
    require_ndim(op, "out", a.out, 2);
    require_nonempty_last(op, "out", a.out);
    check_packed(op, "packed", a.packed, qtype, a.out.dim(1), "qtype", "out's columns");
    if (a.packed.dim(0) != a.out.dim(0))
      fail(KS_ERROR_INVALID_ARGUMENT, op, "packed has " + std::to_string(a.packed.dim(0)) + " rows but out has " +
                                              std::to_string(a.out.dim(0)));
    require_no_overlap(op, "out", a.out, "packed", a.packed);
    const ks_backend_t be = resolve_backend(op, backend, a.out);
    a.qtype = qtype;
    a.rows = a.out.dim(0);
    a.cols = a.out.dim(1);
    a.row_bytes = a.packed.dim(1);
    if (a.rows == 0) return KS_SUCCESS;
    return ks::registry::dispatch(op, be, a.out.dtype, &a, stream);
  });
}
