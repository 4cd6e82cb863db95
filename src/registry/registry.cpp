#include "registry/registry.hpp"

#include "registry/routing.hpp"

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <vector>

#include <atomic>
#include <cstdlib>

namespace ks::registry {

namespace {
std::atomic<int>& deterministic_flag() {
  static std::atomic<int> flag([] {
    const char* e = std::getenv("KS_DETERMINISTIC");
    return (e && e[0] == '1') ? 1 : 0;
  }());
  return flag;
}
}  // namespace

bool deterministic() { return deterministic_flag().load(std::memory_order_relaxed) != 0; }
void set_deterministic(bool on) { deterministic_flag().store(on ? 1 : 0, std::memory_order_relaxed); }

const std::vector<Variant>& all() {
  static std::vector<Variant> variants;
  static std::once_flag once;
  std::call_once(once, [] {
    register_cpu_variants(variants);
    register_cpu_sampling(variants);
    register_cpu_attention(variants);
    register_cuda_variants(variants);
    std::stable_sort(variants.begin(), variants.end(), [](const Variant& a, const Variant& b) {
      const int c = std::strcmp(a.op, b.op);
      if (c != 0) return c < 0;
      if (a.backend != b.backend) return a.backend < b.backend;
      return a.priority > b.priority;
    });
  });
  return variants;
}

static const char* backend_name(ks_backend_t b) { return b == KS_BACKEND_CUDA ? "cuda" : "cpu"; }

namespace {
// Why v cannot take calls of this dtype on this machine now ("" when it can): the checks
// every selection path makes before can_implement. A pinned variant skips the
// deterministic-mode check (with_deterministic false): the pin is the caller's choice.
std::string why_not_static(const Variant& v, detail::DType dtype, bool with_deterministic = true) {
  if (!(v.dtype_mask & dtype_bit(dtype))) return std::string("no ") + detail::dtype_name(dtype);
  if (v.available && !v.available()) return "not available on this machine";
  if (with_deterministic && !v.batch_invariant && deterministic()) return "not batch-invariant (deterministic mode)";
  return "";
}

// "" where v takes weights in the block format named qtype (route_key's / ks_which's "q4_1", "bf16",
// ...); else why not: a block_formats_only variant and dense weights. The one place that refuses
// them (the variants' can_implement does not repeat it).
std::string weights_reason(const Variant& v, std::string_view qtype) {
  if (!v.block_formats_only || !(qtype == "f32" || qtype == "f16" || qtype == "bf16")) return "";
  return "only the GGUF block formats Q4_0, Q4_1 and Q8_0 (the weights: " + std::string(qtype) +
         "; dense weights run on the default variant)";
}
// The same for a call: its weights' format from route_key (only asked of flagged variants).
std::string call_weights_reason(const Variant& v, const char* op, const void* args) {
  return v.block_formats_only ? weights_reason(v, route_key(op, args).qtype) : std::string();
}

bool in_order(const Cell* cell, const char* name) {
  return cell && std::find(cell->order.begin(), cell->order.end(), name) != cell->order.end();
}

// Visits the variants of (op, backend) in routing order: the cell's variants in its order,
// then the others by priority; stops at the first for which f returns true. No allocation
// (the per-call path uses it).
template <typename F>
const Variant* first_in_routing_order(const char* op, ks_backend_t backend, const Cell* cell, F&& f) {
  if (cell)
    for (const std::string& name : cell->order)
      for (const Variant& v : all())
        if (std::strcmp(v.op, op) == 0 && v.backend == backend && name == v.name && f(v)) return &v;
  for (const Variant& v : all())
    if (std::strcmp(v.op, op) == 0 && v.backend == backend && !in_order(cell, v.name) && f(v)) return &v;
  return nullptr;
}
}  // namespace

const char* dispatch_alias(const char* op) {
  // (ks_paged_attention_after_append validates its own promise, then runs paged_attention's variants)
  return op && std::string_view(op) == "paged_attention_after_append" ? "paged_attention" : nullptr;
}

bool op_is_known(std::string_view op) {
  for (const Variant& v : all())
    if (op == v.op) return true;
  return false;
}

Choice select_static(const char* op, ks_backend_t backend, detail::DType dtype, const int64_t* shape,
                     std::string_view qtype) {
  Choice c;
  std::string skipped;
  // A routing cell that covers every shape for this arch and dtype orders the variants for
  // every call, so it orders them here too (cells bounded by shape: ks_which lists them).
  // With a shape: the cell a call of that shape would use.
  const Table& t = active_table();
  const std::string arch = backend == KS_BACKEND_CUDA ? cuda_arch_name(-1) : "cpu";
  const Cell* cell = nullptr;
  if (shape)
    cell = find_cell(t, op, backend_name(backend), arch, detail::dtype_name(dtype), shape[0], shape[1], deterministic(),
                     qtype);
  else  // a cell with no rows or cols bound, for any block format or the query's
    for (const Cell& x : t.cells)
      if (!cell && cell_matches(x, op, backend_name(backend), arch, detail::dtype_name(dtype)) &&
          qtype_matches(x, qtype) && shape_unbounded(x))
        cell = &x;
  c.variant = first_in_routing_order(op, backend, cell, [&](const Variant& v) {
    std::string why = why_not_static(v, dtype);
    if (why.empty()) why = weights_reason(v, qtype);
    if (!why.empty()) skipped += std::string(skipped.empty() ? "" : "; ") + v.name + ": " + why;
    return why.empty();
  });
  if (c.variant) {
    const Variant& v = *c.variant;
    c.reason = in_order(cell, v.name) ? "first runnable variant of " + describe(*cell) +
                                            (shape ? ", the cell for rows " + std::to_string(shape[0]) + ", cols " +
                                                         std::to_string(shape[1])
                                                   : std::string(", which covers every shape"))
                                      : std::string("highest-priority ") + backend_name(backend) + " variant for " +
                                            detail::dtype_name(dtype) + " (priority " + std::to_string(v.priority) + ")";
    if (!skipped.empty()) c.reason += "; skipped " + skipped;
    return c;
  }
  if (!op_is_known(op))
    detail::fail(KS_ERROR_INVALID_ARGUMENT, "which",
                 "op: unknown operator '" + std::string(op) + "' (" + kOpsListedBy + ")");
  c.reason = skipped;
  return c;
}

namespace {
thread_local std::map<std::string, std::string> g_forced;  // op -> variant name
}

const char* pinned_variant(const char* op) {
  auto it = g_forced.find(op);
  return it == g_forced.end() ? nullptr : it->second.c_str();
}

namespace {
// op's variant named `name` (nullptr: none of that name, or name nullptr); fails naming `api`
// when no variant has op.
const Variant* variant_of(const char* op, const char* name, const char* api) {
  bool op_known = false;
  const Variant* found = nullptr;
  for (const Variant& v : all()) {
    if (std::strcmp(v.op, op) != 0) continue;
    op_known = true;
    if (name && std::strcmp(v.name, name) == 0) found = &v;
  }
  if (!op_known) detail::fail(KS_ERROR_INVALID_ARGUMENT, api, std::string("unknown op '") + op + "'");
  return found;
}
}  // namespace

void force_variant(const char* op, const char* variant) {
  if (op == nullptr) {
    if (variant)  // (a NULL op with a variant is a caller's mistake, not "clear every pin")
      detail::fail(KS_ERROR_INVALID_ARGUMENT, "force_variant",
                   std::string("op is NULL but variant '") + variant + "' is given (NULL op and NULL variant: clear every pin)");
    g_forced.clear();
    return;
  }
  if (const char* a = dispatch_alias(op)) op = a;  // (pinning an entry point pins the variants it runs)
  const bool found = variant_of(op, variant, "force_variant") != nullptr || variant == nullptr;
  if (!found) {  // (name the ones this build has: a CUDA variant's name on a CPU-only build, say)
    std::string have;
    for (const Variant& v : all())
      if (std::strcmp(v.op, op) == 0) have += (have.empty() ? "" : ", ") + std::string(v.name);
    detail::fail(KS_ERROR_INVALID_ARGUMENT, "force_variant",
                 std::string("op '") + op + "' has no variant '" + variant + "' in this build (it has: " + have + ")");
  }
  if (variant)
    g_forced[op] = variant;
  else
    g_forced.erase(op);
}

const char* forced_variant(const char* op) {
  if (const char* a = dispatch_alias(op)) op = a;  // (an entry point's pin is its variants' op's)
  const Variant* v = variant_of(op, pinned_variant(op), "forced_variant");
  return v ? v->name : nullptr;
}

const Cell* routed_cell(const char* op, ks_backend_t backend, detail::DType dtype, const void* args) {
  const Table& t = active_table();
  bool any = false;  // skip the shape key and arch lookup for ops the table does not mention
  for (const Cell& c : t.cells) any = any || (c.op == op && c.backend == backend_name(backend));
  if (!any) return nullptr;
  const RouteKey k = route_key(op, args);
  const std::string arch = backend == KS_BACKEND_CUDA ? cuda_arch_name(k.device) : "cpu";
  return find_cell(t, op, backend_name(backend), arch, detail::dtype_name(dtype), k.rows, k.cols, deterministic(),
                   k.qtype);
}

Choice select(const char* op, ks_backend_t backend, detail::DType dtype, const void* args) {
  Choice c;
  (void)active_table();  // a table that does not parse fails every call, pinned ones too
  if (!g_forced.empty()) {
    auto it = g_forced.find(op);
    if (it != g_forced.end()) {
      for (const Variant& v : all()) {
        if (std::strcmp(v.op, op) != 0 || v.backend != backend || it->second != v.name) continue;
        std::string why = why_not_static(v, dtype, /*with_deterministic=*/false);
        if (why.empty()) why = call_weights_reason(v, op, args);
        if (why.empty() && v.can_implement) why = v.can_implement(args);
        if (!why.empty())
          detail::fail(KS_ERROR_BACKEND_UNAVAILABLE, op, "pinned variant " + it->second + " cannot run this call: " + why);
        c.variant = &v;
        c.reason = "pinned by ks_force_variant";
        return c;
      }
      // a pin binds calls on its variant's backend only; calls on another backend route as usual
    }
  }
  std::string skipped;
  bool any_backend = false, any_dtype = false;
  // The routing table's cell for this shape, arch and dtype: its variants first, in its order.
  const Cell* cell = routed_cell(op, backend, dtype, args);
  c.variant = first_in_routing_order(op, backend, cell, [&](const Variant& v) {
    any_backend = true;
    if (!(v.dtype_mask & dtype_bit(dtype))) return false;  // not counted, not reported
    any_dtype = true;
    std::string why = why_not_static(v, dtype);
    if (why.empty()) why = call_weights_reason(v, op, args);
    if (why.empty() && v.can_implement) why = v.can_implement(args);
    if (!why.empty()) skipped += std::string(skipped.empty() ? "" : "; ") + v.name + ": " + why;
    return why.empty();
  });
  if (c.variant) return c;  // (no reason text on this per-call path: ks_which explains via select_static)
  if (!any_backend)
    detail::fail(KS_ERROR_BACKEND_UNAVAILABLE, op,
                 std::string("no ") + backend_name(backend) + " implementation is built");
  if (!any_dtype)
    detail::fail(KS_ERROR_UNSUPPORTED_DTYPE, op,
                 std::string("the ") + backend_name(backend) + " backend has no variant for dtype " +
                     detail::dtype_name(dtype));
  detail::fail(KS_ERROR_BACKEND_UNAVAILABLE, op, "no variant can run this call: " + skipped);
}

ks_status_t dispatch(const char* op, ks_backend_t backend, detail::DType dtype, const void* args,
                     ks_stream_t stream) {
  Choice c = select(op, backend, dtype, args);
  c.variant->run(args, stream);
  return KS_SUCCESS;
}

}  // namespace ks::registry
