#!/usr/bin/env bash
# Create the project's virtual environment (.venv, or $VENV) and install clusterkit with extras.
# Usage: bash scripts/install.sh EXTRAS      e.g. "hpo,ddp" or "test". Idempotent.
# The releases come from constraints/ci.txt (pip -c; CONSTRAINTS=FILE for another, CONSTRAINTS= for
# none): pyproject.toml has ranges, this file the one set CI tests, so this install is reproducible.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
EXTRAS=${1:-hpo,ddp}
PYTHON=${PYTHON:-python3}
CONSTRAINTS=${CONSTRAINTS-constraints/ci.txt}
pin=()
if [ -n "$CONSTRAINTS" ]; then pin=(-c "$CONSTRAINTS"); fi

if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "clusterkit needs Python >= 3.11 ($PYTHON is $("$PYTHON" --version 2>&1))" >&2
  exit 1
fi
if [ ! -x "$VENV/bin/python" ]; then
  if ! "$PYTHON" -m venv "$VENV" 2>/dev/null; then
    # Debian's python3 ships venv separately
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
      rm -rf "$VENV"; "$PYTHON" -m venv "$VENV"
    else
      echo "cannot create a venv: install python3-venv" >&2; exit 1
    fi
  fi
fi
stamp="$VENV/.clusterkit-installed-$EXTRAS"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || { [ -n "$CONSTRAINTS" ] && [ "$CONSTRAINTS" -nt "$stamp" ]; }; then
  "$VENV/bin/python" -m pip install -q --upgrade pip 2>&1 | grep -v "is ignored" || true
  # torch: constraints/ci.txt holds it at 2.13.0 (the CPU build this machine has); see README for CUDA.
  "$VENV/bin/python" -m pip install -q "${pin[@]}" -e ".[$EXTRAS]" 2>&1 | grep -v "is ignored" || true
  "$VENV/bin/python" -c "import clusterkit" && touch "$stamp"
fi
