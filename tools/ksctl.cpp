// ksctl — kernscope's command-line tool.
//   ksctl ops                       table of op x backend x dtypes (every variant)
//   ksctl which OP --dtype D        the variant chosen and why
//   ksctl check                     every op x backend x variant x dtype x shape vs FP64
//   ksctl generate --model PATH     run SmolLM2 (or another Llama GGUF) end to end
//   ksctl bench-model --model PATH  prefill / decode tokens per second (median of repeats)
#include <kernscope/kernscope.hpp>

#include "build_commit.h"  // KS_BUILD_COMMIT (cmake/build_commit.cmake)
#include "core/dtype_key.hpp"
#include "tune.hpp"

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <omp.h>

#include <sched.h>

#include <cctype>
#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdint>
#include <system_error>
#include <cstdlib>
#include <cstring>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <limits>
#include <map>
#include <set>
#include <sstream>
#include <thread>

#include "model/generate.hpp"

int run_check(const std::string& backend, const std::string& op_filter, bool verbose);  // tools/check.cpp
std::vector<std::string> check_entry_points();  // tools/check.cpp
int run_tune(const std::string& backend, std::string op, int reps, const std::string& dir, bool quiet);  // tools/tune.cpp
int run_tune_from_csv(const std::string& csv, const std::string& dir, const std::string& commit);  // tools/tune.cpp

