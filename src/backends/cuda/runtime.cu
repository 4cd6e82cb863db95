// CUDA backend runtime: device discovery, device properties, launch-config
// records and variant registration. Ops without a CUDA variant yet answer
// device tensors with KS_ERROR_BACKEND_UNAVAILABLE.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "backends/cuda/common.cuh"
#include "ops/args.hpp"
#include "registry/registry.hpp"
#include "registry/routing.hpp"

namespace ks::cuda {

// The device count query, once: true when the runtime sees at least one CUDA
// device, else why not. Never throws.
namespace {
struct Presence {
  bool present = false;
  std::string why;
};
const Presence& presence() {
  static const Presence p = [] {
    Presence r;
    int n = 0;
    const cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();  // clear the sticky "no device" error
      // No driver at all also reads "driver version is insufficient" (libcuda is missing or a
      // stub); cudaDriverGetVersion tells the cases apart (0: no driver installed).
      int driver = 0, runtime = 0;
      (void)cudaDriverGetVersion(&driver);
      (void)cudaRuntimeGetVersion(&runtime);
      (void)cudaGetLastError();
      auto version = [](int v) { return std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10); };
      std::string what;
      if (e == cudaErrorInsufficientDriver && driver == 0)
        what = ": no NVIDIA driver on this machine";
      else if (e == cudaErrorInsufficientDriver)
        what = ": the NVIDIA driver supports CUDA " + version(driver) + ", older than this build's CUDA runtime " +
               version(runtime) + " (update the driver)";
      else if (e == cudaErrorNoDevice)
        what = ": no NVIDIA GPU on this machine";
      r.why = std::string("built with the CUDA backend, but the CUDA runtime finds no usable device") + what + " (" +
              cudaGetErrorName(e) + ")";
    } else if (n == 0) {
      r.why = "built with the CUDA backend, but the CUDA runtime reports 0 devices";
    } else {
      r.present = true;
    }
    return r;
  }();
  return p;
}
}  // namespace

const char* unavailable_reason() { return presence().present ? "" : presence().why.c_str(); }

bool device_present() {
  static const bool present = presence().present;
  return present;
}

namespace {
__global__ void arch_probe_kernel() {}  // compiled for the same targets as every kernel
}  // namespace

const DeviceProps& device_props(int device) {
  return once_per_device<DeviceProps>(device, [](int dev) {
    DeviceProps p;
    check_cuda(cudaDeviceGetAttribute(&p.sm_count, cudaDevAttrMultiProcessorCount, dev), "cuda", "device attribute");
    check_cuda(cudaDeviceGetAttribute(&p.major, cudaDevAttrComputeCapabilityMajor, dev), "cuda", "device attribute");
    check_cuda(cudaDeviceGetAttribute(&p.minor, cudaDevAttrComputeCapabilityMinor, dev), "cuda", "device attribute");
    check_cuda(cudaDeviceGetAttribute(&p.smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev), "cuda",
               "device attribute");
    {  // which code the device runs: the cubin for sm_90 (or newer), or a JIT of older PTX
      int prev = 0;
      check_cuda(cudaGetDevice(&prev), "cuda", "cudaGetDevice");
      if (prev != dev) check_cuda(cudaSetDevice(dev), "cuda", "cudaSetDevice");
      cudaFuncAttributes fa{};
      const cudaError_t e = cudaFuncGetAttributes(&fa, arch_probe_kernel);
      if (prev != dev) cudaSetDevice(prev);
      if (e != cudaSuccess) (void)cudaGetLastError();
      p.sm90_code = p.major >= 9 && e == cudaSuccess && fa.ptxVersion >= 90;
    }
    // KS_PDL=0 turns programmatic dependent launch off; without sm_90 code, kernels have no
    // griddepcontrol.wait: PDL would let them start early
    p.pdl = p.sm90_code && !env_is("KS_PDL", "0");
    return p;
  });
}

bool pdl_off_for(const char* op) {
  static const std::string off = [] {
    const char* e = std::getenv("KS_PDL_OFF");
    return std::string(e ? e : "");
  }();
  return !off.empty() && name_in_list(off.c_str(), op);
}

namespace {
struct LaunchRecord {
  const char* op = nullptr;
  const char* fmt = nullptr;
  long long v[12] = {};  // (record_launch refuses more: an internal error, not a garbled config)
};
constexpr int kRecords = 16;
thread_local LaunchRecord g_records[kRecords];
}  // namespace

void record_launch(const char* op, const char* fmt, std::initializer_list<long long> values) {
  int slot = 0;
  for (; slot < kRecords; ++slot)
    if (g_records[slot].op == nullptr || std::strcmp(g_records[slot].op, op) == 0) break;
  if (slot == kRecords) slot = 0;
  LaunchRecord& r = g_records[slot];
  if (values.size() > std::size(r.v))  // (before the record changes: no format without its values)
    detail::fail(KS_ERROR_INTERNAL, op, "record_launch: more than " + std::to_string(std::size(r.v)) + " values");
  r.op = op;
  r.fmt = fmt;
  int i = 0;
  for (long long x : values) r.v[i++] = x;
}

