// The CUDA row-group launch rule (common.cuh) must reproduce the configurations
// that were measured on the H200 (docs/perf/h200_kernscope_raw.csv, 132 SMs): a
// change to the rule is a change to the measured kernels and needs a new GPU run.
// Host-only: runs in every build, with or without CUDA.
#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <sstream>
#include <string>

#include "backends/cuda/launch_rules.hpp"

namespace {

std::map<std::string, long long> parse_config(const std::string& cfg) {
  std::map<std::string, long long> kv;
  std::istringstream in(cfg);
  std::string tok;
  while (in >> tok) {
    const auto eq = tok.find('=');
    if (eq != std::string::npos) kv[tok.substr(0, eq)] = std::stoll(tok.substr(eq + 1));
  }
  return kv;
}

TEST(CudaLaunchRule, ReproducesTheMeasuredRowGroupConfigurations) {
  std::ifstream f(std::string(KS_SOURCE_DIR) + "/docs/perf/h200_kernscope_raw.csv");
  ASSERT_TRUE(f.good());
  std::string line;
  std::getline(f, line);  // header
  int checked = 0;
  while (std::getline(f, line)) {
    // gpu,driver,cuda,commit,op,shape,dtype,impl,"config",us,gbs,pct_copy,copy_gbs
    const auto q0 = line.find('"'), q1 = line.rfind('"');
    ASSERT_NE(q0, std::string::npos);
    const std::string cfg = line.substr(q0 + 1, q1 - q0 - 1);
    std::vector<std::string> head;
    std::istringstream hs(line.substr(0, q0));
    for (std::string c; std::getline(hs, c, ',');) head.push_back(c);
    const std::string op = head[4], shape = head[5], dtype = head[6];
    if (op != "rms_norm" && op != "fused_add_rms_norm" && op != "softmax") continue;
    if (cfg.find("cluster") != std::string::npos) continue;
    const long long rows = std::stoll(shape.substr(0, shape.find('x')));
    const long long H = std::stoll(shape.substr(shape.find('x') + 1));
    const auto kv = parse_config(cfg);
    const long long vec = kv.at("vec");
    const auto g = ks::cuda::row_group_config(rows, (H + vec - 1) / vec, vec == 1, 132);
    SCOPED_TRACE(op + " " + shape + " " + dtype + ": " + cfg);
    EXPECT_EQ(g.nv, kv.at("nv"));
    EXPECT_EQ(g.warps_per_row, kv.at("warps_per_row"));
    EXPECT_EQ(g.rows_per_cta, kv.at("rows_per_cta"));
    EXPECT_EQ(g.grid, kv.at("grid"));
    if (kv.count("preload_w")) {
      const long long ctas = (rows + g.rows_per_cta - 1) / g.rows_per_cta;
      EXPECT_EQ(ctas <= 2 * 132 ? 1 : 0, kv.at("preload_w"));
    }
    ++checked;
  }
  EXPECT_GE(checked, 40);
}

}  // namespace
