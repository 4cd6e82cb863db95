// rms_norm and fused_add_rms_norm: validation, contract, dispatch.
//
// Contract (docs/contracts.md, matches the seed's PyTorch reference):
//   rms_norm:   r = rsqrt(mean(fp32(x)^2) + eps);  out = round(fp32(x) * r * fp32(weight))
//   fused_add:  s = fp32(x) + fp32(residual);  residual = round(s);
//               x = round(s * rsqrt(mean(s^2) + eps) * fp32(weight))   (s unrounded)
// Sums of squares accumulate in FP32 (order unspecified; backends document theirs).
#include "ops/args.hpp"
#include "registry/registry.hpp"

using namespace ks::detail;
using ks::ops::FusedAddRmsNormArgs;
using ks::ops::RmsNormArgs;

extern "C" ks_status_t ks_rms_norm(DLTensor* out, const DLTensor* x, const DLTensor* weight, double eps,
                                   ks_backend_t backend, ks_stream_t stream) {
  static const char* op = "rms_norm";
  return guard(op, [&] {
    RmsNormArgs a;
    a.x = view_of(op, "x", x);
    a.weight = view_of(op, "weight", weight);
    a.out = view_of(op, "out", out);
    require_dtype(op, "x", a.x, {DType::F16, DType::BF16, DType::F32});
    require_like(op, {{"weight", a.weight}, {"out", a.out}}, "x", a.x);
    require_min_ndim(op, "x", a.x, 1);
    require_nonempty_last(op, "x", a.x);
    require_shape(op, "weight", a.weight, {a.x.cols()}, "hidden_size of x");
    require_shape(op, "out", a.out, a.x.shape, "same as x");
    a.eps = checked_eps(op, eps);
    require_no_overlap(op, "out", a.out, "weight", a.weight);
    require_inplace_or_disjoint(op, "out", a.out, "x", a.x);
    const ks_backend_t be = resolve_backend(op, backend, a.x);
    a.rows = a.x.rows();
    a.hidden = a.x.cols();
    if (a.rows == 0) return KS_SUCCESS;
    return ks::registry::dispatch(op, be, a.x.dtype, &a, stream);
  });
}

extern "C" ks_status_t ks_fused_add_rms_norm(DLTensor* x, DLTensor* residual, const DLTensor* weight, double eps,
                                             ks_backend_t backend, ks_stream_t stream) {
  static const char* op = "fused_add_rms_norm";
  return guard(op, [&] {
    FusedAddRmsNormArgs a;
    a.x = view_of(op, "x", x);
    a.residual = view_of(op, "residual", residual);
    a.weight = view_of(op, "weight", weight);
    require_dtype(op, "x", a.x, {DType::F16, DType::BF16, DType::F32});
    require_like(op, {{"residual", a.residual}, {"weight", a.weight}}, "x", a.x);
    require_min_ndim(op, "x", a.x, 1);
    require_nonempty_last(op, "x", a.x);
    require_shape(op, "residual", a.residual, a.x.shape, "same as x");
    require_shape(op, "weight", a.weight, {a.x.cols()}, "hidden_size of x");
    a.eps = checked_eps(op, eps);
    require_no_overlap(op, "x", a.x, "residual", a.residual);
    require_no_overlap(op, "x", a.x, "weight", a.weight);
    require_no_overlap(op, "residual", a.residual, "weight", a.weight);
    const ks_backend_t be = resolve_backend(op, backend, a.x);
    a.rows = a.x.rows();
    a.hidden = a.x.cols();
    if (a.rows == 0) return KS_SUCCESS;
    return ks::registry::dispatch(op, be, a.x.dtype, &a, stream);
  });
}
