// gemm on CUDA (contract: out[m, n] = round(sum_k fp32(a[m, k]) * fp32(b[n, k])), FP32
// accumulation in an unspecified order; a [M, K], b [N, K] (nn.Linear's weight), out [M, N],
// all row-major).
//
// Two variants:
//  - cuda_cublaslt (priority 10): cuBLASLt with CUBLAS_COMPUTE_32F (no TF32), loaded at run
//    time with dlopen, so the library has no link-time dependency on cuBLAS and the variant
//    reports itself unavailable where libcublasLt is missing. No workspace (nothing is
//    allocated per call, so it can be captured in a CUDA graph); the matmul descriptor,
//    layouts and the heuristic's algorithm are cached per (device, dtype, M, N, K, pointer
//    alignments).
//  - cuda_tiled (priority 5): kernscope's own 64 x 64-tiled kernel with FP32 accumulation,
//    any alignment, int64 indexing: the correctness fallback (and the variant a
//    deterministic mode can pin).
#if KS_HAVE_CUBLASLT_H
#include <cublasLt.h>
#include <dlfcn.h>
#endif

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>

#include "backends/cuda/common.cuh"
#include "ops/args.hpp"

namespace ks::cuda {

// ---- own kernel ---------------------------------------------------------------------
constexpr int kTile = 64, kTileK = 16, kGemmThreads = 256;  // each thread: 4 x 4 outputs

template <typename T>
__global__ void __launch_bounds__(kGemmThreads) gemm_tiled_kernel(const T* __restrict__ a, const T* __restrict__ b,
                                                                  T* __restrict__ out, int64_t M, int64_t N, int64_t K) {
  __shared__ float as[kTileK][kTile + 1];
  __shared__ float bs[kTileK][kTile + 1];
  pdl_begin();
  const int64_t n0 = int64_t(blockIdx.x) * kTile;
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  // row tiles stride by gridDim.y (at most 65535 CTAs in y): any M
  for (int64_t m0 = int64_t(blockIdx.y) * kTile; m0 < M; m0 += int64_t(gridDim.y) * kTile) {
    float acc[4][4] = {};
    for (int64_t k0 = 0; k0 < K; k0 += kTileK) {
      for (int i = threadIdx.x; i < kTile * kTileK; i += kGemmThreads) {
        const int r = i / kTileK, c = i % kTileK;
        const int64_t gm = m0 + r, gn = n0 + r, gk = k0 + c;
        as[c][r] = (gm < M && gk < K) ? Dt<T>::to_f(a[gm * K + gk]) : 0.f;
        bs[c][r] = (gn < N && gk < K) ? Dt<T>::to_f(b[gn * K + gk]) : 0.f;
      }
      __syncthreads();
#pragma unroll
      for (int kk = 0; kk < kTileK; ++kk) {
        float av[4], bv[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) av[i] = as[kk][ty * 4 + i], bv[i] = bs[kk][tx * 4 + i];
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
      }
      __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int64_t gm = m0 + ty * 4 + i, gn = n0 + tx * 4 + j;
        if (gm < M && gn < N) out[gm * N + gn] = Dt<T>::from_f(acc[i][j]);
      }
  }
}

void gemm_tiled_cuda(const void* args, ks_stream_t stream) {
  const auto& a = *static_cast<const ops::GemmArgs*>(args);
  DeviceGuard g(a.a.device.device_id, "gemm");
  const DeviceProps& dp = device_props(a.a.device.device_id);
  const dim3 grid(unsigned((a.n + kTile - 1) / kTile), unsigned(std::min<int64_t>((a.m + kTile - 1) / kTile, 65535)));
  const auto s = static_cast<cudaStream_t>(stream);
  with_float_type(a.a.dtype, [&](auto tag) {
    using T = decltype(tag);
    launch_kernel("gemm", gemm_tiled_kernel<T>, grid, dim3(kGemmThreads), 0, s, 1, dp.pdl, static_cast<const T*>(a.a.data),
                  static_cast<const T*>(a.b.data), static_cast<T*>(a.out.data), a.m, a.n, a.k);
  });
  check_launch("gemm");
  record_launch("gemm", "variant=cuda_tiled tile=64x64x16 grid=%lldx%lld", {grid.x, grid.y});
}

// ---- cuBLASLt, loaded at run time ---------------------------------------------------------
#if KS_HAVE_CUBLASLT_H
namespace {
struct Lt {
  void* lib = nullptr;
  std::string why;  // empty when loaded
  decltype(&cublasLtCreate) create = nullptr;
  decltype(&cublasLtMatmulDescCreate) desc_create = nullptr;
  decltype(&cublasLtMatmulDescSetAttribute) desc_set = nullptr;
  decltype(&cublasLtMatrixLayoutCreate) layout_create = nullptr;
  decltype(&cublasLtMatmulPreferenceCreate) pref_create = nullptr;
  decltype(&cublasLtMatmulPreferenceSetAttribute) pref_set = nullptr;
  decltype(&cublasLtMatmulPreferenceDestroy) pref_destroy = nullptr;
  decltype(&cublasLtMatmulAlgoGetHeuristic) heuristic = nullptr;
  decltype(&cublasLtMatmul) matmul = nullptr;
  Lt() {
    for (const char* name : {"libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"})
      if ((lib = dlopen(name, RTLD_NOW | RTLD_LOCAL)) != nullptr) break;
    if (!lib) {
      why = "libcublasLt could not be loaded (dlopen libcublasLt.so.13/.12)";
      return;
    }
    bool ok = true;
    auto sym = [&](auto& f, const char* n) {
      f = reinterpret_cast<std::remove_reference_t<decltype(f)>>(dlsym(lib, n));
      ok = ok && f != nullptr;
    };
    sym(create, "cublasLtCreate");
    sym(desc_create, "cublasLtMatmulDescCreate");
    sym(desc_set, "cublasLtMatmulDescSetAttribute");
    sym(layout_create, "cublasLtMatrixLayoutCreate");
    sym(pref_create, "cublasLtMatmulPreferenceCreate");
    sym(pref_set, "cublasLtMatmulPreferenceSetAttribute");
    sym(pref_destroy, "cublasLtMatmulPreferenceDestroy");
    sym(heuristic, "cublasLtMatmulAlgoGetHeuristic");
    sym(matmul, "cublasLtMatmul");
    if (!ok) why = "libcublasLt lacks an expected entry point";
  }
};
const Lt& lt() {
  static const Lt l;
  return l;
}

struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool ok = false;
};

void lt_check(cublasStatus_t st, const char* what) {
  if (st != CUBLAS_STATUS_SUCCESS)
    detail::fail(KS_ERROR_CUDA, "gemm", std::string("cuBLASLt ") + what + " failed (status " + std::to_string(int(st)) + ")");
}

cudaDataType_t cuda_type(detail::DType d) {
  return d == detail::DType::F32 ? CUDA_R_32F : d == detail::DType::F16 ? CUDA_R_16F : CUDA_R_16BF;
}

// The largest power of two (at most 256, cuBLASLt's default assumption) dividing the address.
uint32_t alignment_of(const void* p) {
  uint32_t al = 256;
  while (al > 1 && reinterpret_cast<uintptr_t>(p) % al != 0) al >>= 1;
  return al;
}

// Per device: the handle; per (device, dtype, M, N, K, pointer alignments): the plan.
// The heuristic assumes 256-byte-aligned matrices unless told otherwise, and an algorithm
// chosen for aligned pointers is refused (CUBLAS_STATUS_NOT_SUPPORTED) or faults on
// pointers that are not (an offset view), so the alignments are part of the key.
// Descriptors live for the process (a few hundred bytes each).
const Plan& plan_for(int device, detail::DType dt, int64_t M, int64_t N, int64_t K, uint32_t align_a,
                     uint32_t align_b, uint32_t align_out, cublasLtHandle_t* handle) {
  static std::mutex mu;
  static std::map<int, cublasLtHandle_t> handles;
  static std::map<std::tuple<int, int, int64_t, int64_t, int64_t, uint32_t, uint32_t, uint32_t>, Plan> plans;
  std::lock_guard<std::mutex> lock(mu);
  const Lt& L = lt();
  auto h = handles.find(device);
  if (h == handles.end()) {
    cublasLtHandle_t hd = nullptr;
    lt_check(L.create(&hd), "create");
    h = handles.emplace(device, hd).first;
  }
  *handle = h->second;
  const auto key = std::make_tuple(device, int(dt), M, N, K, align_a, align_b, align_out);
  auto it = plans.find(key);
  if (it != plans.end()) return it->second;
  Plan p;
  // Column-major view of the row-major problem: out^T (N x M, ld N) = b (K x N col-major,
  // transposed) * a^T (K x M col-major).
  lt_check(L.desc_create(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "matmul descriptor");
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  lt_check(L.desc_set(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta), "set TRANSA");
  lt_check(L.desc_set(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb), "set TRANSB");
  const cudaDataType_t t = cuda_type(dt);
  lt_check(L.layout_create(&p.la, t, uint64_t(K), uint64_t(N), K), "layout of b");
  lt_check(L.layout_create(&p.lb, t, uint64_t(K), uint64_t(M), K), "layout of a");
  lt_check(L.layout_create(&p.lc, t, uint64_t(N), uint64_t(M), N), "layout of out");
  cublasLtMatmulPreference_t pref = nullptr;
  lt_check(L.pref_create(&pref), "preference");
  // cuBLASLt's A is kernscope's b, its B is a, C and D are out
  const std::pair<cublasLtMatmulPreferenceAttributes_t, uint32_t> aligns[] = {
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_b},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_a},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_out},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_out}};
  for (const auto& [attr, al] : aligns) {
    const cublasStatus_t st = L.pref_set(pref, attr, &al, sizeof al);
    if (st != CUBLAS_STATUS_SUCCESS) L.pref_destroy(pref);
    lt_check(st, "set a minimum alignment");
  }
  cublasLtMatmulHeuristicResult_t res{};
  int found = 0;
  const cublasStatus_t st = L.heuristic(*handle, p.desc, p.la, p.lb, p.lc, p.lc, pref, 1, &res, &found);
  L.pref_destroy(pref);
  p.ok = st == CUBLAS_STATUS_SUCCESS && found > 0;
  if (p.ok) p.algo = res.algo;
  return plans.emplace(key, p).first->second;
}
}  // namespace

