// The decode-step fusions on the CPU: fused_add_rms_norm_quant_matmul,
// silu_and_mul_quant_matmul and rotary_embedding_kv_append as their two steps, each through the registry's CPU choice for
// that step (fused_add_rms_norm / rms_norm / silu_and_mul, then quant_matmul) on a host
// scratch row block. So the CPU result is bit for bit the unfused sequence's (the model's
// prefill, which runs the steps apart, and its decode agree exactly on the CPU).
// Every step's variant is chosen before the first one runs: a step that cannot run (a pinned
// variant that does not take the call) fails the call with nothing written, naming the fused
// op and the step.
#include <cstring>
#include <utility>
#include <vector>

#include "ops/args.hpp"
#include "registry/registry.hpp"

using ks::detail::DType;

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

// The variant of `be` that will run one step (its errors restated under the fused op's name).
const registry::Variant* step(const char* fused, const char* op, DType dt, const void* args,
                              ks_backend_t be = KS_BACKEND_CPU) {
  try {
    return registry::select(op, be, dt, args).variant;
  } catch (const detail::Failure& f) {
    detail::fail(f.status, fused, std::string("its ") + op + " step cannot run: " + f.message);
  }
}

QuantMatmulArgs matmul_args(const View& out, const View& h, const View& weight, ks_qtype_t qtype, int64_t m,
                            int64_t n, int64_t k, int64_t row_bytes) {
  QuantMatmulArgs q;
  q.out = out;
  q.x = h;
  q.weight = weight;
  q.qtype = qtype;
  q.m = m;
  q.n = n;
  q.k = k;
  q.row_bytes = row_bytes;
  return q;
}

void norm_quant_matmul_cpu(const void* p, ks_stream_t stream) {
  const auto& a = *static_cast<const NormQuantMatmulArgs*>(p);
  const char* op = "fused_add_rms_norm_quant_matmul";
  const DType dt = a.residual.dtype;
  // h, and (with x) the new residual, in host scratch: residual_out is written last, after both
  // steps, so a step that runs out of memory leaves every output as it was
  std::vector<unsigned char> buf(a.residual.nbytes()), res(a.has_x ? a.residual.nbytes() : 0);
  const View h = host_view(buf.data(), dt, {a.m, a.k});
  FusedAddRmsNormArgs f;  // in place on a copy of residual and h (a copy of x)
  f.x = h;
  f.residual = host_view(res.data(), dt, {a.m, a.k});
  f.weight = a.norm_weight;
  f.eps = a.eps;
  f.rows = a.m;
  f.hidden = a.k;
  RmsNormArgs r;
  r.out = h;
  r.x = a.residual;
  r.weight = a.norm_weight;
  r.eps = a.eps;
  r.rows = a.m;
  r.hidden = a.k;
  const QuantMatmulArgs q = matmul_args(a.out, h, a.weight, a.qtype, a.m, a.n, a.k, a.row_bytes);
  const registry::Variant* norm = a.has_x ? step(op, "fused_add_rms_norm", dt, &f) : step(op, "rms_norm", dt, &r);
  const registry::Variant* mm = a.n > 0 ? step(op, "quant_matmul", dt, &q) : nullptr;
  if (a.has_x) {
    std::memcpy(res.data(), a.residual.data, a.residual.nbytes());
    std::memcpy(buf.data(), a.x.data, a.x.nbytes());
    norm->run(&f, stream);
  } else {
    norm->run(&r, stream);
  }
  if (mm) mm->run(&q, stream);
  if (a.has_x) std::memcpy(a.residual_out.data, res.data(), res.size());
}

void silu_quant_matmul_cpu(const void* p, ks_stream_t stream) {
  const auto& a = *static_cast<const SiluQuantMatmulArgs*>(p);
  const char* op = "silu_and_mul_quant_matmul";
  const DType dt = a.gate_up.dtype;
  std::vector<unsigned char> buf(size_t(a.m * a.k) * detail::dtype_bytes(dt));
  const View h = host_view(buf.data(), dt, {a.m, a.k});
  SiluAndMulArgs s;
  s.out = h;
  s.x = a.gate_up;
  s.rows = a.m;
  s.d = a.k;
  const QuantMatmulArgs q = matmul_args(a.out, h, a.weight, a.qtype, a.m, a.n, a.k, a.row_bytes);
  const registry::Variant* act = step(op, "silu_and_mul", dt, &s);
  const registry::Variant* mm = step(op, "quant_matmul", dt, &q);
  act->run(&s, stream);
  mm->run(&q, stream);
}