namespace {

// The cores other processes keep busy right now among the CPUs this process may run on
// (sched_getaffinity: a container's or taskset's CPUs, not the host's): their /proc/stat `cpuN`
// lines read twice, 100 ms apart (busy: every time but idle and iowait; the counters tick every
// 10 ms, so 100 ms keeps the error near 0.2 cores on 2 CPUs), as a fraction of their time, times
// their count. KS_BUSY_CORES=x stands in for the measurement (tests); -1 where neither is
// available.
double other_busy_cores() {
  if (const char* e = std::getenv("KS_BUSY_CORES")) return std::atof(e);
  cpu_set_t mine;
  CPU_ZERO(&mine);
  if (sched_getaffinity(0, sizeof(mine), &mine) != 0) return -1;
  auto sample = [&](unsigned long long& busy, unsigned long long& total, int& cpus) {
    std::ifstream f("/proc/stat");
    busy = total = 0;
    cpus = 0;
    std::string line;
    while (std::getline(f, line)) {
      if (line.compare(0, 3, "cpu") != 0) break;  // (the cpu lines come first)
      int id = -1;
      if (std::sscanf(line.c_str(), "cpu%d", &id) != 1 || id < 0 || id >= CPU_SETSIZE || !CPU_ISSET(id, &mine))
        continue;  // the aggregate line, or a CPU this process may not use
      unsigned long long v[8] = {};  // user nice system idle iowait irq softirq steal
      const int n = std::sscanf(line.c_str(), "%*s %llu %llu %llu %llu %llu %llu %llu %llu", &v[0], &v[1], &v[2],
                                &v[3], &v[4], &v[5], &v[6], &v[7]);
      if (n < 5) return false;
      unsigned long long t = 0;
      for (int k = 0; k < n; ++k) t += v[k];
      total += t;
      busy += t - v[3] - v[4];
      ++cpus;
    }
    return cpus > 0;
  };
  unsigned long long b0 = 0, t0 = 0, b1 = 0, t1 = 0;
  int c0 = 0, c1 = 0;
  if (!sample(b0, t0, c0)) return -1;
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  if (!sample(b1, t1, c1) || c1 != c0 || t1 <= t0 || b1 < b0) return -1;
  return double(b1 - b0) / double(t1 - t0) * double(c0);
}

// generate's and bench-model's CPU threads when neither --threads nor OpenMP's own settings (OMP_NUM_THREADS,
// OMP_WAIT_POLICY, GOMP_SPINCOUNT) choose: OpenMP's threads spin while they wait, so on cores
// other processes keep busy each of a token's ~300 parallel regions can wait for a time slice
// (decode fell from ~170 to 1-50 tokens/s on 2 cores; docs/perf/cpu.md); one thread fewer per core
// busy elsewhere (at least 1) avoids it. Under 0.75 busy cores nothing changes (the sample's noise).
// Returns the line that says so (empty when nothing changed), which generate prints once the
// model has loaded (so a bad model's error is not preceded by it).
std::string choose_cpu_threads() {
  for (const char* v : {"OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT"})
    if (const char* e = std::getenv(v); e && *e) return "";
  const int all = omp_get_max_threads();
  const double busy = std::min(other_busy_cores(), double(all));
  if (busy < 0.75 || all <= 1) return "";
  const int t = std::max(1, all - int(std::lround(busy)));
  if (t == all) return "";
  omp_set_num_threads(t);
  char line[256];
  std::snprintf(line, sizeof line,
                "[ksctl] other processes keep about %.1f of this process's %d CPUs busy: %d CPU thread%s instead of %d "
                "(--threads N or OMP_WAIT_POLICY=passive to choose)\n",
                busy, omp_get_num_procs(), t, t == 1 ? "" : "s", all);
  return line;
}

ks::Backend parse_device(const std::string& d) {
  if (d == "cpu") return ks::Backend::Cpu;
  if (d == "cuda") return ks::Backend::Cuda;
  if (d == "auto") return ks::Backend::Auto;
  throw CLI::ValidationError("--device", "must be cpu, cuda or auto");
}

// "available", or why not (the library's own reason: not built, or no device).
std::string cuda_status() {
  if (ks::backend_available(ks::Backend::Cuda)) return "available";
  // the reason, from a which on the CUDA backend (its routing table not consulted for a backend
  // that is absent; a routing-table error is ops' own line, not this reason)
  const char *v = nullptr, *r = nullptr;
  if (ks_which("rms_norm", "fp32", KS_BACKEND_CUDA, &v, &r) != KS_SUCCESS) {
    const std::string e = ks_last_error(), key = "not available: ";
    const auto at = e.find(key);  // keep the reason after "...not available: "
    if (at != std::string::npos) return "not available: " + e.substr(at + key.size());
  }
  return "not available";
}

std::string closest_names(const std::string& word, const std::vector<std::string>& names);

// ": did you mean X?" for an operator name that this build lacks (ops and entry points), or "".
std::string op_suggestion(const std::string& op) {
  std::vector<std::string> names;
  for (const auto& v : ks::variants()) names.push_back(v.op);
  for (const std::string& e : check_entry_points()) names.push_back(e);
  std::sort(names.begin(), names.end());
  names.erase(std::unique(names.begin(), names.end()), names.end());
  const std::string list = closest_names(op, names);
  return list.empty() ? "" : ": did you mean " + list + "?";
}

int cmd_ops() {
  // op -> backend -> "variant(dtypes)"
  std::map<std::string, std::map<std::string, std::vector<std::string>>> table;
  for (const auto& v : ks::variants()) table[v.op][v.backend].push_back(std::string(v.name) + " [" + v.dtypes + "]");
  int w = 2;  // the longest op name sets the column
  for (const auto& kv : table) w = std::max(w, int(kv.first.size()));
  std::printf("%-*s %-7s %s\n", w, "op", "backend", "variants [dtypes], best first");
  for (const auto& [op, backends] : table)
    for (const auto& [be, vs] : backends) {
      std::string s;
      for (const auto& x : vs) s += (s.empty() ? "" : ", ") + x;
      std::printf("%-*s %-7s %s\n", w, op.c_str(), be.c_str(), s.c_str());
    }
  // entry points without variants of their own (ks_which / force_variant answer them as that op)
  for (const std::string& entry : check_entry_points())
    if (const char* runs = ks_op_runs_variants_of(entry.c_str()))
      std::printf("%-*s %-7s runs %s's variants (entry point)\n", w, entry.c_str(), "", runs);
  std::printf("\nCUDA backend: %s\n", cuda_status().c_str());
  // the routing table the calls will use: a malformed KS_ROUTING_TABLE is said here (exit 2),
  // not first at the op call that needs it
  try {
    const auto j = nlohmann::json::parse(ks::routing_table());
    std::string files;
    for (const auto& f : j["files"]) files += (files.empty() ? "" : ", ") + f.get<std::string>();
    const char* env = std::getenv("KS_ROUTING_TABLE");  // (empty: unset, as the library reads it)
    std::printf("Routing table: %zu cells from %s%s\n", j["cells"].size(), files.c_str(),
                env && *env ? " (KS_ROUTING_TABLE)" : " (built in)");
  } catch (const std::exception& e) {
    // exit 2, as every subcommand that meets a table it cannot use (ksctl: error: ...)
    std::fprintf(stderr, "ksctl ops: the routing table cannot be used: %s\n", e.what());
    return 2;
  }
  return 0;
}

// The routing table: one line per cell, first match wins. --check: every variant a cell names
// exists for its op and backend (exit 1 otherwise); op: only that op's cells (text; "" = all);
// why: each cell's reason and source after its order.
int cmd_table(bool as_json, bool check_names, std::string op_filter, bool why) {
  if (const char* runs = op_filter.empty() ? nullptr : ks_op_runs_variants_of(op_filter.c_str())) {
    std::fprintf(stderr, "table: %s runs %s's variants: its cells\n", op_filter.c_str(), runs);
    op_filter = runs;
  }
  if (!op_filter.empty() && !ks::tune::has_op(op_filter)) {
    std::fprintf(stderr, "table: --op '%s' is not an operator of this build%s (ksctl ops lists them)\n",
                 op_filter.c_str(), op_suggestion(op_filter).c_str());
    return 2;
  }
  const std::string text = ks::routing_table();
  if (as_json) {
    std::printf("%s\n", text.c_str());
  }
  const auto j = nlohmann::json::parse(text);
  std::set<std::string> known, backends;  // "op/backend/variant"; backends compiled into this build
  for (const auto& v : ks::variants()) {
    known.insert(std::string(v.op) + "/" + v.backend + "/" + v.name);
    backends.insert(v.backend);
  }
  auto bound = [](const nlohmann::json& x) { return x.is_null() ? std::string("any") : std::to_string(x.get<long long>()); };
  // A cell that an earlier one covers (same op and backend; its arch, dtype, qtype and row and
  // column ranges, each "*" / unbounded or containing the later cell's) is never reached: first
  // match wins.
  const auto& cells = j["cells"];
  auto covers = [](const nlohmann::json& e, const nlohmann::json& c) {
    auto field = [&](const char* k) { return e[k] == "*" || e[k] == c[k]; };
    auto range = [&](const char* k) {
      const auto &el = e[k][0], &eh = e[k][1], &cl = c[k][0], &ch = c[k][1];
      const bool lo = el.is_null() || (!cl.is_null() && el.get<long long>() <= cl.get<long long>());
      const bool hi = eh.is_null() || (!ch.is_null() && eh.get<long long>() >= ch.get<long long>());
      return lo && hi;
    };
    return e["op"] == c["op"] && e["backend"] == c["backend"] && field("arch") && field("dtype") && field("qtype") &&
           range("rows") && range("cols");
  };
  std::vector<int> shadowed_by(cells.size(), -1);
  for (size_t i = 0; i < cells.size(); ++i)
    for (size_t e = 0; e < i && shadowed_by[i] < 0; ++e)
      if (covers(cells[e], cells[i])) shadowed_by[i] = int(e);
  // Several earlier cells together may cover a cell that none covers alone (one per dtype, or
  // adjacent shape ranges): for each dtype the cell matches ("*": fp16, bf16, fp32), the earlier
  // cells that match it (same op and backend; arch and qtype "*" or the cell's own) must cover its
  // rows x cols rectangle, checked on the grid of their ranges' ends. shadowed_by -2: so covered.
  // (bounds as 128-bit integers: an end + 1 past INT64_MAX must not wrap; a clamp at 2^62 once made
  // a reachable cell with larger bounds look covered)
  using B = __int128;
  auto lo_hi = [](const nlohmann::json& r) {
    const B lo = r[0].is_null() ? 0 : B(r[0].get<long long>());
    const B hi = r[1].is_null() ? B(INT64_MAX) : B(r[1].get<long long>());
    return std::pair<B, B>(lo, hi);
  };
  for (size_t i = 0; i < cells.size(); ++i) {
    if (shadowed_by[i] >= 0) continue;
    const auto& c = cells[i];
    const auto [r0, r1] = lo_hi(c["rows"]);
    const auto [c0, c1] = lo_hi(c["cols"]);
    bool all_covered = true;
    const std::vector<std::string> dts = c["dtype"] == "*" ? std::vector<std::string>{"fp16", "bf16", "fp32"}
                                                           : std::vector<std::string>{c["dtype"].get<std::string>()};
    for (const std::string& dt : dts) {
      std::vector<std::pair<std::pair<B, B>, std::pair<B, B>>> rects;
      for (size_t e = 0; e < i; ++e) {
        const auto& x = cells[e];
        if (x["op"] == c["op"] && x["backend"] == c["backend"] && (x["arch"] == "*" || x["arch"] == c["arch"]) &&
            (x["qtype"] == "*" || x["qtype"] == c["qtype"]) && (x["dtype"] == "*" || x["dtype"] == dt))
          rects.push_back({lo_hi(x["rows"]), lo_hi(x["cols"])});
      }
      std::vector<B> xs{r0, r1 + 1}, ys{c0, c1 + 1};
      for (const auto& [rr, cc] : rects) {
        for (B v : {rr.first, B(rr.second + 1)}) if (v > r0 && v <= r1) xs.push_back(v);
        for (B v : {cc.first, B(cc.second + 1)}) if (v > c0 && v <= c1) ys.push_back(v);
      }
      std::sort(xs.begin(), xs.end());
      std::sort(ys.begin(), ys.end());
      for (size_t a = 0; a + 1 < xs.size() && all_covered; ++a)
        for (size_t b = 0; b + 1 < ys.size() && all_covered; ++b) {
          if (xs[a] == xs[a + 1] || ys[b] == ys[b + 1]) continue;
          bool hit = false;
          for (const auto& [rr, cc] : rects)
            hit = hit || (rr.first <= xs[a] && xs[a] <= rr.second && cc.first <= ys[b] && ys[b] <= cc.second);
          all_covered = hit;
        }
      if (!all_covered) break;
    }
    if (all_covered) shadowed_by[i] = -2;
  }
  int unknown = 0, shadowed = 0;
  for (size_t i = 0; i < cells.size(); ++i)
    if (shadowed_by[i] == -2) {
      ++shadowed;
      if (check_names)
        std::fprintf(stderr, "ksctl table: %s cell %d (%s) is never reached: earlier cells together cover it\n",
                     cells[i]["table"].get<std::string>().c_str(), cells[i]["index"].get<int>(),
                     cells[i]["op"].get<std::string>().c_str());
    } else if (shadowed_by[i] >= 0) {
      ++shadowed;
      const auto &c = cells[i], &e = cells[size_t(shadowed_by[i])];
      if (check_names)
        std::fprintf(stderr, "ksctl table: %s cell %d (%s) is never reached: %s cell %d covers it\n",
                     c["table"].get<std::string>().c_str(), c["index"].get<int>(), c["op"].get<std::string>().c_str(),
                     e["table"].get<std::string>().c_str(), e["index"].get<int>());
    }
  if (!as_json) {
    std::string files;
    for (const auto& f : j["files"]) files += (files.empty() ? "" : ", ") + f.get<std::string>();
    std::printf("routing table (%s; first matching cell wins; then the remaining variants by priority)\n", files.c_str());
    std::printf("%-18s %-7s %-6s %-10s %-14s %-20s %-10s %s\n", "op", "backend", "arch", "dtype", "rows", "cols", "basis",
                why ? "order  (why / source)" : "order  (--why: each cell's reason and source)");
  }
  std::set<std::string> shown_backends;  // (backends with a listed cell of op_filter)
  for (size_t ci = 0; ci < cells.size(); ++ci) {
    const auto& c = cells[ci];
    std::string order;
    for (const auto& v : c["order"]) {
      const std::string name = v.get<std::string>();
      const bool ok = !backends.count(c["backend"].get<std::string>()) ||  // not built here: cannot tell
                      known.count(c["op"].get<std::string>() + "/" + c["backend"].get<std::string>() + "/" + name) > 0;
      if (!ok) {
        ++unknown;
        std::fprintf(stderr, "ksctl table: %s cell %d: op %s has no %s variant '%s'\n", c["table"].get<std::string>().c_str(),
                     c["index"].get<int>(), c["op"].get<std::string>().c_str(), c["backend"].get<std::string>().c_str(),
                     name.c_str());
      }
      order += (order.empty() ? "" : " > ") + name;
    }
    if (as_json || (!op_filter.empty() && c["op"].get<std::string>() != op_filter)) continue;
    const std::string rows = bound(c["rows"][0]) + ".." + bound(c["rows"][1]);
    const std::string cols = bound(c["cols"][0]) + ".." + bound(c["cols"][1]);
    std::string note = c["why"].get<std::string>();
    if (!c["source"].get<std::string>().empty()) note += "; " + c["source"].get<std::string>();
    shown_backends.insert(c["backend"].get<std::string>());
    // (dtype, then the weights' block format where the cell is bound to one: "bf16:q4_1")
    const std::string dtype =
        c["dtype"].get<std::string>() + (c["qtype"] == "*" ? std::string() : ":" + c["qtype"].get<std::string>());
    std::printf("%-18s %-7s %-6s %-10s %-14s %-20s %-10s %s%s%s%s\n", c["op"].get<std::string>().c_str(),  // (cols: N x K products)
                c["backend"].get<std::string>().c_str(), c["arch"].get<std::string>().c_str(), dtype.c_str(),
                rows.c_str(), cols.c_str(), c["basis"].get<std::string>().c_str(),
                order.c_str(), why ? "  (" : "", why ? note.c_str() : "", why ? ")" : "");
    if (shadowed_by[ci] == -2)
      std::printf("%-18s   (never reached: the cells above together cover it)\n", "");
    if (shadowed_by[ci] >= 0)
      std::printf("%-18s   (never reached: the cell above at %s %d covers it)\n", "",
                  cells[size_t(shadowed_by[ci])]["table"].get<std::string>().c_str(),
                  cells[size_t(shadowed_by[ci])]["index"].get<int>());
  }
  if (!as_json && !op_filter.empty()) {  // a backend without a cell: the variants' priority order decides
    for (const std::string be : {"cpu", "cuda"}) {
      if (shown_backends.count(be)) continue;
      std::string order;  // (ks::variants() lists them best first, as `ksctl ops` shows)
      for (const auto& v : ks::variants())
        if (v.op == op_filter && v.backend == be) order += (order.empty() ? "" : " > ") + std::string(v.name);
      if (order.empty()) continue;
      std::printf("(no cells for %s on %s: the priority order, where each variant can run: %s)\n", op_filter.c_str(),
                  be.c_str(), order.c_str());
    }
  }
  if (!as_json) std::printf("\nCUDA backend: %s\n", cuda_status().c_str());
  if (check_names && !backends.count("cuda"))
    std::fprintf(stderr, "ksctl table --check: the cuda cells' variant names are not checked (no CUDA backend in this build)\n");
  return check_names && (unknown || shadowed) ? 1 : 0;
}

// cols_text: --cols as given where it was a product (AxB), else empty
int cmd_which(const std::string& op, const std::string& dtype, const std::string& device, int64_t rows, int64_t cols,
              const std::string& cols_text) {
  const bool cols_product = !cols_text.empty();
  if ((rows < 0) != (cols < 0)) {
    std::fprintf(stderr, "which: give both --rows and --cols, or neither\n");
    return 2;
  }
  // (an entry point running another op's variants answers as that op: ks_which says so)
  if (!ks::tune::has_op(op) && !ks_op_runs_variants_of(op.c_str())) {
    std::fprintf(stderr, "which: '%s' is not an operator of this build%s (ksctl ops lists them)\n", op.c_str(),
                 op_suggestion(op).c_str());
    return 2;
  }
  // AxB means a * b where the op's cols key is a product (ks_op_cols_factors: quant_matmul's N x K,
  // paged_attention's max_blocks_per_seq x block_size; docs/routing.md#shape-keys-rows-cols)
  if (cols_product && ks_op_cols_factors(op.c_str()) == nullptr) {
    std::fprintf(stderr,
                 "which: --cols AxB (a product) is the key of the ops whose cols multiply two sizes (quant_matmul's "
                 "N x K, paged_attention's max_blocks_per_seq x block_size); %s's cols is one number "
                 "(docs/routing.md#shape-keys-rows-cols)\n",
                 op.c_str());
    return 2;
  }
  const auto w = rows >= 0 ? ks::which(op, dtype, parse_device(device), rows, cols) : ks::which(op, dtype, parse_device(device));
  const std::string dev =
      device != "auto" ? device : (ks::backend_available(ks::Backend::Cuda) ? "cuda (auto)" : "cpu (auto)");
  const std::string shape = rows >= 0 ? " rows " + std::to_string(rows) + " cols " + std::to_string(cols) +
                                            (cols_product ? " (" + cols_text + ")" : "")
                                      : "";
  std::printf("%s %s%s on %s -> %s\n  why: %s\n", op.c_str(), dtype.c_str(), shape.c_str(), dev.c_str(),
              w.variant.c_str(), w.reason.c_str());
  return 0;
}

// "model PATH (L layers, hidden H), backend B, N threads": the first line of generate's report
// and of bench-model's output
std::string model_line(const std::string& path, const ks::model::LlamaModel& model, ks::Backend be) {
  char b[512];
  std::snprintf(b, sizeof b, "model %s (%lld layers, hidden %lld), backend %s, %d thread%s", path.c_str(),
                (long long)model.config().n_layers, (long long)model.config().hidden_size,
                be == ks::Backend::Cpu ? "cpu" : "cuda", omp_get_max_threads(), omp_get_max_threads() == 1 ? "" : "s");
  return b;
}

struct LoadedModel {
  ks::model::GgufFile file;
  ks::model::Tokenizer tok;
  ks::model::LlamaModel model;
  LoadedModel(const std::string& path, int64_t ctx, ks::Backend be, int64_t max_batch = 1)
      : file(ks::model::GgufFile::open(path)), tok(ks::model::tokenizer_from_gguf(file)), model(file, ctx, be, max_batch) {}
};

// cpu (the default), cuda, or auto (cuda when a device is there). The CUDA path keeps
// the weights, KV cache and activations on the GPU and replays each decode step as a
// CUDA graph (src/model/llama.cpp).
ks::Backend model_backend(const std::string& device) {
  ks::Backend be = parse_device(device);
  if (be == ks::Backend::Auto) be = ks::backend_available(ks::Backend::Cuda) ? ks::Backend::Cuda : ks::Backend::Cpu;
  if (be == ks::Backend::Cuda && !ks::backend_available(ks::Backend::Cuda))
    throw ks::BackendUnavailable(KS_ERROR_BACKEND_UNAVAILABLE, "--device cuda: the CUDA backend is " + cuda_status());
  return be;
}

// Edit distance (insertions, deletions, substitutions, adjacent swaps) of two short strings.
size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<std::vector<size_t>> d(a.size() + 1, std::vector<size_t>(b.size() + 1));
  for (size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (size_t i = 1; i <= a.size(); ++i)
    for (size_t j = 1; j <= b.size(); ++j) {
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] != b[j - 1])});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  return d[a.size()][b.size()];
}

