#!/usr/bin/env bash
# One GPU call for the next session's first questions: build for sm_90a and run every CUDA test.
# Since the last GPU run of the CUDA tests (5ff2190, 70 passed): quant_matmul's cuda_bulk_stream
# takes short rows a thread per row only where a stage holds >= 64 rows (bulk_thread_rows; at
# 5ff2190 the thread rows were 2x slower at 576x576 and 1536x576), with 2 or 4 lanes per row where
# a stage has fewer rows than threads (bulk_threads_per_row: SmolLM2's Q8_0 head 4, Q4_1 2; the
# same bits, by shuffles), and the stream-variant test gains 20000x576 and 49152x576 with checks of
# the launch's thread_rows and threads_per_row. The quant_matmul tests run again with
# KS_QMM_BULK_THREAD_ROWS=0 (warp groups; $OUT/warp_groups_tests.txt) and the stream-variant test
# with KS_QMM_BULK_TPR=1 ($OUT/tpr1_tests.txt); then the quant_matmul variants at the short-row
# shapes and 14336x4096, the bulk stream's rows tagged for warp groups and for one lane per row
# -> $OUT/followup.csv. The model's attention tables (headroom 2 since the last model call) are
# host code, tested by the model tests: scripts/gpu_model_check.sh, the next call, warm (it needs
# the model: this script copies .mdl/part_aa to /tmp when carried).
# Usage (device): KS_COMMIT=sha scripts/gpu_followup.sh   (carry .dlpack, .deps[, .mdl/part_aa])
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh  # strict mode, $OUT (created), $BUILD and the helpers
[ -f .mdl/part_aa ] && cp .mdl/part_aa /tmp/ks_part_aa
# (every CUDA test takes about 150 s after the build)
ks_gpu_build_and_test "${KS_FOLLOWUP_FILTER:-*}" 'FP64' || { echo "gpu_followup: the build failed (see $OUT/logs.txt)"; exit 1; }
KS_QMM_BULK_THREAD_ROWS=0 $BUILD/tests/test_cuda_ops --gtest_filter='*QuantMatmul*' > "$OUT/warp_groups_tests.txt" 2>&1
echo "quant_matmul tests at KS_QMM_BULK_THREAD_ROWS=0: $(grep -E '^\[  (PASSED|FAILED)' "$OUT/warp_groups_tests.txt" | tr '\n' ' ')"
shapes=49152x576,1536x576,576x576,14336x4096
$BUILD/bench_ops --csv "$OUT/followup.csv" --ops quant_matmul --dtypes bf16,fp32 --variants --shapes $shapes 2>&1 |
  grep -E "49152x576" | cut -c1-110
ks_bench_tagged KS_QMM_BULK_THREAD_ROWS=0 variant:cuda_bulk_stream "$OUT/followup.csv" --ops quant_matmul --dtypes bf16,fp32 \
  --variants --shapes $shapes
ks_bench_tagged KS_QMM_BULK_TPR=1 variant:cuda_bulk_stream "$OUT/followup.csv" --ops quant_matmul --dtypes bf16,fp32 \
  --variants --shapes 49152x576
KS_QMM_BULK_TPR=1 $BUILD/tests/test_cuda_ops --gtest_filter='*QuantMatmulStream*' > "$OUT/tpr1_tests.txt" 2>&1
echo "stream-variant test at KS_QMM_BULK_TPR=1: $(grep -E '^\[  (PASSED|FAILED)' "$OUT/tpr1_tests.txt" | tr '\n' ' ')"
grep -E "49152x576.*variant:cuda_bulk_stream" "$OUT/followup.csv" | cut -d, -f5-8,10 | head -20