void rope_kv_append_cpu(const void* p, ks_stream_t stream) {
  const auto& a = *static_cast<const RopeKvAppendArgs*>(p);
  const char* op = "rotary_embedding_kv_append";
  const bool append = a.kv.num_tokens > 0 && a.kv.num_kv_heads * a.kv.head_dim > 0;
  const registry::Variant* rope = step(op, "rotary_embedding", a.rope.q.dtype, &a.rope);
  const registry::Variant* kv = append ? step(op, "kv_cache_append", a.kv.k.dtype, &a.kv) : nullptr;
  rope->run(&a.rope, stream);
  if (kv) kv->run(&a.kv, stream);
}

// A composed op's steps, in order, with their variants chosen before any of them runs (one that
// cannot run failed in `step` with nothing written); a failure while running is restated
// under the composed op's name.
struct Step {
  const char* name;
  const registry::Variant* variant;
  const void* args;
};
void run_steps(const char* op, std::initializer_list<Step> steps, ks_stream_t stream) {
  const char* running = "";
  try {
    for (const Step& s : steps) {
      running = s.name;
      s.variant->run(s.args, stream);
    }
  } catch (const detail::Failure& f) {
    detail::fail(f.status, op, std::string("its ") + running + " step cannot run: " + f.message);
  }
}

// Host bytes that a composed op's steps write in place, saved before its first step and put back
// when a later step fails after an earlier one wrote (a step's scratch out of memory, say): the
// call then leaves every output as it was, as the ABI promises of a failed call, and a caller
// that retries does not rotate q and k twice. Every allocation here happens before the first
// write (add, then save); restore allocates nothing.
class SavedBytes {
 public:
  void add(void* p, size_t n) {
    if (n) regions_.push_back({static_cast<unsigned char*>(p), n});
  }
  // rotary_embedding_kv_append's writes: q's (and k's) rotated features, the mapped slots' rows
  void add_rope_kv_append(const RopeKvAppendArgs& a) {
    const RotaryArgs& r = a.rope;
    auto rows = [&](const View& x, int64_t heads, int64_t ts, int64_t hs) {
      const size_t eb = detail::dtype_bytes(x.dtype);
      for (int64_t t = 0; t < r.num_tokens; ++t)
        for (int64_t h = 0; h < heads; ++h)
          add(static_cast<char*>(x.data) + size_t(t * ts + h * hs) * eb, size_t(r.rotary_dim) * eb);
    };
    rows(r.q, r.num_heads, r.q_token_stride, r.q_head_stride);
    if (r.has_k) rows(r.k, r.num_kv_heads, r.k_token_stride, r.k_head_stride);
    const KvCacheAppendArgs& kv = a.kv;
    const size_t row = size_t(kv.num_kv_heads * kv.head_dim) * detail::dtype_bytes(kv.k_cache.dtype);
    for (int64_t t = 0; t < kv.num_tokens; ++t) {
      const int64_t slot = detail::load_index(kv.slot_mapping.data, kv.slot_mapping.dtype, t);
      if (slot < 0) continue;
      add(static_cast<char*>(kv.k_cache.data) + size_t(slot) * row, row);
      add(static_cast<char*>(kv.v_cache.data) + size_t(slot) * row, row);
    }
  }
  void save() {
    size_t total = 0;
    for (const auto& r : regions_) total += r.second;
    bytes_.resize(total);
    unsigned char* o = bytes_.data();
    for (const auto& r : regions_) o = static_cast<unsigned char*>(std::memcpy(o, r.first, r.second)) + r.second;
  }
  // (regions may overlap - q's slice of out, a slot named twice - and then hold the same bytes:
  // every region is saved before the first write)
  void restore() const noexcept {
    const unsigned char* o = bytes_.data() + bytes_.size();
    for (auto it = regions_.rbegin(); it != regions_.rend(); ++it) {
      o -= it->second;
      std::memcpy(it->first, o, it->second);
    }
  }

 private:
  std::vector<std::pair<unsigned char*, size_t>> regions_;
  std::vector<unsigned char> bytes_;
};

// Runs the steps on backend `be`. On the CPU (host memory) the regions `writes` adds to a SavedBytes
// are saved first and put back if any step fails; elsewhere the steps run plainly.
template <class Writes>
void run_steps_restoring(const char* op, std::initializer_list<Step> steps, ks_stream_t stream, ks_backend_t be,
                         Writes&& writes) {
  if (be != KS_BACKEND_CPU) return run_steps(op, steps, stream);
  SavedBytes saved;
  writes(saved);
  saved.save();  // (out of memory here: nothing written yet)
  try {
    run_steps(op, steps, stream);
  } catch (...) {
    saved.restore();
    throw;
  }
}

}  // namespace

