// sample: validation, contract and dispatch (docs/contracts.md#sample). The
// arithmetic every backend shares is in core/sampling_math.hpp.
#include <cmath>
#include <string>

#include "ops/args.hpp"
#include "registry/registry.hpp"

using namespace ks::detail;
using namespace ks::ops;

extern "C" ks_status_t ks_sample(DLTensor* out, DLTensor* valid, const DLTensor* logits, const DLTensor* seed_offset,
                                 double temperature, int64_t top_k, double top_p, ks_backend_t backend,
                                 ks_stream_t stream) {
  static const char* op = "sample";
  return guard(op, [&] {
    SampleArgs a;
    a.logits = view_of(op, "logits", logits);
    a.out = view_of(op, "out", out);
    a.has_valid = valid != nullptr;
    if (a.has_valid) a.valid = view_of(op, "valid", valid);
    a.seed_offset = view_of(op, "seed_offset", seed_offset);
    require_dtype(op, "logits", a.logits, {DType::F16, DType::BF16, DType::F32});
    require_dtype(op, "out", a.out, {DType::I64});
    require_dtype(op, "seed_offset", a.seed_offset, {DType::I64});
    if (a.has_valid) require_dtype(op, "valid", a.valid, {DType::U8});
    require_same_devices(op, {{"out", a.out}, {"seed_offset", a.seed_offset}}, "logits", a.logits);
    if (a.has_valid) require_same_device(op, "valid", a.valid, "logits", a.logits);
    require_min_ndim(op, "logits", a.logits, 1);
    require_nonempty_last(op, "logits", a.logits);
    // the fixed-point weights (each at most 2^40) add up exactly in int64 only over fewer than 2^23 ids
    if (a.logits.cols() >= (int64_t(1) << 23))
      fail(KS_ERROR_INVALID_ARGUMENT, op,
           "logits' last dimension (the vocab) must be below 2^23 = 8388608, where the fixed-point weights (at "
           "most 2^40 each) still sum exactly in 64 bits; got " + std::to_string(a.logits.cols()));
    // one id per row, out = logits' leading dims ([..., vocab] -> [...]; row r of the flattened
    // leading dims draws counter (offset, r))
    const Shape lead = leading_dims(a.logits.shape);
    require_shape(op, "out", a.out, lead, "logits' shape without its last dim (one id per row)");
    if (a.has_valid) require_shape(op, "valid", a.valid, lead, "logits' shape without its last dim (one flag per row)");
    require_shape(op, "seed_offset", a.seed_offset, {2}, "{seed, offset}");
    if (!std::isfinite(temperature) || !(temperature > 0.0) || !(float(temperature) > 0.0f) ||
        !std::isfinite(float(temperature)))
      fail(KS_ERROR_INVALID_ARGUMENT, op,
           "temperature must be finite and > 0 (also after rounding to fp32; for greedy decoding use argmax); got " +
               num_str(temperature));
    if (top_k < 0) fail(KS_ERROR_INVALID_ARGUMENT, op, "top_k must be >= 0 (0: off); got " + std::to_string(top_k));
    if (!(top_p > 0.0 && top_p <= 1.0))
      fail(KS_ERROR_INVALID_ARGUMENT, op, "top_p must be in (0, 1] (1: off); got " + num_str(top_p));
    require_no_overlap(op, "out", a.out, "logits", a.logits);
    require_no_overlap(op, "out", a.out, "seed_offset", a.seed_offset);
    if (a.has_valid) {
      require_no_overlap(op, "valid", a.valid, "logits", a.logits);
      require_no_overlap(op, "valid", a.valid, "out", a.out);
      require_no_overlap(op, "valid", a.valid, "seed_offset", a.seed_offset);
    }
    const ks_backend_t be = resolve_backend(op, backend, a.logits);
    a.temperature = float(temperature);
    a.rows = a.logits.rows();
    a.vocab = a.logits.cols();
    a.top_k = top_k >= a.vocab ? 0 : top_k;
    a.top_p = top_p;
    if (a.rows == 0) return KS_SUCCESS;
    return ks::registry::dispatch(op, be, a.logits.dtype, &a, stream);
  });
}
