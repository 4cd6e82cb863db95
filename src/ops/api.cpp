// Library-level entry points: version, errors, backends, registry queries.
#include <mutex>
#include <string>

#include "core/dtype_key.hpp"
#include "ops/args.hpp"
#include "registry/registry.hpp"
#include "registry/routing.hpp"

namespace ks::detail {
const char* last_error_cstr();
}

using namespace ks::detail;

#define KS_STR2(x) #x
#define KS_STR(x) KS_STR2(x)

extern "C" const char* ks_version(void) {
  return KS_STR(KS_VERSION_MAJOR) "." KS_STR(KS_VERSION_MINOR) "." KS_STR(KS_VERSION_PATCH);
}

extern "C" const char* ks_last_error(void) { return last_error_cstr(); }

extern "C" const char* ks_status_name(ks_status_t s) {
  switch (s) {
    case KS_SUCCESS: return "KS_SUCCESS";
    case KS_ERROR_INVALID_ARGUMENT: return "KS_ERROR_INVALID_ARGUMENT";
    case KS_ERROR_UNSUPPORTED_DTYPE: return "KS_ERROR_UNSUPPORTED_DTYPE";
    case KS_ERROR_UNSUPPORTED_DEVICE: return "KS_ERROR_UNSUPPORTED_DEVICE";
    case KS_ERROR_BACKEND_UNAVAILABLE: return "KS_ERROR_BACKEND_UNAVAILABLE";
    case KS_ERROR_CUDA: return "KS_ERROR_CUDA";
    case KS_ERROR_OUT_OF_MEMORY: return "KS_ERROR_OUT_OF_MEMORY";
    case KS_ERROR_INTERNAL: return "KS_ERROR_INTERNAL";
  }
  return "KS_UNKNOWN_STATUS";
}

extern "C" int ks_backend_available(ks_backend_t backend) {
  switch (backend) {
    case KS_BACKEND_AUTO:
    case KS_BACKEND_CPU: return 1;
    case KS_BACKEND_CUDA: return ks::cuda::device_present() ? 1 : 0;
  }
  return 0;
}

extern "C" size_t ks_variant_count(void) { return ks::registry::all().size(); }

static std::string dtype_list(unsigned mask) {
  std::string s;
  for (DType d : {DType::F16, DType::BF16, DType::F32})
    if (mask & ks::registry::dtype_bit(d)) s += std::string(s.empty() ? "" : ",") + dtype_name(d);
  return s;
}

extern "C" ks_status_t ks_variant_info(size_t index, ks_variant_info_t* info) {
  return guard("variant_info", [&] {
    const auto& all = ks::registry::all();
    if (info == nullptr) fail(KS_ERROR_INVALID_ARGUMENT, "variant_info", "info is NULL");
    if (index >= all.size())
      fail(KS_ERROR_INVALID_ARGUMENT, "variant_info",
           "index " + std::to_string(index) + " >= variant count " + std::to_string(all.size()));
    const auto& v = all[index];
    // dtype strings are interned per mask so the pointer stays valid (static storage).
    static std::string interned[1u << 8];
    static std::once_flag once;
    std::call_once(once, [] {
      for (unsigned m = 0; m < (1u << 8); ++m) interned[m] = dtype_list(m);
    });
    info->op = v.op;
    info->backend = v.backend == KS_BACKEND_CUDA ? "cuda" : "cpu";
    info->name = v.name;
    info->dtypes = interned[v.dtype_mask & 0xFFu].c_str();
    info->summary = v.summary;
    return KS_SUCCESS;
  });
}

extern "C" ks_status_t ks_routing_table(const char** json) {
  return guard("routing_table", [&] {
    if (json == nullptr) fail(KS_ERROR_INVALID_ARGUMENT, "routing_table", "json is NULL");
    static const std::string text = ks::registry::to_json(ks::registry::active_table());
    *json = text.c_str();
    return KS_SUCCESS;
  });
}

