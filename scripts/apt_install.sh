#!/usr/bin/env bash
# Installs the given Debian/Ubuntu packages with apt-get (as root, or through
# sudo). Shared by the setup scripts, which decide what is missing.
#   scripts/apt_install.sh PKG...
set -euo pipefail
[ $# -gt 0 ] || exit 0
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "$@"
