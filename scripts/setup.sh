#!/usr/bin/env bash
# Installs what kernscope needs to build, test and run, if it is missing.
# Debian/Ubuntu packages through apt-get (as root, or with sudo). Idempotent.
set -euo pipefail

PKGS=(cmake ninja-build g++ pkg-config ccache libdlpack-dev googletest libgtest-dev
      libpcre2-dev libcli11-dev nlohmann-json3-dev python3 python3-pip unzip)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  "$(dirname "$0")/apt_install.sh" "${missing[@]}"
else
  echo "setup: system packages present"
fi
