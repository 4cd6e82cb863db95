# Sourced by scripts/gpu_check.sh and scripts/gpu_model_check.sh on the GPU machine: one build
# directory (build-gpu, sm_90a, tools on) serves both, so a warm machine builds once.
# .deps carries development files only; point the PCRE2 link name at the image's runtime library.
BUILD=${KS_GPU_BUILD:-build-gpu}
DEPLIB=$PWD/.deps/usr/lib/x86_64-linux-gnu
for f in /usr/lib/x86_64-linux-gnu/libpcre2-8.so.0 /lib/x86_64-linux-gnu/libpcre2-8.so.0; do
  [ -e "$f" ] && ln -sf "$f" "$DEPLIB/libpcre2-8.so" && break
done
export PKG_CONFIG_PATH=$DEPLIB/pkgconfig PKG_CONFIG_SYSROOT_DIR=$PWD/.deps
# configure + build the given targets (all when none) into $BUILD, logging to $1
ks_gpu_build() {
  local log=$1; shift
  local targets=()
  [ $# -gt 0 ] && targets=(--target "$@")
  cmake -S . -B $BUILD -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a-real -DKS_BUILD_TOOLS=ON \
        -DKS_DLPACK_INCLUDE_DIR=$PWD/.dlpack/usr/include -DCMAKE_PREFIX_PATH=$PWD/.deps/usr >> "$log" 2>&1 &&
  cmake --build $BUILD -j 16 "${targets[@]}" >> "$log" 2>&1
}
