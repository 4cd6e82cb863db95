#!/usr/bin/env bash
# Where the time goes inside two kernels that miss the issue's targets, in one short GPU call:
#  1. cuda_cluster_local_topk with KS_SAMPLE_TRACE=1: the SM cycles of each phase for row 0
#     (bf16, the benchmark's sampling shapes), medians per (L, C) -> $OUT/sample_trace.txt
#  2. quant_matmul's per-warp kernel and cuda_mma_blocks' kernel (M = 1, bf16, the GEMV shapes
#     4096x4096, 14336x4096 and 49152x576) under Nsight Compute: speed of light, issue activity, warp stall reasons, occupancy
#     -> $OUT/ncu_quant_matmul.txt
# It builds first and runs the sampling GPU tests (the trace kernel is a separate
# instantiation; the tests cover the production one).
# Usage (device): KS_COMMIT=sha scripts/gpu_profile_ops.sh   (carry .dlpack and .deps)
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh  # strict mode, $OUT (created), $BUILD and the helpers
ks_gpu_build_and_test 'CudaSample.*' || { echo "gpu_profile_ops: the build failed (see $OUT/logs.txt)"; exit 1; }

KS_SAMPLE_TRACE=1 $BUILD/bench_ops --ops sample --dtypes bf16 --csv /tmp/sample_trace.csv 2>&1 |
  python3 bench/sample_trace_summary.py | tee "$OUT/sample_trace.txt"

# (the first launch of each shape is Q4_1's: the benchmark runs Q4_1, then Q8_0, then Q4_0;
# --variants also runs cuda_mma_blocks, whose kernel is quant_mma_kernel)
: > "$OUT/ncu_quant_matmul.txt"
for kern in quant_matmul_kernel quant_mma_kernel; do
  for shape in 4096x4096 14336x4096 49152x576; do
    echo "== $kern, Q4_1 $shape (bf16, M = 1)" | tee -a "$OUT/ncu_quant_matmul.txt"
    KS_NCU_APPEND=1 KS_NCU_SECTIONS="ComputeWorkloadAnalysis InstructionStats" ks_ncu_bench $kern \
      "$OUT/ncu_quant_matmul.txt" --ops quant_matmul --variants --dtypes bf16 --shapes $shape
  done
done
