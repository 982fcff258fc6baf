#!/usr/bin/env bash
# Test dependencies of the Python side: clusterkit with every extra plus the test tools.
set -euo pipefail
cd "$(dirname "$0")/../.."
bash scripts/install.sh test
# the notebook test's kernel: this venv's interpreter, which has clusterkit
"${VENV:-.venv}/bin/python" -m ipykernel install --sys-prefix --name python3 >/dev/null