// The names `word` was probably meant as: the one it is a prefix of when there is one such, else
// every name at the smallest edit distance (at most 2), as "a, b or c"; "" when `word` is one of
// them or none is close.
std::string closest_names(const std::string& word, const std::vector<std::string>& names) {
  std::vector<std::string> prefixed, closest;
  size_t best = 3;
  for (const std::string& name : names) {
    if (name == word) return "";
    if (name.compare(0, word.size(), word) == 0) prefixed.push_back(name);
    const size_t d = edit_distance(word, name);
    if (d < best) best = d, closest.clear();
    if (d == best && d <= 2) closest.push_back(name);
  }
  const std::vector<std::string>& pick = prefixed.size() == 1 ? prefixed : closest;
  std::string list;
  for (size_t k = 0; k < pick.size(); ++k) list += (k ? (k + 1 == pick.size() ? " or " : ", ") : "") + pick[k];
  return list;
}

// After "The following arguments were not expected": for each leftover "--name[=v]" (CLI11's
// remaining arguments of the app and the subcommands given, not values it took), the
// subcommand's options it was probably meant as (closest_names), on stderr.
std::string suggest_options(const CLI::App& app) {
  std::vector<const CLI::App*> scopes;
  for (const CLI::App* sub : app.get_subcommands()) scopes.push_back(sub);  // the ones given
  if (scopes.empty()) scopes.push_back(&app);
  std::vector<std::string> left = app.remaining(), names;
  for (const CLI::App* sub : app.get_subcommands())
    for (const std::string& r : sub->remaining()) left.push_back(r);
  for (const CLI::App* scope : scopes)
    for (const CLI::Option* opt : scope->get_options())
      for (const std::string& name : opt->get_lnames()) names.push_back("--" + name);
  // bare: words without a dash (generate's prompt given without --prompt), except a value that
  // follows an unknown option (--temprature 0.5)
  std::string out, bare;
  bool after_option = false;
  for (const std::string& arg : left) {
    const bool is_word = !arg.empty() && arg[0] != '-';
    if (is_word && !after_option) bare += (bare.empty() ? "" : " ") + arg;
    after_option = !is_word && arg.find('=') == std::string::npos;
    if (arg.size() < 3 || arg.compare(0, 2, "--") != 0) continue;
    const std::string word = arg.substr(0, arg.find('='));
    const std::string list = closest_names(word, names);
    if (!list.empty()) out += "ksctl: " + word + ": did you mean " + list + "?\n";
  }
  if (!bare.empty() && std::find(names.begin(), names.end(), "--prompt") != names.end())
    out += "ksctl: '" + bare + "' was not expected: did you mean --prompt \"" + bare + "\"?\n";
  return out;
}

