// quant_matmul against quant_matmul_a8 on the CPU, each variant pinned (ks_force_variant), one row
// of fp32 x (decode GEMV) at SmolLM2's matrices and 4096 x 4096, Q4_1 and Q8_0: the median of 41
// calls' wall time per (shape, variant), as CSV on stdout with the machine's CPU name, its hardware
// threads and KS_COMMIT. Usage: bench_cpu_quant > docs/perf/cpu_quant_a8_<commit>.csv
#include <kernscope/kernscope.h>

#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>
static DLTensor t(void* p, DLDataType dt, int nd, int64_t* sh) { DLTensor x{}; x.data = p; x.device = {kDLCPU, 0}; x.ndim = nd; x.dtype = dt; x.shape = sh; return x; }
int main() {
  std::mt19937 rng(1);
  struct F { ks_qtype_t q; const char* name; int bb; };
  const F fmts[] = {{KS_QTYPE_Q4_1, "q4_1", 20}, {KS_QTYPE_Q8_0, "q8_0", 34}};
  const int64_t shapes[][2] = {{576, 576}, {1536, 576}, {576, 1536}, {49152, 576}, {4096, 4096}};
  std::string cpu = "unknown";
  std::ifstream info("/proc/cpuinfo");
  for (std::string line; std::getline(info, line);)
    if (line.rfind("model name", 0) == 0) {
      cpu = line.substr(line.find(':') + 2);
      break;
    }
  const char* commit = std::getenv("KS_COMMIT");
  std::printf("cpu,threads,commit,dtype,format,N,K,op,variant,us_median\n");
  for (auto f : fmts)
    for (auto sh : shapes) {
      const int64_t N = sh[0], K = sh[1], RB = K / 32 * f.bb;
      std::vector<uint8_t> w(static_cast<size_t>(N * RB));
      for (auto& b : w) b = uint8_t(rng());
      for (int64_t n = 0; n < N; ++n)
        for (int64_t b = 0; b < K / 32; ++b) {  // finite fp16 scales: 0x3000-ish
          uint8_t* p = w.data() + n * RB + b * f.bb;
          p[0] = uint8_t(rng()); p[1] = 0x20 + (rng() % 8);
          if (f.q == KS_QTYPE_Q4_1) { p[2] = uint8_t(rng()); p[3] = 0xA0 + (rng() % 8); }
        }
      std::vector<float> x(static_cast<size_t>(K)), out(static_cast<size_t>(N));
      std::normal_distribution<float> nd;
      for (auto& v : x) v = nd(rng);
      int64_t xs[2] = {1, K}, ws[2] = {N, RB}, os[2] = {1, N};
      DLTensor tx = t(x.data(), {kDLFloat, 32, 1}, 2, xs), tw = t(w.data(), {kDLUInt, 8, 1}, 2, ws), to = t(out.data(), {kDLFloat, 32, 1}, 2, os);
      struct R { const char* op; const char* var; };
      const R runs[] = {{"quant_matmul", "cpu_avx512"}, {"quant_matmul", "cpu_reference"}, {"quant_matmul_a8", "cpu_avx512_vnni"}, {"quant_matmul_a8", "cpu_reference"}};
      for (auto r : runs) {
        if (ks_force_variant(r.op, r.var) != KS_SUCCESS) continue;
        std::vector<double> ts;
        for (int i = 0; i < 41; ++i) {
          auto t0 = std::chrono::steady_clock::now();
          ks_status_t st = std::strcmp(r.op, "quant_matmul") == 0 ? ks_quant_matmul(&to, &tx, &tw, f.q, KS_BACKEND_CPU, nullptr)
                                                                  : ks_quant_matmul_a8(&to, &tx, &tw, f.q, KS_BACKEND_CPU, nullptr);
          auto t1 = std::chrono::steady_clock::now();
          if (st != KS_SUCCESS) { std::printf("err %s\n", ks_last_error()); return 1; }
          ts.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
        }
        ks_force_variant(r.op, nullptr);
        std::sort(ts.begin(), ts.end());
        std::printf("\"%s\",%u,%s,fp32,%s,%lld,%lld,%s,%s,%.1f\n", cpu.c_str(), std::thread::hardware_concurrency(),
                    commit ? commit : "unknown", f.name, (long long)N, (long long)K, r.op, r.var, ts[ts.size() / 2]);
      }
    }
}
