// `ksctl tune`: measures every variant of the ops with a choice (tools/check.cpp's
// ks::tune::measure, each result checked against FP64 first), then writes
//  - <dir>/tune_<arch>.csv: one row per (backend, op, dtype, shape, variant), with the commit
//    measured (KS_COMMIT, else the commit ksctl was built from);
//  - <dir>/routing_<arch>.json: a routing table (schema kernscope-routing/1) with one
//    "measured" cell per (op, backend, dtype, shape bucket), its variants fastest first.
// arch: the GPU's sm_XY when CUDA was tuned (cuda cells), "cpu" for the CPU's file (whose
// table arch is "*", matching every machine, as generic.json). Buckets: each measured rows
// value r_i covers [floor(sqrt(r_{i-1} r_i)) + 1, floor(sqrt(r_i r_{i+1}))], the first from 0
// and the last open; the same for cols: every shape goes to the nearest measured one on a log
// scale (a perfect-square midpoint to the lower one).
#include <kernscope/kernscope.hpp>

#include "build_commit.h"  // KS_BUILD_COMMIT (cmake/build_commit.cmake)

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <unistd.h>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <tuple>
#include <string>
#include <vector>

#include "tune.hpp"

#ifdef KS_CHECK_CUDA
#include <cuda_runtime.h>
#endif

namespace {

using ks::tune::Row;

// [lo, hi] per measured value (hi < 0: open), a log-scale partition of [0, inf)
std::map<int64_t, std::pair<int64_t, int64_t>> buckets(const std::set<int64_t>& values) {
  std::map<int64_t, std::pair<int64_t, int64_t>> b;
  const std::vector<int64_t> v(values.begin(), values.end());
  for (size_t i = 0; i < v.size(); ++i) {
    const int64_t lo = i == 0 ? 0 : int64_t(std::floor(std::sqrt(double(v[i - 1]) * double(v[i])))) + 1;
    const int64_t hi = i + 1 == v.size() ? -1 : int64_t(std::floor(std::sqrt(double(v[i]) * double(v[i + 1]))));
    b[v[i]] = {std::min(lo, v[i]), hi < 0 ? -1 : std::max(hi, v[i])};
  }
  return b;
}

nlohmann::json bound(std::pair<int64_t, int64_t> r) {
  return nlohmann::json::array({r.first, r.second < 0 ? nlohmann::json(nullptr) : nlohmann::json(r.second)});
}

std::string cuda_arch() {
#ifdef KS_CHECK_CUDA
  int dev = 0, major = 0, minor = 0;
  if (cudaGetDevice(&dev) == cudaSuccess && cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess &&
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) == cudaSuccess)
    return "sm_" + std::to_string(major) + std::to_string(minor);
#endif
  return "";
}
std::string cuda_name() {
#ifdef KS_CHECK_CUDA
  cudaDeviceProp p{};
  int dev = 0;
  if (cudaGetDevice(&dev) == cudaSuccess && cudaGetDeviceProperties(&p, dev) == cudaSuccess) return p.name;
#endif
  return "a CUDA device";
}

// RFC 4180: quoted when it holds a comma, quote or line break; quotes doubled
std::string csv_field(const std::string& v) {
  if (v.find_first_of(",\"\r\n") == std::string::npos) return v;
  std::string q = "\"";
  for (char ch : v) q += ch == '"' ? std::string("\"\"") : std::string(1, ch);
  return q + "\"";
}

// On a terminal: one line redrawn in place; into a file or pipe (a log): a line every tenth of
// the work and the last, without carriage returns.
void progress_bar(size_t done, size_t total, const std::string& what) {
  if (total == 0) return;
  static const bool tty = isatty(fileno(stderr)) != 0;
  if (!tty) {
    if (done == total || (done * 10 / total) != ((done - (done > 0)) * 10 / total))
      std::fprintf(stderr, "tune: %zu/%zu %s\n", done, total, what.c_str());
    return;
  }
  const int width = 30;
  const int filled = total ? int(double(done) / double(total) * width) : width;
  std::fprintf(stderr, "\r[%s%s] %zu/%zu %-70.70s", std::string(size_t(filled), '#').c_str(),
               std::string(size_t(width - filled), ' ').c_str(), done, total, what.c_str());
  if (done == total) std::fprintf(stderr, "\n");
  std::fflush(stderr);
}