// After "A subcommand is required" for a first word that names none: the subcommands it was
// probably meant as (closest_names).
std::string suggest_subcommand(const CLI::App& app, const std::string& word) {
  std::vector<std::string> names;
  for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; })) names.push_back(sub->get_name());
  const std::string list = closest_names(word, names);
  return list.empty() ? "" : "ksctl: '" + word + "' is not a command: did you mean " + list + "?\n";
}

// An integer option in [lo, hi]: its value a whole number in decimal digits (an optional '-'), so
// that a typo says what is wanted ("'abc' is not a whole number in [1, 1048576]", "'0' is outside
// [1, 1048576]"), rewritten in canonical decimal ("010" -> "10", since CLI11 would otherwise read a
// leading zero as octal after the check); its type shown as "INT in [lo, hi]" (in --help, and in
// CLI11's "1 required ... missing" for an empty --opt=).
CLI::Option* int_in_range(CLI::Option* opt, int64_t lo, int64_t hi) {
  const std::string range = "[" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
  return opt
      ->transform(CLI::Validator(
          [=](std::string& v) {
            int64_t n = 0;
            const char* end = v.data() + v.size();
            const auto r = std::from_chars(v.data(), end, n);
            if (r.ec == std::errc::result_out_of_range && r.ptr == end) return "'" + v + "' is outside " + range;
            if (r.ec != std::errc() || r.ptr != end) return "'" + v + "' is not a whole number in " + range;
            if (n < lo || n > hi) return "'" + v + "' is outside " + range;
            v = std::to_string(n);
            return std::string();
          },
          ""))
      ->type_name("INT in " + range);
}

// An option's value: a float in [lo, hi] ((lo, hi] with lo_open); a NaN is refused (it would pass
// a range check: every comparison with it is false).
CLI::Validator float_in(float lo, bool lo_open, float hi) {
  auto fmt = [](float f) {
    std::ostringstream o;
    o << f;
    return o.str();
  };
  const std::string range = (lo_open ? "(" : "[") + fmt(lo) + ", " + fmt(hi) + "]";
  return CLI::Validator(
      [=](std::string& v) {
        char* end = nullptr;
        const float f = std::strtof(v.c_str(), &end);
        if (end == v.c_str() || *end != '\0' || std::isnan(f)) return "'" + v + "' is not a number in " + range;
        return (lo_open ? f > lo : f >= lo) && f <= hi ? std::string() : "'" + v + "' is outside " + range;
      },
      "FLOAT in " + range);
}

