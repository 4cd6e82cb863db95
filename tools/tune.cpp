// `ksctl tune`: measures every variant of the ops with a choice (tools/check.cpp's
// ks::tune::measure, each result checked against FP64 first), then writes
//  - <dir>/tune_<arch>.csv: one row per (backend, op, dtype, shape, variant);
//  - <dir>/routing_<arch>.json: a routing table (schema kernscope-routing/1) with one
//    "measured" cell per (op, backend, dtype, shape bucket), its variants fastest first.
// arch: the GPU's sm_XY when CUDA was tuned (cuda cells), "cpu" for the CPU's file (whose
// table arch is "*", matching every machine, as generic.json). Buckets: each measured rows
// value r_i covers [floor(sqrt(r_{i-1} r_i)) + 1, floor(sqrt(r_i r_{i+1}))], the first from 0
// and the last open; the same for cols: every shape goes to the nearest measured one on a log
// scale (a perfect-square midpoint to the lower one).
#include <kernscope/kernscope.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
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

void progress_bar(size_t done, size_t total, const std::string& what) {
  if (total == 0) return;
  const int width = 30;
  const int filled = total ? int(double(done) / double(total) * width) : width;
  std::fprintf(stderr, "\r[%s%s] %zu/%zu %-70.70s", std::string(size_t(filled), '#').c_str(),
               std::string(size_t(width - filled), ' ').c_str(), done, total, what.c_str());
  if (done == total) std::fprintf(stderr, "\n");
  std::fflush(stderr);
}

