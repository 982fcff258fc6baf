#!/usr/bin/env bash
# sge tier: Grid Engine 8.1.9 from Debian (sge_qmaster, sge_execd, qsub/qstat/qdel/qconf).
# debconf is preseeded so that the install asks nothing; the postinst may start a qmaster,
# which is stopped again: tests start their own single-node cell (tests/sge.py) and stop it
# by PID. Idempotent. dask-jobqueue into the venv (as 20-slurm.sh).
set -euo pipefail
VENV="${VENV:-.venv}"
SGE_ROOT="${SGE_ROOT:-/var/lib/gridengine}"

if [ "$(id -u)" = 0 ]; then
  if ! command -v qconf >/dev/null || [ ! -x /usr/sbin/sge_qmaster ] || [ ! -x /usr/sbin/sge_execd ]; then
    host="$(hostname -s)"
    for p in gridengine-common gridengine-client gridengine-master; do
      printf '%s shared/gridenginemaster string %s\n' "$p" "$host"
      printf '%s shared/gridenginecell string default\n' "$p"
      printf '%s shared/gridengineconfig boolean true\n' "$p"
    done | debconf-set-selections
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends \
      gridengine-master gridengine-exec gridengine-client
  fi
  # the host name must resolve (qmaster and execd look it up)
  host="$(hostname -s)"
  getent hosts "$host" >/dev/null || echo "127.0.0.1 $host" >> /etc/hosts
  # a qmaster or execd the package scripts started: the tests run their own
  for daemon in qmaster execd; do
    pidfile="$SGE_ROOT/default/spool/$daemon/${daemon}.pid"
    if [ -s "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null \
      && [ "$(cat /proc/"$(cat "$pidfile")"/comm)" = "sge_$daemon" ]; then
      kill "$(cat "$pidfile")" || true
    fi
  done
else
  echo "25-gridengine.sh: not root; expecting gridengine-master/exec/client to be installed" >&2
fi

if [ -x "$VENV/bin/python" ] && ! "$VENV/bin/python" -c 'import dask_jobqueue' 2>/dev/null; then
  "$VENV/bin/pip" install -q 'dask-jobqueue>=0.9'
fi
