#!/usr/bin/env bash
# Self-test of scripts/check_abi_symbols.sh on a scratch copy of the header and the binding
# sources: it passes on the tree as it is, and fails naming the function and the place when
# (a) the header gains a function nobody has, (b) one binding loses a declaration.
#   tests/bindings/test_check_abi_symbols.sh LIB_OR_BUILD_DIR
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
LIB="${1:?usage: $0 LIB_OR_BUILD_DIR}"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
mkdir -p "$TMP/scripts" "$TMP/include/kernscope" "$TMP/bindings/rust/kernscope-sys/src" "$TMP/bindings/go" \
         "$TMP/bindings/node/src"
cp "$ROOT/scripts/check_abi_symbols.sh" "$TMP/scripts/"
cp "$ROOT/include/kernscope/kernscope.h" "$TMP/include/kernscope/"
cp "$ROOT"/bindings/rust/kernscope-sys/src/*.rs "$TMP/bindings/rust/kernscope-sys/src/"
cp "$ROOT"/bindings/go/*.go "$ROOT"/bindings/go/*.c "$ROOT"/bindings/go/*.h "$TMP/bindings/go/"
cp "$ROOT"/bindings/node/src/*.c "$TMP/bindings/node/src/"
pass=0 fail=0
expect() { # expect NAME STATUS PATTERN -- command...
  local name="$1" want="$2" pattern="$3"; shift 4
  local out rc=0
  out="$("$@" 2>&1)" || rc=$?
  if { [ "$want" = ok ] && [ $rc -eq 0 ]; } || { [ "$want" = fail ] && [ $rc -eq 1 ] && grep -qE "$pattern" <<<"$out"; }; then
    pass=$((pass + 1))
  else
    fail=$((fail + 1)); echo "FAIL: $name (rc=$rc)"; printf '    %s\n' "$out"
  fi
}
expect "tree as it is" ok "" -- "$TMP/scripts/check_abi_symbols.sh" "$LIB"

sed -i 's|^KS_API int ks_backend_available(ks_backend_t backend);|&\nKS_API int\n  ks_fake_fn(int x);\n/* KS_API int ks_commented_out(void); */|' \
  "$TMP/include/kernscope/kernscope.h"
expect "new header function" fail "nm -D\): ks_fake_fn" -- "$TMP/scripts/check_abi_symbols.sh" "$LIB"
out="$("$TMP/scripts/check_abi_symbols.sh" "$LIB" 2>&1 || true)"
if [ "$(grep -c 'ks_fake_fn' <<<"$out")" -eq 4 ] && ! grep -q ks_commented_out <<<"$out"; then
  pass=$((pass + 1))
else
  fail=$((fail + 1)); echo "FAIL: expected ks_fake_fn in 4 places and no ks_commented_out:"; echo "$out"
fi
cp "$ROOT/include/kernscope/kernscope.h" "$TMP/include/kernscope/"

sed -i 's|C\.ks_variant_count()|0 /* C.ks_variant_count() */|' "$TMP/bindings/go/kernscope.go"
expect "Go loses ks_variant_count" fail "Go \(bindings/go\): ks_variant_count" -- "$TMP/scripts/check_abi_symbols.sh" "$LIB"
cp "$ROOT"/bindings/go/*.go "$TMP/bindings/go/"

sed -i '/pub fn ks_gemm(/,/) -> ks_status_t;/d' "$TMP/bindings/rust/kernscope-sys/src/lib.rs"
expect "Rust loses ks_gemm" fail "Rust .*: ks_gemm$" -- "$TMP/scripts/check_abi_symbols.sh" "$LIB"

cp "$ROOT"/bindings/rust/kernscope-sys/src/*.rs "$TMP/bindings/rust/kernscope-sys/src/"

# A library that exports every ks_* function and also a strong non-ks_ symbol (what a
# statically linked libstdc++.a or libcudart_static.a looks like when it leaks).
if command -v cc >/dev/null 2>&1; then
  nm -D --defined-only "$(if [ -d "$LIB" ]; then echo "$LIB/libkernscope.so"; else echo "$LIB"; fi)" |
    awk '$2 == "T" && $3 ~ /^ks_/ {sub(/@.*/, "", $3); print "void " $3 "(void) {}"}' > "$TMP/fake.c"
  echo 'int leaked_static_runtime_fn(void) { return 1; }' >> "$TMP/fake.c"
  cc -shared -fPIC -o "$TMP/libfake.so" "$TMP/fake.c"
  expect "strong non-ks_ export" fail "leaked_static_runtime_fn" -- "$TMP/scripts/check_abi_symbols.sh" "$TMP/libfake.so"
fi

echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
