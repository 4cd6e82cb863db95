#!/usr/bin/env bash
# Keep build-prebuilt/'s library (and its COMMIT) as DIR/libkernscope.so.0.xz, a build for
# scripts/gpu_lib_ab.sh to compare (about 6.5 MB instead of 22: several fit the 64 MiB carry).
#   scripts/make_prebuilt.sh /tmp/bme && scripts/pack_lib.sh build-base
# DIR must be git-ignored (the /build*/ pattern) so that it travels only when carried.
set -euo pipefail
cd "$(dirname "$0")/.."
D=${1:?usage: pack_lib.sh DIR}
[ -f build-prebuilt/libkernscope.so.0 ] || { echo "pack_lib: no build-prebuilt/libkernscope.so.0 (scripts/make_prebuilt.sh)"; exit 1; }
git check-ignore -q "${D%/}/" || { echo "pack_lib: $D is not git-ignored (use a build* directory)"; exit 1; }
rm -rf "$D" && mkdir -p "$D"
xz -T2 -6 -c build-prebuilt/libkernscope.so.0 > "$D/libkernscope.so.0.xz"
cp build-prebuilt/COMMIT "$D/"
du -sh "$D"
