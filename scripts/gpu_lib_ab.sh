#!/usr/bin/env bash
# A/B of two builds of the library in one GPU call, for changes a runtime switch cannot isolate
# (a switch's branch can change the code the compiler gives the default path: docs/perf/h200_quant_a8.md).
# Build A is build-prebuilt/ (scripts/make_prebuilt.sh at the change); build B is another directory
# holding only libkernscope.so.0 (e.g. build-base/: the same script at the commit before, then
#   mkdir -p build-base && cp build-prebuilt/libkernscope.so.0 build-base/ ).
# Carry both (["build-prebuilt", "build-base"]: about 48 MB). bench_ops (build A's) runs with each
# library in turn, KS_AB_ROUNDS rounds (default 3) interleaved, its rows tagged kernscope[a] /
# kernscope[b] in $OUT/lib_ab.csv and printed, then the per-shape medians side by side.
#   scripts/gpu_prebuilt.sh 'scripts/gpu_lib_ab.sh build-base --ops quant_matmul_a8 --dtypes bf16 --shapes 4096x4096'
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
B=${1:?usage: gpu_lib_ab.sh DIR_B bench_ops-args...}
shift
[ -f "$B/libkernscope.so.0" ] || { echo "gpu_lib_ab: no $B/libkernscope.so.0"; exit 1; }
A=$PWD/build-prebuilt
B=$(cd "$B" && pwd)
csv=$OUT/lib_ab.csv
rm -f "$csv"
for ((round = 1; round <= ${KS_AB_ROUNDS:-3}; ++round)); do
  for tag in a b; do
    lib=$A
    [ $tag = b ] && lib=$B
    LD_LIBRARY_PATH=$lib:${LD_LIBRARY_PATH:-} "$A/bench_ops" --csv /tmp/ks_lib_ab.csv "$@" 2>&1 | grep -E " us " |
      sed "s/^/[$tag r$round] /" | cut -c1-120
    if [ -f "$csv" ]; then tail -n +2 /tmp/ks_lib_ab.csv; else cat /tmp/ks_lib_ab.csv; fi |
      sed "s/,kernscope,/,kernscope[$tag],/" >> "$csv"
  done
done
python3 - "$csv" <<'PY'
import collections, csv, statistics, sys
t = collections.defaultdict(list)
for r in csv.DictReader(open(sys.argv[1])):
    if r["impl"].startswith("kernscope["):
        t[(r["op"], r["shape"], r["dtype"], r["impl"][-2])].append(float(r["us"]))
for op, shape, dtype in sorted({k[:3] for k in t}):
    a, b = t.get((op, shape, dtype, "a"), []), t.get((op, shape, dtype, "b"), [])
    if a and b:
        ma, mb = statistics.median(a), statistics.median(b)
        print(f"{op:28s} {shape:16s} {dtype:5s} a {ma:8.3f} us  b {mb:8.3f} us  b/a {mb / ma:.3f}")
PY
