#!/usr/bin/env bash
# One GPU call for what the thirteenth session could not run (its device time was spent):
# build for sm_90a and run every CUDA test (argmax's new scan, the sampling selection's skipped
# rounds, cuda_bulk_stream's fp32 cases against the per-warp kernel's conversion-instruction
# decode, the widened split-attention test),
# then bench_ops: argmax and sampling (bf16), every quant_matmul variant (bf16, fp32 head) and the
# decode fusions (the fp32 kernels back to 8c4582c's SASS), RoPE at 1, 2 and 4 items per thread
# (rows tagged [KS_ROPE_ITEMS_PER_THREAD=n]) and argmax at forced clusters of 1, 4 and 16 (its tests
# once at 16) -> $OUT/followup.csv. It also copies
# .mdl/part_aa to /tmp when carried, so a model call (scripts/gpu_model_check.sh) can follow warm.
# Usage (device): KS_COMMIT=sha scripts/gpu_followup.sh   (carry .dlpack, .deps[, .mdl/part_aa]);
# KS_FOLLOWUP_FILTER=gtest-filter runs fewer tests, e.g. '*Argmax*:*Sample*:*Quant*:*Attention*'.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
[ -f .mdl/part_aa ] && cp .mdl/part_aa /tmp/ks_part_aa
source scripts/gpu_env.sh
# (every CUDA test takes about 150 s after the build; KS_FOLLOWUP_FILTER narrows them to fit one call)
ks_gpu_build_and_test "${KS_FOLLOWUP_FILTER:-*}" 'FP64' || { echo "gpu_followup: the build failed (see $OUT/logs.txt)"; exit 1; }
$BUILD/bench_ops --csv "$OUT/followup.csv" --variants --ops argmax,sample,quant_matmul,decode_fusions --dtypes bf16,fp32 \
  2>&1 | grep -E "argmax|sampling|norm_head|silu_down|norm_qkv " | cut -c1-150
for n in 1 2 4; do
  ks_bench_tagged KS_ROPE_ITEMS_PER_THREAD=$n kernscope "$OUT/followup.csv" --ops rotary_embedding --dtypes bf16
done
# argmax with forced clusters of 16 (and 1, 4): its tests, then the benchmark rows tagged [KS_ARGMAX_CLUSTER=c]
KS_ARGMAX_CLUSTER=16 $BUILD/tests/test_cuda_ops --gtest_filter='*Argmax*' --gtest_brief=1 2>&1 | grep -E "PASSED|FAILED|Failure" | head -5
for c in 1 4 16; do
  ks_bench_tagged KS_ARGMAX_CLUSTER=$c kernscope "$OUT/followup.csv" --ops argmax --dtypes bf16
done
grep -E "argmax|rope_neox" "$OUT/followup.csv" | cut -d, -f5,6,8,10,12 | head -30
