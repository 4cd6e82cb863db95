#!/usr/bin/env bash
# Decode attention in one short GPU call: build for sm_90a, the paged/varlen attention GPU tests,
# then the stages in KS_ATTN_STAGES (comma list; default bench,lastcomb,sanitize,ncu_gqa):
#   bench      bench_ops' decode attention under every CUDA variant (bf16 anchors and SmolLM2's
#              fp32 decode shapes) -> $OUT/attention_variants.csv
#   sanitize   memcheck and racecheck of cuda_gqa_cluster's small tests
#   ncu_gqa    Nsight Compute on cuda_gqa_cluster at SmolLM2's shape (192 of 2048 keys, fp32)
#              -> $OUT/ncu_attention_gqa.txt
#   nosplit    the automatic choice with KS_ATTN_SPLIT=0 -> $OUT/attention_nosplit.csv
#   lastcomb   the automatic choice with KS_ATTN_LAST_COMBINE=0 (the split's combine kernel instead
#              of the default, where the unit's last split CTA merges), appended to
#              attention_variants.csv as kernscope[...] rows
#   layout     the cache-layout experiment (KS_BENCH_ATTN=layout) -> $OUT/attention_layout.csv
#   peers      torch SDPA in the same call -> $OUT/peers_attention.csv, and the plot against it
#   ncu_b1     Nsight Compute on cuda_mma_cluster (and the split's combine kernel) at b1 9/3 heads of
#              64 (32K and 1K keys) and 32/8 of 128 (8K keys) -> $OUT/ncu_attention_b1.txt
#   ncu_sdpa   Nsight Compute on torch SDPA's kernels at the same shapes (bench/sdpa_probe.py) ->
#              $OUT/ncu_sdpa.txt
#   ncu_mma    Nsight Compute on cuda_mma_cluster at batch 1, 32/8 heads of 128, 32K keys (with the
#              split's combine kernel) and at batch 32, 8K keys -> $OUT/ncu_attention_mma*.txt
#   timeline   the bf16 anchors with the timeline build's library (build-timeline/, carried):
#              where each launch's time goes, per CTA -> $OUT/timeline.txt, $OUT/timeline.csv
#   anchors    the bf16 anchors only: paged_attention and paged_attention_after_append rows
#              (kernscope, kernscope_after_append) -> $OUT/attention_anchors.csv, then torch SDPA
#              in the same call -> $OUT/peers_attention.csv and the ratios
# KS_ATTN_TEST_FILTER: the GPU tests' gtest filter (default *Attention*; e.g. NONE for none).
# Usage (device): KS_COMMIT=sha scripts/gpu_attention_check.sh   (carry .dlpack and .deps)
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh  # strict mode, $OUT (created), $BUILD and the helpers
STAGES=${KS_ATTN_STAGES:-bench,lastcomb,sanitize,ncu_gqa}
has() { [[ ",$STAGES," == *",$1,"* ]]; }
[ -f .mdl/part_aa ] && cp .mdl/part_aa /tmp/ks_part_aa  # for a model call that follows warm
ks_gpu_build_and_test "${KS_ATTN_TEST_FILTER:-*Attention*}" 'FP64 value|split cuda_gqa' ||
  { echo "gpu_attention_check: the build failed (see $OUT/logs.txt)"; exit 1; }
# (KS_ATTN_RULE_PASSES=0: not these two passes)
# the attention tests again with the small-table rule off (every table of the tests' short contexts
# then takes a cluster: the default runs tables of <= 256 keys in one CTA) and at 512 keys
# (Cuda.AttentionSmallTablesOneCtaRule expects each)
for n in $([ "${KS_ATTN_RULE_PASSES:-1}" = 1 ] && echo 0 512); do
  echo "KS_ATTN_ONE_CTA_KEYS=$n:"
  KS_ATTN_ONE_CTA_KEYS=$n $BUILD/tests/test_cuda_ops --gtest_filter='*Attention*' --gtest_brief=1 2>&1 |
    grep -E "PASSED|FAILED|Failure" | head -8
done
if has bench; then
  $BUILD/bench_ops --csv "$OUT/attention_variants.csv" --variants --ops paged_attention --dtypes bf16,fp32 2>&1 |
    grep -E "variant=cuda_(mma|gqa)" | cut -c1-150
fi
if has sanitize; then
  # (these tests' tables hold 160-256 keys: one CTA by default, clusters with the rule off)
  for n in 256 0; do
    KS_ATTN_ONE_CTA_KEYS=$n ks_sanitize_tests memcheck '*DecodeAndPrefill/cuda_gqa_cluster:*NonFiniteScoresAsOnCpu/cuda_gqa_cluster' 120
    KS_ATTN_ONE_CTA_KEYS=$n ks_sanitize_tests racecheck '*NonFiniteScoresAsOnCpu/cuda_gqa_cluster:*DeviceIndicesOutOfRange/cuda_gqa_cluster' 120
  done
fi
if has ncu_gqa; then
  ks_ncu_bench paged_attention_gqa "$OUT/ncu_attention_gqa.txt" --ops paged_attention --dtypes fp32 \
    --shapes "b1 h9/3 d64 T192 of 2048"
