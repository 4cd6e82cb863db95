#!/usr/bin/env bash
# A short GPU call for cuda_mma_rows when little device time is left: build only test_cuda_ops and
# bench_ops for sm_90a, run the variant's tests, then bench_ops --ops quant_matmul_rows --variants
# (as scripts/gpu_rows_check.sh, whose summary it prints) -> $OUT/rows.csv.
# Usage (device): KS_COMMIT=sha scripts/gpu_rows_quick.sh   (carry .dlpack, .deps)
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
ks_gpu_build "$OUT/build.txt" test_cuda_ops bench_ops || { tail -30 "$OUT/build.txt"; exit 1; }
$BUILD/tests/test_cuda_ops --gtest_filter="${KS_ROWS_FILTER:-*MmaRows*:*RowsRouting*}" 2>&1 | tee "$OUT/tests.txt" |
  grep -E "^\[  (PASSED|FAILED)|Failure|OK \]" | head -20
export KS_DRIVER=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1)
KS_ROWS_BENCH_ONLY=1 scripts/gpu_rows_check.sh
