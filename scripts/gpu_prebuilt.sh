#!/usr/bin/env bash
# On the device: run a command with the binaries scripts/make_prebuilt.sh left in build-prebuilt/
# (carried: carry ["build-prebuilt"]) on PATH and their library on LD_LIBRARY_PATH, after
# printing the commit they were built at and the GPU. No build, so a fresh machine's call starts
# measuring at once. Example (device):
#   scripts/gpu_prebuilt.sh 'test_cuda_ops --gtest_filter=CudaSample.* --gtest_brief=1; bench_ops --ops sample --dtypes bf16 --csv $OUT/s.csv'
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
P=$PWD/build-prebuilt
[ -x "$P/tests/test_cuda_ops" ] || { echo "gpu_prebuilt: no build-prebuilt/ (carry it; scripts/make_prebuilt.sh)"; exit 1; }
export PATH=$P:$P/tests:$PATH LD_LIBRARY_PATH=$P:/usr/local/cuda/lib64:/usr/local/cuda/lib:${LD_LIBRARY_PATH:-}
export OUT
echo "build-prebuilt at $(cat "$P/COMMIT" | tr '\n' ' ')"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
bash -c "$1"
