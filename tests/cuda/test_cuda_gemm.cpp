// gemm on CUDA: both variants (cuBLASLt when libcublasLt loads, and kernscope's tiled
// kernel) against the CPU reference within the FP32 random-walk bound of a K-term sum,
// over odd shapes, every dtype and offset views; and captured in a CUDA graph.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <tuple>
#include <vector>

#include "test_util.hpp"

namespace {

using kstest::Buf;
using ks::DType;

#define CK(x) ASSERT_EQ((x), cudaSuccess) << #x << ": " << cudaGetErrorString(x)

struct DevBuf {
  char* base = nullptr;
  size_t off, n;
  DevBuf(size_t bytes, size_t offset) : off(offset), n(bytes) { cudaMalloc(&base, bytes + offset + 64); }
  ~DevBuf() { cudaFree(base); }
  void* p() const { return base + off; }
};

// The CUDA gemm variants that can run here: the tiled kernel always, cuBLASLt when
// libcublasLt loads (a pin to an unavailable variant fails, so it is skipped).
std::vector<std::string> cuda_gemm_variants() {
  std::vector<std::string> v;
  for (const auto& r : ks::variants()) {
    if (std::string(r.op) != "gemm" || std::string(r.backend) != "cuda") continue;
    if (std::string(r.name) == "cuda_cublaslt") {
      const char* var = nullptr;
      const char* why = nullptr;
      if (ks_which("gemm", "bf16", KS_BACKEND_CUDA, &var, &why) != KS_SUCCESS || std::string(var) != "cuda_cublaslt") {
        std::printf("cuBLASLt variant not available here: %s\n", why ? why : "");
        continue;
      }
    }
    v.push_back(r.name);
  }
  return v;
}

TEST(CudaGemm, EveryVariantAgainstTheCpuReference) {
  if (!ks::backend_available(ks::Backend::Cuda)) GTEST_SKIP() << "no CUDA device";
  const auto variants = cuda_gemm_variants();
  ASSERT_FALSE(variants.empty());
  for (const std::string& var : variants)
    for (DType dt : kstest::float_dtypes())
      for (auto [M, N, K] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{
               {1, 1, 1}, {7, 13, 5}, {64, 64, 64}, {130, 257, 1000}, {512, 576, 576}, {3, 1536, 576}})
        for (size_t off : {size_t(0), ks::dtype_size(dt)}) {
          SCOPED_TRACE(var + " " + ks::dtype_name(dt) + " M=" + std::to_string(M) + " N=" + std::to_string(N) +
                       " K=" + std::to_string(K) + " off=" + std::to_string(off));
          const size_t es = ks::dtype_size(dt);
          Buf a(dt, {M, K}), b(dt, {N, K}), ref(dt, {M, N}), got(dt, {M, N});
          kstest::fill_normal(a);
          kstest::fill_normal(b);
          DevBuf da(a.nbytes(), off), db(b.nbytes(), off), dout(got.nbytes(), off);
          CK(cudaMemcpy(da.p(), a.data(), a.nbytes(), cudaMemcpyHostToDevice));
          CK(cudaMemcpy(db.p(), b.data(), b.nbytes(), cudaMemcpyHostToDevice));
          CK(cudaMemset(dout.p(), 0xFF, got.nbytes()));
          const DLDevice gpu{kDLCUDA, 0};
          ASSERT_EQ(ks_force_variant("gemm", var.c_str()), KS_SUCCESS) << ks_last_error();
          ks::gemm(ks::TensorView(dout.p(), dt, {M, N}, gpu), ks::TensorView(da.p(), dt, {M, K}, gpu),
                   ks::TensorView(db.p(), dt, {N, K}, gpu), ks::Backend::Cuda);
          ASSERT_EQ(ks_force_variant(nullptr, nullptr), KS_SUCCESS);
          CK(cudaDeviceSynchronize());
          CK(cudaMemcpy(got.data(), dout.p(), got.nbytes(), cudaMemcpyDeviceToHost));
          ks::gemm(ref.view(), a.view(), b.view(), ks::Backend::Cpu);
          const double t = kstest::tol(dt), walk = 16 * std::sqrt(double(K)) * 6e-8 * double(K);
          EXPECT_TRUE(kstest::allclose(got.values(), ref.values(), 2 * t, 2 * t + walk));
          (void)es;
        }
}

// cuBLASLt's heuristic assumes 256-byte-aligned matrices unless told the real alignment; a
// plan made for aligned pointers must not be reused for an offset view of the same shape
// (refused with CUBLAS_STATUS_NOT_SUPPORTED, or a misaligned access). Every combination of
// aligned / element-aligned / 8-byte-aligned a, b and out, aligned first, per variant.
TEST(CudaGemm, MixedPointerAlignmentsOfOneShape) {
  if (!ks::backend_available(ks::Backend::Cuda)) GTEST_SKIP() << "no CUDA device";
  const auto variants = cuda_gemm_variants();
  ASSERT_FALSE(variants.empty());
  const int64_t M = 96, N = 256, K = 320;
  for (const std::string& var : variants)
    for (DType dt : kstest::float_dtypes()) {
      const size_t es = ks::dtype_size(dt);
      for (size_t oa : {size_t(0), es, size_t(8)})
        for (size_t ob : {size_t(0), es, size_t(8)})
          for (size_t oo : {size_t(0), es, size_t(8)}) {
            SCOPED_TRACE(var + " " + ks::dtype_name(dt) + " offsets a=" + std::to_string(oa) +
                         " b=" + std::to_string(ob) + " out=" + std::to_string(oo));
            Buf a(dt, {M, K}), b(dt, {N, K}), ref(dt, {M, N}), got(dt, {M, N});
            kstest::fill_normal(a);
            kstest::fill_normal(b);
            DevBuf da(a.nbytes(), oa), db(b.nbytes(), ob), dout(got.nbytes(), oo);
            CK(cudaMemcpy(da.p(), a.data(), a.nbytes(), cudaMemcpyHostToDevice));
            CK(cudaMemcpy(db.p(), b.data(), b.nbytes(), cudaMemcpyHostToDevice));
            CK(cudaMemset(dout.p(), 0xFF, got.nbytes()));
            const DLDevice gpu{kDLCUDA, 0};
            ASSERT_EQ(ks_force_variant("gemm", var.c_str()), KS_SUCCESS) << ks_last_error();
            const ks_status_t st = [&] {
              try {
                ks::gemm(ks::TensorView(dout.p(), dt, {M, N}, gpu), ks::TensorView(da.p(), dt, {M, K}, gpu),
                         ks::TensorView(db.p(), dt, {N, K}, gpu), ks::Backend::Cuda);
                return KS_SUCCESS;
              } catch (const ks::Error& e) {
                ADD_FAILURE() << e.what();
                return KS_ERROR_CUDA;
              }
            }();
            ASSERT_EQ(ks_force_variant(nullptr, nullptr), KS_SUCCESS);
            ASSERT_EQ(st, KS_SUCCESS);
            CK(cudaDeviceSynchronize());
            CK(cudaMemcpy(got.data(), dout.p(), got.nbytes(), cudaMemcpyDeviceToHost));
            ks::gemm(ref.view(), a.view(), b.view(), ks::Backend::Cpu);
            const double t = kstest::tol(dt), walk = 16 * std::sqrt(double(K)) * 6e-8 * double(K);
            EXPECT_TRUE(kstest::allclose(got.values(), ref.values(), 2 * t, 2 * t + walk));
          }
    }
}

// The tiled kernel with more than 65535 row tiles (gridDim.y's limit): the rows past
// 65535 * 64 must be computed too.
TEST(CudaGemm, TiledKernelBeyond65535RowTiles) {
  if (!ks::backend_available(ks::Backend::Cuda)) GTEST_SKIP() << "no CUDA device";
  const int64_t M = 65535 * 64 + 70, N = 5, K = 3;
  Buf a(DType::F32, {M, K}), b(DType::F32, {N, K}), ref(DType::F32, {M, N}), got(DType::F32, {M, N});
  kstest::fill_normal(a);
  kstest::fill_normal(b);
  DevBuf da(a.nbytes(), 0), db(b.nbytes(), 0), dout(got.nbytes(), 0);
  CK(cudaMemcpy(da.p(), a.data(), a.nbytes(), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(db.p(), b.data(), b.nbytes(), cudaMemcpyHostToDevice));
  CK(cudaMemset(dout.p(), 0xFF, got.nbytes()));
  const DLDevice gpu{kDLCUDA, 0};
  ASSERT_EQ(ks_force_variant("gemm", "cuda_tiled"), KS_SUCCESS) << ks_last_error();
  ks::gemm(ks::TensorView(dout.p(), DType::F32, {M, N}, gpu), ks::TensorView(da.p(), DType::F32, {M, K}, gpu),
           ks::TensorView(db.p(), DType::F32, {N, K}, gpu), ks::Backend::Cuda);
  ASSERT_EQ(ks_force_variant(nullptr, nullptr), KS_SUCCESS);
  CK(cudaDeviceSynchronize());
  CK(cudaMemcpy(got.data(), dout.p(), got.nbytes(), cudaMemcpyDeviceToHost));
  ks::gemm(ref.view(), a.view(), b.view(), ks::Backend::Cpu);
  EXPECT_TRUE(kstest::allclose(got.values(), ref.values(), 1e-5, 1e-5));
}

TEST(CudaGemm, CapturedInAGraph) {
  if (!ks::backend_available(ks::Backend::Cuda)) GTEST_SKIP() << "no CUDA device";
  const int64_t M = 16, N = 96, K = 128;
  Buf a(DType::BF16, {M, K}), b(DType::BF16, {N, K}), ref(DType::BF16, {M, N}), got(DType::BF16, {M, N});
  kstest::fill_normal(a);
  kstest::fill_normal(b);
  DevBuf da(a.nbytes(), 0), db(b.nbytes(), 0), dout(got.nbytes(), 0);
  CK(cudaMemcpy(da.p(), a.data(), a.nbytes(), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(db.p(), b.data(), b.nbytes(), cudaMemcpyHostToDevice));
  const DLDevice gpu{kDLCUDA, 0};
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  // first call outside capture (plans and handles are made on first use)
  ks::gemm(ks::TensorView(dout.p(), DType::BF16, {M, N}, gpu), ks::TensorView(da.p(), DType::BF16, {M, K}, gpu),
           ks::TensorView(db.p(), DType::BF16, {N, K}, gpu), ks::Backend::Cuda, s);
  CK(cudaStreamSynchronize(s));
  CK(cudaMemsetAsync(dout.p(), 0xFF, got.nbytes(), s));
  cudaGraph_t g;
  cudaGraphExec_t ge;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  ks::gemm(ks::TensorView(dout.p(), DType::BF16, {M, N}, gpu), ks::TensorView(da.p(), DType::BF16, {M, K}, gpu),
           ks::TensorView(db.p(), DType::BF16, {N, K}, gpu), ks::Backend::Cuda, s);
  CK(cudaStreamEndCapture(s, &g));
  CK(cudaGraphInstantiate(&ge, g, 0));
  CK(cudaGraphLaunch(ge, s));
  CK(cudaStreamSynchronize(s));
  CK(cudaMemcpy(got.data(), dout.p(), got.nbytes(), cudaMemcpyDeviceToHost));
  ks::gemm(ref.view(), a.view(), b.view(), ks::Backend::Cpu);
  EXPECT_TRUE(kstest::allclose(got.values(), ref.values(), 2e-2, 2e-2 + 16 * std::sqrt(double(K)) * 6e-8 * K));
  CK(cudaGraphExecDestroy(ge));
  CK(cudaGraphDestroy(g));
  CK(cudaStreamDestroy(s));
}

}  // namespace