fi
if has nosplit; then
  KS_ATTN_SPLIT=0 $BUILD/bench_ops --csv "$OUT/attention_nosplit.csv" --ops paged_attention --dtypes bf16 2>&1 |
    grep -E "variant=cuda_(mma|gqa)" | grep -v " of " | cut -c1-140
fi
if has lastcomb; then
  ks_bench_tagged KS_ATTN_LAST_COMBINE=0 kernscope "$OUT/attention_variants.csv" --ops paged_attention --dtypes bf16
  grep -F "[KS_ATTN_LAST_COMBINE=0]" "$OUT/attention_variants.csv" | cut -d, -f6,8,10
fi
if has layout; then
  # one kv head's rows at a 2 KB stride (32/8 heads) or back to back (4/1), same bytes
  KS_BENCH_ATTN=layout $BUILD/bench_ops --csv "$OUT/attention_layout.csv" --ops paged_attention --dtypes bf16 2>&1 |
    grep -E "variant=cuda_mma" | cut -c1-140
fi
if has peers; then
  PYTHONUNBUFFERED=1 python3 bench/peers_model.py --ops decode_attention --csv "$OUT/peers_attention.csv" 2>&1 | tail -12
  python3 bench/plot_attention.py --variants "$OUT/attention_variants.csv" --peers docs/perf/h200_model.csv \
    --out "$OUT/h200_attention_mma.png" && echo "plot written"
fi
if has ncu_b1; then  # the batch-1 shapes furthest from SDPA, the split's combine kernel with them
  for shape in "b1 h9/3 d64 T32768" "b1 h32/8 d128 T8192" "b1 h9/3 d64 T1024"; do
    KS_NCU_APPEND=1 KS_NCU_LAUNCHES=2 ks_ncu_bench 'paged_attention_mma|attention_combine' "$OUT/ncu_attention_b1.txt" \
      --ops paged_attention --dtypes bf16 --shapes "$shape"
  done
fi
if has ncu_sdpa; then  # which kernels torch SDPA runs at those shapes: names, grids, durations, DRAM
  ncu --clock-control none --launch-skip 0 --launch-count 12 --section SpeedOfLight --section LaunchStats \
    --section Occupancy python3 bench/sdpa_probe.py "b1 h9/3 d64 T32768" "b1 h32/8 d128 T8192" "b1 h9/3 d64 T1024" \
    > "$OUT/ncu_sdpa.txt" 2>&1
  grep -E "^  [a-zA-Z_].*\(|Duration|DRAM Throughput|Grid Size|Block Size|Registers Per|Shared Memory Config|Achieved Occ" \
    "$OUT/ncu_sdpa.txt" | head -90
fi
if has anchors; then
  KS_BENCH_ATTN=anchors $BUILD/bench_ops --csv "$OUT/attention_anchors.csv" --ops paged_attention --dtypes bf16 \
    > "$OUT/attention_anchors.log" 2>&1
  PYTHONUNBUFFERED=1 python3 bench/peers_model.py --ops decode_attention --csv "$OUT/peers_attention.csv" \
    > "$OUT/peers_attention.log" 2>&1
  python3 - "$OUT/attention_anchors.csv" "$OUT/peers_attention.csv" <<'PY'
import csv, sys
ours = {(r["shape"], r["impl"]): float(r["us"]) for r in csv.DictReader(open(sys.argv[1]))}
sdpa = {r["shape"]: float(r["us"]) for r in csv.DictReader(open(sys.argv[2]))}
for (shape, impl), us in sorted(ours.items()):
    if shape in sdpa:
        print(f"{shape:24s} {impl:48s} {us:9.2f} us  SDPA {sdpa[shape]:9.2f}  ratio {sdpa[shape] / us:.3f}")
PY
fi
if has timeline; then  # (carry build-timeline: scripts/make_prebuilt.sh timeline)
  LD_LIBRARY_PATH=$PWD/build-timeline:$LD_LIBRARY_PATH KS_ATTN_TIMELINE=1 KS_ATTN_TIMELINE_CSV="$OUT/timeline.csv" \
    KS_BENCH_ATTN=anchors $BUILD/bench_ops --csv "$OUT/timeline_anchors.csv" --ops paged_attention --dtypes bf16 \
    > "$OUT/timeline.txt" 2>&1
  grep -A22 "^timeline" "$OUT/timeline.txt" | grep -v "^decode_attention" | head -200
fi
if has ncu_mma; then
  KS_NCU_LAUNCHES=2 ks_ncu_bench 'paged_attention_mma|attention_combine' "$OUT/ncu_attention_mma.txt" --ops paged_attention \
    --dtypes bf16 --shapes "b1 h32/8 d128 T32768"
  ks_ncu_bench paged_attention_mma "$OUT/ncu_attention_mma_b32.txt" --ops paged_attention --dtypes bf16 \
    --shapes "b32 h32/8 d128 T8192"
  ks_sanitize_tests racecheck '*NonFiniteScoresAsOnCpu/cuda_mma_cluster:*DeviceIndicesOutOfRange/cuda_mma_cluster'
fi
