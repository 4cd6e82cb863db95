# Sourced by every GPU script right after `cd "$(dirname "$0")/.."` (the repository root): strict
# mode (set -uo pipefail), OUT (default ./gpu_out) created, and the build helpers below. One build
# directory (build-gpu, sm_90a, tools on) serves every script, so a warm machine builds once.
set -uo pipefail
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
# .deps carries development files only; point the PCRE2 link name at the image's runtime library.
BUILD=${KS_GPU_BUILD:-build-gpu}
if [ "${KS_PREBUILT:-0}" = 1 ]; then  # binaries built elsewhere (scripts/make_prebuilt.sh), carried
  BUILD=$PWD/build-prebuilt
  export LD_LIBRARY_PATH=$BUILD:/usr/local/cuda/lib64:/usr/local/cuda/lib:${LD_LIBRARY_PATH:-}
fi
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
# For the short profiling scripts (gpu_profile_ops.sh, gpu_attention_check.sh): build through
# gpu_check.sh and run the GPU tests matching the gtest filter $1 (no CPU suites, no ks_check
# sweep), printing the verdict lines and those matching the extra pattern $2; exports KS_COMMIT and
# KS_DRIVER for the bench_ops runs that follow (their CSV columns). Fails when the build left no
# bench_ops.
# KS_PREBUILT=1 (with build-prebuilt/ carried, from scripts/make_prebuilt.sh): no build; the
# carried test_cuda_ops runs the filter (its output in $OUT/logs.txt) and $BUILD is build-prebuilt.
ks_gpu_build_and_test() {
  if [ "${KS_PREBUILT:-0}" = 1 ]; then
    echo "build-prebuilt at $(tr '\n' ' ' < $BUILD/COMMIT)" | tee -a "$OUT/logs.txt"
    $BUILD/tests/test_cuda_ops --gtest_filter="$1" 2>&1 | tee -a "$OUT/logs.txt" |
      grep -E "FAILED|PASSED|Failure|error${2:+|$2}" | head -20
  else
    KS_CPU_SUITES=0 KS_CHECK_SWEEP=0 KS_GTEST_FILTER="$1" KS_STAGES=build,test scripts/gpu_check.sh 2>&1 |
      grep -E "FAILED|PASSED|Failure|error${2:+|$2}" | head -20
  fi
  export KS_COMMIT=${KS_COMMIT:-unknown}
  export KS_DRIVER=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1)
  [ -x $BUILD/bench_ops ]
}

# bench_ops run with one environment setting $1 (VAR=value, or several joined by "+":
# A=1+B=2): its rows whose impl column is $2 are appended to the CSV $3 with the impl tagged
# $2[$1]; the other arguments go to bench_ops (e.g. --ops, --dtypes, --shapes). For A/B rows
# beside a script's untagged run.
ks_bench_tagged() {
  local setting=$1 impl=$2 csv=$3; shift 3
  env ${setting//+/ } $BUILD/bench_ops --csv /tmp/ks_tagged.csv "$@" > /dev/null 2>&1
  grep -F ",$impl," /tmp/ks_tagged.csv | sed "s/,$impl,/,$impl[$setting],/" >> "$csv"
}

# Nsight Compute on the first launch of the kernels matching regex $1 inside bench_ops run with
# the arguments after $2 (speed of light, scheduler, warp states, occupancy, launch, memory),
# the report to $2 (appended to, when KS_NCU_APPEND=1), then its headline lines. For the short
# profiling scripts. KS_NCU_LAUNCHES=n profiles the first n matching launches (default 1);
# KS_NCU_SECTIONS adds sections (e.g. "ComputeWorkloadAnalysis InstructionStats").
ks_ncu_bench() {
  local kernel=$1 report=$2 extra=() sec; shift 2
  for sec in ${KS_NCU_SECTIONS:-}; do extra+=(--section "$sec"); done
  # (--clock-control none: the clocks bench_ops runs at, so Duration compares with its times)
  ncu --clock-control none --kernel-name regex:$kernel --launch-count "${KS_NCU_LAUNCHES:-1}" --section SpeedOfLight \
    --section SchedulerStats --section WarpStateStats --section Occupancy --section LaunchStats \
    --section MemoryWorkloadAnalysis "${extra[@]}" $BUILD/bench_ops "$@" --csv /tmp/ncu_bench.csv > /tmp/ncu_report.txt 2>&1
  echo "ncu rc=$?"
  if [ "${KS_NCU_APPEND:-0}" = 1 ]; then cat /tmp/ncu_report.txt >> "$report"; else cp /tmp/ncu_report.txt "$report"; fi
  grep -E "Duration|Memory Throughput|DRAM Throughput|Issue Slots|Warp Cycles Per Issued|Stall|Achieved Occupancy|Registers|Eligible" \
    /tmp/ncu_report.txt | head -30
}
# compute-sanitizer's tool $1 over test_cuda_ops' tests matching the gtest filter $2 (60 s at most
# by default; $3 overrides), its summary and verdict lines.
ks_sanitize_tests() {
  timeout ${3:-60} compute-sanitizer --tool $1 --error-exitcode 9 $BUILD/tests/test_cuda_ops --gtest_filter="$2" \
    --gtest_brief=1 2>&1 | grep -E "SUMMARY|FAILED|PASSED|Invalid" | head -8
  echo "$1 rc=${PIPESTATUS[0]}"
}
# Every CUDA test in one call: test_cuda_ops in $1 shards (googletest's GTEST_TOTAL_SHARDS /
# GTEST_SHARD_INDEX) run at once on the one GPU (correctness tests; their device memory fits
# together), each killed after ${2:-400} s, with the filter ${3:-*}; each shard's log goes to
# $OUT/cuda_tests_shard<i>.txt, then one line per shard (its verdict lines, or "cut by the timeout"
# with its last finished test) and a line of totals. The whole suite ran longer than 300 s alone
# (cut at 6c20047 and cf200dc), more than a call leaves beside a build or a bench.
ks_cuda_tests_sharded() {
  local n=$1 limit=${2:-400} filter=${3:-*} i pids=() passed=0 failed=0
  for ((i = 0; i < n; ++i)); do
    GTEST_TOTAL_SHARDS=$n GTEST_SHARD_INDEX=$i timeout "$limit" $BUILD/tests/test_cuda_ops --gtest_filter="$filter" \
      > "$OUT/cuda_tests_shard$i.txt" 2>&1 &
    pids+=($!)
  done
  for ((i = 0; i < n; ++i)); do
    wait "${pids[$i]}"
    local rc=$? log="$OUT/cuda_tests_shard$i.txt"
    local ok=$(grep -c '^\[       OK \]' "$log") bad=$(grep -c '^\[  FAILED  \] [A-Za-z]' "$log")
    passed=$((passed + ok)); failed=$((failed + bad))
    if [ "$rc" = 124 ]; then
      echo "shard $i: cut by the timeout after $ok tests passed, $bad failed (last: $(grep '^\[       OK \]' "$log" | tail -1 | cut -c15-90))"
    else
      echo "shard $i (rc $rc): $(grep -E '^\[  (PASSED|FAILED) ' "$log" | tr '\n' ' ')"
    fi
    grep -E '^\[  FAILED  \] [A-Za-z]' "$log" | head -10
  done
  echo "CUDA tests: $passed passed, $failed failed in $n shards"
}
