// Shared primitives for the CUDA backend: dtype traits, 16-byte vector IO,
// warp / block reductions, launch checking and configuration records.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <string>

#include "backends/cuda/launch_rules.hpp"
#include "core/common.hpp"

namespace ks::cuda {

// ---- dtype traits --------------------------------------------------------
template <typename T>
struct Dt;
template <>
struct Dt<float> {
  static __device__ __forceinline__ float to_f(float v) { return v; }
  static __device__ __forceinline__ float from_f(float v) { return v; }
};
template <>
struct Dt<__half> {
  static __device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
  static __device__ __forceinline__ __half from_f(float v) { return __float2half_rn(v); }
};
template <>
struct Dt<__nv_bfloat16> {
  static __device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
  static __device__ __forceinline__ __nv_bfloat16 from_f(float v) { return __float2bfloat16_rn(v); }
};

// VEC elements of T moved as one access (16 bytes when VEC = 16 / sizeof(T)).
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Vec {
  T v[VEC];
  __device__ __forceinline__ float f(int i) const { return Dt<T>::to_f(v[i]); }
  __device__ __forceinline__ void set(int i, float x) { v[i] = Dt<T>::from_f(x); }
};

template <typename T, int VEC>
__device__ __forceinline__ Vec<T, VEC> load_vec(const T* p) {
  return *reinterpret_cast<const Vec<T, VEC>*>(p);
}
template <typename T, int VEC>
__device__ __forceinline__ void store_vec(T* p, const Vec<T, VEC>& v) {
  *reinterpret_cast<Vec<T, VEC>*>(p) = v;
}

// ---- reductions ----------------------------------------------------------
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// ---- host side -----------------------------------------------------------
inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Throws a KS_ERROR_CUDA failure naming the op when e != cudaSuccess.
inline void check_cuda(cudaError_t e, const char* op, const char* what) {
  if (e != cudaSuccess)
    detail::fail(e == cudaErrorMemoryAllocation ? KS_ERROR_OUT_OF_MEMORY : KS_ERROR_CUDA, op,
                 std::string(what) + ": " + cudaGetErrorName(e) + ": " + cudaGetErrorString(e));
}
// After a launch: reports launch-configuration errors without synchronizing.
inline void check_launch(const char* op) { check_cuda(cudaGetLastError(), op, "kernel launch"); }

// Makes the tensors' device current for the call and restores the caller's.
class DeviceGuard {
 public:
  DeviceGuard(int device, const char* op) {
    check_cuda(cudaGetDevice(&prev_), op, "cudaGetDevice");
    if (prev_ != device) check_cuda(cudaSetDevice(device), op, "cudaSetDevice");
    cur_ = device;
  }
  ~DeviceGuard() {
    if (prev_ != cur_) cudaSetDevice(prev_);
  }

 private:
  int prev_ = 0, cur_ = 0;
};

struct DeviceProps {
  int sm_count = 0, major = 0, minor = 0;
};
const DeviceProps& device_props(int device);

// Last launch configuration per op (ks_last_launch_config, the benchmark's
// `config` column). Recording is cheap (a few integers into a thread-local slot,
// no formatting or allocation on the launch path); the text is made on request.
// fmt takes up to 8 `%lld` conversions, filled from values in order.
void record_launch(const char* op, const char* fmt, std::initializer_list<long long> values);
std::string last_config(const char* op);

}  // namespace ks::cuda
