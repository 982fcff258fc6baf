#!/usr/bin/env bash
# local tier, Optuna artifacts on S3 (tests/test_hpo_artifacts_s3.py): moto's S3 server and boto3
# in a venv of their own, .tools/s3/venv, since botocore and moto need python-dateutil<3 and the
# kubernetes package in the main venv needs >=3. The test's Dask worker runs from this venv, so
# it also gets clusterkit from this checkout (editable, no extras: the worker runs the code the
# driver runs) and Optuna, at the main venv's versions of everything a worker shares with the
# scheduler and the driver (the wire protocol, pickles, Optuna's objects), and the main venv's
# interpreter (functions pickled by value are bytecode). Idempotent: redone only when those
# versions, clusterkit's dependencies or this script's packages change.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${VENV:-.venv}
S3=.tools/s3
# moto's S3 and its server (Flask), not moto[server]: that extra is every service's dependencies
# (cfn-lint, sympy, networkx, docker, ...), 170 MB more and 25-30 s more to install
PACKAGES=("moto[s3]==5.2.*" flask flask-cors boto3)
SHARED=(dask distributed cloudpickle msgpack optuna numpy tornado toolz psutil pyyaml pydantic
  pydantic-core)

# the main venv's versions of the shared packages, as pip constraints
pins=$("$VENV/bin/python" -m pip freeze --all 2>/dev/null | "$VENV/bin/python" -c '
import re, sys
wanted = sys.argv[1:]
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
found = {}
for line in sys.stdin:
    name, sep, version = line.strip().partition("==")
    if sep and norm(name) in wanted:
        found[norm(name)] = f"{norm(name)}=={version}"
missing = [name for name in wanted if name not in found]
if missing:
    sys.exit(f"45-s3.sh: not installed in the main venv: {missing} (run scripts/setup/00-python.sh)")
print("\n".join(found[name] for name in wanted))
' "${SHARED[@]}")
deps=$("$VENV/bin/python" -c '
import tomllib
print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))')
# the stamp holds what the venv was made for
want=$(printf '%s\n' "$("$VENV/bin/python" --version)" "${PACKAGES[@]}" optuna "$pins" "$deps")
stamp="$S3/.installed"
if [ -x "$S3/venv/bin/moto_server" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi

rm -f "$stamp"
mkdir -p "$S3"
# the main venv's base interpreter, and the main venv's pip (no ensurepip in the new venv)
[ -x "$S3/venv/bin/python" ] || "$VENV/bin/python" -m venv --without-pip "$S3/venv"
printf '%s\n' "$pins" > "$S3/constraints.txt"
links=()
[ -d .tools/wheelhouse ] && links=(--find-links .tools/wheelhouse)
# (the editable build's advice about same-named folders is a warning: not shown)
PYTHONWARNINGS=ignore "$VENV/bin/python" -m pip --python "$S3/venv/bin/python" install -q --prefer-binary \
  "${links[@]}" -c "$S3/constraints.txt" -e . optuna "${PACKAGES[@]}" 2>&1 |
  { grep -v "is ignored" || true; }
"$S3/venv/bin/python" -c 'import boto3, clusterkit, distributed, moto.server, optuna'
printf '%s\n' "$want" > "$stamp"
