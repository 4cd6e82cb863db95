// The decode-step fusions on the CPU: fused_add_rms_norm_quant_matmul and
// silu_and_mul_quant_matmul as their two steps, each through the registry's CPU choice for
// that step (fused_add_rms_norm / rms_norm / silu_and_mul, then quant_matmul) on a host
// scratch row block. So the CPU result is bit for bit the unfused sequence's (the model's
// prefill, which runs the steps apart, and its decode agree exactly on the CPU).
#include <cstring>
#include <vector>

#include "ops/args.hpp"
#include "registry/registry.hpp"

namespace ks::cpu {
namespace {

using namespace ks::ops;

View host_view(void* data, DType dt, std::initializer_list<int64_t> shape) {
  View v;
  v.data = data;
  v.dtype = dt;
  v.device = DLDevice{kDLCPU, 0};
  v.shape = detail::Shape(shape);
  v.numel = 1;
  for (int64_t d : shape) v.numel *= d;
  return v;
}

void matmul_step(const View& out, const View& h, const View& weight, ks_qtype_t qtype, int64_t m, int64_t n,
                 int64_t k, int64_t row_bytes, ks_stream_t stream) {
  if (n == 0) return;
  QuantMatmulArgs q;
  q.out = out;
  q.x = h;
  q.weight = weight;
  q.qtype = qtype;
  q.m = m;
  q.n = n;
  q.k = k;
  q.row_bytes = row_bytes;
  registry::dispatch("quant_matmul", KS_BACKEND_CPU, h.dtype, &q, stream);
}

void norm_quant_matmul_cpu(const void* p, ks_stream_t stream) {
  const auto& a = *static_cast<const NormQuantMatmulArgs*>(p);
  const DType dt = a.residual.dtype;
  std::vector<unsigned char> buf(a.residual.nbytes());
  const View h = host_view(buf.data(), dt, {a.m, a.k});
  if (a.has_x) {  // residual_out = residual, h = x; then the in-place fused step on them
    std::memcpy(a.residual_out.data, a.residual.data, a.residual.nbytes());
    std::memcpy(buf.data(), a.x.data, a.x.nbytes());
    FusedAddRmsNormArgs f;
    f.x = h;
    f.residual = a.residual_out;
    f.weight = a.norm_weight;
    f.eps = a.eps;
    f.rows = a.m;
    f.hidden = a.k;
    registry::dispatch("fused_add_rms_norm", KS_BACKEND_CPU, dt, &f, stream);
  } else {
    RmsNormArgs r;
    r.out = h;
    r.x = a.residual;
    r.weight = a.norm_weight;
    r.eps = a.eps;
    r.rows = a.m;
    r.hidden = a.k;
    registry::dispatch("rms_norm", KS_BACKEND_CPU, dt, &r, stream);
  }
  matmul_step(a.out, h, a.weight, a.qtype, a.m, a.n, a.k, a.row_bytes, stream);
}

void silu_quant_matmul_cpu(const void* p, ks_stream_t stream) {
  const auto& a = *static_cast<const SiluQuantMatmulArgs*>(p);
  const DType dt = a.gate_up.dtype;
  std::vector<unsigned char> buf(size_t(a.m * a.k) * detail::dtype_bytes(dt));
  const View h = host_view(buf.data(), dt, {a.m, a.k});
  SiluAndMulArgs s;
  s.out = h;
  s.x = a.gate_up;
  s.rows = a.m;
  s.d = a.k;
  registry::dispatch("silu_and_mul", KS_BACKEND_CPU, dt, &s, stream);
  matmul_step(a.out, h, a.weight, a.qtype, a.m, a.n, a.k, a.row_bytes, stream);
}

}  // namespace

void register_fused_matmul(std::vector<registry::Variant>& v) {
  v.push_back({"fused_add_rms_norm_quant_matmul", KS_BACKEND_CPU, "cpu_composed", registry::kFloatDTypes, 0,
               "the CPU's fused_add_rms_norm (or rms_norm) into a scratch row block, then its quant_matmul",
               nullptr, nullptr, norm_quant_matmul_cpu});
  v.push_back({"silu_and_mul_quant_matmul", KS_BACKEND_CPU, "cpu_composed", registry::kFloatDTypes, 0,
               "the CPU's silu_and_mul into a scratch row block, then its quant_matmul", nullptr, nullptr,
               silu_quant_matmul_cpu});
}

}  // namespace ks::cpu
