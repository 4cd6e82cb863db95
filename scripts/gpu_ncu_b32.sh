#!/usr/bin/env bash
# Nsight Compute at batch 32 (bf16, 32/8 heads of 128, 8K keys), where decode attention is bound
# by how fast it streams K / V (0.91x torch SDPA): cuda_mma_cluster inside bench_ops, and torch
# SDPA's kernels at the same shape (bench/sdpa_probe.py), with the memory workload sections, so
# the two read patterns can be compared -> $OUT/ncu_mma_b32.txt, $OUT/ncu_sdpa_b32.txt.
# Usage (device): KS_PREBUILT=1 KS_COMMIT=sha scripts/gpu_ncu_b32.sh   (carry build-prebuilt)
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh  # strict mode, $OUT (created), $BUILD and the helpers
ks_gpu_build_and_test 'CudaAttentionMma.TmaTilesGiveTheSameBits' '' || { echo "gpu_ncu_b32: no bench_ops"; exit 1; }
shape="b32 h32/8 d128 T8192"
KS_NCU_SECTIONS="MemoryWorkloadAnalysis_Chart MemoryWorkloadAnalysis_Tables" \
  ks_ncu_bench 'paged_attention_mma' "$OUT/ncu_mma_b32.txt" --ops paged_attention --dtypes bf16 --shapes "$shape"
ncu --clock-control none --launch-skip 0 --launch-count 6 --section SpeedOfLight --section LaunchStats \
  --section Occupancy --section SchedulerStats --section WarpStateStats --section MemoryWorkloadAnalysis \
  --section MemoryWorkloadAnalysis_Chart --section MemoryWorkloadAnalysis_Tables \
  python3 bench/sdpa_probe.py "$shape" > "$OUT/ncu_sdpa_b32.txt" 2>&1
grep -E "^  [a-zA-Z_].*\(|Duration|DRAM Throughput|Memory Throughput|L2 Hit|L1/TEX Hit|Grid Size|Block Size|Registers Per|Achieved Occ|Eligible|Issued Warp" \
  "$OUT/ncu_sdpa_b32.txt" | head -60
