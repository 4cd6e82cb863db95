#!/usr/bin/env bash
# Decode attention in one short GPU call: build for sm_90a, the paged/varlen attention GPU tests,
# bench_ops' decode attention under every CUDA variant (bf16) -> $OUT/attention_variants.csv and
# a plot against torch SDPA (bench/plot_attention.py, SDPA rows from docs/perf/h200_model.csv),
# the automatic choice with KS_ATTN_SPLIT=0 -> $OUT/attention_nosplit.csv, the layout experiment
# (KS_BENCH_ATTN=layout) -> $OUT/attention_layout.csv, torch SDPA timed in the
# same call -> $OUT/peers_attention.csv,
# racecheck of cuda_mma_cluster's small tests, and Nsight Compute on cuda_mma_cluster at batch 1,
# 32/8 heads of 128, 32K keys (speed of light, warp stalls, occupancy; with the split's combine
# kernel) -> $OUT/ncu_attention_mma.txt, and at batch 32, 8K keys -> $OUT/ncu_attention_mma_b32.txt.
# Usage (device): KS_COMMIT=sha scripts/gpu_attention_check.sh   (carry .dlpack and .deps)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
source scripts/gpu_env.sh
ks_gpu_build_and_test '*Attention*' 'FP64 value' ||
  { echo "gpu_attention_check: the build failed (see $OUT/logs.txt)"; exit 1; }
$BUILD/bench_ops --csv "$OUT/attention_variants.csv" --variants --ops paged_attention --dtypes bf16 2>&1 |
  grep -E "variant=cuda_(mma|gqa)" | grep -v " of " | cut -c1-140
# the split beyond a cluster off (KS_ATTN_SPLIT=0), and torch SDPA, in the same call
KS_ATTN_SPLIT=0 $BUILD/bench_ops --csv "$OUT/attention_nosplit.csv" --ops paged_attention --dtypes bf16 2>&1 |
  grep -E "variant=cuda_(mma|gqa)" | grep -v " of " | cut -c1-140
# the cache layout: one kv head's rows at a 2 KB stride (32/8 heads) or back to back (4/1), same bytes
KS_BENCH_ATTN=layout $BUILD/bench_ops --csv "$OUT/attention_layout.csv" --ops paged_attention --dtypes bf16 2>&1 |
  grep -E "variant=cuda_mma" | cut -c1-140
PYTHONUNBUFFERED=1 python3 bench/peers_model.py --ops decode_attention --csv "$OUT/peers_attention.csv" 2>&1 | tail -12
python3 bench/plot_attention.py --variants "$OUT/attention_variants.csv" --peers docs/perf/h200_model.csv \
  --out "$OUT/h200_attention_mma.png" && echo "plot written"
# batch 1 (the split: the attention kernel and attention_combine_kernel), then batch 32
KS_NCU_LAUNCHES=2 ks_ncu_bench 'paged_attention_mma|attention_combine' "$OUT/ncu_attention_mma.txt" --ops paged_attention \
  --dtypes bf16 --shapes "b1 h32/8 d128 T32768"
ks_ncu_bench paged_attention_mma "$OUT/ncu_attention_mma_b32.txt" --ops paged_attention --dtypes bf16 \
  --shapes "b32 h32/8 d128 T8192"
ks_sanitize_tests racecheck '*NonFiniteScoresAsOnCpu/cuda_mma_cluster:*DeviceIndicesOutOfRange/cuda_mma_cluster'
