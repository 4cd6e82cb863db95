// Routing tables: which variant of (op, backend) to try first for a GPU arch, dtype and
// shape bucket. The tables are JSON (src/registry/routing/<arch>.json, compiled into the
// library; KS_ROUTING_TABLE=<file> replaces them at run time) and are documented in
// docs/routing.md. A cell only reorders: the variants it lists are tried first, in its
// order, then every other variant of (op, backend) by priority; each still has to pass
// dtype, availability, deterministic-mode and can_implement checks, so a cell can never
// pick a variant that cannot run a call, and the CPU backend's chain still ends at the
// portable reference.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <kernscope/kernscope.h>

namespace ks::registry {

// The shape a call is routed by: (rows, cols) as docs/routing.md defines them per op, the
// device of its tensors (for the arch), and the ops with packed weights' block format
// ("q4_0", "q4_1", "q8_0", ...; "" for the others).
struct RouteKey {
  int64_t rows = 0, cols = 0;
  int device = 0;
  const char* qtype = "";
};
// Implemented by the ops layer (src/ops/route_key.cpp); an op without a definition gets {0, 0}.
RouteKey route_key(const char* op, const void* args);
// The factors' names where route_key's cols is a product (e.g. quant_matmul's N x K), else nullptr
// (src/ops/route_key.cpp, beside route_key).
const char* cols_factors(std::string_view op);

struct Cell {
  std::string op, backend, arch, dtype;  // arch "*" / dtype "*": any
  std::string qtype = "*";               // the weights' block format ("q4_1", ...); "*": any
  int64_t rows_min = 0, rows_max = INT64_MAX, cols_min = 0, cols_max = INT64_MAX;  // inclusive
  std::vector<std::string> order;  // variant names, tried first, in this order
  std::string basis;               // "measured" or "heuristic"
  std::string source;              // measured: the CSV (and commit) the order comes from
  std::string why;                 // one line: what the measurement / heuristic says
  std::string table;               // the file the cell came from
  int index = 0;                   // its position there
};

// Whether op's calls carry a block format (RouteKey::qtype): the ops with packed weights
// (quant_matmul and its fusions, embedding, dequantize). Only their cells may name a "qtype", and
// only ks_which for them takes one ("bf16:q4_1").
bool op_has_block_format(std::string_view op);

struct Table {
  std::vector<Cell> cells;  // in match order: the first matching cell wins
  std::vector<std::string> files;
};

// Parses one routing JSON document (schema "kernscope-routing/1"); throws
// ks::detail::Failure (KS_ERROR_INVALID_ARGUMENT) naming `name` and the bad field.
Table parse_table(const std::string& json, const std::string& name);
// Whether c applies to (op, backend, arch, dtype) at some shape (arch/dtype "*" match any).
bool cell_matches(const Cell& c, std::string_view op, std::string_view backend, std::string_view arch,
                  std::string_view dtype);
// Whether q names a block format a cell or a which() query may give: q4_0, q4_1, q8_0, f32, f16, bf16.
bool is_qtype_key(std::string_view q);
// Whether c applies to a call or query of block format qtype ("": none): c's qtype "*" or equal.
inline bool qtype_matches(const Cell& c, std::string_view qtype) { return c.qtype == "*" || c.qtype == qtype; }
// Whether (rows, cols) lies in c's ranges; whether c bounds neither.
inline bool shape_in(const Cell& c, int64_t rows, int64_t cols) {
  return rows >= c.rows_min && rows <= c.rows_max && cols >= c.cols_min && cols <= c.cols_max;
}
inline bool shape_unbounded(const Cell& c) {
  return c.rows_min == 0 && c.rows_max == INT64_MAX && c.cols_min == 0 && c.cols_max == INT64_MAX;
}
// The first cell of t that matches; nullptr when none does. any_rows: ignore the cells' rows
// bounds (deterministic mode: the variant for a row must not depend on the call's row count).
// qtype: the call's block format (RouteKey::qtype); a cell bound to a qtype matches only calls
// of that format ("": a call or query without one matches only cells for any qtype).
const Cell* find_cell(const Table& t, std::string_view op, std::string_view backend, std::string_view arch,
                      std::string_view dtype, int64_t rows, int64_t cols, bool any_rows = false,
                      std::string_view qtype = "");
// The active table: KS_ROUTING_TABLE's file when set, else the compiled-in files. Parsed once
// (parse_table: a cell whose op is not an operator of this build, op_is_known, fails the load,
// naming it: a misspelt op would otherwise never match, and its cell be ignored without a word).
const Table& active_table();
// Whether op is an operator of this build: a variant of it is registered (registry.cpp; a test
// that compiles this file alone defines its own).
bool op_is_known(std::string_view op);
// Where an unknown op's message sends the reader for this build's operators (every binding shows it).
inline constexpr const char* kOpsListedBy = "\"ksctl ops\" lists this build's operators; in Python, kernscope.OPS";
// A device's arch name ("sm_90" for compute capability 9.0); device < 0: the current device;
// "" without a CUDA device.
std::string cuda_arch_name(int device);
// "routing cell N of FILE (basis[: source])" for ks_which / ksctl which.
std::string describe(const Cell& c);
// The cells of t for (op, backend, arch, dtype) at any shape, one clause each
// ("rows 1..64, cols 4096..any: [a, b] (routing cell 0 of sm_90.json (heuristic))"), "; "-joined.
// qtype given ("q4_1", ...): the cells bound to another block format are left out.
std::string cells_summary(const Table& t, std::string_view op, std::string_view backend, std::string_view arch,
                          std::string_view dtype, std::string_view qtype = "");
// t as one JSON document (schema "kernscope-routing-active/1"): {"files": [...], "cells": [{op, backend,
// arch, dtype, rows: [min, max|null], cols: [...], order, basis, source, why, table, index}]}.
std::string to_json(const Table& t);

}  // namespace ks::registry