// The block format a row was measured with, as a cell's "qtype" ("q4_1"): the tag before the
// first ':' of its shape where that tag names a format (the packed-weight ops' rows, e.g.
// "Q4_1:1x576x576"), else "" (the cell then applies to every format).
std::string shape_qtype(const std::string& shape) {
  const std::string tag = shape.substr(0, shape.find(':'));
  if (tag.size() == shape.size()) return "";
  for (const char* f : {"Q4_0", "Q4_1", "Q8_0", "F32", "F16", "BF16"})
    if (tag == f) {
      std::string q;
      for (char ch : tag) q += char(std::tolower(static_cast<unsigned char>(ch)));
      return q;
    }
  return "";
}

// the table for one backend's rows; false when no cell could be made
bool write_table(const std::vector<Row>& rows, const std::string& backend, const std::string& arch_name,
                 const std::string& path, const std::string& csv, int reps, const std::string& where,
                 int* undecided) {
  // (op, dtype, block format) -> the keys measured; (op, dtype, format, rows, cols) -> its rows.
  // Each block format a packed-weight op was measured with gets cells of its own.
  std::map<std::tuple<std::string, std::string, std::string>, std::pair<std::set<int64_t>, std::set<int64_t>>> keys;
  std::map<std::tuple<std::string, std::string, std::string, int64_t, int64_t>, std::vector<const Row*>> at;
  for (const Row& r : rows) {
    if (r.backend != backend) continue;
    const std::string q = shape_qtype(r.shape);
    auto& k = keys[{r.op, r.dtype, q}];
    k.first.insert(r.rows);
    k.second.insert(r.cols);
    at[{r.op, r.dtype, q, r.rows, r.cols}].push_back(&r);
  }
  nlohmann::json cells = nlohmann::json::array();
  for (const auto& [opdq, k] : keys) {
    const auto& [op, dtype, qtype] = opdq;
    const auto rb = buckets(k.first), cb = buckets(k.second);
    for (int64_t rv : k.first)
      for (int64_t cv : k.second) {
        auto it = at.find({op, dtype, qtype, rv, cv});
        if (it == at.end()) continue;
        std::vector<const Row*> ok;
        for (const Row* r : it->second)
          if (r->status == "ok") ok.push_back(r);
        if (ok.empty()) continue;
        std::stable_sort(ok.begin(), ok.end(), [](const Row* a, const Row* b) { return a->us < b->us; });
        // Decisive only: the fastest must beat the runner-up by more than half of either one's
        // spread between samples (about the uncertainty of a median of 5) and by 3%; otherwise
        // the timings cannot order them and no cell is written, so calls of that shape keep
        // the registry's order (priority, or a later heuristic cell).
        // A shape where some variant failed its check keeps its cell even so: without one,
        // the registry's order could put the failed variant first (with three or more).
        bool failed = false;
        for (const Row* r : it->second) failed = failed || r->status == "incorrect" || r->status == "error";
        bool decisive = true;
        if (ok.size() > 1) {
          const double margin = (ok[1]->us - ok[0]->us) / ok[0]->us;
          decisive = margin > std::max({0.03, ok[0]->spread / 2, ok[1]->spread / 2});
          if (!decisive && !failed) {
            ++*undecided;
            continue;
          }
        }
        nlohmann::json order = nlohmann::json::array();
        std::string why = "ksctl tune at " + ok[0]->shape + " (median of " + (reps > 0 ? std::to_string(reps) : "the") +
                          " samples):";
        for (const Row* r : ok) {
          order.push_back(r->variant);
          char buf[96];
          std::snprintf(buf, sizeof buf, " %s %.2f us", r->variant.c_str(), r->us);
          why += buf;
        }
        for (const Row* r : it->second)
          if (r->status != "ok") why += " (" + r->variant + ": " + r->status + ")";
        if (!decisive) why += " (not decisive; a cell because a variant failed its check)";
        nlohmann::json cell = {{"op", op},
                               {"backend", backend},
                               {"dtype", dtype},
                               {"rows", bound(rb.at(rv))},
                               {"cols", bound(cb.at(cv))},
                               {"order", order},
                               {"basis", "measured"},
                               {"source", csv},
                               {"why", why}};
        if (!qtype.empty()) cell["qtype"] = qtype;
        cells.push_back(std::move(cell));
      }
  }
  if (cells.empty() && *undecided == 0) {
    std::fprintf(stderr, "tune: no %s variant passed its check at any shape: no table written\n", backend.c_str());
    return false;
  }
  char date[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof date, "%Y-%m-%d", std::gmtime(&now));
  const nlohmann::json table = {{"schema", "kernscope-routing/1"},
                                {"arch", arch_name},
                                {"description", "Measured by ksctl tune on " + where + " (" + date + "); raw times: " + csv},
                                {"cells", cells}};
  std::ofstream f(path);
  f << table.dump(2) << "\n";
  if (!f) {
    std::fprintf(stderr, "tune: cannot write %s\n", path.c_str());
    return false;
  }
  std::printf("%s: %zu measured cells (%d shapes left out: their variants' timings were within the noise). Try it "
              "with KS_ROUTING_TABLE=%s (it replaces the compiled-in tables); to make it the default, put its cells "
              "first in src/registry/routing/%s.json\n",
              path.c_str(), cells.size(), *undecided, path.c_str(), backend == "cpu" ? "generic" : arch_name.c_str());
  return true;
}

