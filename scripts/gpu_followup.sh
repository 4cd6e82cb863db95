#!/usr/bin/env bash
# One GPU call for what the fourteenth session could not run (its device time was spent): build
# for sm_90a and run every CUDA test (b16298f's rotary_embedding_kv_append with its loads issued
# first; the argmax cluster rule argmax_cluster, whose tests also run with every call forced to
# clusters of 16, 4 and 1; cuda_gqa_cluster's pushed cluster merge, whose tests also run with
# KS_ATTN_PUSH_MERGE=0), then bench_ops: argmax and sampling (bf16, every variant), the decode
# fusions (fp32: rope_kv_append against the two calls it replaces) and decode attention at
# SmolLM2's shapes with and without the pushed merge -> $OUT/followup.csv. It also
# copies .mdl/part_aa to /tmp when carried, so a model call (scripts/gpu_model_check.sh) can follow
# warm (the rope change runs once per layer of the model's decode step).
# Usage (device): KS_COMMIT=sha scripts/gpu_followup.sh   (carry .dlpack, .deps[, .mdl/part_aa]);
# KS_FOLLOWUP_FILTER=gtest-filter runs fewer tests, e.g. '*Argmax*:*Sample*:*Rotary*:*Rope*'.
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh  # strict mode, $OUT (created), $BUILD and the helpers
[ -f .mdl/part_aa ] && cp .mdl/part_aa /tmp/ks_part_aa
# (every CUDA test takes about 150 s after the build; KS_FOLLOWUP_FILTER narrows them to fit one call)
ks_gpu_build_and_test "${KS_FOLLOWUP_FILTER:-*}" 'FP64' || { echo "gpu_followup: the build failed (see $OUT/logs.txt)"; exit 1; }
for c in 16 4 1; do
  echo "argmax tests at KS_ARGMAX_CLUSTER=$c:"
  KS_ARGMAX_CLUSTER=$c $BUILD/tests/test_cuda_ops --gtest_filter='*Argmax*' --gtest_brief=1 2>&1 | grep -E "PASSED|FAILED|Failure" | head -5
done
echo "attention tests at KS_ATTN_PUSH_MERGE=0:"
KS_ATTN_PUSH_MERGE=0 $BUILD/tests/test_cuda_ops --gtest_filter='*CudaAttention*' --gtest_brief=1 2>&1 |
  grep -E "PASSED|FAILED|Failure" | head -5
$BUILD/bench_ops --csv "$OUT/followup.csv" --variants --ops argmax,sample,decode_fusions --dtypes bf16,fp32 \
  2>&1 | grep -E "^(argmax|sampling)|rope_kv_append|norm_qkv|silu_down" | cut -c1-150
# decode attention at SmolLM2's shapes (fp32), the pushed cluster merge against the two-barrier one
KS_BENCH_ATTN=model $BUILD/bench_ops --csv /tmp/attn_model.csv --ops paged_attention --dtypes fp32 > /dev/null 2>&1
tail -n +2 /tmp/attn_model.csv >> "$OUT/followup.csv"
export KS_BENCH_ATTN=model
ks_bench_tagged KS_ATTN_PUSH_MERGE=0 kernscope "$OUT/followup.csv" --ops paged_attention --dtypes fp32
unset KS_BENCH_ATTN
grep -E "decode_attention" "$OUT/followup.csv" | cut -d, -f6,8,10