std::string last_config(const char* op) {
  for (const LaunchRecord& r : g_records)
    if (r.op != nullptr && std::strcmp(r.op, op) == 0) {
      char b[256];
      std::snprintf(b, sizeof b, r.fmt, r.v[0], r.v[1], r.v[2], r.v[3], r.v[4], r.v[5], r.v[6], r.v[7], r.v[8], r.v[9],
                    r.v[10], r.v[11]);
      return b;
    }
  return std::string();
}

void rms_norm_cuda(const void*, ks_stream_t);
void fused_add_rms_norm_cuda(const void*, ks_stream_t);
void softmax_cuda(const void*, ks_stream_t);
void softmax_cluster_cuda(const void*, ks_stream_t);
std::string softmax_cluster_can_implement(const void*);
void silu_and_mul_cuda(const void*, ks_stream_t);
void gemv_cuda(const void*, ks_stream_t);
void rotary_cuda(const void*, ks_stream_t);
void kv_cache_append_cuda(const void*, ks_stream_t);
std::string rope_can_implement(const void*);
std::string rope_vec_can_implement(const void*);
void rotary_vec_cuda(const void*, ks_stream_t);
void argmax_cuda(const void*, ks_stream_t);
void sample_cuda(const void*, ks_stream_t);
void sample_cluster_cuda(const void*, ks_stream_t);
std::string sample_cluster_can_implement(const void*);
void sample_local_cuda(const void*, ks_stream_t);
std::string sample_local_can_implement(const void*);
void gemm_tiled_cuda(const void*, ks_stream_t);
void gemm_cublaslt_cuda(const void*, ks_stream_t);
bool cublaslt_available();
void embedding_cuda(const void*, ks_stream_t);
void dequantize_cuda(const void*, ks_stream_t);
void quant_matmul_cuda(const void*, ks_stream_t);
void paged_attention_cuda(const void*, ks_stream_t);
std::string paged_attention_can_implement(const void*);
std::string paged_attention_gqa_can_implement(const void*);
std::string rope_append_attention_gqa_can_implement(const void*);
void rope_append_attention_gqa_cuda(const void*, ks_stream_t);
bool paged_attention_gqa_supported(int device);
void paged_attention_gqa_cuda(const void*, ks_stream_t);
std::string paged_attention_mma_can_implement(const void*);
void paged_attention_mma_cuda(const void*, ks_stream_t);
std::string paged_attention_mma_tma_can_implement(const void*);
void paged_attention_mma_tma_cuda(const void*, ks_stream_t);
std::string varlen_attention_can_implement(const void*);
void varlen_attention_cuda(const void*, ks_stream_t);
void norm_quant_matmul_cuda(const void*, ks_stream_t);
void norm_qmm_rope_cuda(const void*, ks_stream_t);
std::string norm_qmm_rope_can_implement(const void*);
void quant_matmul_m16_cuda(const void*, ks_stream_t);
std::string quant_matmul_m16_can_implement(const void*);
std::string quant_matmul_staged_x_can_implement(const void*);
void quant_matmul_staged_x_cuda(const void*, ks_stream_t);
void quant_matmul_stream_cuda(const void*, ks_stream_t);
std::string quant_matmul_stream_can_implement(const void*);
void quant_matmul_bulk_cuda(const void*, ks_stream_t);
std::string quant_matmul_bulk_can_implement(const void*);
void quant_matmul_mma_cuda(const void*, ks_stream_t);
std::string quant_matmul_mma_can_implement(const void*);
void quant_matmul_mma_stream_cuda(const void*, ks_stream_t);
std::string quant_matmul_mma_stream_can_implement(const void*);
void quant_matmul_mma_diag_cuda(const void*, ks_stream_t);
std::string quant_matmul_mma_diag_can_implement(const void*);
void quant_matmul_a8_warp_cuda(const void*, ks_stream_t);
std::string quant_matmul_a8_warp_can_implement(const void*);
void quant_matmul_a8_bulk_cuda(const void*, ks_stream_t);
std::string quant_matmul_a8_bulk_can_implement(const void*);
void quant_matmul_a8_resident_cuda(const void*, ks_stream_t);
std::string quant_matmul_a8_resident_can_implement(const void*);
void quant_matmul_mma_rows_cuda(const void*, ks_stream_t);
std::string quant_matmul_mma_rows_can_implement(const void*);
void silu_quant_matmul_mma_rows_cuda(const void*, ks_stream_t);
std::string silu_quant_matmul_mma_rows_can_implement(const void*);
void rope_kv_append_cuda(const void*, ks_stream_t);
std::string rope_append_can_implement(const void*);
void silu_quant_matmul_cuda(const void*, ks_stream_t);

}  // namespace ks::cuda

