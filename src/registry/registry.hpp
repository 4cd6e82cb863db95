// Registry of operator variants (after CUTLASS's Operation manifest).
// A variant declares the op it implements, its backend, the dtypes it takes,
// whether the machine can run it at all (available), and whether it can run a
// particular call (can_implement -> "" or the reason it cannot). Selection walks
// the variants of (op, backend) from the highest priority down; the portable CPU
// reference has the lowest priority and accepts every valid call, so selection
// for the CPU backend never dead-ends.
#pragma once

#include <kernscope/kernscope.h>

#include <string>
#include <vector>

#include "core/common.hpp"

namespace ks::registry {

inline unsigned dtype_bit(detail::DType d) { return 1u << unsigned(d); }
constexpr unsigned kFloatDTypes = (1u << unsigned(detail::DType::F16)) | (1u << unsigned(detail::DType::BF16)) |
                                  (1u << unsigned(detail::DType::F32));

struct Variant {
  const char* op;
  ks_backend_t backend;
  const char* name;
  unsigned dtype_mask;  // activation dtypes accepted (dtype_bit)
  int priority;         // higher wins
  const char* summary;
  bool (*available)();                          // machine-level (CPU features, device); nullptr = always
  std::string (*can_implement)(const void* args);  // call-level; nullptr = always ""
  void (*run)(const void* args, ks_stream_t stream);
  // A row's result depends only on the row (not on the call's row count or the row's
  // place): eligible in deterministic mode. Variants that are not say so here.
  bool batch_invariant = true;
  // Takes the GGUF block formats only (Q4_0, Q4_1, Q8_0): selection skips it for dense weights
  // (F32, F16, BF16; the call's format from route_key), a pin on it refuses them, and ks_which
  // reports it skipped for a dense block format ("fp32:f16"). Its can_implement need not check.
  bool block_formats_only = false;
};

// Deterministic (batch-invariant) mode: ks_set_deterministic, KS_DETERMINISTIC=1.
bool deterministic();
void set_deterministic(bool on);

// The variant pinned for op on this thread (ks_force_variant), or nullptr.
const char* pinned_variant(const char* op);

// All registered variants (registered once, on first use).
const std::vector<Variant>& all();

struct Choice {
  const Variant* variant = nullptr;
  std::string reason;
};

// Best variant for this call. Throws ks::detail::Failure (BACKEND_UNAVAILABLE
// or UNSUPPORTED_DTYPE) naming the op when none can run it.
Choice select(const char* op, ks_backend_t backend, detail::DType dtype, const void* args);

// The operator whose variants an entry point dispatches to when it is not its own name
// ("paged_attention_after_append" -> "paged_attention"), or nullptr.
const char* dispatch_alias(const char* op);

// Best variant ignoring call-level checks (for ks_which / ksctl which).
// shape (rows, cols; docs/routing.md#shape-keys-rows-cols) given: the cell matching it orders the
// variants, as for a call of that shape; otherwise only a cell covering every shape does. qtype:
// the weights' block format of a packed-weight op's call ("q4_1", ...; "": none), for the cells
// bound to one.
Choice select_static(const char* op, ks_backend_t backend, detail::DType dtype, const int64_t* shape = nullptr,
                     std::string_view qtype = "");

// The routing-table cell (src/registry/routing.hpp) that orders the variants for this call,
// or nullptr (then: priority order).
struct Cell;
const Cell* routed_cell(const char* op, ks_backend_t backend, detail::DType dtype, const void* args);

// Runs validation-complete args through the selected variant.
ks_status_t dispatch(const char* op, ks_backend_t backend, detail::DType dtype, const void* args,
                     ks_stream_t stream);

// Thread-local pin (ks_force_variant); throws Failure for unknown names.
void force_variant(const char* op, const char* variant);
// The variant pinned for op on this thread as the registry's static name, or nullptr
// (ks_forced_variant); throws Failure for an unknown op.
const char* forced_variant(const char* op);

// Registration hooks, one per backend (called once by all()).
void register_cpu_variants(std::vector<Variant>& out);
void register_cuda_variants(std::vector<Variant>& out);
void register_cpu_sampling(std::vector<Variant>& out);   // src/backends/cpu/sampling.cpp
void register_cpu_attention(std::vector<Variant>& out);  // src/backends/cpu/varlen_attention.cpp

}  // namespace ks::registry
