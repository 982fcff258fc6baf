#!/usr/bin/env bash
# slurm tier: slurm-wlm (slurmctld, slurmd, sbatch/squeue/scancel) and munge from Debian.
# Tests start their own single-node SLURM on 127.0.0.1 from a config in a temp directory
# (tests/slurm.py); nothing is started here. dask-jobqueue into the venv.
set -euo pipefail
VENV="${VENV:-.venv}"

if [ "$(id -u)" = 0 ]; then
  missing=()
  command -v slurmctld >/dev/null || missing+=(slurm-wlm)
  command -v munged >/dev/null || [ -x /usr/sbin/munged ] || missing+=(munge)
  if [ "${#missing[@]}" -gt 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}"
  fi
  # the postinst writes a key but not on every image; munged refuses to start without one
  if [ ! -s /etc/munge/munge.key ]; then
    if command -v mungekey >/dev/null; then mungekey --create --force; else
      dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null; fi
    chown munge:munge /etc/munge/munge.key && chmod 0400 /etc/munge/munge.key
  fi
  # SLURM's NodeName is `hostname -s`, and it must resolve
  host="$(hostname -s)"
  if ! getent hosts "$host" >/dev/null; then
    echo "127.0.0.1 $host" >> /etc/hosts
  fi
else
  echo "20-slurm.sh: not root; expecting slurm-wlm and munge to be installed" >&2
fi

if [ -x "$VENV/bin/python" ] && ! "$VENV/bin/python" -c 'import dask_jobqueue' 2>/dev/null; then
  "$VENV/bin/pip" install -q 'dask-jobqueue>=0.9'
fi
