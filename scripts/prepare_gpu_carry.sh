#!/usr/bin/env bash
# Prepares, on the development machine, what the GPU machine lacks and what cannot travel
# in one call (it has no network). Every folder made here is git-ignored (.git/info/exclude)
# and travels only when a device call names it in `carry`:
#   .dlpack/  the libdlpack-dev header                      (every GPU call)
#   .deps/    PCRE2, CLI11 and nlohmann-json development files, for ksctl and the model tests
#   .whl/     wheels the GPU image lacks (liger-kernel, gguf)
#   .mdl/     SmolLM2-135M-Instruct.Q4_1.gguf in two parts, 50,000,000 bytes and the rest (48.4 MB):
#             a call carries at most 64 MiB, the working tree (about 7 MB) included, so part_aa
#             travels in one call and part_ab in another while the machine is still warm (ignored
#             files left there by a call are kept for the next: build-prebuilt/ carried by an
#             earlier call of the same machine stays for the model call, and .whl's gguf and
#             accelerate wheels fit beside part_ab); 60,000,000 bytes beside a 7 MB tree was
#             refused as over the limit on 2026-12-04
#   scripts/prepare_gpu_carry.sh [model.gguf]
set -euo pipefail
cd "$(dirname "$0")/.."
exclude=.git/info/exclude
for d in /.dlpack/ /.deps/ /.whl/ /.mdl/; do grep -qx "$d" "$exclude" 2>/dev/null || echo "$d" >> "$exclude"; done
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if [ ! -d .dlpack/usr/include/dlpack ]; then
  (cd "$tmp" && apt-get download libdlpack-dev >/dev/null) && dpkg -x "$tmp"/libdlpack-dev_*.deb .dlpack
fi
if [ ! -d .deps/usr/include/CLI ]; then
  (cd "$tmp" && apt-get download libpcre2-dev libcli11-dev nlohmann-json3-dev >/dev/null)
  for f in "$tmp"/*.deb; do case "$f" in *dlpack*) ;; *) dpkg -x "$f" .deps ;; esac; done
  find .deps -name '*.a' -delete  # static archives: not needed, and every MB counts against the 64 MiB
fi
if ! ls .whl/accelerate*.whl >/dev/null 2>&1; then  # liger-kernel: a peer; gguf + accelerate: transformers' GGUF loading
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
    -d .whl liger-kernel gguf accelerate
fi
model=${1:-${KS_CACHE:-$HOME/.cache/kernscope}/SmolLM2-135M-Instruct.Q4_1.gguf}
if [ -f "$model" ] && { [ ! -f .mdl/part_ab ] || [ "$(stat -c %s .mdl/part_aa)" != 50000000 ]; }; then
  rm -rf .mdl && mkdir -p .mdl && split -b 50000000 "$model" .mdl/part_
fi
du -sh .dlpack .deps .whl .mdl 2>/dev/null