// An option's value: not empty (hint: what to do instead, in the message).
CLI::Validator not_empty(const std::string& hint = "") {
  const std::string msg = "must not be empty" + (hint.empty() ? std::string() : " (" + hint + ")");
  return CLI::Validator([msg](std::string& v) { return v.empty() ? msg : std::string(); }, "");
}

int cmd_generate(const std::string& path, const std::string& prompt, int64_t max_tokens, const std::string& device,
                 bool chat, const std::string& system, const ks::model::SamplingParams& sampling, int64_t ctx,
                 const std::string& notes) {  // notes: stderr lines said once the model has loaded
  const ks::Backend be = model_backend(device);
  auto t0 = std::chrono::steady_clock::now();
  const auto file = ks::model::GgufFile::open(path);
  const ks::model::Tokenizer tok = ks::model::tokenizer_from_gguf(file);
  std::vector<ks::model::ChatMessage> messages;
  if (!system.empty()) messages.push_back({"system", system});  // (else the template's default)
  messages.push_back({"user", prompt});
  std::string text = prompt;
  if (chat) {  // the model's own template, as far as kernscope renders one (ChatML)
    if (!file.find("tokenizer.chat_template"))
      throw std::invalid_argument("generate --chat: the model file has no tokenizer.chat_template; leave out --chat "
                                  "and give the formatted prompt");
    const ks::model::ChatFormat format =
        ks::model::chat_format_from_template(file.get_string("tokenizer.chat_template"));
    if (format.default_unknown && system.empty())
      throw std::invalid_argument("generate --chat: the model's template inserts a default system turn that kernscope "
                                  "cannot read (several, or one built from variables); give it with --system");
    text = ks::model::apply_chat_template(messages, true, format);
  }
  const std::vector<int32_t> ids = tok.encode(text, /*parse_special=*/chat);
  // --context 0 (the default): the KV cache holds what this request can use, the prompt and
  // max_tokens (at most the model's context length): no more memory than the reply needs (the
  // attention's block table follows the live context either way: LlamaModel::attention_capacity).
  const int64_t capacity = ctx > 0 ? ctx : std::max<int64_t>(16, int64_t(ids.size()) + max_tokens + 1);
  ks::model::LlamaModel model(file, capacity, be);
  std::fputs(notes.c_str(), stderr);
  if (ctx > model.max_context())  // (LlamaModel caps the cache at the model's own context length)
    std::fprintf(stderr, "[ksctl] --context %lld is past the model's context length: the cache holds %lld tokens\n",
                 (long long)ctx, (long long)model.max_context());
  if (int64_t(ids.size()) >= model.max_context())
    throw ks::InvalidArgument(KS_ERROR_INVALID_ARGUMENT,
                              "generate: the prompt has " + std::to_string(ids.size()) + " tokens; the context (" +
                                  std::to_string(model.max_context()) +
                                  (ctx > 0 ? " from --context" : ", the model's own length") +
                                  ") must exceed it" + (ctx > 0 ? " (raise --context)" : ""));
  // CUDA, greedy: the decode graphs of every attention table the reply may reach, with buffers for
  // the prompt (counted in the load time, not the decode rate)
  if (!(sampling.temperature > 0.0f) && max_tokens > 1) model.prepare_decode_greedy(int64_t(ids.size()), max_tokens);
  const double load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // a reply that reaches the context's end stops there, reported as "context full"
  ks::model::StreamDecoder dec(tok);
  ks::model::GenerateOptions opt;
  opt.max_tokens = max_tokens;
  opt.sampling = sampling;
  const ks::model::EndTokens is_end(tok);
  auto st = ks::model::generate(model, tok, ids, opt, [&](int32_t id) {
    if (is_end(id)) return;  // end-of-turn tokens are not printed
    std::fputs(dec.push(id).c_str(), stdout);
    std::fflush(stdout);
  });
  std::fputs(dec.flush().c_str(), stdout);
  std::printf("\n");
  // (the decode rate counts the tokens after the first, which the prefill makes: none with one)
  char rate[64];
  if (st.generated_tokens > 1)
    std::snprintf(rate, sizeof rate, "decode %.1f tokens/s", st.decode_tokens_per_second());
  else
    std::snprintf(rate, sizeof rate, "no decode rate (the one token came from the prefill)");
  const bool eot = std::string(st.stop_reason) == "end of turn";
  std::fprintf(stderr,
               "\n[ksctl] %s, load %.2f s\n"
               "[ksctl] prompt %lld token%s: prefill %.1f tokens/s, time to first token %.1f ms\n"
               "[ksctl] generated %lld token%s%s: %s (stopped: %s)\n",
               model_line(path, model, be).c_str(), load_s, (long long)st.prompt_tokens, st.prompt_tokens == 1 ? "" : "s", st.prefill_tokens_per_second(),
               st.first_token_seconds * 1e3, (long long)st.generated_tokens, st.generated_tokens == 1 ? "" : "s",
               eot ? " (the last ends the turn, not printed)" : "", rate, st.stop_reason);
  if (eot && !chat && st.generated_tokens <= 1)  // (raw text: a bare question often ends the turn at once)
    std::fprintf(stderr, "[ksctl] the model ended its turn at once: an instruct model answers a question with --chat\n");
  return 0;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : (v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]));
}

