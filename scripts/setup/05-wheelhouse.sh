#!/usr/bin/env bash
# The wheels clusterkit's base install needs, in .tools/wheelhouse: the packaging test installs
# the built wheel into a fresh venv from here (--no-index), so no test reaches a package index.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${VENV:-.venv}
house=.tools/wheelhouse
# the stamp holds the dependency list the house was filled for: it is filled again when that
# list changes, not when another part of pyproject.toml (or only its mtime) does
stamp="$house/.filled"
deps=$("$VENV/bin/python" - <<'PY'
import tomllib
print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))
PY
)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$deps" ]; then
  exit 0
fi
mkdir -p "$house"
# shellcheck disable=SC2086
echo "$deps" | xargs -d '\n' "$VENV/bin/python" -m pip download -q -d "$house" \
  --only-binary=:all: 2>&1 | grep -v "is ignored" || true
printf '%s\n' "$deps" > "$stamp"
