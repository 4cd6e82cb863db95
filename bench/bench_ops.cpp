// kernscope CUDA operator benchmark (the C++ half of bench/; peers run in
// bench/peers.py in the same GPU call).
//
// Method (same as ../shared/anchors): for each op x shape x dtype, enough input
// sets to exceed ~3x the 60 MB L2 are allocated and filled with random data;
// 20 rounds over all sets are captured in one CUDA graph on a non-default
// stream; the graph is replayed once to warm up, then 7 times between CUDA
// events; the median replay time divided by the calls per replay is the µs per
// call. GB/s counts each input read once and each output written once. The
// device-to-device copy bandwidth (2 GiB, median of 20) is measured in the same
// run and every row carries its percentage.
//
// usage: bench_ops --csv out.csv [--dtypes bf16,fp16,fp32] [--ops rms_norm,...] [--impl NAME] [--variants]
// (--ops decode_fusions: the model's decode fusions next to the calls they replace)
// (--variants: the model-path ops with several CUDA variants are also timed under each
//  variant, pinned: rows with impl "variant:<name>"; bench/auto_vs_best.py compares them)
// (--impl names the rows, default "kernscope"; e.g. kernscope_nopdl for a KS_PDL=0 run;
//  --shapes 512x4096,64x128256 keeps only those shapes, as printed, e.g. for a profiler run; decode attention
//  shapes too, e.g. "b1 h32/8 d128 T32768")
//  model-path ops, bf16 only (sample and argmax: every dtype of --dtypes) and opt-in: --ops rotary_embedding,paged_attention,sample,argmax,quant_matmul
//  (rows rope_neox, decode_attention, sampling_topk_topp, argmax, quant_gemv_*; shapes as ../shared/anchors);
//  --ops quant_matmul_a8: quant_matmul's GEMV shapes through quant_matmul_a8 (rows quant_gemv_a8_*);
//  --ops quant_matmul_rows: fp32 quant_matmul at 2..512 rows of SmolLM2's shapes against a dense FP32 gemm
//    (and at the down projection's shape, silu_and_mul_quant_matmul's cuda_mma_rows against the two calls)
//  (--shapes 3072x576 keeps a matrix, "M32 3072x576" one row count of it)
#ifdef KS_HAVE_BUILD_COMMIT
#include "build_commit.h"  // KS_BUILD_COMMIT (cmake/build_commit.cmake)
#endif
#include <cuda_runtime.h>
#include "cuda_check.hpp"
#include "graph_time.hpp"
#include <kernscope/kernscope.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <cstring>
#include <cmath>
#include <memory>
#include <tuple>
#include <vector>

#include "core/half.hpp"
#include "attn_timeline.hpp"
#include "qmm_timeline.hpp"

namespace {

using ks_bench::copy_bandwidth;
using ks_bench::Dev;
using ks_bench::graph_time;
using ks_bench::median;
using ks_bench::nsets;
using ks::DType;

// Fills device memory with random values of dtype dt (normal, sd 1) via a host pattern.
void fill_random(void* d, size_t numel, DType dt, std::mt19937_64& rng) {
  const size_t chunk = std::min<size_t>(numel, size_t(1) << 22);
  std::vector<uint8_t> host(chunk * ks::dtype_size(dt));
  std::normal_distribution<float> nd(0.f, 1.f);
  for (size_t i = 0; i < chunk; ++i) {
    const float v = nd(rng);
    if (dt == DType::F32) std::memcpy(&host[4 * i], &v, 4);
    else {
      const uint16_t h = dt == DType::BF16 ? ks::float_to_bf16(v) : ks::float_to_half(v);
      std::memcpy(&host[2 * i], &h, 2);
    }
  }
  const size_t es = ks::dtype_size(dt);
  for (size_t off = 0; off < numel; off += chunk) {
    const size_t n = std::min(chunk, numel - off);
    CK(cudaMemcpy(static_cast<char*>(d) + off * es, host.data(), n * es, cudaMemcpyHostToDevice));
  }
}


struct Row {
  std::string op, shape, dtype, config;
  double us, gbs;
  std::string impl;  // empty: the run's --impl (the automatic choice); "variant:<name>" for a pinned variant
};

ks::TensorView dv(void* p, DType dt, std::vector<int64_t> shape) { return ks::TensorView(p, dt, shape, DLDevice{kDLCUDA, 0}); }

}  // namespace

