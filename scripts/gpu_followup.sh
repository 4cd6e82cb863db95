#!/usr/bin/env bash
# One GPU call for the next session's first questions: build for sm_90a, run every CUDA test with
# the defaults set after the last GPU call, and benchmark them against the old settings.
# Since 87eb81b (its attention and quant_matmul tests passed, the attention tests also with the L2
# warming off):
#  - decode attention (cuda_gqa_cluster) sizes clusters at a CTA per 64 keys of the table's
#    capacity (was 128) and warm_keys_l2 is off by default (KS_ATTN_PREFETCH_KEYS=0): rows tagged
#    [KS_ATTN_CAPACITY_KEYS=128] and [KS_ATTN_PREFETCH_KEYS=128] -> $OUT/followup.csv;
#  - cuda_bulk_stream's lanes per short row by format (bulk_lanes_per_row: Q4_1 1, Q4_0 / Q8_0 2):
#    the stream test as built and at KS_QMM_BULK_TPR=1 and 4 ($OUT/tpr1_tests.txt, tpr4_tests.txt); quant_matmul at
#    49152x576 tagged [KS_QMM_BULK_TPR=1] -> $OUT/followup.csv.
# Usage (device): KS_COMMIT=sha scripts/gpu_followup.sh   (carry .dlpack, .deps[, .mdl/part_aa])
# The model's A/B runs are scripts/gpu_model_check.sh, the next call, warm (it needs the model:
# this script copies .mdl/part_aa to /tmp when carried).
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh  # strict mode, $OUT (created), $BUILD and the helpers
[ -f .mdl/part_aa ] && cp .mdl/part_aa /tmp/ks_part_aa
filter=${KS_FOLLOWUP_FILTER:-'*'}
ks_gpu_build_and_test "$filter" 'FP64' || { echo "gpu_followup: the build failed (see $OUT/logs.txt)"; exit 1; }
for n in 1 4; do
  KS_QMM_BULK_TPR=$n $BUILD/tests/test_cuda_ops --gtest_filter='*QuantMatmulStream*' > "$OUT/tpr${n}_tests.txt" 2>&1
  echo "stream-variant test at KS_QMM_BULK_TPR=$n: $(grep -E '^\[  (PASSED|FAILED)' "$OUT/tpr${n}_tests.txt" | tr '\n' ' ')"
done
$BUILD/bench_ops --csv "$OUT/followup.csv" --ops paged_attention --dtypes bf16,fp32 > /dev/null 2>&1
$BUILD/bench_ops --csv /tmp/ks_qmm.csv --ops quant_matmul --dtypes bf16,fp32 --variants --shapes 49152x576 > /dev/null 2>&1
tail -n +2 /tmp/ks_qmm.csv >> "$OUT/followup.csv"
ks_bench_tagged KS_ATTN_CAPACITY_KEYS=128 kernscope "$OUT/followup.csv" --ops paged_attention --dtypes bf16,fp32
ks_bench_tagged KS_ATTN_PREFETCH_KEYS=128 kernscope "$OUT/followup.csv" --ops paged_attention --dtypes bf16,fp32
ks_bench_tagged KS_QMM_BULK_TPR=1 variant:cuda_bulk_stream "$OUT/followup.csv" --ops quant_matmul --dtypes bf16,fp32 \
  --variants --shapes 49152x576
python3 - "$OUT/followup.csv" <<'PY'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
for r in rows:
    if r['op'] == 'decode_attention' or 'bulk_stream' in r['impl']:
        print(f"{r['op']:18} {r['shape']:26} {r['dtype']:5} {r['impl']:42} {float(r['us']):9.3f}")
PY
