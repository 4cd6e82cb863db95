#!/usr/bin/env bash
# A short GPU call for one change: build, the GPU tests matching KS_GTEST_FILTER (default: the
# decode fusions, quant_matmul and decode attention), memcheck of KS_MEMCHECK_FILTER, then
# `bench_ops --ops KS_BENCH_OPS` (default decode_fusions) -> $OUT/bench_quick.csv (either `none`:
# skipped).
# Saves .mdl/part_aa to /tmp when carried, for a gpu_model_check.sh call after it.
# Usage (device): KS_COMMIT=sha scripts/gpu_quick_check.sh   (carry .dlpack and .deps)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
[ -f .mdl/part_aa ] && cp .mdl/part_aa /tmp/ks_part_aa
F=${KS_GTEST_FILTER:-'Cuda.FusedNorm*:Cuda.RotaryKvAppend*:Cuda.WeightStaging*:Cuda.QuantMatmul*:*CudaAttention*'}
KS_CPU_SUITES=0 KS_CHECK_SWEEP=0 KS_GTEST_FILTER="$F" KS_STAGES=build,test scripts/gpu_check.sh 2>&1 |
  grep -E "FAILED|PASSED|Failure|error" | head -30
BUILD=${KS_GPU_BUILD:-build-gpu}
M=${KS_MEMCHECK_FILTER:-'Cuda.FusedNormQkv*'}
if [ "$M" != none ]; then
  compute-sanitizer --tool memcheck --error-exitcode 9 $BUILD/tests/test_cuda_ops --gtest_filter="$M" --gtest_brief=1 \
    > /tmp/memcheck.txt 2>&1; echo "memcheck ($M) rc=$?"; grep -E "ERROR SUMMARY" /tmp/memcheck.txt
fi
B=${KS_BENCH_OPS:-decode_fusions}
[ "$B" != none ] && $BUILD/bench_ops --ops $B --csv "$OUT/bench_quick.csv" 2>&1 | tail -20