namespace {
// ks_which and ks_which_shape (shape: {rows, cols}, or nullptr)
ks_status_t which_impl(const char* op, const char* dtype, ks_backend_t backend, const int64_t* shape,
                       const char** variant, const char** reason) {
  return guard("which", [&] {
    if (op == nullptr) fail(KS_ERROR_INVALID_ARGUMENT, "which", "op is NULL");
    if (dtype == nullptr) fail(KS_ERROR_INVALID_ARGUMENT, "which", "dtype is NULL");
    if (variant == nullptr || reason == nullptr) fail(KS_ERROR_INVALID_ARGUMENT, "which", "variant/reason is NULL");
    const char* asked = op;  // an entry point that runs another operator's variants answers as that operator
    if (const char* a = ks::registry::dispatch_alias(op)) op = a;
    // "bf16", or "bf16:q4_1": the activations' dtype, then the weights' block format (the
    // routing cells bound to one; docs/routing.md)
    // (any case; torch's names float16 / half, bfloat16, float32 / float as fp16, bf16, fp32)
    const std::string full = ks::canonical_dtype_key(dtype), base = full.substr(0, full.find(':'));
    const std::string qtype = full.find(':') == std::string::npos ? "" : full.substr(full.find(':') + 1);
    DType d = DType::Other;
    for (DType c : {DType::F16, DType::BF16, DType::F32})
      if (base == dtype_name(c)) d = c;
    if (d == DType::Other)
      fail(KS_ERROR_UNSUPPORTED_DTYPE, "which",
           "dtype must be fp16, bf16 or fp32 (also float16 / half, bfloat16, float32 / float; any case), for "
           "packed-weight ops optionally followed by :q4_0, :q4_1, :q8_0, :f32, :f16 or :bf16; got '" +
               std::string(dtype) + "'");
    if (full.find(':') != std::string::npos) {
      if (!ks::registry::op_has_block_format(op))
        fail(KS_ERROR_INVALID_ARGUMENT, "which",
             std::string("dtype: a block format after ':' is for the ops with packed weights only; ") + op +
                 " has none");
      if (!ks::registry::is_qtype_key(qtype))
        fail(KS_ERROR_INVALID_ARGUMENT, "which",
             "dtype's block format after ':' must be q4_0, q4_1, q8_0, f32, f16 or bf16; got '" + full + "'");
      if (std::string(op) == "quant_matmul_a8" && qtype != "q4_0" && qtype != "q4_1" && qtype != "q8_0")
        fail(KS_ERROR_INVALID_ARGUMENT, "which",
             "dtype: quant_matmul_a8 takes the integer block formats only (q4_0, q4_1, q8_0); got '" + full + "'");
    }
    if (backend == KS_BACKEND_AUTO) backend = ks_backend_available(KS_BACKEND_CUDA) ? KS_BACKEND_CUDA : KS_BACKEND_CPU;
    if (backend != KS_BACKEND_CPU && backend != KS_BACKEND_CUDA)
      fail(KS_ERROR_INVALID_ARGUMENT, "which", "unknown backend");
    static thread_local std::string v_out, r_out;
    if (const char* pin = ks::registry::pinned_variant(op)) {  // a pin decides (if it belongs to the backend)
      for (const auto& v : ks::registry::all())
        if (std::string(v.op) == op && v.backend == backend && v.name == std::string(pin)) {
          v_out = pin;
          r_out = "pinned by ks_force_variant on this thread";
          *variant = v_out.c_str();
          *reason = r_out.c_str();
          return KS_SUCCESS;
        }
    }
    if (shape && (shape[0] < 0 || shape[1] < 0)) fail(KS_ERROR_INVALID_ARGUMENT, "which", "rows and cols must be >= 0");
    auto c = ks::registry::select_static(op, backend, d, shape, qtype);
    if (!c.variant) {
      if (backend == KS_BACKEND_CUDA && !ks_backend_available(KS_BACKEND_CUDA))
        fail(KS_ERROR_BACKEND_UNAVAILABLE, op, std::string("the CUDA backend is not available: ") + ks::cuda::unavailable_reason());
      fail(KS_ERROR_BACKEND_UNAVAILABLE, op, "no variant for this dtype and backend" + (c.reason.empty() ? std::string() : ": " + c.reason));
    }
    v_out = c.variant->name;
    r_out = c.reason;
    {  // the routing table may put another variant first at some shapes: say where
      const std::string arch = backend == KS_BACKEND_CUDA ? ks::registry::cuda_arch_name(-1) : "cpu";
      const std::string cells = ks::registry::cells_summary(ks::registry::active_table(), op,
                                                            backend == KS_BACKEND_CUDA ? "cuda" : "cpu", arch, base,
                                                            qtype);
      if (!cells.empty() && !shape) r_out += "; by shape (" + (arch.empty() ? std::string("no device") : arch) + "): " + cells;
      if (shape) r_out += " (each call still passes its variant's can_implement: alignment, sizes)";
      if (asked != op) r_out += std::string("; ") + asked + " runs " + op + "'s variants";
      if (shape && qtype.empty()) {  // cells bound to a block format that a call of this shape may meet
        std::string formats;
        for (const auto& c : ks::registry::active_table().cells)
          if (c.qtype != "*" && ks::registry::cell_matches(c, op, backend == KS_BACKEND_CUDA ? "cuda" : "cpu", arch, base) &&
              ks::registry::shape_in(c, shape[0], shape[1]) && formats.find(c.qtype) == std::string::npos)
            formats += (formats.empty() ? "" : ", ") + c.qtype;
        if (!formats.empty())
          r_out += "; with " + formats + " weights a cell bound to that format may decide instead (ask with dtype '" +
                   base + ":" + formats.substr(0, formats.find(',')) + "')";
      }
    }
    *variant = v_out.c_str();
    *reason = r_out.c_str();
    return KS_SUCCESS;
  });
}
}  // namespace

