#!/usr/bin/env bash
# Nsight Compute at batch 32 (bf16, 32/8 heads of 128, 8K keys), where decode attention is bound
# by how fast it streams K / V (0.91x torch SDPA): cuda_mma_cluster inside bench_ops, and torch
# SDPA's kernels at the same shape (bench/sdpa_probe.py), with the memory workload sections, so
# the two read patterns can be compared -> $OUT/ncu_mma_b32.txt, $OUT/ncu_sdpa_b32.txt.
# KS_NCU_TMA=1 also profiles cuda_mma_tma -> $OUT/ncu_tma_b32.txt (KS_NCU_SDPA=0: then stop).
# Usage (device): KS_PREBUILT=1 KS_COMMIT=sha scripts/gpu_ncu_b32.sh   (carry build-prebuilt)
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh  # strict mode, $OUT (created), $BUILD and the helpers
ks_gpu_build_and_test 'CudaAttentionMma.TmaTilesGiveTheSameBits' '' || { echo "gpu_ncu_b32: no bench_ops"; exit 1; }
shape="b32 h32/8 d128 T8192"
[ "${KS_NCU_TMA:-0}" = 1 ] || KS_NCU_SECTIONS="MemoryWorkloadAnalysis_Chart MemoryWorkloadAnalysis_Tables" \
  ks_ncu_bench 'paged_attention_mma' "$OUT/ncu_mma_b32.txt" --ops paged_attention --dtypes bf16 --shapes "$shape"
# cuda_mma_tma (the same kernel, tiles by the TMA unit: whole-row requests) at the same shape
# (KS_NCU_TMA=1, with the other variants run by --variants but not profiled)
if [ "${KS_NCU_TMA:-0}" = 1 ]; then
  ncu --clock-control none --kernel-name-base demangled --kernel-name 'regex:mma_kernel<__nv_bfloat16, .int.128, .int.4, .bool.1, .bool.0, .bool.1>' \
    --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis --section SchedulerStats \
    --section WarpStateStats --section Occupancy --section LaunchStats $BUILD/bench_ops --ops paged_attention \
    --dtypes bf16 --shapes "$shape" --variants --csv /tmp/ncu_tma.csv > "$OUT/ncu_tma_b32.txt" 2>&1
  grep -E "mma_kernel|Duration|DRAM Throughput|L2 Hit|Eligible Warps|Registers Per" "$OUT/ncu_tma_b32.txt" | head -12
  [ "${KS_NCU_SDPA:-1}" = 1 ] || exit 0
fi
ncu --clock-control none --launch-skip 0 --launch-count 6 --section SpeedOfLight --section LaunchStats \
  --section Occupancy --section SchedulerStats --section WarpStateStats --section MemoryWorkloadAnalysis \
  --section MemoryWorkloadAnalysis_Chart --section MemoryWorkloadAnalysis_Tables \
  python3 bench/sdpa_probe.py "$shape" > "$OUT/ncu_sdpa_b32.txt" 2>&1
grep -E "^  [a-zA-Z_].*\(|Duration|DRAM Throughput|Memory Throughput|L2 Hit|L1/TEX Hit|Grid Size|Block Size|Registers Per|Achieved Occ|Eligible|Issued Warp" \
  "$OUT/ncu_sdpa_b32.txt" | head -60
