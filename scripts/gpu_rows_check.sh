#!/usr/bin/env bash
# One GPU call for quant_matmul's cuda_mma_rows (2026-12-01): build for sm_90a, run the quant_matmul
# and deterministic-mode GPU tests (the new variant's tests and the routing of 8+ fp32 rows to it
# among them), then bench_ops --ops quant_matmul_rows --variants: SmolLM2's matrices at 2..512 rows
# of fp32 x, every variant, next to the dense FP32 gemm (cuBLASLt) the model used from 16 rows
# -> $OUT/rows.csv, and a summary (the best variant per shape, and cuda_mma_rows against the dense
# gemm and the automatic choice), then the automatic choice under each of cuda_mma_rows' plan
# switches (rows tagged [VAR=value]; KS_ROWS_AB=0 skips them).
# Usage (device): KS_COMMIT=sha scripts/gpu_rows_check.sh   (carry .dlpack, .deps[, .mdl/part_aa])
# The model's batched A/B is scripts/gpu_model_check.sh's dense_decode, the next call (warm: this
# script copies .mdl/part_aa to /tmp when carried).
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh  # strict mode, $OUT (created), $BUILD and the helpers
[ -f .mdl/part_aa ] && cp .mdl/part_aa /tmp/ks_part_aa
if [ "${KS_ROWS_BENCH_ONLY:-0}" != 1 ]; then  # (=1: built and tested already, by gpu_rows_quick.sh)
  ks_gpu_build_and_test "${KS_ROWS_FILTER:-*QuantMatmul*:*Deterministic*}" 'FP64' ||
    { echo "gpu_rows_check: the build failed (see $OUT/logs.txt)"; exit 1; }
fi
$BUILD/bench_ops --csv "$OUT/rows.csv" --ops quant_matmul_rows --dtypes fp32 --variants > "$OUT/rows_bench.txt" 2>&1
# cuda_mma_rows' plan switches (unmeasured until this call), as the automatic choice's rows tagged
# [VAR=value] (from 8 rows the routing takes cuda_mma_rows): the L2 prefetch of the first chunk of
# weights before the dependency wait, 4 and 1 groups of 8 rows per CTA, 64 KB stages
if [ "${KS_ROWS_AB:-1}" = 1 ]; then
  # (KS_ROWS_AB_SETTINGS="VAR=value ..." replaces the list)
  for setting in ${KS_ROWS_AB_SETTINGS:-KS_QMM_ROWS_PREFETCH=1 KS_QMM_ROWS_GROUPS=4 KS_QMM_ROWS_GROUPS=1 KS_QMM_ROWS_STAGE_KB=64}; do
    ks_bench_tagged "$setting" kernscope "$OUT/rows.csv" --ops quant_matmul_rows --dtypes fp32
  done
fi
# KS_ROWS_NCU=1: Nsight Compute over cuda_mma_rows at 32 rows of the 3072 x 576 matrix (its first
# launch; the report in $OUT/rows_ncu.txt): where a CTA's time goes
if [ "${KS_ROWS_NCU:-0}" = 1 ]; then
  ks_ncu_bench quant_mma_rows "$OUT/rows_ncu.txt" --ops quant_matmul_rows --dtypes fp32 --shapes "M32 3072x576"
fi
python3 - "$OUT/rows.csv" <<'PY'
import csv, sys, collections
rows = list(csv.DictReader(open(sys.argv[1])))
by = collections.defaultdict(dict)
for r in rows:
    by[(r['op'], r['shape'])][r['impl']] = float(r['us'])
print(f"{'op':22} {'shape':18} {'auto':>9} {'mma_rows':>9} {'dense':>9} {'best variant':>28}")
for (op, shape), d in by.items():
    if op.startswith('silu_down_rows_'):  # SiLU + down: the two calls against the fused kernel
        print(f"{op:22} {shape:18} two calls {d.get('silu_and_mul+quant_matmul', float('nan')):.2f}  "
              f"fused {d.get('fused:cuda_mma_rows', float('nan')):.2f}")
        continue
    var = {k: v for k, v in d.items() if k.startswith('variant:')}
    best = min(var, key=var.get) if var else '-'
    print(f"{op:22} {shape:18} {d.get('kernscope', float('nan')):9.2f} {d.get('variant:cuda_mma_rows', float('nan')):9.2f} "
          f"{d.get('dense_fp32_gemm', float('nan')):9.2f} {best[8:]:>20} {var.get(best, float('nan')):7.2f}")
    tagged = {k: v for k, v in d.items() if k.startswith('kernscope[')}
    if tagged:
        print("    " + "  ".join(f"{k[10:-1]} {v:.2f}" for k, v in tagged.items()))
PY
