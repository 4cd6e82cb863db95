#!/usr/bin/env bash
# One GPU call for this session's questions: build for sm_90a, run the CUDA tests of what changed
# and benchmark it, the changes on by default and off by a switch in the same run.
# Since the last GPU run of the CUDA tests (01d720c, 70 passed):
#  - both decode attention kernels (cuda_gqa_cluster, cuda_mma_cluster) prefetch the first
#    KS_ATTN_PREFETCH_KEYS (default 128) keys of a CTA's range into L2 before griddepcontrol.wait
#    (warm_keys_l2): the attention tests run as built and again with KS_ATTN_PREFETCH_KEYS=0
#    ($OUT/no_prefetch_tests.txt); decode attention at the anchor and the model's shapes as built,
#    tagged [KS_ATTN_PREFETCH_KEYS=0] and [KS_ATTN_CAPACITY_KEYS=64] -> $OUT/followup.csv;
#  - cuda_bulk_stream takes short rows one lane per row (2 or 4 lanes measured slower at 01d720c):
#    the quant_matmul tests as built and the stream test at KS_QMM_BULK_TPR=4 ($OUT/tpr4_tests.txt);
#    quant_matmul at 49152x576 tagged [KS_QMM_BULK_TPR=2] -> $OUT/followup.csv.
# Usage (device): KS_COMMIT=sha scripts/gpu_followup.sh   (carry .dlpack, .deps[, .mdl/part_aa])
# The model's A/B runs are scripts/gpu_model_check.sh, the next call, warm (it needs the model:
# this script copies .mdl/part_aa to /tmp when carried).
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh  # strict mode, $OUT (created), $BUILD and the helpers
[ -f .mdl/part_aa ] && cp .mdl/part_aa /tmp/ks_part_aa
filter=${KS_FOLLOWUP_FILTER:-'*Attention*:*QuantMatmul*:Cuda.Graph*:*Rotary*:*Rope*'}
ks_gpu_build_and_test "$filter" 'FP64' || { echo "gpu_followup: the build failed (see $OUT/logs.txt)"; exit 1; }
KS_ATTN_PREFETCH_KEYS=0 $BUILD/tests/test_cuda_ops --gtest_filter='*Attention*' > "$OUT/no_prefetch_tests.txt" 2>&1
echo "attention tests at KS_ATTN_PREFETCH_KEYS=0: $(grep -E '^\[  (PASSED|FAILED)' "$OUT/no_prefetch_tests.txt" | tr '\n' ' ')"
KS_QMM_BULK_TPR=4 $BUILD/tests/test_cuda_ops --gtest_filter='*QuantMatmulStream*' > "$OUT/tpr4_tests.txt" 2>&1
echo "stream-variant test at KS_QMM_BULK_TPR=4: $(grep -E '^\[  (PASSED|FAILED)' "$OUT/tpr4_tests.txt" | tr '\n' ' ')"
$BUILD/bench_ops --csv "$OUT/followup.csv" --ops paged_attention --dtypes bf16,fp32 > /dev/null 2>&1
$BUILD/bench_ops --csv /tmp/ks_qmm.csv --ops quant_matmul --dtypes bf16,fp32 --variants --shapes 49152x576 > /dev/null 2>&1
tail -n +2 /tmp/ks_qmm.csv >> "$OUT/followup.csv"
ks_bench_tagged KS_ATTN_PREFETCH_KEYS=0 kernscope "$OUT/followup.csv" --ops paged_attention --dtypes bf16,fp32
ks_bench_tagged KS_ATTN_CAPACITY_KEYS=64 kernscope "$OUT/followup.csv" --ops paged_attention --dtypes bf16,fp32
ks_bench_tagged KS_QMM_BULK_TPR=2 variant:cuda_bulk_stream "$OUT/followup.csv" --ops quant_matmul --dtypes bf16,fp32 \
  --variants --shapes 49152x576
python3 - "$OUT/followup.csv" <<'PY'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
for r in rows:
    if r['op'] == 'decode_attention' or 'bulk_stream' in r['impl']:
        print(f"{r['op']:18} {r['shape']:26} {r['dtype']:5} {r['impl']:42} {float(r['us']):9.3f}")
PY
