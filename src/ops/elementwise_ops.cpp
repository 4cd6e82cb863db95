// silu_and_mul, softmax and argmax: validation, contract, dispatch.
//
// silu_and_mul: g = fp32(x[..., :D]), u = fp32(x[..., D:]); out = round(g * sigmoid(g) * u),
//               sigmoid(g) = 1 / (1 + exp(-g)) in FP32.
// softmax:      as torch.softmax(x.float(), -1): z = x - max(x); out = round(exp(z) / sum(exp(z))).
//               A row with NaN or +inf, or all -inf, is all NaN; -inf entries of a row with a
//               finite maximum give exactly 0.
// argmax:       first index of the maximum; a row holding NaN gives its first NaN's index.
#include "ops/args.hpp"
#include "registry/registry.hpp"

using namespace ks::detail;
using namespace ks::ops;

extern "C" ks_status_t ks_silu_and_mul(DLTensor* out, const DLTensor* x, ks_backend_t backend, ks_stream_t stream) {
  static const char* op = "silu_and_mul";
  return guard(op, [&] {
    SiluAndMulArgs a;
    a.x = view_of(op, "x", x);
    a.out = view_of(op, "out", out);
    require_dtype(op, "x", a.x, {DType::F16, DType::BF16, DType::F32});
    require_like(op, {{"out", a.out}}, "x", a.x);
    require_min_ndim(op, "x", a.x, 1);
    require_nonempty_last(op, "x", a.x);
    if (a.x.cols() % 2 != 0)
      fail(KS_ERROR_INVALID_ARGUMENT, op, "x's last dimension must be even (gate and up halves); got shape " +
                                               shape_str(a.x.shape));
    Shape oshape = a.x.shape;
    oshape.back() /= 2;
    require_shape(op, "out", a.out, oshape, "x's shape with the last dim halved");
    require_no_overlap(op, "out", a.out, "x", a.x);
    const ks_backend_t be = resolve_backend(op, backend, a.x);
    a.rows = a.x.rows();
    a.d = a.x.cols() / 2;
    if (a.rows == 0) return KS_SUCCESS;
    return ks::registry::dispatch(op, be, a.x.dtype, &a, stream);
  });
}

extern "C" ks_status_t ks_softmax(DLTensor* out, const DLTensor* x, ks_backend_t backend, ks_stream_t stream) {
  static const char* op = "softmax";
  return guard(op, [&] {
    SoftmaxArgs a;
    a.x = view_of(op, "x", x);
    a.out = view_of(op, "out", out);
    require_dtype(op, "x", a.x, {DType::F16, DType::BF16, DType::F32});
    require_like(op, {{"out", a.out}}, "x", a.x);
    require_min_ndim(op, "x", a.x, 1);
    require_nonempty_last(op, "x", a.x);
    require_shape(op, "out", a.out, a.x.shape, "same as x");
    require_inplace_or_disjoint(op, "out", a.out, "x", a.x);
    const ks_backend_t be = resolve_backend(op, backend, a.x);
    a.rows = a.x.rows();
    a.cols = a.x.cols();
    if (a.rows == 0) return KS_SUCCESS;
    return ks::registry::dispatch(op, be, a.x.dtype, &a, stream);
  });
}

extern "C" ks_status_t ks_argmax(DLTensor* out, const DLTensor* x, ks_backend_t backend, ks_stream_t stream) {
  static const char* op = "argmax";
  return guard(op, [&] {
    ArgmaxArgs a;
    a.x = view_of(op, "x", x);
    a.out = view_of(op, "out", out);
    require_dtype(op, "x", a.x, {DType::F16, DType::BF16, DType::F32});
    require_dtype(op, "out", a.out, {DType::I64});
    require_same_device(op, "out", a.out, "x", a.x);
    require_min_ndim(op, "x", a.x, 1);
    require_nonempty_last(op, "x", a.x);
    // one index per row, out = x's leading dims ([..., V] -> [...]; a 1-d x gives a 0-d index, as
    // torch.argmax(x, dim=-1))
    require_shape(op, "out", a.out, leading_dims(a.x.shape), "x's shape without its last dim (one index per row)");
    require_no_overlap(op, "out", a.out, "x", a.x);
    const ks_backend_t be = resolve_backend(op, backend, a.x);
    a.rows = a.x.rows();
    a.cols = a.x.cols();
    if (a.rows == 0) return KS_SUCCESS;
    return ks::registry::dispatch(op, be, a.x.dtype, &a, stream);
  });
}
