#!/usr/bin/env bash
# Quantized GEMV in one short GPU call: build for sm_90a (or the carried binaries: KS_PREBUILT=1),
# the quant_matmul GPU tests (KS_QUANT_FILTER: another gtest filter), bench_ops' decode GEMVs under
# every CUDA variant of quant_matmul and quant_matmul_a8 (bf16; fp32 at the output head's shape;
# Nsight Compute of the int8-x kernel: KS_QUANT_NCU=quant_gemv_a8_bulk) and the model's decode fusions
# (including the final norm + Q8_0 head, fused vs split) -> $OUT/quant_variants.csv,
# cuda_bulk_stream at stages of 32 and 128 KB (rows tagged [KS_QMM_BULK_STAGE_KB=n]; not under
# KS_QUANT_BULK_STAGES=0), memcheck of the tests matching KS_QUANT_MEMCHECK (default the streaming
# variants' bit-for-bit test), and Nsight Compute on the kernels named in KS_QUANT_NCU (regexes;
# default quant_gemv_bulk) at 4096 x 4096 and 14336 x 4096 Q4_1 (speed of light, warp stalls,
# memory) -> $OUT/ncu_<kernel>.txt. First, bench/gemv_read_probe: the weight bytes read alone at
# the GEMVs' sizes -> $OUT/gemv_read.csv. KS_QUANT_VARIANTS=0: the automatic choice only, at the
# large shapes; KS_QUANT_NCU=none, KS_QUANT_MEMCHECK=none: not those; KS_QUANT_PROBE=0: no probe;
# KS_QUANT_A8_TEST_TAGS, KS_QUANT_A8_VARIANTS, KS_QUANT_A8_TAGS, KS_QUANT_TIMELINE and KS_QUANT_BULK_X_VEC (below).
# Usage (device): KS_COMMIT=sha scripts/gpu_quant_check.sh   (carry .dlpack and .deps, or
# build-prebuilt with KS_PREBUILT=1 LD_LIBRARY_PATH=$PWD/build-prebuilt)
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh  # strict mode, $OUT (created), $BUILD and the helpers
ks_gpu_build_and_test "${KS_QUANT_FILTER:-*QuantMatmul*:*Quant*:*Fused*}" 'FP64' ||
  { echo "gpu_quant_check: the build failed (see $OUT/logs.txt)"; exit 1; }
# the weight read alone at the GEMVs' sizes (bench/gemv_read_probe.cu) -> $OUT/gemv_read.csv
[ "${KS_QUANT_PROBE:-1}" = 1 ] && [ -x $BUILD/gemv_read_probe ] && $BUILD/gemv_read_probe --csv "$OUT/gemv_read.csv" | tee "$OUT/gemv_read.txt"
if [ "${KS_QUANT_VARIANTS:-1}" = 1 ]; then
  $BUILD/bench_ops --csv "$OUT/quant_variants.csv" --variants --ops quant_matmul,quant_matmul_a8,decode_fusions \
    --dtypes bf16,fp32 2>&1 | grep -E "quant_gemv|norm_head|silu_down|norm_qkv " | cut -c1-150
else  # the automatic choice only, at the large shapes
  $BUILD/bench_ops --csv "$OUT/quant_variants.csv" --ops quant_matmul,quant_matmul_a8 --dtypes bf16 \
    --shapes 4096x4096,14336x4096,49152x576 2>&1 | grep -E "quant_gemv" | cut -c1-150