// One RFC 4180 record into fields (quoted fields may hold commas, doubled quotes and line
// breaks); *open: the record ends inside a quoted field (its next line continues it).
std::vector<std::string> csv_split(const std::string& line, bool* open) {
  std::vector<std::string> f(1);
  bool q = false;
  for (size_t i = 0; i < line.size(); ++i) {
    const char ch = line[i];
    if (q && ch == '"' && i + 1 < line.size() && line[i + 1] == '"') f.back() += '"', ++i;
    else if (ch == '"') q = !q;
    else if (ch == ',' && !q) f.emplace_back();
    else f.back() += ch;
  }
  *open = q;
  return f;
}

// a whole field as a number (std::stod alone would take "5x" as 5)
bool parse_num(const std::string& s, double* v) {
  if (s.empty()) return false;
  char* end = nullptr;
  *v = std::strtod(s.c_str(), &end);
  return end == s.c_str() + s.size() && std::isfinite(*v);
}

// The rows of an earlier run's tune_<arch>.csv, for --from-csv, and the arch of its cuda rows
// (sm_XY; "" when it has none). false with *err set when the file is not such a CSV.
bool read_rows(const std::string& path, std::vector<Row>* rows, std::string* arch, std::string* err) {
  std::ifstream in(path);
  if (!in) {
    *err = "cannot be read";
    return false;
  }
  std::string line;
  if (!std::getline(in, line) || line.rfind("backend,arch,op,dtype,shape,rows,cols,variant,status,us,spread,why", 0) != 0) {
    *err = "is not a ksctl tune CSV (its first line is not tune's header)";
    return false;
  }
  std::set<std::tuple<std::string, std::string, std::string, std::string, int64_t, int64_t, std::string>> seen;
  int n = 1;
  while (std::getline(in, line)) {
    const int first = ++n;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty()) continue;
    bool open = false;
    auto f = csv_split(line, &open);
    for (std::string more; open && std::getline(in, more); ++n) {  // a quoted line break
      if (!more.empty() && more.back() == '\r') more.pop_back();
      line += "\n" + more;
      f = csv_split(line, &open);
    }
    const std::string at = "line " + std::to_string(first) + ": ";
    if (open || (f.size() != 12 && f.size() != 13)) {  // (13: the commit, written since 2026-11-30)
      *err = at + (open ? "a quoted field is not closed" : "expected 12 or 13 fields, found " + std::to_string(f.size()));
      return false;
    }
    Row r;
    r.backend = f[0];
    r.op = f[2];
    r.dtype = f[3];
    r.shape = f[4];
    r.variant = f[7];
    r.status = f[8];
    r.why = f[11];
    double rows_v = 0, cols_v = 0;
    if (!parse_num(f[5], &rows_v) || !parse_num(f[6], &cols_v) || rows_v < 0 || cols_v < 0 ||
        rows_v != std::floor(rows_v) || cols_v != std::floor(cols_v)) {
      *err = at + "rows and cols must be integers >= 0";
      return false;
    }
    r.rows = int64_t(rows_v);
    r.cols = int64_t(cols_v);
    if (r.backend != "cpu" && r.backend != "cuda") {
      *err = at + "backend must be cpu or cuda, not \"" + r.backend + "\"";
      return false;
    }
    if (r.status != "ok" && r.status != "incorrect" && r.status != "skipped" && r.status != "error") {
      *err = at + "status must be ok, incorrect, skipped or error, not \"" + r.status + "\"";
      return false;
    }
    if (r.status == "ok" && (!parse_num(f[9], &r.us) || r.us <= 0 || !parse_num(f[10], &r.spread) || r.spread < 0)) {
      *err = at + "an ok row needs us > 0 and spread >= 0";
      return false;
    }
    if (r.backend == "cuda") {  // the table's arch and file name; cpu rows' tables are arch "*"
      bool sm = f[1].size() > 3 && f[1].compare(0, 3, "sm_") == 0;
      for (size_t i = 3; sm && i < f[1].size(); ++i) sm = f[1][i] >= '0' && f[1][i] <= '9';
      if (!sm || (!arch->empty() && *arch != f[1])) {
        *err = at + "a cuda row's arch must be sm_<digits>, the same on every cuda row (got \"" + f[1] + "\")";
        return false;
      }
      *arch = f[1];
    }
    if (!seen.insert({r.backend, r.op, r.dtype, shape_qtype(r.shape), r.rows, r.cols, r.variant}).second) {
      *err = at + "a second row for " + r.backend + " " + r.op + " " + r.dtype + " " + r.variant + " at rows " +
             f[5] + ", cols " + f[6];
      return false;
    }
    rows->push_back(std::move(r));
  }
  if (rows->empty()) {
    *err = "has no rows after its header";
    return false;
  }
  return true;
}

