#!/usr/bin/env bash
# One GPU call for what the fourteenth session could not run (its device time was spent): build
# for sm_90a and run every CUDA test (b16298f's rotary_embedding_kv_append with its loads issued
# first; the argmax cluster rule argmax_cluster, whose tests also run with every call forced to
# clusters of 16, 4 and 1), then bench_ops: argmax and sampling (bf16, every variant) and the decode
# fusions (fp32: rope_kv_append against the two calls it replaces) -> $OUT/followup.csv. It also
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
$BUILD/bench_ops --csv "$OUT/followup.csv" --variants --ops argmax,sample,decode_fusions --dtypes bf16,fp32 \
  2>&1 | grep -E "^(argmax|sampling)|rope_kv_append|norm_qkv|silu_down" | cut -c1-150
