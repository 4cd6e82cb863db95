// Routing tables: parsing (nlohmann-json), matching, the active table. See routing.hpp.
#include "registry/routing.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <utility>

#include "core/common.hpp"

namespace ks::registry {

// Generated at configure time from src/registry/routing/*.json (CMakeLists.txt).
const std::vector<std::pair<const char*, const char*>>& embedded_routing_tables();

namespace {

// Thrown directly (as detail::fail would) so that this file stands alone in tests/internal.
[[noreturn]] void bad(const std::string& name, const std::string& what) {
  throw detail::Failure{KS_ERROR_INVALID_ARGUMENT, "routing: " + name + ": " + what};
}

std::string str_field(const nlohmann::json& j, const char* key, const std::string& where, bool required = true) {
  if (!j.contains(key)) {
    if (required) bad(where, std::string("missing \"") + key + "\"");
    return "";
  }
  if (!j[key].is_string()) bad(where, std::string("\"") + key + "\" must be a string");
  return j[key].get<std::string>();
}

// [min, max] with null max meaning unbounded; absent: everything.
void range_field(const nlohmann::json& j, const char* key, const std::string& where, int64_t* lo, int64_t* hi) {
  if (!j.contains(key)) return;
  const auto& r = j[key];
  if (!r.is_array() || r.size() != 2 || !r[0].is_number_integer() || !(r[1].is_number_integer() || r[1].is_null()))
    bad(where, std::string("\"") + key + "\" must be [min, max] (integers; max may be null)");
  for (int i = 0; i < 2; ++i)  // (nlohmann keeps integers past 2^63 - 1 unsigned: get<int64_t> would wrap them)
    if (r[i].is_number_unsigned() && r[i].get<uint64_t>() > uint64_t(INT64_MAX))
      bad(where, std::string("\"") + key + "\" bounds must be at most 2^63 - 1 (null: unbounded); got " +
                     std::to_string(r[i].get<uint64_t>()));
  *lo = r[0].get<int64_t>();
  *hi = r[1].is_null() ? INT64_MAX : r[1].get<int64_t>();
  if (*lo < 0 || *hi < *lo) bad(where, std::string("\"") + key + "\" must have 0 <= min <= max");
}

}  // namespace

bool is_qtype_key(std::string_view q) {
  return q == "q4_0" || q == "q4_1" || q == "q8_0" || q == "f32" || q == "f16" || q == "bf16";
}

bool op_has_block_format(std::string_view op) {
  return op == "quant_matmul" || op == "quant_matmul_a8" || op == "fused_add_rms_norm_quant_matmul" ||
         op == "fused_add_rms_norm_quant_matmul_rope_kv_append" || op == "silu_and_mul_quant_matmul" ||
         op == "embedding" || op == "dequantize";
}

Table parse_table(const std::string& text, const std::string& name) {
  nlohmann::json j;
  // Duplicate keys: JSON parsers keep the last, which would drop a field without a word (a
  // misspelt "op" before the right one, a second "cells" array); the first duplicate is named.
  std::vector<std::vector<std::string>> keys;  // per open object, its keys so far
  int arrays = 0, cell = -1;                  // (cells: the objects directly inside the root's array)
  std::string duplicate;
  auto note = [&](int, nlohmann::json::parse_event_t ev, nlohmann::json& v) {
    using E = nlohmann::json::parse_event_t;
    if (ev == E::object_start) {
      if (keys.size() == 1 && arrays == 1) ++cell;
      keys.emplace_back();
    } else if (ev == E::object_end) {
      keys.pop_back();
    } else if (ev == E::array_start) {
      ++arrays;
    } else if (ev == E::array_end) {
      --arrays;
    } else if (ev == E::key && !keys.empty() && duplicate.empty()) {
      const std::string k = v.get<std::string>();
      for (const auto& seen : keys.back())
        if (seen == k) duplicate = (keys.size() == 2 && cell >= 0 ? " cell " + std::to_string(cell) : "") + ": duplicate key \"" + k + "\"";
      keys.back().push_back(k);
    }
    return true;
  };
  try {
    j = nlohmann::json::parse(text, note);
  } catch (const nlohmann::json::exception& e) {  // (parse errors, and numbers past a double's range)
    bad(name, std::string("not valid JSON: ") + e.what());
  }
  if (!duplicate.empty())
    throw detail::Failure{KS_ERROR_INVALID_ARGUMENT,
                          "routing: " + name + duplicate + " (JSON keeps only the last: give each field once)"};
  if (!j.is_object()) bad(name, "the document must be an object");
  if (str_field(j, "schema", name) != "kernscope-routing/1")
    bad(name, "\"schema\" must be \"kernscope-routing/1\"");
  for (const auto& [key, value] : j.items())
    if (key != "schema" && key != "arch" && key != "description" && key != "cells")
      bad(name, "unknown key \"" + key + "\" (expected schema, arch, description, cells)");
  const std::string arch = str_field(j, "arch", name);
  {  // "*" or sm_<digits>: a typo must not make a file that silently matches nothing
    bool ok = arch == "*" || (arch.size() > 3 && arch.size() <= 7 && arch.compare(0, 3, "sm_") == 0 && arch[3] != '0');
    for (size_t i = 3; ok && arch != "*" && i < arch.size(); ++i) ok = arch[i] >= '0' && arch[i] <= '9';
    if (!ok) bad(name, "\"arch\" must be \"*\" or sm_<compute capability digits> (e.g. sm_90); got \"" + arch + "\"");
  }
  if (!j.contains("cells") || !j["cells"].is_array()) bad(name, "\"cells\" must be an array");
  Table t;
  t.files.push_back(name);
  int index = 0;
  for (const auto& cj : j["cells"]) {
    const std::string where = name + " cell " + std::to_string(index);
    if (!cj.is_object()) bad(where, "must be an object");
    for (const auto& [key, value] : cj.items()) {
      static const char* const known[] = {"op",    "backend", "dtype", "qtype",  "rows",
                                          "cols",  "order",   "basis", "source", "why"};
      bool ok = false;
      for (const char* k : known) ok = ok || key == k;
      if (!ok) bad(where, "unknown key \"" + key + "\" (a misspelt \"rows\" would match every shape)");
    }
    Cell c;
    c.table = name;
    c.index = index++;
    c.arch = arch;
    c.op = str_field(cj, "op", where);
    if (!op_is_known(c.op)) {
      std::string shown;  // (control characters shown as '?': a NUL would cut the message)
      for (const char ch : c.op) shown += (unsigned char)ch < 0x20 ? '?' : ch;
      bad(where, "\"op\": unknown operator '" + shown + "' (" + kOpsListedBy +
                     (c.op == "paged_attention_after_append" ? "; it runs paged_attention's cells" : "") + ")");
    }
    c.backend = str_field(cj, "backend", where);
    if (c.backend != "cpu" && c.backend != "cuda") bad(where, "\"backend\" must be \"cpu\" or \"cuda\"");
    if (c.backend == "cpu" && arch != "*")
      bad(where, "a cpu cell in a file for arch " + arch + " can never match (the CPU backend's arch is not a GPU's): "
                 "put it in a file with \"arch\": \"*\"");
    c.dtype = cj.contains("dtype") ? str_field(cj, "dtype", where) : "*";
    if (c.dtype != "*" && c.dtype != "fp16" && c.dtype != "bf16" && c.dtype != "fp32")
      bad(where, "\"dtype\" must be \"fp16\", \"bf16\", \"fp32\" or \"*\"");
    c.qtype = cj.contains("qtype") ? str_field(cj, "qtype", where) : "*";
    if (c.qtype != "*" && !is_qtype_key(c.qtype))
      bad(where, "\"qtype\" must be \"q4_0\", \"q4_1\", \"q8_0\", \"f32\", \"f16\", \"bf16\" or \"*\"; got \"" + c.qtype + "\"");
    if (c.qtype != "*" && !op_has_block_format(c.op))
      bad(where, "\"qtype\" applies to the ops with packed weights only (quant_matmul and its fusions, embedding, "
                 "dequantize); " + c.op + "'s calls have no block format, so the cell would never match");
    range_field(cj, "rows", where, &c.rows_min, &c.rows_max);
    range_field(cj, "cols", where, &c.cols_min, &c.cols_max);
    if (!cj.contains("order") || !cj["order"].is_array() || cj["order"].empty())
      bad(where, "\"order\" must be a non-empty array of variant names");
    for (const auto& v : cj["order"]) {
      if (!v.is_string()) bad(where, "\"order\" must hold variant names (strings)");
      c.order.push_back(v.get<std::string>());
    }
    c.basis = str_field(cj, "basis", where);
    if (c.basis != "measured" && c.basis != "heuristic") bad(where, "\"basis\" must be \"measured\" or \"heuristic\"");
    c.source = str_field(cj, "source", where, c.basis == "measured");
    c.why = str_field(cj, "why", where);
    t.cells.push_back(std::move(c));
  }
  return t;
}

bool cell_matches(const Cell& c, std::string_view op, std::string_view backend, std::string_view arch,
                  std::string_view dtype) {
  return c.op == op && c.backend == backend && (c.arch == "*" || c.arch == arch) && (c.dtype == "*" || c.dtype == dtype);
}

const Cell* find_cell(const Table& t, std::string_view op, std::string_view backend, std::string_view arch,
                      std::string_view dtype, int64_t rows, int64_t cols, bool any_rows, std::string_view qtype) {
  for (const Cell& c : t.cells) {
    if (!cell_matches(c, op, backend, arch, dtype)) continue;
    if (!qtype_matches(c, qtype)) continue;
    if (!shape_in(c, any_rows ? c.rows_min : rows, cols)) continue;  // (any_rows: a row c holds)
    return &c;
  }
  return nullptr;
}

namespace {
Table load_active_table() {
  Table table;
  if (const char* env = std::getenv("KS_ROUTING_TABLE"); env && *env) {
    // one file, or several separated by ':' (e.g. `ksctl tune`'s cpu and GPU tables); the
    // first matching cell wins, in the order given
    std::string list = env;
    std::vector<std::string> paths;
    for (size_t start = 0; start <= list.size();) {
      const size_t end = std::min(list.find(':', start), list.size());
      if (end > start) paths.push_back(list.substr(start, end - start));
      start = end + 1;
    }
    // a file listed twice (under any spelling, a link included) would be read twice, and an error
    // in it could not say which entry it means: refused before any file is read (entries that are
    // not regular files get their own errors below)
    for (size_t i = 0; i < paths.size(); ++i) {
      std::error_code ec;
      if (!std::filesystem::is_regular_file(paths[i], ec)) continue;
      for (size_t j = 0; j < i; ++j)
        if (std::filesystem::is_regular_file(paths[j], ec) && std::filesystem::equivalent(paths[i], paths[j], ec))
          bad(paths[i], "KS_ROUTING_TABLE lists this file twice (also as " + paths[j] + "); list each file once");
    }
    for (const std::string& path : paths) {
      std::error_code ec;
      if (std::filesystem::is_directory(path, ec)) bad(path, "KS_ROUTING_TABLE names a directory; it takes files (':'-separated)");
      if (std::filesystem::exists(path, ec) && !std::filesystem::is_regular_file(path, ec))
        bad(path, "KS_ROUTING_TABLE names something that is not a regular file (a device or a pipe)");
      if (std::filesystem::is_regular_file(path, ec) && std::filesystem::file_size(path, ec) > (16u << 20))
        bad(path, "the routing table is larger than 16 MiB (a table is a few KB of cells)");
      std::ifstream f(path);
      if (!f) bad(path, "KS_ROUTING_TABLE names a file that cannot be read");
      std::stringstream ss;
      ss << f.rdbuf();
      Table t = parse_table(ss.str(), path);
      table.files.insert(table.files.end(), t.files.begin(), t.files.end());
      for (auto& c : t.cells) table.cells.push_back(std::move(c));
    }
    if (table.files.empty()) bad(env, "KS_ROUTING_TABLE lists no file (entries are separated by ':')");
    return table;
  }
  {
    // Arch-specific files first, the generic ("*") one last: the first matching cell wins.
    std::vector<Table> parts;
    for (const auto& [name, text] : embedded_routing_tables()) parts.push_back(parse_table(text, name));
    std::stable_sort(parts.begin(), parts.end(), [](const Table& a, const Table& b) {
      const bool ga = !a.cells.empty() && a.cells[0].arch == "*", gb = !b.cells.empty() && b.cells[0].arch == "*";
      return ga < gb;
    });
    for (auto& p : parts) {
      table.files.insert(table.files.end(), p.files.begin(), p.files.end());
      for (auto& c : p.cells) table.cells.push_back(std::move(c));
    }
  }
  return table;
}
}  // namespace

// A function-local static: initialised once, thread-safe; a load that throws leaves it
// uninitialised, so the next call tries again (and fails the same way, naming the file).
const Table& active_table() {
  static const Table table = load_active_table();
  return table;
}

std::string describe(const Cell& c) {
  std::string s = "routing cell " + std::to_string(c.index) + " of " + c.table + " (" + c.basis;
  if (!c.source.empty()) s += ": " + c.source;
  return s + ")";
}

namespace {
std::string bound(int64_t x) { return x == INT64_MAX ? "any" : std::to_string(x); }
nlohmann::json range_json(int64_t lo, int64_t hi) {
  return nlohmann::json::array({lo, hi == INT64_MAX ? nlohmann::json() : nlohmann::json(hi)});
}
}  // namespace

std::string cells_summary(const Table& t, std::string_view op, std::string_view backend, std::string_view arch,
                          std::string_view dtype, std::string_view qtype) {
  std::string s;
  for (const Cell& c : t.cells) {
    if (!cell_matches(c, op, backend, arch, dtype)) continue;
    if (!qtype.empty() && !qtype_matches(c, qtype)) continue;
    std::string order;
    for (const auto& v : c.order) order += (order.empty() ? "" : ", ") + v;
    s += std::string(s.empty() ? "" : "; ") + (c.qtype == "*" ? "" : c.qtype + " weights, ") + "rows " +
         bound(c.rows_min) + ".." + bound(c.rows_max) + ", cols " + bound(c.cols_min) + ".." + bound(c.cols_max) +
         ": [" + order + "] (" + describe(c) + ")";
  }
  return s;
}

std::string to_json(const Table& t) {
  nlohmann::json j;
  j["schema"] = "kernscope-routing-active/1";
  j["files"] = t.files;
  j["cells"] = nlohmann::json::array();
  for (const Cell& c : t.cells)
    j["cells"].push_back({{"op", c.op}, {"backend", c.backend}, {"arch", c.arch}, {"dtype", c.dtype}, {"qtype", c.qtype},
                          {"rows", range_json(c.rows_min, c.rows_max)}, {"cols", range_json(c.cols_min, c.cols_max)},
                          {"order", c.order}, {"basis", c.basis}, {"source", c.source}, {"why", c.why},
                          {"table", c.table}, {"index", c.index}});
  return j.dump(1, ' ', false, nlohmann::json::error_handler_t::replace);  // a non-UTF-8 path: U+FFFD
}

}  // namespace ks::registry
