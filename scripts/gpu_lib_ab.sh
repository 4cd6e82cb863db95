#!/usr/bin/env bash
# A/B(/C...) of builds of the library in one GPU call, for changes a runtime switch cannot isolate
# (a switch's branch can change the code the compiler gives the default path: docs/perf/h200_quant_a8.md).
# Build "a" is build-prebuilt/ (scripts/make_prebuilt.sh); builds "b", "c", ... are the directories
# named in DIRS (comma-separated), each holding only libkernscope.so.0, or libkernscope.so.0.xz
# (22 MB → about 6.5 MB: three libraries beside build-prebuilt stay under the 64 MiB carry limit;
# unpacked here into a temporary directory). Make one with scripts/pack_lib.sh DIR after a
# make_prebuilt.sh of that tree.
# Carry all of them (["build-prebuilt", "build-base", ...]). bench_ops (build a's) runs with each
# library in turn, KS_AB_ROUNDS rounds (default 3) interleaved (a b c a b c ...), its rows tagged
# kernscope[a], kernscope[b], ... in $OUT/lib_ab.csv and printed, then the per-shape medians side by
# side with each build's ratio to a (x/a > 1: slower than a). KS_AB_TEST=FILTER: then build a's
# test_cuda_ops runs that googletest filter with each library (e.g. the bit-for-bit tests of the
# kernels a build changes), a verdict line per library.
#   scripts/gpu_prebuilt.sh 'scripts/gpu_lib_ab.sh build-base,build-c --ops quant_matmul_a8 --dtypes bf16 --shapes 4096x4096'
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
DIRS=${1:?usage: gpu_lib_ab.sh DIR_B[,DIR_C,...] bench_ops-args...}
shift
A=$PWD/build-prebuilt
[ -x "$A/bench_ops" ] || { echo "gpu_lib_ab: no $A/bench_ops (scripts/make_prebuilt.sh)"; exit 1; }
tmp=$(mktemp -d /tmp/ks_lib_ab.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
tags=(a)
libs=("$A")
letters=(b c d e f g h)
IFS=, read -r -a dirs <<< "$DIRS"
for i in "${!dirs[@]}"; do
  d=${dirs[$i]}
  tag=${letters[$i]:?gpu_lib_ab: at most ${#letters[@]} libraries besides a}
  if [ -f "$d/libkernscope.so.0" ]; then
    lib=$(cd "$d" && pwd)
  elif [ -f "$d/libkernscope.so.0.xz" ]; then
    lib=$tmp/$tag
    mkdir -p "$lib"
    if command -v xz > /dev/null; then
      xz -dc "$d/libkernscope.so.0.xz" > "$lib/libkernscope.so.0"
    else
      python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
        "$d/libkernscope.so.0.xz" "$lib/libkernscope.so.0"
    fi || { echo "gpu_lib_ab: could not unpack $d/libkernscope.so.0.xz"; exit 1; }
  else
    echo "gpu_lib_ab: no $d/libkernscope.so.0 or $d/libkernscope.so.0.xz"
    exit 1
  fi
  tags+=("$tag")
  libs+=("$lib")
done
origins=(build-prebuilt "${dirs[@]}")
for i in "${!tags[@]}"; do
  echo "[${tags[$i]}] ${origins[$i]}: $(head -1 "${origins[$i]}/COMMIT" 2>/dev/null || echo '(no COMMIT)')"
done
csv=$OUT/lib_ab.csv
rm -f "$csv"
for ((round = 1; round <= ${KS_AB_ROUNDS:-3}; ++round)); do
  for i in "${!tags[@]}"; do
    tag=${tags[$i]}
    rm -f "$tmp/run.csv"
    LD_LIBRARY_PATH=${libs[$i]}:${LD_LIBRARY_PATH:-} "$A/bench_ops" --csv "$tmp/run.csv" "$@" 2>&1 | grep -E " us " |
      sed "s/^/[$tag r$round] /" | cut -c1-120
    [ -f "$tmp/run.csv" ] || { echo "[$tag r$round] bench_ops wrote no CSV"; continue; }
    if [ -f "$csv" ]; then tail -n +2 "$tmp/run.csv"; else cat "$tmp/run.csv"; fi |
      sed "s/,kernscope,/,kernscope[$tag],/" >> "$csv"
  done
done
[ -f "$csv" ] || { echo "gpu_lib_ab: no rows"; exit 1; }
python3 - "$csv" "${tags[@]}" <<'PY'
import collections, csv, statistics, sys
tags = sys.argv[2:]
t = collections.defaultdict(list)
for r in csv.DictReader(open(sys.argv[1])):
    if r["impl"].startswith("kernscope[") and r["impl"].endswith("]"):
        t[(r["op"], r["shape"], r["dtype"], r["impl"][len("kernscope["):-1])].append(float(r["us"]))
for op, shape, dtype in sorted({k[:3] for k in t}):
    med = {g: statistics.median(t[(op, shape, dtype, g)]) for g in tags if t.get((op, shape, dtype, g))}
    if "a" not in med:
        continue
    cells = "  ".join(f"{g} {v:8.3f}" + ("" if g == "a" else f" ({v / med['a']:.3f})") for g, v in med.items())
    print(f"{op:28s} {shape:16s} {dtype:5s} us: {cells}")
PY
if [ -n "${KS_AB_TEST:-}" ]; then
  for i in "${!tags[@]}"; do
    LD_LIBRARY_PATH=${libs[$i]}:${LD_LIBRARY_PATH:-} "$A/tests/test_cuda_ops" --gtest_filter="$KS_AB_TEST" --gtest_brief=1 \
      > "$OUT/lib_ab_test_${tags[$i]}.txt" 2>&1
    rc=$?
    echo "[${tags[$i]}] test_cuda_ops --gtest_filter=$KS_AB_TEST: rc $rc; $(grep -E '^\[  (PASSED|FAILED)  \]' "$OUT/lib_ab_test_${tags[$i]}.txt" | tr '\n' ' ')"
  done
fi