// fused_add_rms_norm_quant_matmul_rope_kv_append as its two steps on backend `be` (the CPU's
// only variant, and CUDA's fallback): the norm + matmul into out, then RoPE and the append on
// out's slices.
void norm_qmm_rope_append_composed(const void* p, ks_stream_t stream, ks_backend_t be) {
  const auto& a = *static_cast<const NormQmmRopeAppendArgs*>(p);
  const char* op = "fused_add_rms_norm_quant_matmul_rope_kv_append";
  const registry::Variant* mm = step(op, "fused_add_rms_norm_quant_matmul", a.mm.residual.dtype, &a.mm, be);
  const registry::Variant* rope = step(op, "rotary_embedding_kv_append", a.rkv.rope.q.dtype, &a.rkv, be);
  // (what the steps write: out, whose slices q and k are rotated in place, residual_out, the caches' rows)
  run_steps_restoring(op, {{"fused_add_rms_norm_quant_matmul", mm, &a.mm}, {"rotary_embedding_kv_append", rope, &a.rkv}},
                      stream, be, [&](SavedBytes& saved) {
                        saved.add(a.mm.out.data, a.mm.out.nbytes());
                        if (a.mm.has_x) saved.add(a.mm.residual_out.data, a.mm.residual_out.nbytes());
                        saved.add_rope_kv_append(a.rkv);
                      });
}

// rotary_embedding_kv_append_paged_attention as its two steps on backend `be` (the CPU's only
// variant, and CUDA's fallback): RoPE and the append, then the attention over the caches.
void rope_append_attention_composed(const void* p, ks_stream_t stream, ks_backend_t be) {
  const auto& a = *static_cast<const RopeKvAppendAttentionArgs*>(p);
  const char* op = "rotary_embedding_kv_append_paged_attention";
  const registry::Variant* rope = step(op, "rotary_embedding_kv_append", a.rkv.rope.q.dtype, &a.rkv, be);
  const registry::Variant* attn = step(op, "paged_attention", a.attn.q.dtype, &a.attn, be);
  // (what is written before the last step: the rotated q and k, the appended rows; out comes last)
  run_steps_restoring(op, {{"rotary_embedding_kv_append", rope, &a.rkv}, {"paged_attention", attn, &a.attn}}, stream,
                      be, [&](SavedBytes& saved) { saved.add_rope_kv_append(a.rkv); });
}

void register_fused_matmul(std::vector<registry::Variant>& v) {
  v.push_back({"fused_add_rms_norm_quant_matmul", KS_BACKEND_CPU, "cpu_composed", registry::kFloatDTypes, 0,
               "the CPU's fused_add_rms_norm (or rms_norm) into a scratch row block, then its quant_matmul",
               nullptr, nullptr, norm_quant_matmul_cpu});
  v.push_back({"silu_and_mul_quant_matmul", KS_BACKEND_CPU, "cpu_composed", registry::kFloatDTypes, 0,
               "the CPU's silu_and_mul into a scratch row block, then its quant_matmul", nullptr, nullptr,
               silu_quant_matmul_cpu});
  v.push_back({"rotary_embedding_kv_append", KS_BACKEND_CPU, "cpu_composed", registry::kFloatDTypes, 0,
               "the CPU's rotary_embedding, then its kv_cache_append", nullptr, nullptr, rope_kv_append_cpu});
  v.push_back({"fused_add_rms_norm_quant_matmul_rope_kv_append", KS_BACKEND_CPU, "cpu_composed",
               registry::kFloatDTypes, 0,
               "the CPU's fused_add_rms_norm_quant_matmul into out, then its rotary_embedding_kv_append on out's "
               "q, k and v",
               nullptr, nullptr, [](const void* p, ks_stream_t s) { norm_qmm_rope_append_composed(p, s, KS_BACKEND_CPU); }});
  v.push_back({"rotary_embedding_kv_append_paged_attention", KS_BACKEND_CPU, "cpu_composed", registry::kFloatDTypes, 0,
               "the CPU's rotary_embedding_kv_append, then its paged_attention", nullptr, nullptr,
               [](const void* p, ks_stream_t s) { rope_append_attention_composed(p, s, KS_BACKEND_CPU); }});
}

}  // namespace ks::cpu