namespace ks::cuda {
namespace {
// Device code accesses whole elements: a data pointer must be a multiple of the
// element size (any framework's tensors are; only hand-made byte offsets are not).
bool elem_aligned(const detail::View& t) {
  const int es = detail::dtype_bytes(t.dtype);
  return t.numel == 0 || es == 0 || reinterpret_cast<uintptr_t>(t.data) % uintptr_t(es) == 0;
}
std::string align_reason(std::initializer_list<const detail::View*> ts) {
  for (auto* t : ts)
    if (!elem_aligned(*t)) return "a data pointer is not a multiple of the element size";
  return "";
}
std::string ci_rms(const void* p) {
  auto& a = *static_cast<const ops::RmsNormArgs*>(p);
  return align_reason({&a.x, &a.weight, &a.out});
}
std::string ci_fused(const void* p) {
  auto& a = *static_cast<const ops::FusedAddRmsNormArgs*>(p);
  return align_reason({&a.x, &a.residual, &a.weight});
}
std::string ci_softmax(const void* p) {
  auto& a = *static_cast<const ops::SoftmaxArgs*>(p);
  return align_reason({&a.x, &a.out});
}
std::string ci_softmax_cluster(const void* p) {
  const std::string why = ci_softmax(p);
  return why.empty() ? softmax_cluster_can_implement(p) : why;
}
std::string ci_silu(const void* p) {
  auto& a = *static_cast<const ops::SiluAndMulArgs*>(p);
  return align_reason({&a.x, &a.out});
}
std::string ci_gemv(const void* p) {
  auto& a = *static_cast<const ops::GemvArgs*>(p);
  return align_reason({&a.x, &a.weight, &a.out});
}
std::string ci_rotary(const void* p) {
  auto& a = *static_cast<const ops::RotaryArgs*>(p);
  std::string why = a.has_k ? align_reason({&a.q, &a.k, &a.positions}) : align_reason({&a.q, &a.positions});
  return why.empty() ? rope_can_implement(p) : why;
}
std::string ci_rotary_vec(const void* p) {
  const std::string why = ci_rotary(p);
  return why.empty() ? rope_vec_can_implement(p) : why;
}
std::string ci_argmax(const void* p) {
  auto& a = *static_cast<const ops::ArgmaxArgs*>(p);
  return align_reason({&a.x, &a.out});
}
std::string ci_embedding(const void* p) {
  auto& a = *static_cast<const ops::EmbeddingArgs*>(p);
  return align_reason({&a.out, &a.ids, &a.table});
}
std::string ci_dequantize(const void* p) {
  auto& a = *static_cast<const ops::DequantizeArgs*>(p);
  return align_reason({&a.out, &a.packed});
}
// cuda_warp_per_column: every qtype. The other variants take the GGUF block formats only: they are
// flagged block_formats_only below, and the registry skips them for dense weights (F32, F16, BF16),
// which run on the default variants only (dense_matmul_kernel, model_ops.cu).
std::string ci_quant_matmul(const void* p) {
  auto& a = *static_cast<const ops::QuantMatmulArgs*>(p);
  return align_reason({&a.x, &a.out, &a.weight});
}
std::string ci_quant_matmul_a8(const void* p, std::string (*variant_reason)(const void*)) {
  auto& a = *static_cast<const ops::QuantMatmulArgs*>(p);
  const std::string why = align_reason({&a.x, &a.out, &a.weight});
  return why.empty() ? variant_reason(p) : why;
}
std::string ci_quant_matmul_a8_warp(const void* p) { return ci_quant_matmul_a8(p, quant_matmul_a8_warp_can_implement); }
std::string ci_quant_matmul_a8_bulk(const void* p) { return ci_quant_matmul_a8(p, quant_matmul_a8_bulk_can_implement); }
std::string ci_quant_matmul_a8_resident(const void* p) {
  return ci_quant_matmul_a8(p, quant_matmul_a8_resident_can_implement);
}
std::string ci_quant_matmul_m16(const void* p) {
  const std::string why = ci_quant_matmul(p);
  return why.empty() ? quant_matmul_m16_can_implement(p) : why;
}
std::string ci_quant_matmul_staged_x(const void* p) {
  const std::string why = ci_quant_matmul(p);
  return why.empty() ? quant_matmul_staged_x_can_implement(p) : why;
}
std::string ci_quant_matmul_stream(const void* p) {
  const std::string why = ci_quant_matmul(p);
  return why.empty() ? quant_matmul_stream_can_implement(p) : why;
}
std::string ci_quant_matmul_bulk(const void* p) {
  const std::string why = ci_quant_matmul(p);
  return why.empty() ? quant_matmul_bulk_can_implement(p) : why;
}
std::string ci_quant_matmul_mma(const void* p) {
  const std::string why = ci_quant_matmul(p);
  return why.empty() ? quant_matmul_mma_can_implement(p) : why;
}
std::string ci_quant_matmul_mma_stream(const void* p) {
  const std::string why = ci_quant_matmul(p);
  return why.empty() ? quant_matmul_mma_stream_can_implement(p) : why;
}
std::string ci_quant_matmul_mma_diag(const void* p) {
  const std::string why = ci_quant_matmul(p);
  return why.empty() ? quant_matmul_mma_diag_can_implement(p) : why;
}
std::string ci_quant_matmul_mma_rows(const void* p) {
  const std::string why = ci_quant_matmul(p);
  return why.empty() ? quant_matmul_mma_rows_can_implement(p) : why;
}
std::string ci_norm_quant_matmul(const void* p) {  // cuda_warp_per_column: every qtype
  auto& a = *static_cast<const ops::NormQuantMatmulArgs*>(p);
  return a.has_x ? align_reason({&a.residual, &a.x, &a.residual_out, &a.norm_weight, &a.out, &a.weight})
                                  : align_reason({&a.residual, &a.norm_weight, &a.out, &a.weight});
}
std::string ci_silu_quant_matmul(const void* p) {  // cuda_warp_per_column: every qtype
  auto& a = *static_cast<const ops::SiluQuantMatmulArgs*>(p);
  return align_reason({&a.gate_up, &a.out, &a.weight});
}
std::string ci_silu_quant_matmul_mma_rows(const void* p) {
  const std::string why = ci_silu_quant_matmul(p);
  return why.empty() ? silu_quant_matmul_mma_rows_can_implement(p) : why;
}
std::string ci_rope_kv_append(const void* p) {
  auto& a = *static_cast<const ops::RopeKvAppendArgs*>(p);
  std::string why = align_reason({&a.rope.q, &a.rope.k, &a.rope.positions, &a.kv.v, &a.kv.k_cache, &a.kv.v_cache,
                                  &a.kv.slot_mapping});
  if (why.empty()) why = rope_can_implement(&a.rope);
  return why.empty() ? rope_append_can_implement(p) : why;
}
std::string ci_norm_qmm_rope_append(const void* p) {
  auto& a = *static_cast<const ops::NormQmmRopeAppendArgs*>(p);
  std::string why = ci_norm_quant_matmul(&a.mm);  // (block formats only: the staged block kernel's epilogue)
  if (why.empty()) why = ci_rope_kv_append(&a.rkv);
  return why.empty() ? norm_qmm_rope_can_implement(p) : why;
}
std::string ci_norm_qmm_rope_composed(const void* p) {
  auto& a = *static_cast<const ops::NormQmmRopeAppendArgs*>(p);
  std::string why = ci_norm_quant_matmul(&a.mm);
  return why.empty() ? ci_rope_kv_append(&a.rkv) : why;
}
std::string ci_attention(const void* p) {
  auto& a = *static_cast<const ops::PagedAttentionArgs*>(p);
  std::string why = align_reason({&a.out, &a.q, &a.k_cache, &a.v_cache, &a.block_tables, &a.context_lens});
  if (why.empty() && a.has_seq_ids) why = align_reason({&a.seq_ids});
  return why.empty() ? paged_attention_can_implement(p) : why;
}
std::string ci_gemm(const void* p) {
  auto& a = *static_cast<const ops::GemmArgs*>(p);
  return align_reason({&a.a, &a.b, &a.out});
}
std::string ci_sample(const void* p) {
  auto& a = *static_cast<const ops::SampleArgs*>(p);
  std::string why = align_reason({&a.logits, &a.out, &a.seed_offset});
  return why;
}
std::string ci_sample_cluster(const void* p) {
  const std::string why = ci_sample(p);
  return why.empty() ? sample_cluster_can_implement(p) : why;
}
std::string ci_sample_local(const void* p) {
  const std::string why = ci_sample(p);
  return why.empty() ? sample_local_can_implement(p) : why;
}
// The cluster variants (cuda_gqa_cluster, cuda_mma_cluster): ci_attention's checks, sm_90 code
// on the device, then the variant's own (can_implement).
std::string ci_attention_cluster(const void* p, std::string (*can_implement)(const void*)) {
  auto& a = *static_cast<const ops::PagedAttentionArgs*>(p);
  std::string why = ci_attention(p);
  if (!why.empty()) return why;
  if (!paged_attention_gqa_supported(a.q.device.device_id)) return "thread-block clusters need compute capability 9.0";
  return can_implement(p);
}
std::string ci_attention_gqa(const void* p) { return ci_attention_cluster(p, paged_attention_gqa_can_implement); }
std::string ci_attention_mma(const void* p) { return ci_attention_cluster(p, paged_attention_mma_can_implement); }
std::string ci_attention_mma_tma(const void* p) { return ci_attention_cluster(p, paged_attention_mma_tma_can_implement); }
std::string ci_rope_append_attention_gqa(const void* p) {
  auto& a = *static_cast<const ops::RopeKvAppendAttentionArgs*>(p);
  std::string why = ci_rope_kv_append(&a.rkv);
  if (why.empty()) why = ci_attention_gqa(&a.attn);
  return why.empty() ? rope_append_attention_gqa_can_implement(p) : why;
}
std::string ci_rope_append_attention_composed(const void* p) {
  auto& a = *static_cast<const ops::RopeKvAppendAttentionArgs*>(p);
  std::string why = ci_rope_kv_append(&a.rkv);
  return why.empty() ? ci_attention(&a.attn) : why;
}
std::string ci_varlen(const void* p) {
  auto& a = *static_cast<const ops::VarlenAttentionArgs*>(p);
  const std::string why = align_reason({&a.out, &a.q, &a.k, &a.v, &a.cu_q, &a.cu_k});
  return why.empty() ? varlen_attention_can_implement(p) : why;
}
std::string ci_kv(const void* p) {
  auto& a = *static_cast<const ops::KvCacheAppendArgs*>(p);
  return align_reason({&a.slot_mapping});  // rows are copied as bytes: any alignment
}
}  // namespace
}  // namespace ks::cuda

