#!/usr/bin/env bash
# Builds and tests the Rust, Go and Node bindings against BUILD_DIR/libkernscope.so, after the
# ABI symbol check. Build outputs go to BUILD_DIR/bindings/ (the source tree stays clean).
#
#   bindings/run_tests.sh BUILD_DIR [abi] [rust] [go] [node]      (default: all four)
#
# Needs cargo, go (>= 1.19), node (>= 18) with node_api.h, cmake, a C compiler
# (scripts/setup_bindings.sh installs them). KS_BINDINGS_JOBS (default 2) caps build jobs;
# KS_BINDINGS_SKIP_MISSING=1 skips a language whose toolchain is missing instead of failing.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
[ $# -ge 1 ] || { echo "usage: $0 BUILD_DIR [abi] [rust] [go] [node]" >&2; exit 2; }
BUILD="$(cd "$1" 2>/dev/null && pwd)" || { echo "run_tests: no build dir $1" >&2; exit 2; }
shift
[ -f "$BUILD/libkernscope.so" ] || { echo "run_tests: $BUILD/libkernscope.so not built" >&2; exit 2; }
STAGES=("$@")
[ ${#STAGES[@]} -gt 0 ] || STAGES=(abi rust go node)
JOBS="${KS_BINDINGS_JOBS:-2}"
OUT="$BUILD/bindings"
mkdir -p "$OUT"
INC="$ROOT/include"
DLPACK_INC="$(sed -n 's/^DLPACK_INCLUDE_DIR:[A-Z]*=//p' "$BUILD/CMakeCache.txt" 2>/dev/null)"
[ -n "$DLPACK_INC" ] && [ -f "$DLPACK_INC/dlpack/dlpack.h" ] || DLPACK_INC=/usr/include
if ! command -v cargo >/dev/null 2>&1 && [ -x "${HOME:-/root}/.cargo/bin/cargo" ]; then
  PATH="${HOME:-/root}/.cargo/bin:$PATH"
fi
if [ -z "${HOME:-}" ]; then
  export GOCACHE="${GOCACHE:-$OUT/go-cache}" GOPATH="${GOPATH:-$OUT/gopath}"
fi

passed=() failed=() skipped=()
need() { # need TOOL STAGE: 0 if present; else fail or skip the stage
  command -v "$1" >/dev/null 2>&1 && return 0
  if [ "${KS_BINDINGS_SKIP_MISSING:-0}" = 1 ]; then
    echo "run_tests: $2: skipped, no $1 (scripts/setup_bindings.sh installs it)"; skipped+=("$2")
  else
    echo "run_tests: $2: no $1 on the PATH (run scripts/setup_bindings.sh)" >&2; failed+=("$2")
  fi
  return 1
}
stage() { # stage NAME COMMAND...: runs the command, records the result
  local name="$1"; shift
  echo "==== bindings: $name"
  if "$@"; then passed+=("$name"); else failed+=("$name"); echo "==== bindings: $name FAILED" >&2; fi
}

run_abi() {
  "$ROOT/scripts/check_abi_symbols.sh" "$BUILD/libkernscope.so" &&
    "$ROOT/tests/bindings/test_check_abi_symbols.sh" "$BUILD/libkernscope.so"
}

run_rust() {
  CARGO_TARGET_DIR="$OUT/rust" KERNSCOPE_LIB_DIR="$BUILD" KERNSCOPE_INCLUDE_DIR="$INC" \
    cargo test --offline --manifest-path "$ROOT/bindings/rust/Cargo.toml" -j "$JOBS"
}

run_go() {
  (cd "$ROOT/bindings/go" &&
    export CGO_ENABLED=1 GOPROXY=off GOTOOLCHAIN=local GOFLAGS="-p=$JOBS" \
           CGO_CFLAGS="${CGO_CFLAGS:--g -O2} -I$INC -I$DLPACK_INC" \
           CGO_LDFLAGS="${CGO_LDFLAGS:-} -L$BUILD -Wl,-rpath,$BUILD" &&
    go vet ./... && go test -count=1 ./...)
}

run_node() {
  local gen=()
  command -v ninja >/dev/null 2>&1 && gen=(-G Ninja)
  [ -f "$OUT/node/CMakeCache.txt" ] && gen=()
  cmake -S "$ROOT/bindings/node" -B "$OUT/node" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release \
        -DKERNSCOPE_LIB_DIR="$BUILD" -DKERNSCOPE_INCLUDE_DIR="$INC" -DDLPACK_INCLUDE_DIR="$DLPACK_INC" >/dev/null &&
    cmake --build "$OUT/node" -j "$JOBS" &&
    (cd "$ROOT/bindings/node" && KERNSCOPE_NODE_ADDON="$OUT/node/kernscope.node" node --test test/kernscope.test.js) &&
    if command -v tsc >/dev/null 2>&1; then
      echo "run_tests: checking index.d.ts with $(tsc --version)" && tsc -p "$ROOT/bindings/node/test/tsconfig.json"
    else
      echo "run_tests: no tsc: index.d.ts not type-checked (apt: node-typescript)"
    fi
}

for s in "${STAGES[@]}"; do
  case "$s" in
    abi) need nm abi && need perl abi && stage abi run_abi ;;
    rust) need cargo rust && stage rust run_rust ;;
    go) need go go && stage go run_go ;;
    node) need node node && need cmake node && stage node run_node ;;
    *) echo "run_tests: unknown stage $s (abi, rust, go, node)" >&2; exit 2 ;;
  esac
done

echo "==== bindings: passed: ${passed[*]:-none}; failed: ${failed[*]:-none}${skipped:+; skipped: ${skipped[*]}}"
echo "bindings: ${#passed[@]} passed, ${#failed[@]} failed"
[ ${#failed[@]} -eq 0 ]