// the table for one backend's rows; false when no cell could be made
bool write_table(const std::vector<Row>& rows, const std::string& backend, const std::string& arch_name,
                 const std::string& path, const std::string& csv, int reps, const std::string& where,
                 int* undecided) {
  // (op, dtype) -> the keys measured; (op, dtype, rows, cols) -> its rows
  std::map<std::pair<std::string, std::string>, std::pair<std::set<int64_t>, std::set<int64_t>>> keys;
  std::map<std::tuple<std::string, std::string, int64_t, int64_t>, std::vector<const Row*>> at;
  for (const Row& r : rows) {
    if (r.backend != backend) continue;
    auto& k = keys[{r.op, r.dtype}];
    k.first.insert(r.rows);
    k.second.insert(r.cols);
    at[{r.op, r.dtype, r.rows, r.cols}].push_back(&r);
  }
  nlohmann::json cells = nlohmann::json::array();
  for (const auto& [opd, k] : keys) {
    const auto rb = buckets(k.first), cb = buckets(k.second);
    for (int64_t rv : k.first)
      for (int64_t cv : k.second) {
        auto it = at.find({opd.first, opd.second, rv, cv});
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
        if (ok.size() > 1) {
          const double margin = (ok[1]->us - ok[0]->us) / ok[0]->us;
          if (!(margin > std::max({0.03, ok[0]->spread / 2, ok[1]->spread / 2}))) {
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
        cells.push_back({{"op", opd.first},
                         {"backend", backend},
                         {"dtype", opd.second},
                         {"rows", bound(rb.at(rv))},
                         {"cols", bound(cb.at(cv))},
                         {"order", order},
                         {"basis", "measured"},
                         {"source", csv},
                         {"why", why}});
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

// One RFC 4180 line into fields (quoted fields may hold commas and doubled quotes).
std::vector<std::string> csv_split(const std::string& line) {
  std::vector<std::string> f(1);
  bool q = false;
  for (size_t i = 0; i < line.size(); ++i) {
    const char ch = line[i];
    if (q && ch == '"' && i + 1 < line.size() && line[i + 1] == '"') f.back() += '"', ++i;
    else if (ch == '"') q = !q;
    else if (ch == ',' && !q) f.emplace_back();
    else f.back() += ch;
  }
  return f;
}

// The rows of an earlier run's tune_<arch>.csv (its arch column too), for --from-csv.
bool read_rows(const std::string& path, std::vector<Row>* rows, std::string* arch) {
  std::ifstream in(path);
  std::string line;
  if (!in || !std::getline(in, line) || line.rfind("backend,arch,op,dtype,shape,rows,cols,variant,status,us,spread", 0) != 0)
    return false;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    const auto f = csv_split(line);
    if (f.size() < 12) return false;
    Row r;
    r.backend = f[0];
    *arch = f[1];
    r.op = f[2];
    r.dtype = f[3];
    r.shape = f[4];
    r.rows = std::stoll(f[5]);
    r.cols = std::stoll(f[6]);
    r.variant = f[7];
    r.status = f[8];
    r.us = f[9].empty() ? -1 : std::stod(f[9]);
    r.spread = f[10].empty() ? 0 : std::stod(f[10]);
    r.why = f[11];
    rows->push_back(std::move(r));
  }
  return true;
}

}  // namespace

// `ksctl tune --from-csv FILE`: the routing table again from an earlier run's measurements
// (after a change of the rule that turns them into cells; no timing, no device needed).
int run_tune_from_csv(const std::string& csv_path, const std::string& dir, const std::string& commit) {
  std::vector<Row> rows;
  std::string arch;
  try {
    if (!read_rows(csv_path, &rows, &arch)) {
      std::fprintf(stderr, "tune: %s is not a ksctl tune CSV\n", csv_path.c_str());
      return 2;
    }
  } catch (const std::exception&) {
    std::fprintf(stderr, "tune: %s has a malformed number\n", csv_path.c_str());
    return 2;
  }
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  int status = 0;
  for (const std::string be : {"cpu", "cuda"}) {
    bool any = false;
    for (const Row& r : rows) any = any || r.backend == be;
    if (!any) continue;
    const std::string a = be == "cpu" ? "cpu" : arch;
    const std::string name = std::filesystem::path(csv_path).filename().string();
    const std::string source = name + " @ " + (commit.empty() ? "unknown commit" : commit);
    int undecided = 0;
    if (!write_table(rows, be, be == "cpu" ? "*" : a, dir + "/routing_" + a + ".json", source, 0,
                     "the machine that measured " + name, &undecided))
      status = 1;
  }
  return status;
}

int run_tune(const std::string& backend, const std::string& op, int reps, const std::string& dir, bool quiet) {
  if (reps < 1) {
    std::fprintf(stderr, "tune: --reps must be >= 1\n");
    return 2;
  }
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec || !std::filesystem::is_directory(dir)) {
    std::fprintf(stderr, "tune: cannot create --out-dir %s\n", dir.c_str());
    return 2;
  }
  if (!op.empty()) {
    bool known = false;
    for (const auto& v : ks::variants()) known = known || op == v.op;
    if (!known) {
      std::fprintf(stderr, "tune: unknown op '%s' (the operators: ksctl ops)\n", op.c_str());
      return 2;
    }
  }
  if (backend == "cuda" && !ks::backend_available(ks::Backend::Cuda)) {
    std::fprintf(stderr, "tune: --backend cuda, but the CUDA backend is not available here\n");
    return 3;
  }
  const std::vector<Row> rows = ks::tune::measure(backend, op, reps, quiet ? ks::tune::Progress() : progress_bar);
  if (rows.empty()) {  // not an error: every op here has one variant
    std::printf("tune: nothing to tune (no op%s with more than one variant on the backends present)\n",
                op.empty() ? "" : (" " + op).c_str());
    return 0;
  }
  int status = 0;
  for (const std::string be : {"cpu", "cuda"}) {
    bool any = false;
    for (const Row& r : rows) any = any || r.backend == be;
    if (!any) continue;
    const std::string arch = be == "cpu" ? "cpu" : cuda_arch();
    const std::string csv = dir + "/tune_" + arch + ".csv", json = dir + "/routing_" + arch + ".json";
    // the table's "source": the CSV's name and the commit measured (gpu_check.sh exports KS_COMMIT)
    const char* commit = std::getenv("KS_COMMIT");
    const std::string source = "tune_" + arch + ".csv @ " + (commit && *commit ? commit : "unknown commit");
    std::ofstream f(csv);
    f << "backend,arch,op,dtype,shape,rows,cols,variant,status,us,spread,why\n";
    for (const Row& r : rows) {
      if (r.backend != be) continue;
      char us[32], spread[32];
      std::snprintf(us, sizeof us, "%.3f", r.us);
      std::snprintf(spread, sizeof spread, "%.3f", r.spread);
      f << r.backend << ',' << arch << ',' << r.op << ',' << r.dtype << ',' << csv_field(r.shape) << ',' << r.rows << ','
        << r.cols << ',' << r.variant << ',' << r.status << ',' << (r.status == "ok" ? us : "") << ','
        << (r.status == "ok" ? spread : "") << ',' << csv_field(r.why) << "\n";
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