// --out-dir, created if missing (false, and the reason on stderr, when it cannot be)
bool make_out_dir(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec || !std::filesystem::is_directory(dir)) {
    std::fprintf(stderr, "tune: cannot create --out-dir %s\n", dir.c_str());
    return false;
  }
  return true;
}

// the backends the rows hold, cpu first: one CSV and one table each
std::vector<std::string> backends_of(const std::vector<Row>& rows) {
  std::vector<std::string> out;
  for (const char* be : {"cpu", "cuda"})
    for (const Row& r : rows)
      if (r.backend == be) {
        out.push_back(be);
        break;
      }
  return out;
}

}  // namespace

bool ks::tune::has_op(const std::string& op) {
  for (const auto& v : ks::variants())
    if (op == v.op) return true;
  return false;
}

// `ksctl tune --from-csv FILE`: the routing table again from an earlier run's measurements
// (after a change of the rule that turns them into cells; no timing, no device needed).
int run_tune_from_csv(const std::string& csv_path, const std::string& dir, const std::string& commit) {
  std::vector<Row> rows;
  std::string arch, err;
  if (!read_rows(csv_path, &rows, &arch, &err)) {
    std::fprintf(stderr, "tune: %s %s\n", csv_path.c_str(), err.c_str());
    return 2;
  }
  if (!make_out_dir(dir)) return 2;
  int status = 0;
  for (const std::string& be : backends_of(rows)) {
    const std::string a = be == "cpu" ? "cpu" : arch;
    const std::string name = std::filesystem::path(csv_path).filename().string();
    const std::string source = name + " @ " + (commit.empty() ? "unknown commit" : commit);
    int undecided = 0;
    if (!write_table(rows, be, be == "cpu" ? "*" : a, dir + "/routing_" + a + ".json", source, 0,
                     "the machine that measured " + name + "; cells re-derived by ksctl tune --from-csv", &undecided))
      status = 1;
  }
  return status;
}

