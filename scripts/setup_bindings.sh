#!/usr/bin/env bash
# Installs what the Rust, Go and Node bindings need, if it is missing (Debian/Ubuntu, apt-get,
# as root or through sudo). Idempotent: dpkg and the PATH are checked first, nothing is
# reinstalled. Run scripts/setup.sh first for the C/C++ toolchain (cmake, ninja, g++, dlpack).
#
#   go     Debian's golang-go (cgo; the bindings need Go >= 1.19).
#   node   Node-API headers (node_api.h). If the installed node already ships them (NodeSource's
#          nodejs package puts them in /usr/include/node) nothing is installed: Debian's
#          libnode-dev installs the same paths and conflicts with that package. Otherwise
#          Debian's nodejs + libnode-dev (a matching pair) are installed.
#   cargo  only if no cargo is on the PATH: Debian's cargo (the crates build with Rust >= 1.63).
#   tsc    Debian's node-typescript, to type-check bindings/node/index.d.ts (test/types.ts).
set -euo pipefail

have_pkg() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }

node_headers() {
  # Prints the directory holding node_api.h for the node on the PATH, if any.
  local d prefix=""
  if command -v node >/dev/null 2>&1; then
    prefix="$(dirname "$(dirname "$(readlink -f "$(command -v node)")")")"
  fi
  for d in ${prefix:+"$prefix/include/node"} /usr/include/node /usr/local/include/node /usr/include/nodejs/src; do
    [ -f "$d/node_api.h" ] && { echo "$d"; return 0; }
  done
  return 1
}

missing=()
if ! have_pkg golang-go && ! command -v go >/dev/null 2>&1; then missing+=(golang-go); fi
if ! node_headers >/dev/null; then
  have_pkg libnode-dev || missing+=(libnode-dev)
  command -v node >/dev/null 2>&1 || have_pkg nodejs || missing+=(nodejs)
fi
if ! command -v cargo >/dev/null 2>&1 && ! have_pkg cargo && [ ! -x "${HOME:-/root}/.cargo/bin/cargo" ]; then
  missing+=(cargo)
fi
command -v tsc >/dev/null 2>&1 || have_pkg node-typescript || missing+=(node-typescript)
command -v cmake >/dev/null 2>&1 || have_pkg cmake || missing+=(cmake)
command -v cc >/dev/null 2>&1 || have_pkg gcc || missing+=(gcc)

if [ ${#missing[@]} -gt 0 ]; then
  echo "setup_bindings: installing ${missing[*]}"
  "$(dirname "$0")/apt_install.sh" "${missing[@]}"
else
  echo "setup_bindings: go, node headers, cargo and tsc present"
fi

# The addon is built against the headers' Node-API; the node binary must support that version.
hdr="$(node_headers)" || { echo "setup_bindings: node_api.h not found after install" >&2; exit 1; }
node_napi="$(node -p 'process.versions.napi')"
node_ver="$(node -p 'process.versions.node')"
hdr_ver="$(sed -n 's/^#define NODE_\(MAJOR\|MINOR\|PATCH\)_VERSION \([0-9]*\).*/\2/p' "$hdr/node_version.h" | paste -sd.)"
echo "setup_bindings: node $node_ver (Node-API $node_napi), headers $hdr (node $hdr_ver); addon uses Node-API 8"
if [ "$node_napi" -lt 8 ]; then
  echo "setup_bindings: node $node_ver supports Node-API $node_napi < 8" >&2
  exit 1
fi
if [ "${node_ver%%.*}" != "${hdr_ver%%.*}" ]; then
  echo "setup_bindings: note: node $node_ver and headers $hdr_ver differ in major version (fine for Node-API 8)"
fi
go version
if command -v cargo >/dev/null 2>&1; then cargo --version; else "${HOME:-/root}/.cargo/bin/cargo" --version; fi