bool cublaslt_available() { return device_present() && lt().why.empty(); }
std::string cublaslt_why() { return lt().why; }

void gemm_cublaslt_cuda(const void* args, ks_stream_t stream) {
  const auto& a = *static_cast<const ops::GemmArgs*>(args);
  const int dev = a.a.device.device_id;
  DeviceGuard g(dev, "gemm");
  if (a.m > INT32_MAX || a.n > INT32_MAX || a.k > INT32_MAX) return gemm_tiled_cuda(args, stream);
  cublasLtHandle_t handle = nullptr;
  const Plan& p = plan_for(dev, a.a.dtype, a.m, a.n, a.k, alignment_of(a.a.data), alignment_of(a.b.data),
                           alignment_of(a.out.data), &handle);
  if (!p.ok) return gemm_tiled_cuda(args, stream);  // no algorithm for this problem: the own kernel
  const float alpha = 1.f, beta = 0.f;
  lt_check(lt().matmul(handle, p.desc, &alpha, a.b.data, p.la, a.a.data, p.lb, &beta, a.out.data, p.lc, a.out.data,
                       p.lc, &p.algo, nullptr, 0, static_cast<cudaStream_t>(stream)),
           "matmul");
  record_launch("gemm", "variant=cuda_cublaslt compute=32F workspace=0 m=%lld n=%lld k=%lld", {a.m, a.n, a.k});
}
#else   // built without cublasLt.h: the variant is registered but never available
bool cublaslt_available() { return false; }
std::string cublaslt_why() { return "built without cublasLt.h"; }
void gemm_cublaslt_cuda(const void* args, ks_stream_t stream) { gemm_tiled_cuda(args, stream); }
#endif

}  // namespace ks::cuda
