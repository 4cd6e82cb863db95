#!/usr/bin/env bash
# Prepares a private Python environment for building and testing the kernscope
# Python package (python/, tests/python), if it is missing. Idempotent: an
# existing venv is reused and a package is installed only when it cannot be
# imported, so a second run does nothing and needs no network.
#
#   scripts/setup_python.sh [VENV_DIR]     (default: build/python-venv)
#
# The venv is isolated from the system's site-packages (nothing is installed
# outside VENV_DIR; torch, if the system has it, stays invisible, so the torch
# and GPU tests skip). It gets the build requirements that pyproject.toml names
# (nanobind, scikit-build-core; the build itself uses the system's cmake and
# ninja from scripts/setup.sh, through --no-build-isolation) and the test
# requirements (numpy, ml_dtypes, pytest). No torch.
#
# PYTHON selects the interpreter (default python3; >= 3.9, with its C headers).
# On Debian/Ubuntu a missing venv module or Python.h is installed through
# apt-get (python3-venv, python3-dev), as root or with sudo.
set -euo pipefail

VENV="${1:-build/python-venv}"
PY="${PYTHON:-python3}"

command -v "$PY" >/dev/null 2>&1 || { echo "setup_python: no $PY on the PATH (scripts/setup.sh installs python3)" >&2; exit 1; }
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 9))' ||
  { echo "setup_python: $("$PY" --version 2>&1) is too old (need >= 3.9)" >&2; exit 1; }

apt_install() {
  command -v apt-get >/dev/null 2>&1 || return 1
  echo "setup_python: installing $*"
  "$(dirname "$0")/apt_install.sh" "$@"
}

# The extension is compiled against the interpreter's headers.
if ! "$PY" -c 'import os, sysconfig, sys; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))'; then
  apt_install python3-dev || { echo "setup_python: Python.h not found for $PY (install its -dev package)" >&2; exit 1; }
fi

if [ ! -x "$VENV/bin/python" ]; then
  mkdir -p "$(dirname "$VENV")"
  if ! "$PY" -m venv "$VENV" 2>/dev/null; then
    rm -rf "$VENV"
    apt_install python3-venv || { echo "setup_python: $PY cannot create a venv (install its venv module)" >&2; exit 1; }
    "$PY" -m venv "$VENV"
  fi
  echo "setup_python: created $VENV ($("$VENV/bin/python" --version 2>&1))"
fi
VPY="$VENV/bin/python"

# import name -> requirement (the lower bounds of pyproject.toml)
declare -A REQ=(
  [nanobind]="nanobind>=2.2"
  [scikit_build_core]="scikit-build-core>=0.10"
  [numpy]="numpy>=1.22"
  [ml_dtypes]="ml_dtypes>=0.3"
  [pytest]="pytest>=7"
)
missing=()
for mod in nanobind scikit_build_core numpy ml_dtypes pytest; do
  "$VPY" -c "import $mod" 2>/dev/null || missing+=("${REQ[$mod]}")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup_python: pip installing ${missing[*]} into $VENV"
  "$VPY" -m pip install -q --disable-pip-version-check "${missing[@]}"
else
  echo "setup_python: $VENV has nanobind, scikit-build-core, numpy, ml_dtypes and pytest"
fi
