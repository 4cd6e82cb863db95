#!/usr/bin/env bash
# One GPU call for the seventeenth session's first questions: build for sm_90a and run every CUDA
# test, then time the fused RoPE + append + attention kernel against the two calls it replaces.
# rotary_embedding_kv_append_paged_attention (KS_MODEL_FUSE_ATTN=1 in the model) measured 2-4 us
# per layer slower than rotary_embedding_kv_append + paged_attention at batch 1 (3c95e82, with and
# without PDL); bdfdd28 issues the first step's K/V copies before the rotation and has not run.
#  1. every CUDA test (KS_FOLLOWUP_FILTER narrows them), then the quant_matmul tests again with
#     KS_QMM_BULK_THREAD_ROWS=1 (their summary line was lost at 06b604a), output kept in
#     $OUT/thread_rows_tests.txt;
#  2. bench_ops decode_fusions (fp32): rope_append_attention fused / unfused at 192 and 576 live
#     keys of a 2048-token table and 576 of 656, with the other decode fusions -> $OUT/followup.csv;
#  3. Nsight Compute on both attention kernels (their first launch: 192 of 2048 keys) -> $OUT/ncu_attn.txt.
# It also copies .mdl/part_aa to /tmp when carried, so a model call (scripts/gpu_model_check.sh,
# KS_MODEL_AB_ONLY=fuse_attn,fuse_attn_batch) can follow warm.
# Usage (device): KS_COMMIT=sha scripts/gpu_followup.sh   (carry .dlpack, .deps[, .mdl/part_aa])
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh  # strict mode, $OUT (created), $BUILD and the helpers
[ -f .mdl/part_aa ] && cp .mdl/part_aa /tmp/ks_part_aa
# (every CUDA test takes about 150 s after the build)
ks_gpu_build_and_test "${KS_FOLLOWUP_FILTER:-*}" 'FP64' || { echo "gpu_followup: the build failed (see $OUT/logs.txt)"; exit 1; }
KS_QMM_BULK_THREAD_ROWS=1 $BUILD/tests/test_cuda_ops --gtest_filter='*QuantMatmul*' > "$OUT/thread_rows_tests.txt" 2>&1
echo "quant_matmul tests at KS_QMM_BULK_THREAD_ROWS=1: $(grep -E '^\[  (PASSED|FAILED)' "$OUT/thread_rows_tests.txt" | tr '\n' ' ')"
$BUILD/bench_ops --csv "$OUT/followup.csv" --ops decode_fusions --dtypes fp32 2>&1 | grep -E "rope_append_attention|norm_head" | cut -c1-120
: > "$OUT/ncu_attn.txt"
for kern in paged_attention_gqa_rope_kernel paged_attention_gqa_kernel; do
  echo "== $kern (SmolLM2, fp32, 192 of 2048 keys)" | tee -a "$OUT/ncu_attn.txt"
  KS_NCU_APPEND=1 KS_NCU_SECTIONS="LaunchStats Occupancy WarpStateStats" ks_ncu_bench $kern "$OUT/ncu_attn.txt" \
    --ops decode_fusions --dtypes fp32
done
