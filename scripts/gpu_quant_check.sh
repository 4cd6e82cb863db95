#!/usr/bin/env bash
# Quantized GEMV in one short GPU call: build for sm_90a, the quant_matmul GPU tests, bench_ops'
# decode GEMVs under every CUDA variant (bf16; fp32 at the output head's shape) and the model's
# decode fusions (including the final norm + Q8_0 head, fused vs split) -> $OUT/quant_variants.csv,
# memcheck of cuda_mma_stream's test, and Nsight Compute on cuda_mma_stream at 4096 x 4096 Q4_1
# (speed of light, warp stalls, memory) -> $OUT/ncu_quant_stream.txt.
# Usage (device): KS_COMMIT=sha scripts/gpu_quant_check.sh   (carry .dlpack and .deps)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
source scripts/gpu_env.sh
ks_gpu_build_and_test '*QuantMatmul*:*Quant*:*Fused*' 'FP64' ||
  { echo "gpu_quant_check: the build failed (see $OUT/logs.txt)"; exit 1; }
$BUILD/bench_ops --csv "$OUT/quant_variants.csv" --variants --ops quant_matmul,decode_fusions --dtypes bf16,fp32 2>&1 |
  grep -E "quant_gemv|norm_head|silu_down|norm_qkv " | cut -c1-150
ks_ncu_bench quant_mma_stream "$OUT/ncu_quant_stream.txt" --ops quant_matmul --variants --dtypes bf16 --shapes 4096x4096
ks_sanitize_tests memcheck '*QuantMatmulMmaStreamVariant*' 120
