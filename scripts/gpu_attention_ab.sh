#!/usr/bin/env bash
# One GPU call: build, the attention GPU tests, then decode attention's benchmark as built
# ($OUT/attn.csv: the anchor shapes and the model's FP32 shapes) and, at the model's shapes
# only (KS_BENCH_ATTN=model), under KS_ATTN_LIVE_SPLIT=0 and KS_ATTN_MIN_KEYS=128/256/512
# ($OUT/attn_variants.csv). docs/perf/h200_attention_live_split_a672f15.csv is the two joined.
# Usage (device): scripts/gpu_attention_ab.sh COMMIT   (carry .dlpack and .deps)
# It also saves .mdl/part_aa to /tmp when carried, for a gpu_model_check.sh call after it.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
export KS_COMMIT=${1:-unknown}
# build, the attention GPU tests and the attention benchmark as built (and part_aa saved)
KS_GTEST_FILTER='*CudaAttention*:Cuda.Graph*' KS_MEMCHECK_FILTER=none KS_BENCH_OPS=paged_attention \
  OUT="$OUT" scripts/gpu_quick_check.sh > /tmp/attn_ab.txt 2>&1
grep -E "FAILED|PASSED" /tmp/attn_ab.txt
mv "$OUT/bench_quick.csv" "$OUT/attn.csv"
BUILD=${KS_GPU_BUILD:-build-gpu}
export KS_BENCH_ATTN=model
KS_ATTN_LIVE_SPLIT=0 $BUILD/bench_ops --ops paged_attention --impl no_live_split --csv /tmp/attn_n0.csv >> /tmp/attn_ab.txt 2>&1
for n in 128 256 512; do
  KS_ATTN_MIN_KEYS=$n $BUILD/bench_ops --ops paged_attention --impl min_keys_$n --csv /tmp/attn_n$n.csv >> /tmp/attn_ab.txt 2>&1
done
{ cat /tmp/attn_n0.csv; for n in 128 256 512; do tail -n +2 /tmp/attn_n$n.csv; done; } > "$OUT/attn_variants.csv"
python3 - "$OUT/attn.csv" "$OUT/attn_variants.csv" <<'PY'
import csv, sys
for f in sys.argv[1:]:
    for r in csv.DictReader(open(f)):
        print(r['shape'], r['dtype'], r['impl'], r['us'], r['config'][:60])
PY
