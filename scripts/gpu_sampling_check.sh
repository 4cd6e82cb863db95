#!/usr/bin/env bash
# Sampling and argmax in one short GPU call: build for sm_90a, the sampling and argmax GPU tests
# (bit for bit against the CPU), the sampling tests again with KS_SAMPLE_FINISH_WARP=0 (every
# row's last step by the whole CTA instead of one warp), bench_ops' sample and argmax under every
# CUDA variant (bf16) -> $OUT/sampling.csv with the default's rows under KS_SAMPLE_FINISH_WARP=0
# appended tagged, and cuda_cluster_local_topk's phase cycles (KS_SAMPLE_TRACE=1) ->
# $OUT/sample_trace.txt.
# Usage (device): KS_COMMIT=sha scripts/gpu_sampling_check.sh   (carry .dlpack and .deps)
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh  # strict mode, $OUT (created), $BUILD and the helpers
ks_gpu_build_and_test 'CudaSample.*:*Argmax*' || { echo "gpu_sampling_check: the build failed (see $OUT/logs.txt)"; exit 1; }
echo "KS_SAMPLE_FINISH_WARP=0:"
KS_SAMPLE_FINISH_WARP=0 $BUILD/tests/test_cuda_ops --gtest_filter='CudaSample.*' --gtest_brief=1 2>&1 |
  grep -E "PASSED|FAILED|Failure" | head -8
$BUILD/bench_ops --csv "$OUT/sampling.csv" --variants --ops sample,argmax --dtypes bf16 2>&1 |
  grep -E "^(sampling|argmax)" | cut -c1-150
ks_bench_tagged KS_SAMPLE_FINISH_WARP=0 kernscope "$OUT/sampling.csv" --ops sample --dtypes bf16
grep -F "[KS_SAMPLE_FINISH_WARP=0]" "$OUT/sampling.csv" | cut -d, -f6,8,10
KS_SAMPLE_TRACE=1 $BUILD/bench_ops --ops sample --dtypes bf16 --csv /tmp/sample_trace.csv 2>&1 |
  python3 bench/sample_trace_summary.py | tee "$OUT/sample_trace.txt"
