#!/usr/bin/env bash
# The wheels clusterkit's base install needs, in .tools/wheelhouse: the packaging test installs
# the built wheel into a fresh venv from here (--no-index), so no test reaches a package index.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${VENV:-.venv}
house=.tools/wheelhouse
stamp="$house/.filled"
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ]; then
  exit 0
fi
mkdir -p "$house"
deps=$("$VENV/bin/python" - <<'PY'
import tomllib
print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))
PY
)
# shellcheck disable=SC2086
echo "$deps" | xargs -d '\n' "$VENV/bin/python" -m pip download -q -d "$house" \
  --only-binary=:all: 2>&1 | grep -v "is ignored" || true
touch "$stamp"