extern "C" ks_status_t ks_which(const char* op, const char* dtype, ks_backend_t backend, const char** variant,
                                const char** reason) {
  return which_impl(op, dtype, backend, nullptr, variant, reason);
}

extern "C" ks_status_t ks_which_shape(const char* op, const char* dtype, ks_backend_t backend, int64_t rows,
                                      int64_t cols, const char** variant, const char** reason) {
  const int64_t shape[2] = {rows, cols};
  return which_impl(op, dtype, backend, shape, variant, reason);
}

extern "C" const char* ks_op_runs_variants_of(const char* op) { return ks::registry::dispatch_alias(op); }

extern "C" const char* ks_op_cols_factors(const char* op) {
  if (op == nullptr) return nullptr;
  if (const char* runs = ks::registry::dispatch_alias(op)) op = runs;  // (an entry point: as the op it runs)
  return ks::registry::cols_factors(op);
}

extern "C" ks_status_t ks_force_variant(const char* op, const char* variant) {
  return guard("force_variant", [&] {
    ks::registry::force_variant(op, variant);
    return KS_SUCCESS;
  });
}

extern "C" ks_status_t ks_forced_variant(const char* op, const char** variant) {
  return guard("forced_variant", [&] {
    if (op == nullptr) fail(KS_ERROR_INVALID_ARGUMENT, "forced_variant", "op is NULL");
    if (variant == nullptr) fail(KS_ERROR_INVALID_ARGUMENT, "forced_variant", "variant is NULL");
    *variant = ks::registry::forced_variant(op);
    return KS_SUCCESS;
  });
}

extern "C" ks_status_t ks_set_deterministic(int enabled) {
  // (through guard: a call that returns a status clears the last error, as the header says)
  return guard("set_deterministic", [&] {
    ks::registry::set_deterministic(enabled != 0);
    return KS_SUCCESS;
  });
}

extern "C" int ks_deterministic(void) { return ks::registry::deterministic() ? 1 : 0; }
