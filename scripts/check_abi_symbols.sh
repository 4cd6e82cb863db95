#!/usr/bin/env bash
# Checks that every function declared `KS_API ... ks_xxx(` in include/kernscope/kernscope.h is
#   - exported by the built library (nm -D --defined-only), and
#   - declared or called by every binding: Rust (`fn ks_xxx(` in bindings/rust/kernscope-sys/src),
#     Go (`C.ks_xxx(` in bindings/go/*.go or a call in bindings/go/*.c),
#     Node (a call in bindings/node/src/*.c).
# Comments are ignored. Exits 1 listing what is missing where.
#
#   scripts/check_abi_symbols.sh [LIB_OR_BUILD_DIR]     (default: build/libkernscope.so)
#   KS_ABI_HEADER=path/to/kernscope.h overrides the header (used by the self-test).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
HEADER="${KS_ABI_HEADER:-$ROOT/include/kernscope/kernscope.h}"
LIB="${1:-$ROOT/build/libkernscope.so}"
[ -d "$LIB" ] && LIB="$LIB/libkernscope.so"
[ -f "$HEADER" ] || { echo "check_abi_symbols: no header $HEADER" >&2; exit 2; }
[ -f "$LIB" ] || { echo "check_abi_symbols: no library $LIB (build it first)" >&2; exit 2; }

# C, Go and Rust sources without /* */ and // comments.
strip_comments() { perl -0777 -pe 's{/\*.*?\*/}{ }gs; s{//[^\n]*}{}g' "$@"; }

mapfile -t DECLARED < <(strip_comments "$HEADER" | tr '\n' ' ' |
  grep -oE 'KS_API[^;(]*[^A-Za-z0-9_]ks_[A-Za-z0-9_]+[[:space:]]*\(' |
  grep -oE 'ks_[A-Za-z0-9_]+[[:space:]]*\($' | tr -d ' (' | sort -u)
if [ ${#DECLARED[@]} -eq 0 ]; then
  echo "check_abi_symbols: no KS_API functions parsed from $HEADER" >&2
  exit 2
fi

EXPORTED="$(nm -D --defined-only "$LIB" | awk '$2 ~ /^[TtWwi]$/ {print $3}' | sed 's/@.*//' | sort -u)"
RUST_SRC="$(strip_comments "$ROOT"/bindings/rust/kernscope-sys/src/*.rs 2>/dev/null || true)"
GO_SRC="$(strip_comments "$ROOT"/bindings/go/*.go 2>/dev/null || true)"
GO_C_SRC="$(strip_comments "$ROOT"/bindings/go/*.c 2>/dev/null || true)"
NODE_SRC="$(strip_comments "$ROOT"/bindings/node/src/*.c 2>/dev/null || true)"

missing=0
report() { echo "  missing from $1: $2"; missing=$((missing + 1)); }
for f in "${DECLARED[@]}"; do
  grep -qx "$f" <<<"$EXPORTED" || report "$(basename "$LIB") (nm -D)" "$f"
  grep -qE "(^|[^A-Za-z0-9_])fn[[:space:]]+${f}[[:space:]]*\(" <<<"$RUST_SRC" || report "Rust (bindings/rust/kernscope-sys)" "$f"
  grep -qE "C\.${f}[[:space:]]*\(" <<<"$GO_SRC" || grep -qE "(^|[^A-Za-z0-9_])${f}[[:space:]]*\(" <<<"$GO_C_SRC" ||
    report "Go (bindings/go)" "$f"
  grep -qE "(^|[^A-Za-z0-9_])${f}[[:space:]]*\(" <<<"$NODE_SRC" || report "Node (bindings/node/src)" "$f"
done

# Exported ks_* symbols the header does not declare: a note, not a failure.
extra="$(comm -13 <(printf '%s\n' "${DECLARED[@]}") <(grep -E '^ks_' <<<"$EXPORTED" || true) | tr '\n' ' ')"
[ -n "$extra" ] && echo "check_abi_symbols: note: exported but not in the header: $extra"

# Strong exports other than ks_*: a static archive leaking into the dynamic symbol table
# (libstdc++.a, libcudart_static.a). Those interpose with the host process's own copies.
leaked="$(nm -D --defined-only "$LIB" | awk '$2 ~ /^[TDBR]$/ {print $3}' | sed 's/@.*//' |
  grep -vE '^(ks_|_init$|_fini$|_edata$|_end$|__bss_start$)' | head -5 | tr '\n' ' ' || true)"
if [ -n "$leaked" ]; then
  echo "check_abi_symbols: strong exports other than ks_* (a static library leaked; link with --exclude-libs,ALL): $leaked"
  missing=$((missing + 1))
fi

if [ "$missing" -gt 0 ]; then
  echo "check_abi_symbols: FAILED, $missing missing (header declares ${#DECLARED[@]} functions)" >&2
  exit 1
fi
echo "check_abi_symbols: ok, ${#DECLARED[@]} functions in $(basename "$LIB") and the Rust, Go and Node bindings"
