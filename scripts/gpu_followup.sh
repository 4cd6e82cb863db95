#!/usr/bin/env bash
# One GPU call for the sixteenth session's first questions: build for sm_90a and run every CUDA
# test, then ask where the SmolLM2 output head's time goes. The head (Q8_0, 49152 x 576, fp32 x)
# is the largest kernel of a decode step: 28.2 us fused with the final norm and 24.3 us as norm +
# cuda_bulk_stream at b24c014 (bench_ops decode_fusions: 1.07-1.24 TB/s, a quarter of the copy
# rate), and cuda_bulk_stream takes about the same time at 49152 x 576 as at 14336 x 4096 (22 us
# for Q8_0 at both, 18 us for Q4_1 at both: f299a95), though the second has twice the bytes.
#  1. every CUDA test (KS_FOLLOWUP_FILTER narrows them);
#  2. bench_ops quant_matmul --variants at those two shapes (bf16 and fp32 x) and decode_fusions
#     (fp32: the fused and split head) -> $OUT/followup.csv;
#  3. Nsight Compute on quant_gemv_bulk_kernel at both shapes (speed of light, memory, warp
#     stalls, instruction mix) -> $OUT/ncu_head.txt;
#  and the same for KS_QMM_BULK_THREAD_ROWS=1 (rows of < 32 blocks a thread per row instead of
#  warp groups; the same bits): the quant_matmul tests again, tagged benchmark rows, one profile.
# It also copies .mdl/part_aa to /tmp when carried, so a model call (scripts/gpu_model_check.sh)
# can follow warm.
# Usage (device): KS_COMMIT=sha scripts/gpu_followup.sh   (carry .dlpack, .deps[, .mdl/part_aa])
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh  # strict mode, $OUT (created), $BUILD and the helpers
[ -f .mdl/part_aa ] && cp .mdl/part_aa /tmp/ks_part_aa
# (every CUDA test takes about 150 s after the build)
ks_gpu_build_and_test "${KS_FOLLOWUP_FILTER:-*}" 'FP64' || { echo "gpu_followup: the build failed (see $OUT/logs.txt)"; exit 1; }
echo "quant_matmul stream tests at KS_QMM_BULK_THREAD_ROWS=1:"
KS_QMM_BULK_THREAD_ROWS=1 $BUILD/tests/test_cuda_ops --gtest_filter='*QuantMatmul*' --gtest_brief=1 2>&1 |
  grep -E "PASSED|FAILED|Failure" | head -5
$BUILD/bench_ops --csv "$OUT/followup.csv" --variants --ops quant_matmul --dtypes bf16,fp32 \
  --shapes 49152x576,14336x4096 2>&1 | grep -E "^quant_gemv" | cut -c1-160
# cuda_bulk_stream with a thread per row for rows of < 32 blocks (the same bits), tagged rows
ks_bench_tagged KS_QMM_BULK_THREAD_ROWS=1 variant:cuda_bulk_stream "$OUT/followup.csv" --variants --ops quant_matmul \
  --dtypes bf16,fp32 --shapes 49152x576
grep -F "KS_QMM_BULK_THREAD_ROWS" "$OUT/followup.csv" | cut -d, -f5-10
$BUILD/bench_ops --csv /tmp/fusions.csv --ops decode_fusions --dtypes fp32 2>&1 | grep -E "norm_head" | cut -c1-120
tail -n +2 /tmp/fusions.csv >> "$OUT/followup.csv"
# (each bench_ops run launches Q4_1 first: the profiled launch is Q4_1's, which takes 18 us at both
# shapes, as Q8_0 takes 22 at both)
: > "$OUT/ncu_head.txt"
for shape in 49152x576 14336x4096; do
  for dt in fp32 bf16; do
    echo "== quant_gemv_bulk_kernel, Q4_1 $shape ($dt x, M = 1)" | tee -a "$OUT/ncu_head.txt"
    KS_NCU_APPEND=1 KS_NCU_SECTIONS="ComputeWorkloadAnalysis InstructionStats" \
      ks_ncu_bench quant_gemv_bulk_kernel "$OUT/ncu_head.txt" --ops quant_matmul --variants --dtypes $dt --shapes $shape
  done
done
echo "== quant_gemv_bulk_kernel with KS_QMM_BULK_THREAD_ROWS=1, Q4_1 49152x576 (fp32 x)" | tee -a "$OUT/ncu_head.txt"
KS_QMM_BULK_THREAD_ROWS=1 KS_NCU_APPEND=1 KS_NCU_SECTIONS="ComputeWorkloadAnalysis InstructionStats" \
  ks_ncu_bench quant_gemv_bulk_kernel "$OUT/ncu_head.txt" --ops quant_matmul --variants --dtypes fp32 --shapes 49152x576
