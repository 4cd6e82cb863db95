#!/usr/bin/env bash
# Build the GPU test and benchmark binaries, ksctl and the model tests here (no GPU needed: nvcc
# only) for sm_90a and copy them into build-prebuilt/ (git-ignored: /build*/), so a GPU call can
# carry them (about 22 MB stripped, under the 64 MiB carry limit, also beside the model's second part) and
# run them at once instead of spending ~200 s of device time on a fresh machine's build.
# scripts/gpu_model_check.sh under KS_PREBUILT=1 skips its build stage and runs the carried ksctl
# and test_model. The device runs them through scripts/gpu_prebuilt.sh, or any GPU script
# that uses ks_gpu_build_and_test and $BUILD/bench_ops under KS_PREBUILT=1 (scripts/gpu_env.sh).
#   scripts/make_prebuilt.sh [local build dir] [timeline]   (default /tmp/ks-prebuilt; needs .dlpack from
#   scripts/prepare_gpu_carry.sh; installs the build's packages with scripts/setup.sh, as a fresh
#   checkout lacks them; reuses the dir's earlier objects)
# With "timeline", also build-timeline/libkernscope.so.0: the library built with
# -DKS_ATTN_TIMELINE=ON (cuda_mma_cluster's timeline; gpu_attention_check.sh's timeline stage),
# then the build dir back to a normal library.
# The binaries load libkernscope.so.0 from build-prebuilt/ (LD_LIBRARY_PATH) and libcudart.so.13
# from the device's CUDA 13 toolkit; built against this machine's older glibc and libstdc++, which
# the device's newer ones accept.
set -euo pipefail
cd "$(dirname "$0")/.."
B=${1:-/tmp/ks-prebuilt}
[ -d .dlpack/usr/include ] || { echo "make_prebuilt: no .dlpack (run scripts/prepare_gpu_carry.sh)"; exit 1; }
scripts/setup.sh  # the build's own packages (PCRE2, CLI11, GoogleTest, ccache, ...), as `make` installs them
cmake -S . -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a-real -DKS_BUILD_TOOLS=ON \
  -DKS_DLPACK_INCLUDE_DIR="$PWD/.dlpack/usr/include" > /dev/null  # (CMakeLists.txt uses ccache when present)
cmake --build "$B" --target test_cuda_ops bench_ops ksctl test_model kv_read_probe dsmem_probe gemv_read_probe
rm -rf build-prebuilt && mkdir -p build-prebuilt/tests  # (a build directory's layout: $BUILD/...)
cp -L "$B/libkernscope.so.0" build-prebuilt/
cp "$B/tests/test_cuda_ops" "$B/tests/test_model" build-prebuilt/tests/
cp "$B/ksctl" build-prebuilt/
cp "$B/bench_ops" "$B/kv_read_probe" "$B/dsmem_probe" "$B/gemv_read_probe" build-prebuilt/
# (symbols a run does not need left out: about 2 MB less to carry beside the model's second part)
strip --strip-unneeded build-prebuilt/libkernscope.so.0 build-prebuilt/tests/* build-prebuilt/ksctl build-prebuilt/bench_ops build-prebuilt/kv_read_probe \
  build-prebuilt/dsmem_probe build-prebuilt/gemv_read_probe
git rev-parse --short HEAD > build-prebuilt/COMMIT
if [ "${2:-}" = timeline ]; then
  cmake -S . -B "$B" -DKS_ATTN_TIMELINE=ON > /dev/null
  cmake --build "$B" --target kernscope
  rm -rf build-timeline && mkdir -p build-timeline
  cp -L "$B/libkernscope.so.0" build-timeline/ && strip --strip-unneeded build-timeline/libkernscope.so.0
  cp build-prebuilt/COMMIT build-timeline/
  cmake -S . -B "$B" -DKS_ATTN_TIMELINE=OFF > /dev/null
  cmake --build "$B" --target kernscope
fi
git diff --quiet HEAD -- src include tests bench || echo "(uncommitted changes)" >> build-prebuilt/COMMIT
du -sh build-prebuilt