int main(int argc, char** argv) {
  std::string shapes, impl = "kernscope", csv = "bench_ops.csv", dtypes = "bf16,fp16,fp32", ops = "rms_norm,fused_add_rms_norm,silu_and_mul,gemv,softmax";
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    if (k == "--variants") { --i; continue; }  // a flag: no value
    if (k == "--csv") csv = argv[i + 1];
    else if (k == "--dtypes") dtypes = argv[i + 1];
    else if (k == "--ops") ops = argv[i + 1];
    else if (k == "--impl") impl = argv[i + 1];
    else if (k == "--shapes") shapes = argv[i + 1];
  }
  // --variants: also time every CUDA variant of the ops that have several (pinned), next to the
  // automatic choice (bench/auto_vs_best.py: is the choice within 3% of the best variant?)
  bool variants = false;
  for (int i = 1; i < argc; ++i) variants = variants || std::string(argv[i]) == "--variants";
  auto has = [](const std::string& list, const std::string& x) { return ("," + list + ",").find("," + x + ",") != std::string::npos; };
  auto want_shape = [&](int64_t a, int64_t b) { return shapes.empty() || has(shapes, std::to_string(a) + "x" + std::to_string(b)); };
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));
  int drv = 0, rt = 0;
  CK(cudaDriverGetVersion(&drv));
  CK(cudaRuntimeGetVersion(&rt));
  const double copy_gbs = copy_bandwidth(s);
  std::printf("device %s, copy bandwidth %.1f GB/s\n", prop.name, copy_gbs);
  std::mt19937_64 rng(1234);
  std::vector<Row> rows;
  // cfg_op: the library op whose launch configuration the row records (default: op itself)
  auto record = [&](const std::string& op, const std::string& shape, DType dt, double us, size_t bytes,
                    const char* cfg_op = nullptr) {
    Row r{op, shape, ks::dtype_name(dt), ks_last_launch_config(cfg_op ? cfg_op : op.c_str()), us,
          double(bytes) / (us * 1e-6) / 1e9};
    std::printf("%-20s %-14s %-5s %10.3f us %8.1f GB/s %5.1f%%  %s\n", op.c_str(), shape.c_str(), r.dtype.c_str(), us, r.gbs,
                100 * r.gbs / copy_gbs, r.config.c_str());
    rows.push_back(r);
  };
  // the same call under every CUDA variant of lib_op, pinned (--variants; none when lib_op has one)
  auto also_variants = [&](const char* lib_op, const std::string& op, const std::string& shape, DType dt, size_t bytes,
                           int k, const std::function<void(int, cudaStream_t)>& call) {
    if (!variants) return;
    std::vector<std::string> names;
    for (const auto& v : ks::variants())
      if (std::strcmp(v.op, lib_op) == 0 && std::strcmp(v.backend, "cuda") == 0) names.push_back(v.name);
    if (names.size() < 2) return;
    for (const auto& name : names) {
      ks::check(ks_force_variant(lib_op, name.c_str()));
      try {
        const double us = graph_time(k, call, s);
        record(op, shape, dt, us, bytes, lib_op);
        rows.back().impl = "variant:" + name;
      } catch (const ks::Error& e) {
        std::printf("%-20s %-14s variant %s cannot run it: %s\n", op.c_str(), shape.c_str(), name.c_str(), e.what());
      }
      ks::check(ks_force_variant(lib_op, nullptr));
    }
  };
  for (DType dt : {DType::BF16, DType::F16, DType::F32}) {
    if (!has(dtypes, ks::dtype_name(dt))) continue;
    const size_t es = ks::dtype_size(dt);
    const std::vector<std::pair<int64_t, int64_t>> norm_shapes = {{1, 4096}, {16, 4096}, {512, 1024}, {512, 4096}, {4096, 8192}, {16384, 8192}};
    if (has(ops, "rms_norm"))
      for (auto [m, h] : norm_shapes) {
        if (!want_shape(m, h)) continue;
        const size_t bytes = size_t(2 * m * h + h) * es;
        const int k = nsets(bytes);
        std::vector<std::unique_ptr<Dev>> x, w, o;
        for (int i = 0; i < k; ++i) {
          x.emplace_back(new Dev(m * h * es)); w.emplace_back(new Dev(h * es)); o.emplace_back(new Dev(m * h * es));
          fill_random(x.back()->p, m * h, dt, rng); fill_random(w.back()->p, h, dt, rng);
        }
        const double us = graph_time(k, [&](int i, cudaStream_t st) {
          ks::rms_norm(dv(o[i]->p, dt, {m, h}), dv(x[i]->p, dt, {m, h}), dv(w[i]->p, dt, {h}), 1e-6, ks::Backend::Cuda, st);
        }, s);
        record("rms_norm", std::to_string(m) + "x" + std::to_string(h), dt, us, bytes);
      }
    if (has(ops, "fused_add_rms_norm"))
      for (auto [m, h] : norm_shapes) {
        if (!want_shape(m, h)) continue;
        const size_t bytes = size_t(4 * m * h + h) * es;
        const int k = nsets(bytes);
        std::vector<std::unique_ptr<Dev>> x, r, w;
        for (int i = 0; i < k; ++i) {
          x.emplace_back(new Dev(m * h * es)); r.emplace_back(new Dev(m * h * es)); w.emplace_back(new Dev(h * es));
          fill_random(x.back()->p, m * h, dt, rng); fill_random(r.back()->p, m * h, dt, rng); fill_random(w.back()->p, h, dt, rng);
        }
        const double us = graph_time(k, [&](int i, cudaStream_t st) {
          ks::fused_add_rms_norm(dv(x[i]->p, dt, {m, h}), dv(r[i]->p, dt, {m, h}), dv(w[i]->p, dt, {h}), 1e-6, ks::Backend::Cuda, st);
        }, s);
        record("fused_add_rms_norm", std::to_string(m) + "x" + std::to_string(h), dt, us, bytes);
      }
    if (has(ops, "silu_and_mul"))
      for (auto [m, d] : std::vector<std::pair<int64_t, int64_t>>{{1, 14336}, {16, 14336}, {512, 4096}, {512, 14336}, {4096, 14336}}) {
        if (!want_shape(m, 2 * d)) continue;
        const size_t bytes = size_t(3 * m * d) * es;
        const int k = nsets(bytes);
        std::vector<std::unique_ptr<Dev>> x, o;
        for (int i = 0; i < k; ++i) {
          x.emplace_back(new Dev(2 * m * d * es)); o.emplace_back(new Dev(m * d * es));
          fill_random(x.back()->p, 2 * m * d, dt, rng);
        }
        const double us = graph_time(k, [&](int i, cudaStream_t st) {
          ks::silu_and_mul(dv(o[i]->p, dt, {m, d}), dv(x[i]->p, dt, {m, 2 * d}), ks::Backend::Cuda, st);
        }, s);
        record("silu_and_mul", std::to_string(m) + "x" + std::to_string(2 * d), dt, us, bytes);
      }
    if (has(ops, "gemv"))
      for (auto [n, h] : std::vector<std::pair<int64_t, int64_t>>{{512, 1024}, {4096, 4096}, {14336, 4096}, {4096, 14336}, {28672, 8192}, {128256, 4096}}) {
        if (!want_shape(n, h)) continue;
        const size_t bytes = size_t(n * h + h + n) * es;
        const int k = nsets(bytes);
        std::vector<std::unique_ptr<Dev>> x, w, o;
        for (int i = 0; i < k; ++i) {
          x.emplace_back(new Dev(h * es)); w.emplace_back(new Dev(n * h * es)); o.emplace_back(new Dev(n * es));
          fill_random(x.back()->p, h, dt, rng); fill_random(w.back()->p, n * h, dt, rng);
        }
        const double us = graph_time(k, [&](int i, cudaStream_t st) {
          ks::gemv(dv(o[i]->p, dt, {n}), dv(x[i]->p, dt, {h}), dv(w[i]->p, dt, {n, h}), ks::Backend::Cuda, st);
        }, s);
        record("gemv", std::to_string(n) + "x" + std::to_string(h), dt, us, bytes);
      }
    if (has(ops, "softmax"))
      for (auto [m, h] : std::vector<std::pair<int64_t, int64_t>>{{512, 128}, {512, 1024}, {4096, 4096}, {64, 32000}, {64, 128256}, {256, 151936}}) {
        if (!want_shape(m, h)) continue;
        const size_t bytes = size_t(2 * m * h) * es;
        const int k = nsets(bytes);
        std::vector<std::unique_ptr<Dev>> x, o;
        for (int i = 0; i < k; ++i) {
          x.emplace_back(new Dev(m * h * es)); o.emplace_back(new Dev(m * h * es));
          fill_random(x.back()->p, m * h, dt, rng);
        }
        const std::function<void(int, cudaStream_t)> call = [&](int i, cudaStream_t st) {
          ks::softmax(dv(o[i]->p, dt, {m, h}), dv(x[i]->p, dt, {m, h}), ks::Backend::Cuda, st);
        };
        const double us = graph_time(k, call, s);
        record("softmax", std::to_string(m) + "x" + std::to_string(h), dt, us, bytes);
        also_variants("softmax", "softmax", std::to_string(m) + "x" + std::to_string(h), dt, bytes, k, call);
      }
  }
  // ---- model-path ops (bf16; opt-in: --ops rotary_embedding,paged_attention,sample,argmax,quant_matmul),
  // shapes and byte counts as in ../shared/anchors/anchors2_h200.py where it has them.
  const DType bf = DType::BF16;
  if (has(ops, "rotary_embedding"))
    for (int64_t n : {int64_t(1), int64_t(4096), int64_t(32768)}) {
      // q [n, 32, 128], k [n, 8, 128] in place, NeoX, int64 positions; bytes: q and k read and written
      // (the anchor also counts its cos/sin tables; kernscope reads positions instead)
      const int64_t H = 32, KVH = 8, D = 128;
      const size_t bytes = size_t(2 * n * (H + KVH) * D * 2 + n * 8);
      const int k = nsets(bytes);
      std::vector<std::unique_ptr<Dev>> q, kk, pos;
      for (int i = 0; i < k; ++i) {
        q.emplace_back(new Dev(n * H * D * 2)); kk.emplace_back(new Dev(n * KVH * D * 2)); pos.emplace_back(new Dev(n * 8));
        fill_random(q.back()->p, n * H * D, bf, rng); fill_random(kk.back()->p, n * KVH * D, bf, rng);
        std::vector<int64_t> pv(static_cast<size_t>(n));
        for (int64_t t = 0; t < n; ++t) pv[size_t(t)] = (t * 7919) % 32768;
        CK(cudaMemcpy(pos.back()->p, pv.data(), n * 8, cudaMemcpyHostToDevice));
      }
      const std::function<void(int, cudaStream_t)> call = [&](int i, cudaStream_t st) {
        ks::rotary_embedding(dv(q[i]->p, bf, {n, H, D}), dv(kk[i]->p, bf, {n, KVH, D}), dv(pos[i]->p, DType::I64, {n}), D,
                             500000.0, true, ks::Backend::Cuda, st);
      };
      const double us = graph_time(k, call, s);
      record("rope_neox", std::to_string(n) + "x(32+8)x128", bf, us, bytes, "rotary_embedding");
      also_variants("rotary_embedding", "rope_neox", std::to_string(n) + "x(32+8)x128", bf, bytes, k, call);
    }
  if (has(ops, "paged_attention")) {
    // decode: one query per sequence over T live cached keys in 16-token blocks (contiguous block
    // ids) of a block table sized for `capacity` tokens; bytes = the live K and V read once, as
    // the anchor counts them
    auto attention = [&](int64_t b, int64_t hq, int64_t hkv, int64_t d, int64_t T, int64_t capacity, DType dt) {
      // (--shapes also names attention shapes as printed, e.g. "b1 h32/8 d128 T32768", for a profiler run)
      char shape[96];
      std::snprintf(shape, sizeof shape, "b%lld h%lld/%lld d%lld T%lld", (long long)b, (long long)hq, (long long)hkv,
                    (long long)d, (long long)T);
      std::string sh = shape;
      if (capacity != T) sh += " of " + std::to_string(capacity);
      if (!shapes.empty() && !has(shapes, sh)) return;
      // 16-token blocks, or KS_BENCH_ATTN_BS=n (experiments; a shape whose capacity n does not
      // divide is left out, so a tagged row always ran at n)
      static const int64_t block = std::max<int64_t>(1, std::getenv("KS_BENCH_ATTN_BS") ? std::atoll(std::getenv("KS_BENCH_ATTN_BS")) : 16);
      if (capacity % block != 0) return;
      const int64_t bs = block, blocks_per_seq = capacity / bs, blocks = b * blocks_per_seq, es = int64_t(ks::dtype_size(dt));
      const size_t kv_bytes = size_t(blocks * bs * hkv * d * es);
      const size_t bytes = size_t(2 * b * T * hkv * d * es);
      const int k = nsets(bytes);
      std::vector<std::unique_ptr<Dev>> q, kc, vc, o;
      for (int i = 0; i < k; ++i) {
        q.emplace_back(new Dev(b * hq * d * es)); o.emplace_back(new Dev(b * hq * d * es));
        kc.emplace_back(new Dev(kv_bytes)); vc.emplace_back(new Dev(kv_bytes));
        fill_random(q.back()->p, b * hq * d, dt, rng);
        fill_random(kc.back()->p, blocks * bs * hkv * d, dt, rng);
        fill_random(vc.back()->p, blocks * bs * hkv * d, dt, rng);
      }
      std::vector<int32_t> table(static_cast<size_t>(blocks)), lens(static_cast<size_t>(b), int32_t(T));
      for (int64_t i = 0; i < blocks; ++i) table[size_t(i)] = int32_t(i);
      Dev dtable(blocks * 4), dlens(b * 4);
      CK(cudaMemcpy(dtable.p, table.data(), blocks * 4, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(dlens.p, lens.data(), b * 4, cudaMemcpyHostToDevice));
      const double scale = 1.0 / std::sqrt(double(d));
      const std::function<void(int, cudaStream_t)> call = [&](int i, cudaStream_t st) {
        ks::paged_attention(dv(o[i]->p, dt, {b, hq, d}), dv(q[i]->p, dt, {b, hq, d}), dv(kc[i]->p, dt, {blocks, bs, hkv, d}),
                            dv(vc[i]->p, dt, {blocks, bs, hkv, d}), dv(dtable.p, DType::I32, {b, blocks_per_seq}),
                            ks::TensorView(), dv(dlens.p, DType::I32, {b}), scale, ks::Backend::Cuda, st);
      };
      const double us = graph_time(k, call, s);
      ks_bench::report_attention_timeline(sh + " paged_attention", us);
      record("decode_attention", sh, dt, us, bytes, "paged_attention");
      also_variants("paged_attention", "decode_attention", sh, dt, bytes, k, call);
      // paged_attention_after_append with fresh_keys = 1 (impl "<impl>_after_append"): the call a
      // decode step makes right after its append. Here each call's predecessor is the previous
      // attention call, which writes no cache row, block table or length, so the promise holds;
      // its early reads (the context, the first tiles' entries and older keys) overlap that call.
      const std::function<void(int, cudaStream_t)> after = [&](int i, cudaStream_t st) {
        ks::paged_attention_after_append(dv(o[i]->p, dt, {b, hq, d}), dv(q[i]->p, dt, {b, hq, d}),
                                         dv(kc[i]->p, dt, {blocks, bs, hkv, d}), dv(vc[i]->p, dt, {blocks, bs, hkv, d}),
                                         dv(dtable.p, DType::I32, {b, blocks_per_seq}), ks::TensorView(),
                                         dv(dlens.p, DType::I32, {b}), scale, /*fresh_keys=*/1, ks::Backend::Cuda, st);
      };
      const double us_after = graph_time(k, after, s);
      ks_bench::report_attention_timeline(sh + " after_append", us_after);
      record("decode_attention", sh, dt, us_after, bytes, "paged_attention");
      rows.back().impl = impl + "_after_append";
    };
    // KS_BENCH_ATTN=model: only the model's shapes (below); =anchors: only the anchors' bf16
    // shapes; =layout: only an experiment on the
    // cache layout: 32/8 heads of 128 at 32K keys (each key's row of one kv head is 256 bytes
    // at a 2 KB stride) against 4/1 heads at 256K keys (the same bytes and heads per kv head,
    // rows back to back), both at batch 1
    const char* only_env = std::getenv("KS_BENCH_ATTN");
    const std::string only = only_env ? only_env : "";
    if (only == "layout") {
      attention(1, 32, 8, 128, 32768, 32768, bf);
      attention(1, 4, 1, 128, 262144, 262144, bf);
    } else if (only != "model")
      for (auto [b, hq, hkv, d] : std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>>{{1, 9, 3, 64}, {1, 32, 8, 128}, {32, 32, 8, 128}})
        for (int64_t T : {int64_t(1024), int64_t(8192), int64_t(32768)}) attention(b, hq, hkv, d, T, T, bf);
    // SmolLM2's decode step in the model: FP32, short live contexts in a cache of 2048 tokens
    // (ksctl generate's default --context) and of 656 (bench-model's after a 512-token prompt)
    if (only != "layout" && only != "anchors") {
      for (int64_t T : {int64_t(64), int64_t(192), int64_t(576)}) attention(1, 9, 3, 64, T, 2048, DType::F32);
      for (int64_t T : {int64_t(128), int64_t(576)}) attention(1, 9, 3, 64, T, 656, DType::F32);
    }
  }
  // (sample and argmax take every dtype of --dtypes: the anchors' bf16, and fp16 / fp32 logits)
  for (const char* op : {"sample", "argmax"}) {
    if (!has(ops, op)) continue;
    for (DType lt : {DType::BF16, DType::F16, DType::F32}) {
    if (!has(dtypes, ks::dtype_name(lt))) continue;
    for (auto [b, V] : std::vector<std::pair<int64_t, int64_t>>{{1, 128256}, {64, 128256}, {256, 151936}}) {
      const size_t bytes = size_t(b * V) * ks::dtype_size(lt);
      const int k = nsets(bytes);
      std::vector<std::unique_ptr<Dev>> x;
      for (int i = 0; i < k; ++i) {
        x.emplace_back(new Dev(bytes));
        fill_random(x.back()->p, b * V, lt, rng);
      }
      Dev out(b * 8), so(16);
      const int64_t seed_offset[2] = {1234, 0};
      CK(cudaMemcpy(so.p, seed_offset, 16, cudaMemcpyHostToDevice));
      const bool sampling = std::strcmp(op, "sample") == 0;
      const std::function<void(int, cudaStream_t)> call = [&](int i, cudaStream_t st) {
        if (sampling)  // top-k 50, top-p 0.9, as the anchor's torch path
          ks::sample(dv(out.p, DType::I64, {b}), ks::TensorView(), dv(x[i]->p, lt, {b, V}), dv(so.p, DType::I64, {2}),
                     1.0, 50, 0.9, ks::Backend::Cuda, st);
        else
          ks::argmax(dv(out.p, DType::I64, {b}), dv(x[i]->p, lt, {b, V}), ks::Backend::Cuda, st);
      };
      const double us = graph_time(k, call, s);
      const std::string shape = std::to_string(b) + "x" + std::to_string(V);
      record(sampling ? "sampling_topk_topp" : "argmax", shape, lt, us, bytes, op);
      also_variants(op, sampling ? "sampling_topk_topp" : "argmax", shape, lt, bytes, k, call);
    }
    }
  }
  // n packed rows of h weights at p (device): random codes with small finite fp16 scales (the
  // high byte of d, and of Q4_1's m, masked to 0x1f); dense BF16: random values
  auto fill_packed = [&](void* p, ks::QType qt, int64_t n, int64_t h, int64_t bb) {
    if (qt == ks::QType::BF16) return fill_random(p, n * h, DType::BF16, rng);
    if (qt == ks::QType::F16) return fill_random(p, n * h, DType::F16, rng);
    if (qt == ks::QType::F32) return fill_random(p, n * h, DType::F32, rng);
    const int64_t row_bytes = h / 32 * bb;
    std::vector<uint8_t> host(static_cast<size_t>(n * row_bytes));
    for (auto& c : host) c = uint8_t(rng());
    for (int64_t r = 0; r < n; ++r)
      for (int64_t blk = 0; blk < h / 32; ++blk) {
        uint8_t* b = host.data() + r * row_bytes + blk * bb;
        b[1] = uint8_t(b[1] & 0x1f);
        if (qt == ks::QType::Q4_1) b[3] = uint8_t(b[3] & 0x1f);
      }
    CK(cudaMemcpy(p, host.data(), host.size(), cudaMemcpyHostToDevice));
  };
  if (has(ops, "quant_matmul") || has(ops, "quant_matmul_a8"))
    for (auto [qt, qname, bb] : std::vector<std::tuple<ks::QType, const char*, int64_t>>{
             {ks::QType::Q4_1, "q4_1", 20}, {ks::QType::Q8_0, "q8_0", 34}, {ks::QType::Q4_0, "q4_0", 18},
             {ks::QType::BF16, "bf16", 64}, {ks::QType::F16, "f16", 64},
             {ks::QType::F32, "f32", 128}})  // (dense weights: 64 / 128 bytes per 32 values; quant_matmul only)
      for (auto [n, h, xdt] : std::vector<std::tuple<int64_t, int64_t, DType>>{
               {576, 576, bf}, {1536, 576, bf}, {4096, 4096, bf}, {14336, 4096, bf}, {49152, 576, bf},
               {49152, 576, DType::F32}}) {
        // decode GEMV (M = 1, bf16 x; fp32 x at 49152 x 576, as the model runs it): bytes = the
        // packed weight bytes + x + out; 49152 x 576 is the shape of SmolLM2's output head
        if (!want_shape(n, h)) continue;
        const int64_t row_bytes = h / 32 * bb, es = int64_t(ks::dtype_size(xdt));
        const size_t bytes = size_t(n * row_bytes + es * h + es * n);
        const int k = nsets(bytes);
        std::vector<std::unique_ptr<Dev>> x, w, o;
        for (int i = 0; i < k; ++i) {
          x.emplace_back(new Dev(es * h)); w.emplace_back(new Dev(n * row_bytes)); o.emplace_back(new Dev(es * n));
          fill_random(x.back()->p, h, xdt, rng);
          fill_packed(w.back()->p, qt, n, h, bb);
        }
        const auto call = [&](int i, cudaStream_t st) {
          ks::quant_matmul(dv(o[i]->p, xdt, {1, n}), dv(x[i]->p, xdt, {1, h}), dv(w[i]->p, DType::U8, {n, row_bytes}), qt,
                           ks::Backend::Cuda, st);
        };
        const std::string shape = std::to_string(n) + "x" + std::to_string(h);
        if (has(ops, "quant_matmul")) {
          const std::string op = std::string("quant_gemv_") + qname;
          record(op, shape, xdt, graph_time(k, call, s), bytes, "quant_matmul");
          also_variants("quant_matmul", op, shape, xdt, bytes, k, call);
        }
        const bool dense = qt == ks::QType::BF16 || qt == ks::QType::F16 || qt == ks::QType::F32;
        if (has(ops, "quant_matmul_a8") && !dense) {  // the same matrices, x quantized to int8 per block
          const auto a8 = [&](int i, cudaStream_t st) {
            ks::quant_matmul_a8(dv(o[i]->p, xdt, {1, n}), dv(x[i]->p, xdt, {1, h}), dv(w[i]->p, DType::U8, {n, row_bytes}),
                                qt, ks::Backend::Cuda, st);
          };
          const std::string op = std::string("quant_gemv_a8_") + qname;
          const double us = graph_time(k, a8, s);
          ks_bench::report_qmm_timeline(shape + " " + op + " " + ks::dtype_name(xdt), us);
          record(op, shape, xdt, us, bytes, "quant_matmul_a8");
          also_variants("quant_matmul_a8", op, shape, xdt, bytes, k, a8);
        }
      }
  // Batched quant_matmul (M rows of fp32 x, as the model's batched decode and prefill run it; opt-in:
  // --ops quant_matmul_rows): SmolLM2's matrices (q / o 576 x 576, gate|up 3072 x 576, down 576 x 1536,
  // the Q8_0 head 49152 x 576) at M = 2, 4, 8, 16, 32, 64 and 512, the automatic choice and every variant
  // (--variants), next to the FP32 dense path the model took from 16 rows until 2026-12-01 (impl
  // "dense_fp32_gemm": ks::gemm on a dequantized copy, cuBLASLt). bytes = the packed weights + x + out.
  if (has(ops, "quant_matmul_rows")) {
    const DType f32 = DType::F32;
    for (auto [qt, qname, bb, n, h] : std::vector<std::tuple<ks::QType, const char*, int64_t, int64_t, int64_t>>{
             {ks::QType::Q4_1, "q4_1", 20, 576, 576}, {ks::QType::Q4_1, "q4_1", 20, 3072, 576},
             {ks::QType::Q4_1, "q4_1", 20, 576, 1536}, {ks::QType::Q8_0, "q8_0", 34, 49152, 576}})
      for (int64_t m : {2, 4, 8, 16, 32, 64, 512}) {
        // --shapes: the matrix ("3072x576": every M) or one row count of it ("M32 3072x576")
        const std::string mshape = "M" + std::to_string(m) + " " + std::to_string(n) + "x" + std::to_string(h);
        if (!want_shape(n, h) && !has(shapes, mshape)) continue;
        const int64_t row_bytes = h / 32 * bb;
        const size_t bytes = size_t(n * row_bytes + 4 * m * h + 4 * m * n);
        const int k = nsets(bytes);
        std::vector<std::unique_ptr<Dev>> x, w, o, dense;
        for (int i = 0; i < k; ++i) {
          x.emplace_back(new Dev(4 * m * h)); w.emplace_back(new Dev(n * row_bytes)); o.emplace_back(new Dev(4 * m * n));
          dense.emplace_back(new Dev(4 * n * h));
          fill_random(x.back()->p, m * h, f32, rng);
          fill_packed(w.back()->p, qt, n, h, bb);
          ks::dequantize(dv(dense.back()->p, f32, {n, h}), dv(w.back()->p, DType::U8, {n, row_bytes}), qt, ks::Backend::Cuda, s);
        }
        CK(cudaStreamSynchronize(s));
        const std::string op = std::string("quant_matmul_rows_") + qname,
                          shape = "M" + std::to_string(m) + " " + std::to_string(n) + "x" + std::to_string(h);
        const auto call = [&](int i, cudaStream_t st) {
          ks::quant_matmul(dv(o[i]->p, f32, {m, n}), dv(x[i]->p, f32, {m, h}), dv(w[i]->p, DType::U8, {n, row_bytes}), qt,
                           ks::Backend::Cuda, st);
        };
        record(op, shape, f32, graph_time(k, call, s), bytes, "quant_matmul");
        also_variants("quant_matmul", op, shape, f32, bytes, k, call);
        const auto gemm = [&](int i, cudaStream_t st) {
          ks::gemm(dv(o[i]->p, f32, {m, n}), dv(x[i]->p, f32, {m, h}), dv(dense[i]->p, f32, {n, h}), ks::Backend::Cuda, st);
        };
        record(op, shape, f32, graph_time(k, gemm, s), bytes, "gemm");
        rows.back().impl = "dense_fp32_gemm";
        if (n == 576 && h == 1536) {  // the down projection with SiLU: one kernel against the model's two calls
          std::vector<std::unique_ptr<Dev>> gu, act;
          for (int i = 0; i < k; ++i) {
            gu.emplace_back(new Dev(4 * m * 2 * h));
            act.emplace_back(new Dev(4 * m * h));
            fill_random(gu.back()->p, m * 2 * h, f32, rng);
          }
          const std::string sop = std::string("silu_down_rows_") + qname;
          const size_t sbytes = bytes + size_t(4 * m * h);  // (gate_up is twice x)
          const auto two = [&](int i, cudaStream_t st) {
            ks::silu_and_mul(dv(act[i]->p, f32, {m, h}), dv(gu[i]->p, f32, {m, 2 * h}), ks::Backend::Cuda, st);
            ks::quant_matmul(dv(o[i]->p, f32, {m, n}), dv(act[i]->p, f32, {m, h}),
                             dv(w[i]->p, DType::U8, {n, row_bytes}), qt, ks::Backend::Cuda, st);
          };
          record(sop, shape, f32, graph_time(k, two, s), sbytes, "quant_matmul");
          rows.back().impl = "silu_and_mul+quant_matmul";
          if (ks_force_variant("silu_and_mul_quant_matmul", "cuda_mma_rows") == KS_SUCCESS) {
            const auto one = [&](int i, cudaStream_t st) {
              ks::silu_and_mul_quant_matmul(dv(o[i]->p, f32, {m, n}), dv(gu[i]->p, f32, {m, 2 * h}),
                                            dv(w[i]->p, DType::U8, {n, row_bytes}), qt, ks::Backend::Cuda, st);
            };
            try {
              record(sop, shape, f32, graph_time(k, one, s), sbytes, "silu_and_mul_quant_matmul");
              rows.back().impl = "fused:cuda_mma_rows";
            } catch (const std::exception& e) {  // (declined: no row; the pin is cleared below)
              std::fprintf(stderr, "silu_and_mul_quant_matmul / cuda_mma_rows at %s: %s\n", shape.c_str(), e.what());
            }
            ks_force_variant("silu_and_mul_quant_matmul", nullptr);
          }
        }
      }
  }
  // The model's decode fusions (SmolLM2-135M, one token, FP32 activations, Q4_1 weights): each
  // fused call next to the sequence it replaces, both as graph replays (impl "fused" / "unfused").
  if (has(ops, "decode_fusions")) {
    const DType f32 = DType::F32;
    const int64_t H = 576, QKV = 960, I = 1536, KVH = 3, D = 64, NH = 9;
    auto packed = [&](int64_t n, int64_t k) {  // Q4_1 rows with small finite scales
      const int64_t rb = k / 32 * 20;
      std::vector<uint8_t> host(size_t(n * rb));
      for (auto& c : host) c = uint8_t(rng());
      for (int64_t b = 0; b < n * k / 32; ++b) host[size_t(b * 20 + 1)] &= 0x1f, host[size_t(b * 20 + 3)] &= 0x1f;
      auto d = std::make_unique<Dev>(host.size());
      CK(cudaMemcpy(d->p, host.data(), host.size(), cudaMemcpyHostToDevice));
      return d;
    };
    auto buf = [&](int64_t n) {
      auto d = std::make_unique<Dev>(size_t(n) * 4);
      fill_random(d->p, size_t(n), f32, rng);
      return d;
    };
    const auto wqkv = packed(QKV, H), wgu = packed(2 * I, H), wd = packed(H, I);
    const auto x = buf(H), r = buf(H), r2 = buf(H), nw = buf(H), qkv = buf(QKV), gu = buf(2 * I), act = buf(I),
               out = buf(2 * I), kc = buf(64 * 16 * KVH * D), vc = buf(64 * 16 * KVH * D);
    auto pos = std::make_unique<Dev>(4), slot = std::make_unique<Dev>(8);
    const int32_t p0 = 100;
    const int64_t s0 = 100;
    CK(cudaMemcpy(pos->p, &p0, 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(slot->p, &s0, 8, cudaMemcpyHostToDevice));
    const ks::QType q = ks::QType::Q4_1;
    auto time_pair = [&](const std::string& name, const std::function<void(cudaStream_t)>& fused,
                         const std::function<void(cudaStream_t)>& unfused, size_t bytes) {
      for (int which = 0; which < 2; ++which) {
        const double us = graph_time(1, [&](int, cudaStream_t st) { (which ? unfused : fused)(st); }, s);
        record(name, "smollm2_b1", f32, us, bytes, nullptr);
        rows.back().impl = which ? "unfused" : "fused";
      }
    };
    const auto qkv3 = [&](int64_t col, int64_t heads) {
      return dv(static_cast<float*>(qkv->p) + col, f32, {1, heads, D});
    };
    // the model's two fused calls before attention (each also timed against what it replaces)
    const std::vector<int64_t> cache = {64, 16, KVH, D};
    const auto norm_qkv = [&](cudaStream_t st) {
      ks::fused_add_rms_norm_quant_matmul(dv(qkv->p, f32, {1, QKV}), dv(r2->p, f32, {1, H}), dv(x->p, f32, {1, H}),
                                          dv(r->p, f32, {1, H}), dv(nw->p, f32, {H}), 1e-5, dv(wqkv->p, DType::U8, {QKV, H / 32 * 20}),
                                          q, ks::Backend::Cuda, st);
    };
    const auto rope_kv_append = [&](cudaStream_t st) {
      ks::rotary_embedding_kv_append(qkv3(0, NH), qkv3(NH * D, KVH), qkv3((NH + KVH) * D, KVH), dv(pos->p, DType::I32, {1}),
                                     D, 10000.0, false, dv(kc->p, f32, cache), dv(vc->p, f32, cache),
                                     dv(slot->p, DType::I64, {1}), ks::Backend::Cuda, st);
    };
    time_pair("norm_qkv", norm_qkv, [&](cudaStream_t st) {
      ks::fused_add_rms_norm(dv(x->p, f32, {1, H}), dv(r->p, f32, {1, H}), dv(nw->p, f32, {H}), 1e-5, ks::Backend::Cuda, st);
      ks::quant_matmul(dv(qkv->p, f32, {1, QKV}), dv(x->p, f32, {1, H}), dv(wqkv->p, DType::U8, {QKV, H / 32 * 20}), q,
                       ks::Backend::Cuda, st);
    }, size_t(QKV * H / 32 * 20));
    time_pair("norm_gate_up", [&](cudaStream_t st) {
      ks::fused_add_rms_norm_quant_matmul(dv(gu->p, f32, {1, 2 * I}), dv(r2->p, f32, {1, H}), dv(x->p, f32, {1, H}),
                                          dv(r->p, f32, {1, H}), dv(nw->p, f32, {H}), 1e-5, dv(wgu->p, DType::U8, {2 * I, H / 32 * 20}),
                                          q, ks::Backend::Cuda, st);
    }, [&](cudaStream_t st) {
      ks::fused_add_rms_norm(dv(x->p, f32, {1, H}), dv(r->p, f32, {1, H}), dv(nw->p, f32, {H}), 1e-5, ks::Backend::Cuda, st);
      ks::quant_matmul(dv(gu->p, f32, {1, 2 * I}), dv(x->p, f32, {1, H}), dv(wgu->p, DType::U8, {2 * I, H / 32 * 20}), q,
                       ks::Backend::Cuda, st);
    }, size_t(2 * I * H / 32 * 20));
    time_pair("silu_down", [&](cudaStream_t st) {
      ks::silu_and_mul_quant_matmul(dv(out->p, f32, {1, H}), dv(gu->p, f32, {1, 2 * I}), dv(wd->p, DType::U8, {H, I / 32 * 20}),
                                    q, ks::Backend::Cuda, st);
    }, [&](cudaStream_t st) {
      ks::silu_and_mul(dv(act->p, f32, {1, I}), dv(gu->p, f32, {1, 2 * I}), ks::Backend::Cuda, st);
      ks::quant_matmul(dv(out->p, f32, {1, H}), dv(act->p, f32, {1, I}), dv(wd->p, DType::U8, {H, I / 32 * 20}), q,
                       ks::Backend::Cuda, st);
    }, size_t(H * I / 32 * 20));
    time_pair("rope_kv_append", rope_kv_append, [&](cudaStream_t st) {
      ks::rotary_embedding(qkv3(0, NH), qkv3(NH * D, KVH), dv(pos->p, DType::I32, {1}), D, 10000.0, false,
                           ks::Backend::Cuda, st);
      ks::kv_cache_append(dv(kc->p, f32, cache), dv(vc->p, f32, cache), qkv3(NH * D, KVH), qkv3((NH + KVH) * D, KVH),
                          dv(slot->p, DType::I64, {1}), ks::Backend::Cuda, st);
    }, size_t(QKV * 4 * 2));
    // the final norm + output head (Q8_0, 49152 x 576, tied to the embedding): the fused call
    // against the norm and quant_matmul's own routing (the model's KS_MODEL_SPLIT_HEAD=1); three
    // copies of the 28 MB head rotate past L2
    {
      const int64_t V = 49152, rb8 = H / 32 * 34;
      std::vector<uint8_t> host(size_t(V * rb8));
      std::vector<std::unique_ptr<Dev>> heads;
      for (int i = 0; i < 3; ++i) {
        for (auto& c : host) c = uint8_t(rng());
        for (int64_t b = 0; b < V * H / 32; ++b) host[size_t(b * 34 + 1)] &= 0x1f;  // small finite scales
        heads.emplace_back(new Dev(host.size()));
        CK(cudaMemcpy(heads.back()->p, host.data(), host.size(), cudaMemcpyHostToDevice));
      }
      Dev logits(size_t(V) * 4);
      for (int which = 0; which < 2; ++which) {
        const double us = graph_time(3, [&](int i, cudaStream_t st) {
          const auto wv = dv(heads[size_t(i)]->p, DType::U8, {V, rb8});
          if (which == 0) {
            ks::fused_add_rms_norm_quant_matmul(dv(logits.p, f32, {1, V}), dv(r2->p, f32, {1, H}), dv(x->p, f32, {1, H}),
                                                dv(r->p, f32, {1, H}), dv(nw->p, f32, {H}), 1e-5, wv, ks::QType::Q8_0,
                                                ks::Backend::Cuda, st);
          } else {
            ks::fused_add_rms_norm(dv(x->p, f32, {1, H}), dv(r->p, f32, {1, H}), dv(nw->p, f32, {H}), 1e-5,
                                   ks::Backend::Cuda, st);
            ks::quant_matmul(dv(logits.p, f32, {1, V}), dv(x->p, f32, {1, H}), wv, ks::QType::Q8_0, ks::Backend::Cuda, st);
          }
        }, s);
        record("norm_head", "smollm2_b1", f32, us, host.size(), nullptr);
        rows.back().impl = which ? "unfused" : "fused";
      }
    }
    // the norm + q/k/v matmul + RoPE + append in one kernel, against the two fused calls
    time_pair("norm_qkv_rope_append", [&](cudaStream_t st) {
      ks::fused_add_rms_norm_quant_matmul_rope_kv_append(
          dv(qkv->p, f32, {1, QKV}), dv(r2->p, f32, {1, H}), dv(x->p, f32, {1, H}), dv(r->p, f32, {1, H}),
          dv(nw->p, f32, {H}), 1e-5, dv(wqkv->p, DType::U8, {QKV, H / 32 * 20}), q, NH, KVH, dv(pos->p, DType::I32, {1}),
          D, 10000.0, false, dv(kc->p, f32, cache), dv(vc->p, f32, cache), dv(slot->p, DType::I64, {1}),
          ks::Backend::Cuda, st);
    }, [&](cudaStream_t st) {
      norm_qkv(st);
      rope_kv_append(st);
    }, size_t(QKV * H / 32 * 20));
    // RoPE + append + decode attention in one kernel (rotary_embedding_kv_append_paged_attention,
    // the model's KS_MODEL_FUSE_ATTN=1) against the two calls, for one token with `len` live keys
    // in a table of `blocks` blocks of 16 (2048 tokens: generate's default, clusters of 16; 656:
    // bench-model's); identity block table, the token at position len - 1 and its own slot
    for (const auto& [blocks, len] : std::vector<std::pair<int64_t, int32_t>>{{128, 192}, {128, 576}, {41, 576}}) {
      const std::vector<int64_t> cs = {blocks, 16, KVH, D};
      const auto akc = buf(blocks * 16 * KVH * D), avc = buf(blocks * 16 * KVH * D), attn = buf(NH * D);
      std::vector<int32_t> table(static_cast<size_t>(blocks));
      for (int64_t i = 0; i < blocks; ++i) table[size_t(i)] = int32_t(i);
      Dev bt(table.size() * 4), cl(4), apos(4), aslot(8);
      const int32_t p = len - 1;
      const int64_t sl = len - 1;
      CK(cudaMemcpy(bt.p, table.data(), table.size() * 4, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(cl.p, &len, 4, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(apos.p, &p, 4, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(aslot.p, &sl, 8, cudaMemcpyHostToDevice));
      const float scale = 0.125f;
      const auto btv = dv(bt.p, DType::I32, {1, blocks}), clv = dv(cl.p, DType::I32, {1});
      const std::string shape = "smollm2_b1_keys" + std::to_string(len) + "_of" + std::to_string(blocks * 16);
      for (int which = 0; which < 2; ++which) {
        const double us = graph_time(1, [&](int, cudaStream_t st) {
          if (which == 0) {
            ks::rotary_embedding_kv_append_paged_attention(
                dv(attn->p, f32, {1, NH, D}), qkv3(0, NH), qkv3(NH * D, KVH), qkv3((NH + KVH) * D, KVH),
                dv(apos.p, DType::I32, {1}), D, 10000.0, false, dv(akc->p, f32, cs), dv(avc->p, f32, cs),
                dv(aslot.p, DType::I64, {1}), btv, ks::TensorView(), clv, scale, ks::Backend::Cuda, st);
          } else {
            ks::rotary_embedding_kv_append(qkv3(0, NH), qkv3(NH * D, KVH), qkv3((NH + KVH) * D, KVH),
                                           dv(apos.p, DType::I32, {1}), D, 10000.0, false, dv(akc->p, f32, cs),
                                           dv(avc->p, f32, cs), dv(aslot.p, DType::I64, {1}), ks::Backend::Cuda, st);
            ks::paged_attention(dv(attn->p, f32, {1, NH, D}), qkv3(0, NH), dv(akc->p, f32, cs), dv(avc->p, f32, cs), btv,
                                ks::TensorView(), clv, scale, ks::Backend::Cuda, st);
          }
        }, s);
        record("rope_append_attention", shape, f32, us, size_t(len) * KVH * D * 4 * 2, nullptr);
        rows.back().impl = which ? "unfused" : "fused";
      }
    }
  }
  FILE* f = std::fopen(csv.c_str(), "w");
  if (!f) return 1;
  const char* commit = std::getenv("KS_COMMIT");  // else the commit bench_ops was built from
#ifdef KS_HAVE_BUILD_COMMIT
  if (!commit || !*commit) commit = KS_BUILD_COMMIT;
#endif
  const std::string drv_s = driver_version(drv);
  std::fprintf(f, "gpu,driver,cuda,commit,op,shape,dtype,impl,config,us,gbs,pct_copy,copy_gbs\n");
  for (const auto& r : rows)
    std::fprintf(f, "%s,%s,%d,%s,%s,%s,%s,%s,\"%s\",%.3f,%.1f,%.1f,%.1f\n", prop.name, drv_s.c_str(), rt, commit ? commit : "unknown",
                 r.op.c_str(), r.shape.c_str(), r.dtype.c_str(), r.impl.empty() ? impl.c_str() : r.impl.c_str(),
                 r.config.c_str(), r.us, r.gbs, 100 * r.gbs / copy_gbs, copy_gbs);
  std::fclose(f);
  CK(cudaStreamDestroy(s));
  return 0;
}