// Prefill of a synthetic prompt of N tokens and decode of D tokens, R repeats;
// reports medians. The prompt is the chat template around a fixed text, cut or
// repeated to N tokens, so the numbers are comparable across runs.
int cmd_bench_model(const std::string& path, std::vector<int64_t> prompt_lens, int64_t decode_tokens, int repeats,
                    const std::string& device, const std::string& csv, std::vector<int64_t> batches, int64_t context) {
  const ks::Backend be = model_backend(device);
  int64_t max_len = 0, max_batch = 1;
  for (auto n : prompt_lens) max_len = std::max(max_len, n);
  for (auto b : batches) max_batch = std::max(max_batch, b);
  const int64_t need = max_len + decode_tokens + 1;
  if (context > 0 && context < need)
    throw ks::InvalidArgument(KS_ERROR_INVALID_ARGUMENT, "bench-model: --context " + std::to_string(context) +
                                                             " is shorter than the longest prompt + decode tokens + 1 (" +
                                                             std::to_string(need) + ")");
  LoadedModel m(path, context > 0 ? context : need, be, max_batch);
  if (need > m.model.max_context())  // (the cache is capped at the model's own context length)
    throw ks::InvalidArgument(KS_ERROR_INVALID_ARGUMENT,
                              "bench-model: the longest --prompt-tokens (" + std::to_string(max_len) + ") + --decode-tokens (" +
                                  std::to_string(decode_tokens) + ") + 1 = " + std::to_string(need) +
                                  " exceeds the model's context length of " + std::to_string(m.model.max_context()) +
                                  " tokens");
  std::printf("[ksctl] %s, KV cache %lld tokens x %lld sequence%s; batched rows count every sequence's tokens "
              "(tokens and tokens/s)\n",
              model_line(path, m.model, be).c_str(), (long long)m.model.max_context(), (long long)max_batch,
              max_batch == 1 ? "" : "s");
  std::vector<int32_t> base = m.tok.encode(
      ks::model::apply_chat_template({{"user", "Tell me a long story about a lighthouse keeper and the sea."}}), true);
  FILE* out = csv.empty() ? nullptr : std::fopen(csv.c_str(), "w");
  if (!csv.empty() && !out)
    throw ks::InvalidArgument(KS_ERROR_INVALID_ARGUMENT, "bench-model: cannot write --csv " + csv + ": " +
                                                             std::strerror(errno));
  if (out) std::fprintf(out, "phase,prompt_tokens,tokens,threads,median_tokens_per_s,repeats,batch\n");
  std::printf("%-8s %8s %8s %14s\n", "phase", "prompt", "tokens", "tokens/s (med)");
  for (int64_t n : prompt_lens) {
    std::vector<int32_t> prompt;
    while (int64_t(prompt.size()) < n) prompt.push_back(base[prompt.size() % base.size()]);
    std::vector<double> pf, dc, gpu_us;  // gpu_us: KS_MODEL_STEP_TIMING's step times
    for (int r = 0; r < repeats + 1; ++r) {  // first run is a warm-up
      ks::model::GenerateOptions opt;
      opt.max_tokens = decode_tokens;
      opt.stop_at_eos = false;
      (void)m.model.take_step_times_us();
      auto st = ks::model::generate(m.model, m.tok, prompt, opt, [](int32_t) {});
      if (r == 0) continue;
      pf.push_back(st.prefill_tokens_per_second());
      dc.push_back(st.decode_tokens_per_second());
      for (float us : m.model.take_step_times_us()) gpu_us.push_back(us);
    }
    std::printf("%-8s %8lld %8lld %14.1f\n", "prefill", (long long)n, (long long)n, median(pf));
    std::printf("%-8s %8lld %8lld %14.1f\n", "decode", (long long)n, (long long)decode_tokens, median(dc));
    if (!gpu_us.empty())  // the step on the GPU against its wall time: the rest is the host's turn
      std::printf("  step timing (KS_MODEL_STEP_TIMING): %.1f us on the GPU per decode step (median of %zu), "
                  "%.1f us per token from the decode rate\n",
                  median(gpu_us), gpu_us.size(), 1e6 / median(dc));
    if (out) {
      std::fprintf(out, "prefill,%lld,%lld,%d,%.2f,%d,1\n", (long long)n, (long long)n, omp_get_max_threads(), median(pf),
                   repeats);
      std::fprintf(out, "decode,%lld,%lld,%d,%.2f,%d,1\n", (long long)n, (long long)decode_tokens, omp_get_max_threads(),
                   median(dc), repeats);
    }
    // batched decode: b sequences, each prefilled with the prompt, then decode_tokens steps of
    // all b at once (one decode_batch call per step); tokens/s counts every sequence's token
    for (int64_t b : batches) {
      if (b <= 1) continue;
      std::vector<double> rates;
      for (int r = 0; r < repeats + 1; ++r) {
        std::vector<int32_t> toks(static_cast<size_t>(b));
        std::vector<int64_t> poss(static_cast<size_t>(b), n);
        for (int64_t sq = 0; sq < b; ++sq) toks[size_t(sq)] = m.model.forward_argmax_seq(sq, prompt.data(), n, 0);
        const auto t0 = std::chrono::steady_clock::now();
        std::vector<int32_t> next(static_cast<size_t>(b));
        for (int64_t i = 0; i < decode_tokens; ++i) {
          m.model.decode_batch(toks.data(), poss.data(), b, next.data());
          toks.swap(next);
          for (auto& p : poss) ++p;
        }
        const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (r > 0) rates.push_back(double(b * decode_tokens) / secs);
      }
      // (tokens: every sequence's, as the rate; the CSV's tokens column stays the steps per sequence)
      std::printf("%-8s %8lld %8lld %14.1f   (batch %lld: %lld steps of %lld sequences)\n", "decode", (long long)n,
                  (long long)(b * decode_tokens), median(rates), (long long)b, (long long)decode_tokens, (long long)b);
      if (out)
        std::fprintf(out, "decode,%lld,%lld,%d,%.2f,%d,%lld\n", (long long)n, (long long)decode_tokens,
                     omp_get_max_threads(), median(rates), repeats, (long long)b);
    }
  }
  if (out) std::fclose(out);
  return 0;
}

}  // namespace

// --help's option column without the type repeated by each range check: CLI11 prints the type,
// then every validator's description, and a range's description starts with the type again
// ("INT:INT in [1 - 100]"); this keeps one ("INT in [1 - 100]").
class Formatter : public CLI::Formatter {
 public:
  std::string make_option_opts(const CLI::Option* opt) const override {
    std::string s = CLI::Formatter::make_option_opts(opt);
    for (const std::string t : {"INT", "UINT", "FLOAT"})
      for (size_t at; (at = s.find(" " + t + ":" + t + " ")) != std::string::npos ||
                      (at = s.find(" " + t + ":" + t + ":")) != std::string::npos;)
        s.erase(at + 1, t.size() + 1);
    return s;
  }
};

