#!/usr/bin/env bash
# Sampling and argmax in one short GPU call: build for sm_90a, the sampling and argmax GPU tests
# (bit for bit against the CPU), the sampling tests again with KS_SAMPLE_FLOOR=0 (the row's floor
# off: every range's own top-k, then rank 0's radix selection) and with KS_SAMPLE_FINISH_WARP=0
# (every row's last step by the whole CTA instead of one warp) and with KS_SAMPLE_VEC=0 (scalar
# loads instead of runs of 16 bytes), bench_ops' sample and argmax under every CUDA variant (bf16) -> $OUT/sampling.csv
# with the default's rows under those settings appended tagged, and cuda_cluster_local_topk's
# phase cycles (KS_SAMPLE_TRACE=1: default, scalar loads, no floor) -> $OUT/sample_trace.txt,
# and the PyTorch peers of the same shapes -> $OUT/peers_sampling.csv; fp16 and fp32 logits, with
# and without KS_SAMPLE_VEC=0 -> $OUT/sampling_dtypes.csv.
# KS_SAMPLING_TEST_SETTINGS / KS_SAMPLING_BENCH_SETTINGS (VAR=value words; a bench word may join
# several with "+") replace the settings the tests are repeated under and the tagged benchmark
# rows are taken under (default bench settings: scalar loads alone and with clusters of 8,
# clusters of 8 and of 16, no floor).
# Usage (device): KS_COMMIT=sha scripts/gpu_sampling_check.sh   (carry .dlpack and .deps)
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh  # strict mode, $OUT (created), $BUILD and the helpers
ks_gpu_build_and_test 'CudaSample.*:*Argmax*' || { echo "gpu_sampling_check: the build failed (see $OUT/logs.txt)"; exit 1; }
for setting in ${KS_SAMPLING_TEST_SETTINGS:-KS_SAMPLE_VEC=0 KS_SAMPLE_FLOOR=0 KS_SAMPLE_FINISH_WARP=0}; do
  echo "$setting:"
  env $setting $BUILD/tests/test_cuda_ops --gtest_filter='CudaSample.*' --gtest_brief=1 2>&1 |
    grep -E "PASSED|FAILED|Failure" | head -8
done
$BUILD/bench_ops --csv "$OUT/sampling.csv" --variants --ops sample,argmax --dtypes bf16 2>&1 |
  grep -E "^(sampling|argmax)" | cut -c1-150
# fp16 and fp32 logits (the runs of 16 bytes hold 8 and 4 scores), and with scalar loads
$BUILD/bench_ops --csv "$OUT/sampling_dtypes.csv" --ops sample,argmax --dtypes fp16,fp32 > /dev/null 2>&1
ks_bench_tagged KS_SAMPLE_VEC=0 kernscope "$OUT/sampling_dtypes.csv" --ops sample --dtypes fp16,fp32
grep -E ",(fp16|fp32),kernscope" "$OUT/sampling_dtypes.csv" | cut -d, -f5,6,7,8,10
for setting in ${KS_SAMPLING_BENCH_SETTINGS:-KS_SAMPLE_VEC=0 KS_SAMPLE_CLUSTER=8 KS_SAMPLE_CLUSTER=16 KS_SAMPLE_VEC=0+KS_SAMPLE_CLUSTER=8 KS_SAMPLE_FLOOR=0}; do
  ks_bench_tagged $setting kernscope "$OUT/sampling.csv" --ops sample --dtypes bf16
  grep -F "[$setting]" "$OUT/sampling.csv" | cut -d, -f6,8,10
done
# the PyTorch peers in the same call (sort path and argmax, eager and torch.compile; KS_PEERS=0 skips)
if [ "${KS_PEERS:-1}" = 1 ]; then
  PYTHONUNBUFFERED=1 python3 bench/peers_model.py --ops sampling_topk_topp,argmax --csv "$OUT/peers_sampling.csv" 2>&1 |
    grep -E "^(sampling|argmax)|FAILED" | cut -c1-120
fi
for setting in KS_SAMPLE_FLOOR=1 KS_SAMPLE_VEC=0 KS_SAMPLE_FLOOR=0; do
  echo "== $setting" | tee -a "$OUT/sample_trace.txt"
  env $setting KS_SAMPLE_TRACE=1 $BUILD/bench_ops --ops sample --dtypes bf16 --csv /tmp/sample_trace.csv 2>&1 |
    python3 bench/sample_trace_summary.py | tee -a "$OUT/sample_trace.txt"
done
