#!/usr/bin/env bash
# Profiles chosen kernels of bench_ops with Nsight Compute on the GPU machine and
# writes short text reports under $OUT (default ./gpu_out).
#   PROFILE="name:ops:dtypes:shapes:kernel-regex ..."  one bench_ops run per entry, restricted
#   to those shapes (comma list), and the first launch of the matching kernel profiled.
#   Default: the open targets of docs/cuda.md (wide softmax, mid-size and large rms_norm in
#   bf16 and fp16, decode fused_add). KS_SOFTMAX_CLUSTER sweeps are run when SWEEP_CLUSTER=1;
#   the softmax candidates (co-resident clusters per configuration) are printed by
#   KS_DEBUG_CONFIG=1.
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh  # strict mode, $OUT (created), $BUILD and the helpers
export PATH=/usr/local/cuda/bin:$PATH
if [ ! -x $BUILD/bench_ops ]; then
  cmake -S . -B $BUILD -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a-real \
    -DKS_BUILD_TOOLS=OFF -DKS_DLPACK_INCLUDE_DIR=$PWD/.dlpack/usr/include > "$OUT/profile_build.txt" 2>&1 &&
  cmake --build $BUILD -j 16 --target bench_ops >> "$OUT/profile_build.txt" 2>&1 || { tail -30 "$OUT/profile_build.txt"; exit 1; }
fi
PROFILE=${PROFILE:-"softmax_wide:softmax:bf16:64x128256:softmax_cluster rms_mid:rms_norm:bf16:512x4096:norm_kernel rms_big_bf16:rms_norm:bf16:16384x8192:norm_kernel rms_big_fp16:rms_norm:fp16:16384x8192:norm_kernel fused_decode:fused_add_rms_norm:bf16:1x4096:norm_kernel"}
SECTIONS="${NCU_SECTIONS:-} --section SpeedOfLight --section LaunchStats --section Occupancy --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats"
for spec in $PROFILE; do
  IFS=: read -r name ops dtypes shapes kre <<<"$spec"
  KS_DEBUG_CONFIG=1 ncu $SECTIONS -k "regex:$kre" -c 1 $BUILD/bench_ops --csv /tmp/ncu_$name.csv --ops "$ops" \
    --dtypes "$dtypes" --shapes "$shapes" > "$OUT/ncu_$name.txt" 2>&1
  echo "== $name"; grep "kernscope softmax" "$OUT/ncu_$name.txt" | sort -u | head -24
  grep -E "smsp__pcsamp|Stall|stall" "$OUT/ncu_$name.txt" | head -20; grep -E "Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Waves Per SM|Cluster|Block Limit|Stall|Warp Cycles Per Issued" "$OUT/ncu_$name.txt" | head -40
done
if [ "${SWEEP_CLUSTER:-0}" = 1 ]; then
  for cl in 2 4 8 16; do
    echo "== KS_SOFTMAX_CLUSTER=$cl"
    KS_SOFTMAX_CLUSTER=$cl $BUILD/bench_ops --csv /tmp/sweep_$cl.csv --ops softmax --dtypes bf16,fp32 | grep -E "x128256|x151936"
  done
fi