int main(int argc, char** argv) {
  CLI::App app{"ksctl: kernscope operators, kernel selection, checks and the SmolLM2 demo"};
  app.formatter(std::make_shared<Formatter>());  // (before the subcommands, which copy it)
  app.require_subcommand(1);
  app.option_defaults()->always_capture_default();  // --help shows every default
  app.set_version_flag("--version", std::string("kernscope ") + ks::version() + " (commit " + KS_BUILD_COMMIT + ")");

  auto* ops = app.add_subcommand("ops", "Table of op x backend x dtypes (every registered variant)");

  auto* which = app.add_subcommand("which", "Show the variant chosen for an op, dtype and device, and why");
  std::string w_op, w_dtype = "fp32", w_device = "cpu";
  which->add_option("op", w_op, "operator name, e.g. rms_norm")->required();
  which->add_option("--dtype", w_dtype,
                    "fp16 | bf16 | fp32 (or torch's names: float16 / half, bfloat16, float32 / float; any case); for the packed-weight ops "
                    "optionally followed by the weights' block format, e.g. bf16:q4_1 (the routing cells bound to one); "
                    "ks_which checks it")
      ->transform([](std::string v) { return ks::canonical_dtype_key(std::move(v)); });  // (shown so: bf16:q4_1)
  which->add_option("--device", w_device, "cpu | cuda | auto")->check(CLI::IsMember({"cpu", "cuda", "auto"}));
  int64_t w_rows = -1, w_cols = -1;  // -1: not given
  std::string w_cols_text;            // --cols as given where it is a product (NxK), else empty
  // a shape key: decimal digits only, at most 12 (so a product of two stays in int64)
  auto shape_number = [](const char* opt, const std::string& v, const std::string& part) {
    if (part.empty() || part.find_first_not_of("0123456789") != std::string::npos || part.size() > 12)
      throw CLI::ValidationError(opt, "'" + v + "' is not a non-negative integer" +
                                          (std::string(opt) == "--cols" ? " or NxK" : "") + " (at most 12 digits)");
    return std::stoll(part);
  };
  which->add_option_function<std::string>(
      "--rows", [&w_rows, shape_number](const std::string& v) { w_rows = shape_number("--rows", v, v); },
      "with --cols: the choice for a call of this shape (docs/routing.md#shape-keys-rows-cols)");
  // --cols: a number, or AxB for a product (where the op's cols key is one: ks_op_cols_factors)
  which->add_option_function<std::string>(
          "--cols",
          [&w_cols, &w_cols_text, shape_number](const std::string& v) {
            const size_t x = v.find_first_of("xX*");
            w_cols_text = x != std::string::npos ? v : std::string();
            // (a product of 2^63 or more is refused, as Python's which refuses it: no call has that
            // many elements)
            int64_t prod = 0;
            if (x == std::string::npos)
              w_cols = shape_number("--cols", v, v);
            else if (__builtin_mul_overflow(shape_number("--cols", v, v.substr(0, x)),
                                            shape_number("--cols", v, v.substr(x + 1)), &prod))
              throw CLI::ValidationError("--cols", "'" + v + "' is 2^63 or more");
            else
              w_cols = prod;
          },
          "with --rows (the op's shape key: e.g. hidden_size, vocab; quant_matmul: N x K, paged_attention: "
          "max_blocks_per_seq x block_size, each given as the product or as AxB, e.g. 576x576)");

  auto* table = app.add_subcommand("table", "The routing table: which variant goes first per op, GPU arch, dtype and shape");
  bool t_json = false, t_check = false, t_why = false;
  std::string t_op;
  table->add_flag("--json", t_json, "print the table as JSON (ks_routing_table; every cell)");
  table->add_flag("--check", t_check,
                  "exit 1 when a cell names a variant that does not exist, or is never reached (an earlier cell "
                  "covers it)");
  table->add_option("--op", t_op, "only this op's cells");
  table->add_flag("--why", t_why, "each cell's reason and measurement source after its order");

  auto* check = app.add_subcommand("check", "Every op x backend x variant x dtype x shape against FP64 references");
  std::string c_backend = "all", c_op;
  bool c_verbose = false;
  check->add_option("--backend", c_backend, "cpu | cuda | all")->check(CLI::IsMember({"cpu", "cuda", "all"}));
  check->add_option("--op", c_op, "only this op");
  check->add_flag("-v,--verbose", c_verbose, "print every case");

  auto* tune = app.add_subcommand(
      "tune", "Time every variant of the ops with a choice on the present CPU / GPU and write routing tables");
  tune->footer("Each variant is first checked against FP64 at the shape (an incorrect one is reported and never "
               "put first), then timed (CUDA: CUDA-graph replays after 20 ms of warm-up): median of --reps samples. A "
               "shape gets a cell only when its fastest variant beats the runner-up by more than half of either one's "
               "spread between samples and by 3% (or when one of its variants failed its check). Writes DIR/tune_<arch>.csv and DIR/routing_<arch>.json (arch: cpu, or the GPU's sm_XY); use a table with "
               "KS_ROUTING_TABLE=file[:file] or check it into src/registry/routing/ (docs/routing.md). Grid:\n" +
               ks::tune::grid_summary());
  std::string u_backend = "all", u_op, u_dir = ".";
  int u_reps = 5;
  bool u_quiet = false;
  auto* u_backend_opt =
      tune->add_option("--backend", u_backend, "cpu | cuda | all (the ones present)")->check(CLI::IsMember({"cpu", "cuda", "all"}));
  auto* u_op_opt = tune->add_option("--op", u_op, "only this op");
  // (at least 3: with one sample the spread is 0 and a busy machine's single slow sample would decide a cell)
  auto* u_reps_opt = int_in_range(
      tune->add_option("--reps", u_reps,
                       "timed samples per variant and shape (at least 3: their spread decides whether a cell is written)"),
      3, 1000);
  tune->add_option("--out-dir", u_dir, "where the CSV and the tables go (created if missing)");
  tune->add_flag("-q,--quiet", u_quiet, "no progress bar");
  std::string u_from_csv, u_commit;
  // --from-csv measures nothing: the options that choose what to measure do not go with it
  auto* u_from_csv_opt = tune->add_option("--from-csv", u_from_csv,
                                          "write the tables again from an earlier run's tune_<arch>.csv instead of measuring")
                             ->excludes(u_backend_opt)
                             ->excludes(u_op_opt)
                             ->excludes(u_reps_opt);
  tune->add_option("--commit", u_commit, "with --from-csv: the commit the CSV was measured at (the cells' source)")
      ->needs(u_from_csv_opt);

  auto* gen = app.add_subcommand("generate", "Generate text with a Llama-family GGUF model using only kernscope ops");
  // (an empty --prompt: the default, a question with --chat and the start of its answer without,
  // since an instruct model given a bare question as raw text may end its turn at once)
  std::string g_model, g_prompt, g_device = "auto";
  int64_t g_max = 128, g_ctx = 0;
  bool g_chat = false;
  std::string g_system;
  float g_temp = 0.0f, g_top_p = 1.0f;
  int64_t g_top_k = 0;
  uint64_t g_seed = 0;
  gen->add_option("-m,--model", g_model, "path to the .gguf file")->required()->check(CLI::ExistingFile);
  gen->add_option("--prompt", g_prompt, "prompt text (not empty; left out: the default)")
      ->default_str("with --chat: What is the capital of France? / without: The capital of France is")
      ->check(not_empty("leave --prompt out for the default prompt"));
  int_in_range(gen->add_option("--max-tokens", g_max, "tokens to generate at most"), 1, int64_t(1) << 20);
  gen->add_option("--device", g_device, "cpu | cuda | auto (auto: cuda when a CUDA device is present)")->check(CLI::IsMember({"cpu", "cuda", "auto"}));
  CLI::Option* chat_flag = gen->add_flag(
      "--chat", g_chat,
      "wrap the prompt in the model's chat template (ChatML only: its tokenizer.chat_template must render "
      "<|im_start|> turns; its default system turn unless --system)");
  gen->add_option("--system", g_system, "with --chat: the system prompt instead of the template's default")
      ->needs(chat_flag)
      ->check(not_empty());
  gen->add_option("--temperature", g_temp,
                  "0 = greedy; > 0 samples from softmax(logits / T), after --top-k and --top-p (kernscope's sample op)")
      ->check(float_in(0.0f, /*lo_open=*/false, 100.0f));
  int_in_range(gen->add_option("--top-k", g_top_k,
                               "with --temperature > 0: sample among the top_k largest logits (0: all)"),
               0, INT32_MAX);
  gen->add_option("--top-p", g_top_p,
                  "with --temperature > 0: sample from the smallest set of tokens whose probability reaches top_p (1: all)")
      ->check(float_in(0.0f, /*lo_open=*/true, 1.0f));
  // (checked as decimal digits within 64 bits before the conversion, which takes hex and clamps
  // values past 2^64 - 1 to it)
  gen->add_option("--seed", g_seed, "sampling seed (fixed by default, so sampled runs are reproducible)")
      ->transform(CLI::Validator(
          [](std::string& v) {
            uint64_t n = 0;
            const char* end = v.data() + v.size();
            const auto r = std::from_chars(v.data(), end, n);
            if (v.empty() || v.find_first_not_of("0123456789") != std::string::npos)
              return "'" + v + "' is not a whole number in [0, 18446744073709551615]";
            if (r.ec != std::errc() || r.ptr != end) return "'" + v + "' is outside [0, 18446744073709551615]";
            v = std::to_string(n);  // (canonical decimal: CLI11 reads a leading zero as octal)
            return std::string();
          },
          ""))
      ->type_name("INT in [0, 2^64 - 1]");
  int g_threads = 0, b_threads = 0;
  int_in_range(gen->add_option("--threads", g_threads,
                               "CPU threads (0 = all cores, one fewer per core other processes keep busy at the "
                               "start; 1 avoids stalls when other processes load the CPU)"),
               0, 1024);
  gen->add_option("--context", g_ctx, "KV-cache capacity in tokens (0: the prompt + --max-tokens)")
      ->transform(CLI::Validator(
          [](std::string& v) {
            char* end = nullptr;
            const long long n = std::strtoll(v.c_str(), &end, 10);
            if (!(end != v.c_str() && *end == '\0' && (n == 0 || (n >= 16 && n <= (1LL << 20)))))
              return "'" + v + "' is not 0 or a whole number in [16, 1048576]";
            v = std::to_string(n);  // (canonical decimal: CLI11 reads a leading zero as octal)
            return std::string();
          },
          ""))
      ->type_name("0 or INT in [16, 1048576]");

  auto* bench = app.add_subcommand("bench-model", "Prefill and decode tokens/s of a GGUF model (median of repeats)");
  std::string b_model, b_device = "auto", b_csv;
  std::vector<int64_t> b_prompts{64, 512};
  int64_t b_decode = 128;
  int b_repeats = 5;
  bench->add_option("-m,--model", b_model, "path to the .gguf file")->required()->check(CLI::ExistingFile);
  int_in_range(bench->add_option("--prompt-tokens", b_prompts, "prompt lengths to measure"), 1, int64_t(1) << 20);
  int_in_range(bench->add_option("--decode-tokens", b_decode, "tokens decoded per repeat"), 2, 4096);
  int_in_range(bench->add_option("--repeats", b_repeats, "repeats (median reported; one extra warm-up)"), 1, 100);
  bench->add_option("--device", b_device, "cpu | cuda | auto (auto: cuda when a CUDA device is present)")->check(CLI::IsMember({"cpu", "cuda", "auto"}));
  bench->add_option("--csv", b_csv,
                    "write results to this CSV: phase, prompt_tokens, tokens (a batched row's decode steps per "
                    "sequence), threads, median_tokens_per_s (every sequence's tokens), repeats, batch");
  int64_t b_context = 0;
  int_in_range(bench->add_option("--context", b_context,
                                 "KV-cache capacity in tokens (default: the longest prompt + decode tokens + 1; the "
                                 "decode attention's block table follows the live context, its widest is the whole "
                                 "cache)"),
               16, int64_t(1) << 20)
      ->default_str("the longest prompt + decode tokens + 1");
  std::vector<int64_t> b_batches{1};
  int_in_range(bench->add_option("--batch", b_batches,
                                 "also decode this many sequences at once (decode throughput), e.g. 8 32"),
               1, 256);
  int_in_range(bench->add_option("--threads", b_threads,
                                 "CPU threads (0 = all cores, one fewer per core other processes keep busy, as "
                                 "generate; OMP_NUM_THREADS or OMP_WAIT_POLICY set: OpenMP's choice)"),
               0, 1024);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help / --version exit 0 through CLI11's printer; a usage error prints its message and
    // exits 2, like every other refusal here (CLI11's own codes, 105-ish, would be a second scheme)
    // (a likely typo of an option or a command: the suggestion first, in place of CLI11's message,
    // which lists the leftovers in reverse and says "A subcommand is required" before the name)
    std::string hint;
    if (dynamic_cast<const CLI::ExtrasError*>(&e)) hint = suggest_options(app);
    if (hint.empty() && app.get_subcommands().empty() && argc > 1 && argv[1][0] != '-')
      hint = suggest_subcommand(app, argv[1]);
    if (!hint.empty()) {
      std::fprintf(stderr, "%sRun with --help for more information.\n", hint.c_str());
      return 2;
    }
    const int rc = app.exit(e);
    return rc == 0 ? 0 : 2;
  }
  try {
    if (*ops) return cmd_ops();
    if (*which) return cmd_which(w_op, w_dtype, w_device, w_rows, w_cols, w_cols_text);
    if (*table) return cmd_table(t_json, t_check, t_op, t_why);
    if (*check) return run_check(c_backend, c_op, c_verbose);
    if (*tune) return u_from_csv.empty() ? run_tune(u_backend, u_op, u_reps, u_dir, u_quiet)
                                         : run_tune_from_csv(u_from_csv, u_dir, u_commit);
    if (*gen && g_threads > 0) omp_set_num_threads(g_threads);
    std::string notes;  // (said once the model has loaded: an error about the model comes first)
    if (*gen && g_threads == 0 &&
        (g_device == "cpu" || (g_device == "auto" && !ks::backend_available(ks::Backend::Cuda))))
      notes = choose_cpu_threads();
    if (*bench && b_threads > 0) omp_set_num_threads(b_threads);
    // bench-model's --threads 0: generate's choice (all cores, one fewer per core busy elsewhere), said
    // before the run; the CSV's threads column records what ran
    if (*bench && b_threads == 0 &&
        (b_device == "cpu" || (b_device == "auto" && !ks::backend_available(ks::Backend::Cuda))))
      std::fputs(choose_cpu_threads().c_str(), stderr);
    if (*gen) {
      if (g_temp == 0.0f && (gen->count("--top-k") + gen->count("--top-p") + gen->count("--seed")) > 0)
        std::fprintf(stderr, "[ksctl] note: --top-k, --top-p and --seed act only with --temperature > 0; "
                             "this run is greedy\n");
      if (g_prompt.empty()) {  // (said, since without --chat the output continues a prompt never shown)
        g_prompt = g_chat ? "What is the capital of France?" : "The capital of France is";
        notes += std::string("[ksctl] no --prompt: the default ") + (g_chat ? "question" : "prompt") + " \"" +
                        g_prompt + "\"" + (g_chat ? "" : " (the output continues it)") + "\n";
      }
      return cmd_generate(g_model, g_prompt, g_max, g_device, g_chat, g_system,
                          ks::model::SamplingParams{g_temp, g_top_k, g_top_p, g_seed}, g_ctx, notes);
    }
    if (*bench) return cmd_bench_model(b_model, b_prompts, b_decode, b_repeats, b_device, b_csv, b_batches, b_context);
  } catch (const ks::Error& e) {
    std::fprintf(stderr, "ksctl: error: %s (%s)\n", e.what(), ks_status_name(e.status()));
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ksctl: error: %s\n", e.what());
    return 2;
  }
  return 0;
}
