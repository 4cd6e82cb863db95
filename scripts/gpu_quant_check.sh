#!/usr/bin/env bash
# Quantized GEMV in one short GPU call: build for sm_90a, the quant_matmul GPU tests, bench_ops'
# decode GEMVs under every CUDA variant (bf16; fp32 at the output head's shape) and the model's
# decode fusions (including the final norm + Q8_0 head, fused vs split) -> $OUT/quant_variants.csv,
# cuda_bulk_stream at stages of 32 and 128 KB (rows tagged [KS_QMM_BULK_STAGE_KB=n]), memcheck of
# the streaming variants' test, and Nsight Compute on cuda_bulk_stream at 4096 x 4096 and
# 14336 x 4096 Q4_1 (speed of light, warp stalls, memory) -> $OUT/ncu_quant_bulk.txt.
# Usage (device): KS_COMMIT=sha scripts/gpu_quant_check.sh   (carry .dlpack and .deps)
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh  # strict mode, $OUT (created), $BUILD and the helpers
ks_gpu_build_and_test '*QuantMatmul*:*Quant*:*Fused*' 'FP64' ||
  { echo "gpu_quant_check: the build failed (see $OUT/logs.txt)"; exit 1; }
$BUILD/bench_ops --csv "$OUT/quant_variants.csv" --variants --ops quant_matmul,decode_fusions --dtypes bf16,fp32 2>&1 |
  grep -E "quant_gemv|norm_head|silu_down|norm_qkv " | cut -c1-150
for kb in 32 128; do
  ks_bench_tagged KS_QMM_BULK_STAGE_KB=$kb variant:cuda_bulk_stream "$OUT/quant_variants.csv" --variants \
    --ops quant_matmul --dtypes bf16,fp32 --shapes 4096x4096,14336x4096,49152x576
done
grep "cuda_bulk_stream\[" "$OUT/quant_variants.csv" | cut -d, -f5,6,8,10 | head -30
rm -f "$OUT/ncu_quant_bulk.txt"
for shape in 4096x4096 14336x4096; do
  KS_NCU_APPEND=1 ks_ncu_bench quant_gemv_bulk "$OUT/ncu_quant_bulk.txt" --ops quant_matmul --variants --dtypes bf16 \
    --shapes $shape
done
ks_sanitize_tests memcheck '*QuantMatmulStreamVariantsEqualTheDefault*' 240
