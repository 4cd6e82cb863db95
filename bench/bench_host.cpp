// Host-side cost of one kernscope call (Google Benchmark): validation, variant
// selection and dispatch, on tensors small enough that the arithmetic is
// negligible. The same path runs before every CUDA launch, so this is the
// library's share of the per-call overhead that Python and C callers see.
#include <benchmark/benchmark.h>
#include <kernscope/kernscope.h>

#include <vector>

namespace {

DLTensor f32(float* p, int ndim, int64_t* shape) {
  DLTensor t{};
  t.data = p;
  t.device = {kDLCPU, 0};
  t.ndim = ndim;
  t.dtype = {kDLFloat, 32, 1};
  t.shape = shape;
  return t;
}

void BM_rms_norm_1x8(benchmark::State& st) {
  std::vector<float> x(8, 1.0f), w(8, 1.0f), y(8);
  int64_t xs[2] = {1, 8}, ws[1] = {8};
  DLTensor tx = f32(x.data(), 2, xs), tw = f32(w.data(), 1, ws), ty = f32(y.data(), 2, xs);
  for (auto _ : st) benchmark::DoNotOptimize(ks_rms_norm(&ty, &tx, &tw, 1e-6, KS_BACKEND_CPU, nullptr));
}
BENCHMARK(BM_rms_norm_1x8);

void BM_rms_norm_validation_error(benchmark::State& st) {  // returns before dispatch
  std::vector<float> x(8, 1.0f), w(8, 1.0f), y(8);
  int64_t xs[2] = {1, 8}, ws[1] = {8};
  DLTensor tx = f32(x.data(), 2, xs), tw = f32(w.data(), 1, ws), ty = f32(y.data(), 2, xs);
  for (auto _ : st) benchmark::DoNotOptimize(ks_rms_norm(&ty, &tx, &tw, 0.0, KS_BACKEND_CPU, nullptr));
}
BENCHMARK(BM_rms_norm_validation_error);

void BM_quant_matmul_1x32x1(benchmark::State& st) {
  std::vector<float> x(32, 1.0f), y(1);
  std::vector<uint8_t> w(20, 0);
  int64_t xs[2] = {1, 32}, ws[2] = {1, 20}, ys[2] = {1, 1};
  DLTensor tx = f32(x.data(), 2, xs), ty = f32(y.data(), 2, ys);
  DLTensor tw{};
  tw.data = w.data();
  tw.device = {kDLCPU, 0};
  tw.ndim = 2;
  tw.dtype = {kDLUInt, 8, 1};
  tw.shape = ws;
  for (auto _ : st)
    benchmark::DoNotOptimize(ks_quant_matmul(&ty, &tx, &tw, KS_QTYPE_Q4_1, KS_BACKEND_CPU, nullptr));
}
BENCHMARK(BM_quant_matmul_1x32x1);

}  // namespace

BENCHMARK_MAIN();
