// Deterministic (batch-invariant) mode on CUDA: the variants that are not batch-invariant
// (cuBLASLt gemm, cluster-split attention) are not chosen, softmax keeps to its row-group
// kernel for wide rows, and a row alone equals the same row inside a batch, bitwise.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "test_util.hpp"

namespace {

using kstest::Buf;
using ks::DType;

#define CK(x) ASSERT_EQ((x), cudaSuccess) << #x << ": " << cudaGetErrorString(x)

struct DeterministicMode {
  DeterministicMode() { ks_set_deterministic(1); }
  ~DeterministicMode() { ks_set_deterministic(0); }
};

std::string which_cuda(const char* op) {
  const char* v = nullptr;
  const char* why = nullptr;
  return ks_which(op, "bf16", KS_BACKEND_CUDA, &v, &why) == KS_SUCCESS ? std::string(v) : std::string("error");
}

TEST(CudaDeterministic, SelectionSkipsVariantsThatAreNotBatchInvariant) {
  if (!ks::backend_available(ks::Backend::Cuda)) GTEST_SKIP() << "no CUDA device";
  DeterministicMode on;
  EXPECT_EQ(which_cuda("gemm"), "cuda_tiled");
  EXPECT_EQ(which_cuda("paged_attention"), "cuda_cta_per_head");
  EXPECT_EQ(which_cuda("softmax"), "cuda_rowgroup");
}

// softmax over 128256-wide rows: in deterministic mode a row alone (which would take the
// cluster path otherwise) and the same row at several places in batches of 2 to 64 rows
// give the same bytes.
TEST(CudaDeterministic, WideSoftmaxRowsAreBatchInvariant) {
  if (!ks::backend_available(ks::Backend::Cuda)) GTEST_SKIP() << "no CUDA device";
  DeterministicMode on;
  const int64_t V = 128256;
  for (DType dt : kstest::float_dtypes()) {
    Buf probe(dt, {1, V});
    kstest::fill_normal(probe, 2.0);
    auto run = [&](int64_t rows, int64_t r) {
      Buf x(dt, {rows, V}), out(dt, {rows, V});
      kstest::fill_normal(x);
      std::memcpy(static_cast<char*>(x.data()) + size_t(r * V) * ks::dtype_size(dt), probe.data(), probe.nbytes());
      void *dx = nullptr, *dout = nullptr;
      cudaMalloc(&dx, x.nbytes());
      cudaMalloc(&dout, out.nbytes());
      cudaMemcpy(dx, x.data(), x.nbytes(), cudaMemcpyHostToDevice);
      ks::softmax(ks::TensorView(dout, dt, {rows, V}, DLDevice{kDLCUDA, 0}),
                  ks::TensorView(dx, dt, {rows, V}, DLDevice{kDLCUDA, 0}), ks::Backend::Cuda);
      cudaMemcpy(out.data(), dout, out.nbytes(), cudaMemcpyDeviceToHost);
      cudaFree(dx);
      cudaFree(dout);
      const auto* p = static_cast<const uint8_t*>(out.data()) + size_t(r * V) * ks::dtype_size(dt);
      return std::vector<uint8_t>(p, p + size_t(V) * ks::dtype_size(dt));
    };
    const auto alone = run(1, 0);
    EXPECT_EQ(std::string(ks_last_launch_config("softmax")).find("cluster"), std::string::npos)
        << "deterministic mode must not take the cluster path: " << ks_last_launch_config("softmax");
    for (int64_t rows : {int64_t(2), int64_t(7), int64_t(64)})
      for (int64_t r : {int64_t(0), rows - 1}) EXPECT_EQ(run(rows, r), alone) << ks::dtype_name(dt) << " row " << r << " of " << rows;
  }
}

}  // namespace
