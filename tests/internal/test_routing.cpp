// The routing-table logic on its own (src/registry/routing.cpp compiled into this test):
// parsing and its error messages, cell matching for fake device descriptions (arch,
// dtype, shape buckets), first-match order, and the compiled-in tables.
#include <gtest/gtest.h>

#include <string>

#include "core/common.hpp"
#include "registry/routing.hpp"

namespace ks::registry {

// (the registry's op_is_known, which this test does not link: the ops the compiled-in tables name)
bool op_is_known(std::string_view op) {
  for (const char* o : {"argmax", "dequantize", "embedding", "fused_add_rms_norm", "fused_add_rms_norm_quant_matmul",
                        "fused_add_rms_norm_quant_matmul_rope_kv_append", "gemm", "gemv", "kv_cache_append",
                        "paged_attention", "quant_matmul", "quant_matmul_a8", "rms_norm", "rotary_embedding",
                        "rotary_embedding_kv_append", "rotary_embedding_kv_append_paged_attention", "sample",
                        "silu_and_mul", "silu_and_mul_quant_matmul", "softmax", "varlen_attention"})
    if (op == o) return true;
  return false;
}

namespace {

std::string doc(const std::string& arch, const std::string& cells) {
  return R"({"schema": "kernscope-routing/1", "arch": ")" + arch + R"(", "cells": [)" + cells + "]}";
}

std::string error_of(const std::string& json) {
  try {
    parse_table(json, "t.json");
  } catch (const detail::Failure& f) {
    return f.message;
  }
  return "";
}

TEST(Routing, ParsesCellsWithDefaults) {
  const Table t = parse_table(doc("sm_90", R"(
    {"op": "softmax", "backend": "cuda", "dtype": "bf16", "rows": [1, 64], "cols": [1024, null],
     "order": ["b", "a"], "basis": "measured", "source": "docs/perf/x.csv", "why": "b is 1.3x faster"},
    {"op": "softmax", "backend": "cuda", "order": ["a"], "basis": "heuristic", "why": "default"})"),
                              "t.json");
  ASSERT_EQ(t.cells.size(), 2u);
  const Cell& c = t.cells[0];
  EXPECT_EQ(c.arch, "sm_90");
  EXPECT_EQ(c.dtype, "bf16");
  EXPECT_EQ(c.rows_min, 1);
  EXPECT_EQ(c.rows_max, 64);
  EXPECT_EQ(c.cols_min, 1024);
  EXPECT_EQ(c.cols_max, INT64_MAX);
  EXPECT_EQ(c.order, (std::vector<std::string>{"b", "a"}));
  EXPECT_EQ(describe(c), "routing cell 0 of t.json (measured: docs/perf/x.csv)");
  const Cell& d = t.cells[1];
  EXPECT_EQ(d.dtype, "*");
  EXPECT_EQ(d.qtype, "*");  // no "qtype": every block format
  EXPECT_EQ(d.rows_min, 0);
  EXPECT_EQ(d.rows_max, INT64_MAX);
  EXPECT_EQ(d.index, 1);
  EXPECT_EQ(describe(d), "routing cell 1 of t.json (heuristic)");
}

TEST(Routing, BadDocumentsNameTheFileAndField) {
  const std::string ok = R"("op": "softmax", "backend": "cuda", "order": ["a"], "basis": "heuristic", "why": "w")";
  EXPECT_NE(error_of("{").find("t.json: not valid JSON"), std::string::npos) << error_of("{");
  EXPECT_NE(error_of(R"({"schema": "other", "arch": "*", "cells": []})").find("\"schema\""), std::string::npos);
  EXPECT_NE(error_of(R"({"schema": "kernscope-routing/1", "cells": []})").find("missing \"arch\""), std::string::npos);
  EXPECT_NE(error_of(doc("*", "{" + ok + R"(, "dtype": "fp64"})")).find("t.json cell 0: \"dtype\""), std::string::npos);
  EXPECT_NE(error_of(doc("*", "{" + ok + R"(, "row": [1, 64]})")).find("t.json cell 0: unknown key \"row\""),
            std::string::npos);
  EXPECT_NE(error_of(R"({"schema": "kernscope-routing/1", "arch": "*", "cell": []})").find("unknown key \"cell\""),
            std::string::npos);
  for (const char* arch : {"sm90", "SM_90", "cpu", "sm_", "sm_9a"})
    EXPECT_NE(error_of(doc(arch, "")).find("\"arch\" must be"), std::string::npos) << arch;
  EXPECT_EQ(error_of(doc("sm_100", "")), "");
  EXPECT_NE(error_of(doc("*", R"({"op": "softmax", "backend": "tpu", "order": ["a"], "basis": "heuristic", "why": "w"})"))
                .find("\"backend\""),
            std::string::npos);
  EXPECT_NE(error_of(doc("*", "{" + ok + R"(, "rows": [5, 2]})")).find("\"rows\" must have 0 <= min <= max"),
            std::string::npos);
  EXPECT_NE(error_of(doc("*", "{" + ok + R"(, "cols": [1]})")).find("\"cols\" must be [min, max]"), std::string::npos);
  EXPECT_NE(error_of(doc("*", R"({"op": "softmax", "backend": "cuda", "order": [], "basis": "heuristic", "why": "w"})"))
                .find("\"order\""),
            std::string::npos);
  EXPECT_NE(error_of(doc("*", R"({"op": "softmax", "backend": "cuda", "order": ["a"], "basis": "measured", "why": "w"})"))
                .find("missing \"source\""),
            std::string::npos);
  EXPECT_NE(error_of(doc("*", R"({"op": "softmax", "backend": "cuda", "order": ["a"], "basis": "guess", "why": "w"})"))
                .find("\"basis\""),
            std::string::npos);
  for (const char* q : {"Q4_1", "q4_k", "", "fp32"})
    EXPECT_NE(error_of(doc("*", "{" + ok + R"(, "qtype": ")" + q + R"("})")).find("t.json cell 0: \"qtype\" must be"),
              std::string::npos)
        << q;
  EXPECT_NE(error_of(doc("*", "{" + ok + R"(, "qtype": 5})")).find("\"qtype\" must be a string"), std::string::npos);
  // (ok's op is softmax, which has no block format: a bound cell would never match)
  EXPECT_NE(error_of(doc("*", "{" + ok + R"(, "qtype": "q8_0"})")).find("packed weights only"), std::string::npos);
  EXPECT_EQ(error_of(doc("*", "{" + ok + R"(, "qtype": "*"})")), "");
  EXPECT_EQ(error_of(doc("*", R"({"op": "embedding", "backend": "cuda", "qtype": "q8_0", "order": ["a"], "basis": "heuristic", "why": "w"})")), "");
  EXPECT_EQ(error_of(doc("*", "{" + ok + "}")), "");
  // (the message of json's refusal holds needle)
  auto has_error = [](const std::string& json, const std::string& needle) {
    const std::string e = error_of(json);
    EXPECT_NE(e.find(needle), std::string::npos) << e;
  };
  // an op this build does not have, before any other check of its cell (a bound qtype included);
  // control characters shown as '?'
  has_error(doc("*", R"({"op": "rmsnorm", "backend": "cpu", "order": ["a"], "basis": "heuristic", "why": "w"})"), "t.json cell 0: \"op\": unknown operator 'rmsnorm'");
  has_error(doc("*", R"({"op": "rmsnorm", "backend": "cpu", "qtype": "q4_0", "order": ["a"], "basis": "heuristic", "why": "w"})"), "unknown operator 'rmsnorm'");
  has_error(doc("*", R"({"op": "softmax\u0000x", "backend": "cpu", "order": ["a"], "basis": "heuristic", "why": "w"})"), "unknown operator 'softmax?x'");
  has_error(doc("*", R"({"op": "paged_attention_after_append", "backend": "cuda", "order": ["a"], "basis": "heuristic", "why": "w"})"), "runs paged_attention's cells");
  // duplicate keys: JSON keeps the last, so a misspelt first "op" or a first "cells" would vanish
  has_error(doc("*", R"({"op": "rmsnorm", "op": "softmax", "backend": "cpu", "order": ["a"], "basis": "heuristic", "why": "w"})"), "t.json cell 0: duplicate key \"op\"");
  has_error(doc("*", "{" + ok + "}, {" + ok + R"(, "rows": [1, 2], "rows": [5, 6]})"), "t.json cell 1: duplicate key \"rows\"");
  has_error(R"({"schema": "kernscope-routing/1", "arch": "*", "cells": [{"x": 1}], "cells": []})", "t.json: duplicate key \"cells\"");
  // numbers past a double's range, bounds past int64: named, not an internal error or a wrapped value
  has_error(doc("*", "{" + ok + R"(, "rows": [1, 1e400]})"), "t.json: not valid JSON");
  has_error(doc("*", "{" + ok + R"(, "rows": [1, 18446744073709551615]})"), "\"rows\" bounds must be at most 2^63 - 1");
  EXPECT_EQ(error_of(doc("*", "{" + ok + R"(, "rows": [1, 9223372036854775807]})")), "");
  // a cpu cell in a GPU arch's file could never match; arch digits without a leading zero
  has_error(doc("sm_90", R"({"op": "softmax", "backend": "cpu", "order": ["a"], "basis": "heuristic", "why": "w"})"),
            "a cpu cell in a file for arch sm_90 can never match");
  for (const char* arch : {"sm_090", "sm_99999999"})
    EXPECT_NE(error_of(doc(arch, "")).find("\"arch\" must be"), std::string::npos) << arch;
}

// A cell bound to a block format ("qtype") matches calls of that format only; one without binds
// every format; a call or query without a format (qtype "") skips the bound cells.
TEST(Routing, QtypeBoundCellsMatchTheirFormatOnly) {
  const Table t = parse_table(doc("sm_90", R"(
    {"op": "quant_matmul", "backend": "cuda", "dtype": "bf16", "qtype": "q4_1", "rows": [1, 1],
     "order": ["q41_first"], "basis": "heuristic", "why": "w"},
    {"op": "quant_matmul", "backend": "cuda", "dtype": "bf16", "rows": [1, 1], "order": ["any_format"],
     "basis": "heuristic", "why": "w"},
    {"op": "quant_matmul", "backend": "cuda", "qtype": "q8_0", "order": ["q80_every_shape"], "basis": "heuristic",
     "why": "w"})"),
                        "sm_90.json");
  ASSERT_EQ(t.cells.size(), 3u);
  EXPECT_EQ(t.cells[0].qtype, "q4_1");
  EXPECT_EQ(t.cells[1].qtype, "*");
  auto pick = [&](int64_t rows, const char* q) -> std::string {
    const Cell* c = find_cell(t, "quant_matmul", "cuda", "sm_90", "bf16", rows, 4096, false, q);
    return c ? c->order[0] : "none";
  };
  EXPECT_EQ(pick(1, "q4_1"), "q41_first");
  EXPECT_EQ(pick(1, "q4_0"), "any_format");
  EXPECT_EQ(pick(1, "q8_0"), "any_format");  // the first match wins: the unbound cell comes before
  EXPECT_EQ(pick(1, ""), "any_format");
  EXPECT_EQ(pick(2, "q4_1"), "none");
  EXPECT_EQ(pick(2, "q8_0"), "q80_every_shape");
  EXPECT_EQ(pick(2, ""), "none");
}

// Fake devices: an H200 (sm_90), an A100 (sm_80) and the CPU, against one table.
TEST(Routing, MatchesArchDtypeAndInclusiveBucketsFirstCellWins) {
  Table t = parse_table(doc("sm_90", R"(
    {"op": "softmax", "backend": "cuda", "dtype": "bf16", "rows": [1, 64], "cols": [0, 4096],
     "order": ["small"], "basis": "heuristic", "why": "w"},
    {"op": "softmax", "backend": "cuda", "order": ["big"], "basis": "heuristic", "why": "w"})"),
                        "sm_90.json");
  const Table g = parse_table(doc("*", R"(
    {"op": "softmax", "backend": "cuda", "order": ["generic"], "basis": "heuristic", "why": "w"},
    {"op": "softmax", "backend": "cpu", "order": ["cpu_fast"], "basis": "heuristic", "why": "w"})"),
                              "generic.json");
  for (const Cell& c : g.cells) t.cells.push_back(c);
  auto pick = [&](const char* backend, const char* arch, const char* dt, int64_t rows, int64_t cols) -> std::string {
    const Cell* c = find_cell(t, "softmax", backend, arch, dt, rows, cols);
    return c ? c->order[0] : "none";
  };
  EXPECT_EQ(pick("cuda", "sm_90", "bf16", 1, 4096), "small");   // both bounds inclusive
  EXPECT_EQ(pick("cuda", "sm_90", "bf16", 64, 0), "small");
  EXPECT_EQ(pick("cuda", "sm_90", "bf16", 65, 4096), "big");    // rows past the bucket
  EXPECT_EQ(pick("cuda", "sm_90", "bf16", 0, 4096), "big");     // zero rows: below it
  EXPECT_EQ(pick("cuda", "sm_90", "bf16", 1, 4097), "big");
  EXPECT_EQ(pick("cuda", "sm_90", "fp16", 1, 16), "big");       // the dtype does not match
  EXPECT_EQ(pick("cuda", "sm_80", "bf16", 1, 16), "generic");   // another arch: the generic cells
  EXPECT_EQ(pick("cpu", "cpu", "fp32", 7, 7), "cpu_fast");
  EXPECT_EQ(find_cell(t, "rms_norm", "cuda", "sm_90", "bf16", 1, 1), nullptr);
  EXPECT_EQ(find_cell(t, "softmax", "cpu", "sm_90", "bf16", INT64_MAX, INT64_MAX)->order[0], "cpu_fast");
  // deterministic mode ignores the rows bounds: the choice may not depend on the row count
  for (int64_t rows : {1, 64, 65, 100000})
    EXPECT_EQ(find_cell(t, "softmax", "cuda", "sm_90", "bf16", rows, 4096, /*any_rows=*/true)->order[0], "small") << rows;
}

// The tables compiled into the library parse, and the arch-specific ones come before the
// generic one (first match wins). (Their variant names are checked against the registry by
// `ksctl table --check`, a ctest.)
TEST(Routing, CompiledInTablesParseSpecificBeforeGeneric) {
  const Table& t = active_table();
  ASSERT_FALSE(t.cells.empty());
  bool seen_generic = false;
  for (const Cell& c : t.cells) {
    if (c.arch == "*") seen_generic = true;
    else EXPECT_FALSE(seen_generic) << "cell " << c.index << " of " << c.table << " comes after a generic cell";
    EXPECT_FALSE(c.why.empty());
  }
  EXPECT_TRUE(seen_generic);
}

}  // namespace
}  // namespace ks::registry