fi
# KS_QUANT_A8_TEST_TAGS: the quant_matmul_a8 GPU tests again under each setting (VAR=value, several
# joined by "+"; e.g. KS_QMM_A8_RES_WARPS=12 or KS_QMM_A8_RES_CTAS=2+KS_QMM_A8_RES_WARPS=16)
for tag in ${KS_QUANT_A8_TEST_TAGS:-}; do
  echo "== [$tag] quant_matmul_a8 tests" | tee -a "$OUT/a8_test_tags.txt"
  env ${tag//+/ } $BUILD/tests/test_cuda_ops --gtest_filter='*QuantMatmulA8*' --gtest_brief=1 2>&1 |
    grep -E "PASSED|FAILED|Failure" | head -8 | tee -a "$OUT/a8_test_tags.txt"
done
# KS_QUANT_A8_VARIANTS=1: every quant_matmul_a8 variant at the decode shapes (bf16 x) -> $OUT/quant_a8_variants.csv
if [ "${KS_QUANT_A8_VARIANTS:-0}" = 1 ]; then
  $BUILD/bench_ops --csv "$OUT/quant_a8_variants.csv" --variants --ops quant_matmul_a8 --dtypes bf16 \
    --shapes 576x576,1536x576,4096x4096,14336x4096,49152x576 2>&1 | grep -E "quant_gemv" | cut -c1-150
fi
# KS_QUANT_A8_TAGS: quant_matmul_a8's automatic choice (and every variant under
# KS_QUANT_A8_TAG_VARIANTS=1) again under each setting (VAR=value, several joined by "+"), its rows
# printed tagged and kept in $OUT/quant_a8_tagged.csv
tag_variants=""
[ "${KS_QUANT_A8_TAG_VARIANTS:-0}" = 1 ] && tag_variants=--variants
for tag in ${KS_QUANT_A8_TAGS:-}; do
  env ${tag//+/ } $BUILD/bench_ops --csv /tmp/ks_a8_tag.csv $tag_variants --ops quant_matmul_a8 --dtypes bf16 \
    --shapes 4096x4096,14336x4096,49152x576 2>&1 | grep quant_gemv_a8 | sed "s/^/[$tag] /" | cut -c1-120
  sed "1!s/,kernscope,/,kernscope[$tag],/" /tmp/ks_a8_tag.csv >> "$OUT/quant_a8_tagged.csv"
done
# KS_QUANT_TIMELINE=1: cuda_a8_resident's timeline (the library of build-timeline/, carried:
# scripts/make_prebuilt.sh DIR timeline) at 4096 x 4096 and 49152 x 576, by default and under each
# of KS_QUANT_TIMELINE_TAGS (as KS_QUANT_A8_TAGS) -> the printed summaries and $OUT/qmm_timeline_<n>.csv
if [ "${KS_QUANT_TIMELINE:-0}" = 1 ]; then
  if [ -f build-timeline/libkernscope.so.0 ]; then
    n=0
    for tag in default ${KS_QUANT_TIMELINE_TAGS:-}; do
      n=$((n + 1))
      echo "== timeline [$tag] (csv: qmm_timeline_$n.csv)"
      settings=""
      [ "$tag" = default ] || settings=${tag//+/ }
      env $settings LD_LIBRARY_PATH="$PWD/build-timeline:${LD_LIBRARY_PATH:-}" KS_QMM_TIMELINE=1 \
        KS_QMM_TIMELINE_CSV="$OUT/qmm_timeline_$n.csv" $BUILD/bench_ops --csv /tmp/ks_qtl.csv --ops quant_matmul_a8 \
        --dtypes bf16 --shapes "${KS_QUANT_TIMELINE_SHAPES:-4096x4096,49152x576}" 2>&1 | grep -A2 "^timeline"
    done
  else
    echo "gpu_quant_check: KS_QUANT_TIMELINE=1 but no build-timeline/ carried"
  fi
fi
# KS_QUANT_BULK_X_VEC=1: cuda_bulk_stream's value-by-value x staging (KS_QMM_BULK_X_VEC=0; 16-byte
# loads are the default since ae645f0's call): the quant_matmul GPU tests under it
# (KS_QUANT_BULK_X_VEC_FILTER), then its rows tagged beside the default's
if [ "${KS_QUANT_BULK_X_VEC:-0}" = 1 ]; then
  KS_QMM_BULK_X_VEC=0 $BUILD/tests/test_cuda_ops --gtest_filter="${KS_QUANT_BULK_X_VEC_FILTER:-*QuantMatmul*:*Fused*}" \
    --gtest_brief=1 2>&1 | grep -E "PASSED|FAILED|Failure" | head -8
  ks_bench_tagged KS_QMM_BULK_X_VEC=0 variant:cuda_bulk_stream "$OUT/quant_variants.csv" --variants --ops quant_matmul \
    --dtypes bf16,fp32 --shapes 4096x4096,14336x4096,49152x576
  grep "cuda_bulk_stream" "$OUT/quant_variants.csv" | cut -d, -f5,6,7,8,10 | head -30
fi
if [ "${KS_QUANT_BULK_STAGES:-1}" = 1 ]; then
  for kb in 32 128; do
    ks_bench_tagged KS_QMM_BULK_STAGE_KB=$kb variant:cuda_bulk_stream "$OUT/quant_variants.csv" --variants \
      --ops quant_matmul --dtypes bf16,fp32 --shapes 4096x4096,14336x4096,49152x576
  done
  grep "cuda_bulk_stream\[" "$OUT/quant_variants.csv" | cut -d, -f5,6,8,10 | head -30
fi
for kernel in ${KS_QUANT_NCU:-quant_gemv_bulk}; do
  [ "$kernel" = none ] && continue
  rm -f "$OUT/ncu_$kernel.txt"
  for shape in 4096x4096 14336x4096; do
    KS_NCU_APPEND=1 ks_ncu_bench "$kernel" "$OUT/ncu_$kernel.txt" --ops quant_matmul,quant_matmul_a8 --variants --dtypes bf16 \
      --shapes $shape
  done
done
[ "${KS_QUANT_MEMCHECK:-}" = none ] ||
  ks_sanitize_tests memcheck "${KS_QUANT_MEMCHECK:-*QuantMatmulStreamVariantsEqualTheDefault*}" 240
