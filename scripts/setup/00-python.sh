#!/usr/bin/env bash
# Test dependencies of the Python side: clusterkit with every extra plus the test tools.
set -euo pipefail
cd "$(dirname "$0")/../.."
bash scripts/install.sh test