namespace ks::registry {
void register_cuda_variants(std::vector<Variant>& v) {
  bool (*avail)() = [] { return ks::cuda::device_present(); };
  v.push_back({"rms_norm", KS_BACKEND_CUDA, "cuda_rowgroup", kFloatDTypes, 10,
               "W warps per row, row cached in registers, 16-byte vectors when aligned", avail, ks::cuda::ci_rms,
               ks::cuda::rms_norm_cuda});
  v.push_back({"fused_add_rms_norm", KS_BACKEND_CUDA, "cuda_rowgroup", kFloatDTypes, 10,
               "W warps per row, FP32 sum cached in registers", avail, ks::cuda::ci_fused, ks::cuda::fused_add_rms_norm_cuda});
  v.push_back({"softmax", KS_BACKEND_CUDA, "cuda_cluster", kFloatDTypes, 20,
               "few wide rows (>= 16 KB, < 4 rows per SM): a thread-block cluster per row, the row spread over "
               "its SMs and reduced through distributed shared memory (sm_90)",
               avail, ks::cuda::ci_softmax_cluster, ks::cuda::softmax_cluster_cuda, /*batch_invariant=*/false});
  v.push_back({"softmax", KS_BACKEND_CUDA, "cuda_rowgroup", kFloatDTypes, 10,
               "row groups: warps per row and rows per CTA by width; any shape, batch-invariant", avail,
               ks::cuda::ci_softmax, ks::cuda::softmax_cuda});
  v.push_back({"silu_and_mul", KS_BACKEND_CUDA, "cuda_vec", kFloatDTypes, 10, "2-D grid, 16-byte vectors, unrolled",
               avail, ks::cuda::ci_silu, ks::cuda::silu_and_mul_cuda});
  v.push_back({"gemv", KS_BACKEND_CUDA, "cuda_warp_per_row", kFloatDTypes, 10,
               "one warp per output row, 16-byte loads, 4 in flight", avail, ks::cuda::ci_gemv, ks::cuda::gemv_cuda});
  v.push_back({"rotary_embedding", KS_BACKEND_CUDA, "cuda_vec16", kFloatDTypes, 20,
               "a thread per (token, 8 heads, 16 bytes of pairs): 16-byte loads issued first, its own sincosf; "
               "16-byte aligned pointers and strides", avail, ks::cuda::ci_rotary_vec, ks::cuda::rotary_vec_cuda});
  v.push_back({"rotary_embedding", KS_BACKEND_CUDA, "cuda_token_cta", kFloatDTypes, 10,
               "a CTA per token: cos/sin once in shared memory, every head of q and k; strided views", avail,
               ks::cuda::ci_rotary, ks::cuda::rotary_cuda});
  v.push_back({"argmax", KS_BACKEND_CUDA, "cuda_cluster_per_row", kFloatDTypes, 10,
               "a row per cluster of up to 16 CTAs (sm_90; one CTA elsewhere), 16-byte loads, (value, index) "
               "reduction: first NaN, then first maximum", avail, ks::cuda::ci_argmax,
               ks::cuda::argmax_cuda});
  v.push_back({"gemm", KS_BACKEND_CUDA, "cuda_cublaslt", kFloatDTypes, 10,
               "cuBLASLt, FP32 compute (no TF32), no workspace; loaded at run time", [] {
                 return ks::cuda::cublaslt_available();
               },
               ks::cuda::ci_gemm, ks::cuda::gemm_cublaslt_cuda, /*batch_invariant=*/false});
  v.push_back({"gemm", KS_BACKEND_CUDA, "cuda_tiled", kFloatDTypes, 5,
               "kernscope's 64x64-tiled kernel, FP32 accumulation: the fallback", avail, ks::cuda::ci_gemm,
               ks::cuda::gemm_tiled_cuda});
  // priority 25, above cuda_cluster_topk: its GPU tests passed and it measured faster at every
  // benchmark shape at 69d45c2 (1x128256 bf16 26.9 vs 59.2 us, 64x128256 168 vs 295, 256x151936
  // 1019 vs 1222)
  v.push_back({"sample", KS_BACKEND_CUDA, "cuda_cluster_local_topk", kFloatDTypes, 25,
               "top_k 1..1024, vocab up to 16 x 32768 (8 x 32768 where clusters of 16 cannot be resident): a row "
               "over a cluster of up to 16 CTAs, each selecting "
               "its own range's top-k in registers, one cluster barrier, then the row's top-k of those, top-p "
               "and the draw in one CTA; bit-identical to the CPU",
               avail, ks::cuda::ci_sample_local, ks::cuda::sample_local_cuda});
  v.push_back({"sample", KS_BACKEND_CUDA, "cuda_cluster_topk", kFloatDTypes, 20,
               "top_k 1..1024: a row over a cluster of up to 16 CTAs, radix-selected top-k (12+12+8 bits), "
               "then top-p and the draw on the members in one CTA; bit-identical to the CPU",
               avail, ks::cuda::ci_sample_cluster, ks::cuda::sample_cluster_cuda});
  v.push_back({"sample", KS_BACKEND_CUDA, "cuda_cta_per_row", kFloatDTypes, 10,
               "a CTA per row: radix selection for top-k / top-p on exact integers, Philox draws", avail,
               ks::cuda::ci_sample, ks::cuda::sample_cuda});
  v.push_back({"embedding", KS_BACKEND_CUDA, "cuda_cta_per_id", kFloatDTypes, 10,
               "a CTA per id: dense copy or FP32 block decode; device ids out of range give a NaN row", avail,
               ks::cuda::ci_embedding, ks::cuda::embedding_cuda});
  v.push_back({"dequantize", KS_BACKEND_CUDA, "cuda_elementwise", kFloatDTypes, 10,
               "a thread per element: FP32 block decode, one rounding", avail, ks::cuda::ci_dequantize,
               ks::cuda::dequantize_cuda});
  v.push_back({"quant_matmul_a8", KS_BACKEND_CUDA, "cuda_a8_warp", kFloatDTypes, 10,
               "any M: a warp per output column; x's row quantized to int8 in shared memory by the CTA, each "
               "block's codes dotted by dp4a (exact int32 sums), the block values summed lane by lane then by "
               "a butterfly",
               avail, ks::cuda::ci_quant_matmul_a8_warp, ks::cuda::quant_matmul_a8_warp_cuda});
  v.push_back({"quant_matmul_a8", KS_BACKEND_CUDA, "cuda_a8_bulk_stream", kFloatDTypes, 20,
               "M = 1, sm_90, weights 16-byte aligned: cuda_bulk_stream's ring of bulk-copied row stages (a CTA "
               "per SM) feeding 16 warps that take the rows in pairs with cuda_a8_warp's arithmetic and order "
               "(the same bits)",
               avail, ks::cuda::ci_quant_matmul_a8_bulk, ks::cuda::quant_matmul_a8_bulk_cuda});
  v.push_back({"quant_matmul_a8", KS_BACKEND_CUDA, "cuda_a8_resident", kFloatDTypes, 30,
               "M = 1, sm_90, matrices that fit the SMs' shared memory in one wave: each CTA (1 or 2 per SM) "
               "copies its rows into shared memory at once before waiting for x, and where the call takes at "
               "most half of each SM it lets the next kernel launch at entry, so the next call's copies "
               "overlap its sums; cuda_a8_warp's arithmetic and order (the same bits)",
               avail, ks::cuda::ci_quant_matmul_a8_resident, ks::cuda::quant_matmul_a8_resident_cuda});
  v.push_back({"quant_matmul", KS_BACKEND_CUDA, "cuda_warp_per_column", kFloatDTypes, 10,
               "a warp per output column, blocks decoded once per 4 rows of x (Q4_0, Q4_1, Q8_0); dense weights "
               "(F32, F16, BF16: the only CUDA variant that takes them) read in 16-byte chunks where aligned", avail,
               ks::cuda::ci_quant_matmul, ks::cuda::quant_matmul_cuda});
  v.push_back({"quant_matmul", KS_BACKEND_CUDA, "cuda_warp_per_column_m16", kFloatDTypes, 5,
               "cuda_warp_per_column with 16 rows of x per decoded block (M >= 8; the same bits); below it "
               "until measured", avail, ks::cuda::ci_quant_matmul_m16, ks::cuda::quant_matmul_m16_cuda});
  v.push_back({"quant_matmul", KS_BACKEND_CUDA, "cuda_staged_x", kFloatDTypes, 3,
               "M >= 2, K <= 2720: x's rows staged once per CTA in shared memory, 16 rows per decoded block "
               "where they fit; the same bits as cuda_warp_per_column; lowest by priority, first for fp32 at 2..15 "
               "rows by sm_90.json (the model's batched decode measured faster at a1bda96)",
               avail, ks::cuda::ci_quant_matmul_staged_x, ks::cuda::quant_matmul_staged_x_cuda});
  v.push_back({"quant_matmul", KS_BACKEND_CUDA, "cuda_row_stream", kFloatDTypes, 4,
               "M = 1: each warp streams whole weight rows into two shared-memory buffers with cp.async (the "
               "next row in flight while one is decoded), the same bits as cuda_warp_per_column; below it "
               "until measured", avail, ks::cuda::ci_quant_matmul_stream, ks::cuda::quant_matmul_stream_cuda});
  v.push_back({"quant_matmul", KS_BACKEND_CUDA, "cuda_bulk_stream", kFloatDTypes, 3,
               "M = 1, sm_90: a CTA per SM streams its contiguous range of weight rows through a ring of <= 128 KB "
               "shared-memory stages, each one bulk copy (TMA) on an mbarrier, while 16 warps sum the stage's "
               "blocks two at a time; the same bits as cuda_warp_per_column; below it by priority, first where "
               "sm_90.json's cells put it",
               avail, ks::cuda::ci_quant_matmul_bulk, ks::cuda::quant_matmul_bulk_cuda});
  v.push_back({"quant_matmul", KS_BACKEND_CUDA, "cuda_mma_blocks",
               registry::dtype_bit(detail::DType::F16) | registry::dtype_bit(detail::DType::BF16), 2,
               "bf16 / fp16 x, M <= 8, Q4_0 / Q4_1: each block's sums on the tensor cores (mma.sync m16n8k16, the "
               "codes exact in bf16 / fp16, FP32 accumulation), then d * S + m * X per block; the same values up "
               "to FP32 rounding, not the same bits as cuda_warp_per_column; lowest by priority, first where "
               "sm_90.json's cells put it",
               avail, ks::cuda::ci_quant_matmul_mma, ks::cuda::quant_matmul_mma_cuda,
               /*batch_invariant=*/false});  // serves M <= 8 only: M = 9 runs elsewhere
  v.push_back({"quant_matmul", KS_BACKEND_CUDA, "cuda_mma_stream", kFloatDTypes, 1,
               "M <= 8 (fp32 x: M <= 2), Q4_0 / Q4_1 / Q8_0, weights 16-byte aligned: cuda_mma_blocks' block "
               "sums (fp32 x as three exact bf16 pieces, Q8_0 codes as two nibbles) fed by persistent CTAs (one "
               "per SM at most) that stream the rows through a 4-stage cp.async ring, the first stages before "
               "the dependency wait; the same values up to FP32 rounding; lowest by priority, first where "
               "sm_90.json's cells put it",
               avail, ks::cuda::ci_quant_matmul_mma_stream, ks::cuda::quant_matmul_mma_stream_cuda,
               /*batch_invariant=*/false});  // serves M <= 8 only
  v.push_back({"quant_matmul", KS_BACKEND_CUDA, "cuda_mma_diag",
               registry::dtype_bit(detail::DType::F16) | registry::dtype_bit(detail::DType::BF16), 1,
               "M = 1 (decode GEMV), bf16 / fp16 x, Q4_0 / Q4_1 / Q8_0, weights 16-byte aligned, sm_90: "
               "cuda_mma_stream's block sums with B's 8 columns carrying 8 blocks of the one row (x placed "
               "block-diagonally), so every accumulator a lane holds is used; each warp streams its own "
               "16-row x 8-block units through a ring of bulk copies on mbarriers; the same values up to "
               "FP32 rounding; lowest by priority, first where sm_90.json's cells put it",
               avail, ks::cuda::ci_quant_matmul_mma_diag, ks::cuda::quant_matmul_mma_diag_cuda,
               /*batch_invariant=*/false});  // serves M = 1 only
  v.push_back({"quant_matmul", KS_BACKEND_CUDA, "cuda_mma_rows", kFloatDTypes, 1,
               "any M (batched decode, prefill), Q4_0 / Q4_1 / Q8_0: cuda_mma_blocks' block sums with 8 rows of x "
               "per MMA and up to 4 such groups per decoded block (fp32 x as three exact bf16 pieces chained into "
               "one accumulator), x staged per CTA in shared memory, K split over a CTA's warps in an order set "
               "by N and K only (batch-invariant); the same values up to FP32 rounding; lowest by priority, first "
               "where sm_90.json's cells put it",
               avail, ks::cuda::ci_quant_matmul_mma_rows, ks::cuda::quant_matmul_mma_rows_cuda});
  v.push_back({"fused_add_rms_norm_quant_matmul", KS_BACKEND_CUDA, "cuda_warp_per_column", kFloatDTypes, 10,
               "quant_matmul's warp per output column; each warp computes its rows' (x + residual) norm itself, "
               "warp 0 of block 0 writes residual_out; every qtype, dense ones included", avail, ks::cuda::ci_norm_quant_matmul,
               ks::cuda::norm_quant_matmul_cuda});
  v.push_back({"silu_and_mul_quant_matmul", KS_BACKEND_CUDA, "cuda_warp_per_column", kFloatDTypes, 10,
               "quant_matmul's warp per output column, silu(gate) * up computed as the row is read; every qtype, "
               "dense ones included", avail,
               ks::cuda::ci_silu_quant_matmul, ks::cuda::silu_quant_matmul_cuda});
  v.push_back({"silu_and_mul_quant_matmul", KS_BACKEND_CUDA, "cuda_mma_rows", kFloatDTypes, 1,
               "any M: silu_and_mul's values (rounded as it stores them) staged as the rows of x of quant_matmul's "
               "cuda_mma_rows, so the bits are silu_and_mul then that variant's; batch-invariant. Lowest by "
               "priority and in no routing cell yet (not measured): pinned by tests and benchmarks",
               avail, ks::cuda::ci_silu_quant_matmul_mma_rows, ks::cuda::silu_quant_matmul_mma_rows_cuda});
  v.push_back({"rotary_embedding_kv_append", KS_BACKEND_CUDA, "cuda_token_cta", kFloatDTypes, 10,
               "a CTA per token: each (head, pair) rotated by its own thread, rotated k pairs stored to k and the "
               "cache row, then v and k's unrotated features copied", avail, ks::cuda::ci_rope_kv_append,
               ks::cuda::rope_kv_append_cuda});
  v.push_back({"fused_add_rms_norm_quant_matmul_rope_kv_append", KS_BACKEND_CUDA, "cuda_warp_per_column",
               kFloatDTypes, 10,
               "one kernel: fused_add_rms_norm_quant_matmul's staged kernel whose CTAs rotate their (2i, 2i+1) "
               "column pairs of q and k and write k and v to the cache row (interleaved pairs, K <= 2720)",
               avail, ks::cuda::ci_norm_qmm_rope_append, ks::cuda::norm_qmm_rope_cuda});
  v.push_back({"fused_add_rms_norm_quant_matmul_rope_kv_append", KS_BACKEND_CUDA, "cuda_composed", kFloatDTypes, 0,
               "the two calls: CUDA's fused_add_rms_norm_quant_matmul, then its rotary_embedding_kv_append",
               avail, ks::cuda::ci_norm_qmm_rope_composed,
               [](const void* p, ks_stream_t s) { ks::cpu::norm_qmm_rope_append_composed(p, s, KS_BACKEND_CUDA); }});
  v.push_back({"paged_attention", KS_BACKEND_CUDA, "cuda_gqa_cluster", kFloatDTypes, 20,
               "a CTA cluster per (token, kv head): K/V read once for the query heads that share them, "
               "keys split over up to 16 CTAs merged in distributed shared memory (sm_90)",
               avail, ks::cuda::ci_attention_gqa, ks::cuda::paged_attention_gqa_cuda, /*batch_invariant=*/false});
  v.push_back({"rotary_embedding_kv_append_paged_attention", KS_BACKEND_CUDA, "cuda_gqa_cluster", kFloatDTypes, 20,
               "one kernel: cuda_gqa_cluster, each lane rotating its pieces of q and of the token's new key, which "
               "it uses for the key at slot_mapping[t] instead of the cache's row; rank 0 writes the cache row and "
               "rotates q and k in place after the cluster's last barrier (sm_90)",
               avail, ks::cuda::ci_rope_append_attention_gqa, ks::cuda::rope_append_attention_gqa_cuda,
               /*batch_invariant=*/false});
  v.push_back({"rotary_embedding_kv_append_paged_attention", KS_BACKEND_CUDA, "cuda_composed", kFloatDTypes, 0,
               "the two calls: CUDA's rotary_embedding_kv_append, then its paged_attention", avail,
               ks::cuda::ci_rope_append_attention_composed,
               [](const void* p, ks_stream_t s) { ks::cpu::rope_append_attention_composed(p, s, KS_BACKEND_CUDA); },
               /*batch_invariant=*/false});
  v.push_back({"paged_attention", KS_BACKEND_CUDA, "cuda_mma_cluster",
               registry::dtype_bit(detail::DType::F16) | registry::dtype_bit(detail::DType::BF16), 5,
               "cuda_gqa_cluster's cluster split (bf16/fp16, head_dim <= 128, <= 16 query heads per kv head) "
               "with Q K^T and P V on the tensor cores (FP32 weights carried as three bf16/fp16 pieces) and each "
               "warp streaming its own 16-key tiles through a cp.async ring; first where sm_90.json's cells put it",
               avail, ks::cuda::ci_attention_mma, ks::cuda::paged_attention_mma_cuda, /*batch_invariant=*/false});
  v.push_back({"paged_attention", KS_BACKEND_CUDA, "cuda_mma_tma",
               registry::dtype_bit(detail::DType::F16) | registry::dtype_bit(detail::DType::BF16), 4,
               "cuda_mma_cluster with each warp's K / V tiles brought by the TMA unit (two tensor copies per "
               "16-key tile on an mbarrier, 128-byte swizzled rows) instead of per-lane cp.async copies; same bits; "
               "head_dim 64 or 128, block_size a multiple of 16",
               avail, ks::cuda::ci_attention_mma_tma, ks::cuda::paged_attention_mma_tma_cuda, /*batch_invariant=*/false});
  v.push_back({"varlen_attention", KS_BACKEND_CUDA, "cuda_cta_per_row_head", kFloatDTypes, 10,
               "a CTA per (query row, head): key tiles of 64, online FP32 softmax", avail, ks::cuda::ci_varlen,
               ks::cuda::varlen_attention_cuda});
  v.push_back({"paged_attention", KS_BACKEND_CUDA, "cuda_cta_per_head", kFloatDTypes, 10,
               "a CTA per (token, head): key tiles of 128, online FP32 softmax", avail, ks::cuda::ci_attention,
               ks::cuda::paged_attention_cuda});
  v.push_back({"kv_cache_append", KS_BACKEND_CUDA, "cuda_token_cta", kFloatDTypes, 10,
               "a CTA per token, 16-byte copies when aligned; out-of-range device slots skipped", avail,
               ks::cuda::ci_kv, ks::cuda::kv_cache_append_cuda});
  // The variants that take the GGUF block formats only (the registry skips them for dense weights,
  // refuses them when pinned, and ks_which says so): every quant_matmul variant but
  // cuda_warp_per_column, silu_and_mul_quant_matmul's cuda_mma_rows and the RoPE fusion's
  // one-kernel cuda_warp_per_column (dense weights there: cuda_composed)
  for (Variant& x : v) {
    const std::string op = x.op, name = x.name;
    if (x.backend == KS_BACKEND_CUDA &&
        ((op == "quant_matmul" && name != "cuda_warp_per_column") ||
         (op == "silu_and_mul_quant_matmul" && name == "cuda_mma_rows") ||
         (op == "fused_add_rms_norm_quant_matmul_rope_kv_append" && name == "cuda_warp_per_column")))
      x.block_formats_only = true;
  }
}
std::string cuda_arch_name(int device) {
  if (!cuda::device_present()) return "";  // no device: callers say so (not a driver error)
  if (device < 0) cuda::check_cuda(cudaGetDevice(&device), "which", "cudaGetDevice");
  const cuda::DeviceProps& p = cuda::device_props(device);
  return "sm_" + std::to_string(p.major) + std::to_string(p.minor);
}

}  // namespace ks::registry

extern "C" const char* ks_last_launch_config(const char* op) {
  static thread_local std::string s;
  s = op ? ks::cuda::last_config(op) : std::string();
  return s.c_str();
}