int run_tune(const std::string& backend, std::string op, int reps, const std::string& dir, bool quiet) {
  if (const char* runs = op.empty() ? nullptr : ks_op_runs_variants_of(op.c_str())) {
    std::fprintf(stderr, "tune: %s runs %s's variants: tuning %s\n", op.c_str(), runs, runs);
    op = runs;
  }
  if (reps < 1) {
    std::fprintf(stderr, "tune: --reps must be >= 1\n");
    return 2;
  }
  if (!op.empty() && !ks::tune::has_op(op)) {
    std::fprintf(stderr, "tune: unknown op '%s' (the operators: ksctl ops)\n", op.c_str());
    return 2;
  }
  if (backend == "cuda" && !ks::backend_available(ks::Backend::Cuda)) {
    std::fprintf(stderr, "tune: --backend cuda, but the CUDA backend is not available here\n");
    return 3;
  }
  // The directories of --out-dir's path that this run creates (from the deepest), removed again
  // when it writes nothing into them; a path whose existence cannot be told counts as existing.
  std::vector<std::filesystem::path> created;
  for (std::filesystem::path d = std::filesystem::absolute(dir).lexically_normal(); !d.empty() && d != d.parent_path();
       d = d.parent_path()) {
    std::error_code ec;
    const bool there = std::filesystem::exists(d, ec);
    if (there || ec) break;
    created.push_back(d);
  }
  if (!make_out_dir(dir)) return 2;  // (before measuring: a path that cannot be made fails at once)
  auto drop_new_dirs = [&] {
    std::error_code ec;
    for (const auto& d : created)
      if (!std::filesystem::remove(d, ec)) break;  // (only an empty directory is removed)
  };
  const std::vector<Row> rows = ks::tune::measure(backend, op, reps, quiet ? ks::tune::Progress() : progress_bar);
  if (rows.empty()) {  // not an error: every op here has one variant, or the op has no shapes in the grid
    int choices = 0;  // the op's variants on the backends present
    for (const auto& v : ks::variants())
      if (op == v.op && (backend == "all" || backend == v.backend) &&
          ks::backend_available(std::string(v.backend) == "cpu" ? ks::Backend::Cpu : ks::Backend::Cuda))
        ++choices;
    if (!op.empty() && choices > 1)
      std::printf("tune: nothing to tune: %s has %d variants here but no shapes in tune's grid (tune --help lists "
                  "the grid; its routing cells are written by hand: docs/routing.md)\n",
                  op.c_str(), choices);
    else
      std::printf("tune: nothing to tune (no op%s with more than one variant on the backends present)\n",
                  op.empty() ? "" : (" " + op).c_str());
    drop_new_dirs();
    return 0;
  }
  int status = 0;
  for (const std::string& be : backends_of(rows)) {
    const std::string arch = be == "cpu" ? "cpu" : cuda_arch();
    const std::string csv = dir + "/tune_" + arch + ".csv", json = dir + "/routing_" + arch + ".json";
    // the table's "source": the CSV's name and the commit measured (KS_COMMIT, which gpu_check.sh
    // exports, else the commit ksctl was built from)
    const char* commit = std::getenv("KS_COMMIT");
    const std::string source = "tune_" + arch + ".csv @ " + (commit && *commit ? commit : KS_BUILD_COMMIT);
    std::ofstream f(csv);
    f << "backend,arch,op,dtype,shape,rows,cols,variant,status,us,spread,why,commit\n";
    for (const Row& r : rows) {
      if (r.backend != be) continue;
      char us[32], spread[32];
      std::snprintf(us, sizeof us, "%.3f", r.us);
      std::snprintf(spread, sizeof spread, "%.3f", r.spread);
      f << r.backend << ',' << arch << ',' << r.op << ',' << r.dtype << ',' << csv_field(r.shape) << ',' << r.rows << ','
        << r.cols << ',' << r.variant << ',' << r.status << ',' << (r.status == "ok" ? us : "") << ','
        << (r.status == "ok" ? spread : "") << ',' << csv_field(r.why) << ','
        << csv_field(commit && *commit ? commit : KS_BUILD_COMMIT) << "\n";
    }
    if (!f) {
      std::fprintf(stderr, "tune: cannot write %s\n", csv.c_str());
      return 1;
    }
    for (const Row& r : rows)
      if (r.backend == be && (r.status == "incorrect" || r.status == "error")) {
        std::fprintf(stderr, "tune: %s %s %s %s: %s: %s\n", r.op.c_str(), r.variant.c_str(), r.dtype.c_str(),
                     r.shape.c_str(), r.status == "error" ? "ERROR" : "INCORRECT", r.why.c_str());
        status = 1;
      }
    int noisy = 0;
    for (const Row& r : rows) noisy += r.backend == be && r.status == "ok" && r.spread > 0.25;
    if (noisy)
      std::fprintf(stderr,
                   "tune: warning: %d %s timings vary by more than 25%% between samples (the spread column of %s): "
                   "is the machine busy? Tune on a quiet machine%s before using the table.\n",
                   noisy, be.c_str(), csv.c_str(), be == "cpu" ? " (OMP_WAIT_POLICY=passive helps when cores are shared)" : "");
    const std::string where = be == "cpu" ? std::string("this machine's CPU") : cuda_name();
    int undecided = 0;
    if (!write_table(rows, be, be == "cpu" ? "*" : arch, json, source, reps, where, &undecided))
      status = status ? status : 1;
  }
  return status;
}
