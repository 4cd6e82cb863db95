#!/usr/bin/env bash
# One GPU call for the session's open questions (carried binaries: KS_PREBUILT=1, or a build):
#  - every CUDA test (test_cuda_ops in 4 shards at once: ks_cuda_tests_sharded) ->
#    $OUT/cuda_tests_shard*.txt, a line per shard;
#  - the attention tests again with KS_ATTN_ONE_CTA_KEYS=0 (the small tables' clusters, which the
#    default's one CTA per unit replaced) -> $OUT/one_cta_tests.txt;
#  - the after-append attention tests with one step of early reads (KS_ATTN_PREWAIT_STEPS=1) ->
#    $OUT/prewait1_tests.txt;
#  - decode attention (bf16 anchors) as built and at 64-token blocks (KS_BENCH_ATTN_BS=64); torch
#    SDPA in the same call -> $OUT/followup.csv, $OUT/peers_attention.csv. (At cf200dc it also read
#    the caches head-major under a timing-only switch, since removed: docs/perf/h200_attention.md.)
# KS_FOLLOWUP_TESTS=0 skips the test runs, KS_FOLLOWUP_BENCH=0 the benchmark; =attn runs the attention tests only (*Attention*) ->
# $OUT/attention_tests.txt. KS_FOLLOWUP_VARIANTS=1: the anchors under every CUDA variant too
# (bench_ops --variants: cuda_mma_cluster, cuda_mma_tma, ... pinned). KS_FOLLOWUP_TAGGED=SETTING,IMPL[;SETTING,IMPL...]
# (e.g. KS_ATTN_LAST_COMBINE=0,kernscope): that impl's anchor rows again under SETTING.
# KS_FOLLOWUP_ENV_TESTS=SETTING,FILTER[;SETTING,FILTER...] (e.g. KS_ATTN_LIVE_SPLIT=0,CudaAttentionMma.Split*;
# SETTING may join several with +): those tests again under SETTING -> $OUT/env_tests.txt.
# Usage (device): KS_PREBUILT=1 KS_COMMIT=sha scripts/gpu_followup.sh   (carry build-prebuilt)
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh  # strict mode, $OUT (created), $BUILD and the helpers
ks_gpu_build_and_test 'Cuda.AttentionSmallTablesOneCtaRule' 'FP64' || { echo "gpu_followup: no bench_ops (see $OUT/logs.txt)"; exit 1; }
if [ "${KS_FOLLOWUP_TESTS:-1}" = attn ]; then
  $BUILD/tests/test_cuda_ops --gtest_filter="${KS_FOLLOWUP_FILTER:-*Attention*}" > "$OUT/attention_tests.txt" 2>&1
  echo "attention tests: $(grep -E '^\[  (PASSED|FAILED)|^\[  FAILED  \] [A-Z]' "$OUT/attention_tests.txt" | tr '\n' ' ')"
  grep -E "^cuda_mma_(tma|cluster) " "$OUT/attention_tests.txt" | cut -c1-160 | head -30
elif [ "${KS_FOLLOWUP_TESTS:-1}" = 1 ]; then
  KS_ATTN_ONE_CTA_KEYS=0 $BUILD/tests/test_cuda_ops --gtest_filter='*Attention*' > "$OUT/one_cta_tests.txt" 2>&1
  echo "attention tests at KS_ATTN_ONE_CTA_KEYS=0: $(grep -E '^\[  (PASSED|FAILED)' "$OUT/one_cta_tests.txt" | tr '\n' ' ')"
  ks_cuda_tests_sharded 4 300  # every CUDA test, 4 shards at once
  # paged_attention_after_append's early reads with one step instead of two (read once per process)
  KS_ATTN_PREWAIT_STEPS=1 $BUILD/tests/test_cuda_ops --gtest_filter='*AfterAppend*:*AfterFusedQkv*' > "$OUT/prewait1_tests.txt" 2>&1
  echo "after-append tests at KS_ATTN_PREWAIT_STEPS=1: $(grep -E '^\[  (PASSED|FAILED)' "$OUT/prewait1_tests.txt" | tr '\n' ' ')"
fi
if [ -n "${KS_FOLLOWUP_ENV_TESTS:-}" ]; then  # SETTING,FILTER[;SETTING,FILTER...]: those tests again under SETTING
  IFS=';' read -ra env_runs <<< "$KS_FOLLOWUP_ENV_TESTS"
  for run in "${env_runs[@]}"; do
    setting=${run%%,*}
    env ${setting//+/ } $BUILD/tests/test_cuda_ops --gtest_filter="${run#*,}" >> "$OUT/env_tests.txt" 2>&1
    echo "tests under $setting: $(grep -E '^\[  (PASSED|FAILED)|^\[  FAILED  \] [A-Z]' "$OUT/env_tests.txt" | tail -3 | tr '\n' ' ')"
  done
fi
[ "${KS_FOLLOWUP_BENCH:-1}" = 1 ] || exit 0  # (KS_FOLLOWUP_BENCH=0: the tests only)
shapes=${KS_FOLLOWUP_SHAPES:-}
args=(--ops paged_attention --dtypes bf16 ${shapes:+--shapes "$shapes"} ${KS_FOLLOWUP_VARIANTS:+--variants})
KS_BENCH_ATTN=anchors $BUILD/bench_ops --csv "$OUT/followup.csv" "${args[@]}" > /dev/null 2>&1
if [ -n "${KS_FOLLOWUP_TAGGED:-}" ]; then  # SETTING,IMPL[;SETTING,IMPL...]: that impl's rows again under SETTING (tagged)
  IFS=';' read -ra tagged_runs <<< "$KS_FOLLOWUP_TAGGED"
  for run in "${tagged_runs[@]}"; do
    KS_BENCH_ATTN=anchors ks_bench_tagged "${run%%,*}" "${run#*,}" "$OUT/followup.csv" "${args[@]}"
  done
fi
if [ "${KS_FOLLOWUP_BS64:-1}" = 1 ]; then  # (KS_FOLLOWUP_BS64=0: not)
  KS_BENCH_ATTN=anchors ks_bench_tagged KS_BENCH_ATTN_BS=64 kernscope "$OUT/followup.csv" "${args[@]}"
fi
PYTHONUNBUFFERED=1 python3 bench/peers_model.py --ops decode_attention --csv "$OUT/peers_attention.csv" > /dev/null 2>&1
python3 - "$OUT/followup.csv" "$OUT/peers_attention.csv" <<'PY'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
peer = {r['shape']: float(r['us']) for r in csv.DictReader(open(sys.argv[2])) if r['op'] == 'decode_attention'}
for r in rows:
    if r['op'] == 'decode_attention':
        p = peer.get(r['shape'])
        print(f"{r['shape']:26} {r['impl']:52} {float(r['us']):9.3f} us  {float(r['gbs']):7.0f} GB/s"
              + (f"  SDPA {p:8.3f} ratio {p / float(r['us']):.3f}" if p else ""))
PY
