#!/usr/bin/env bash
# ssh tier: OpenSSH server (tests start a private sshd on 127.0.0.1), iproute2 (network
# namespaces for the two-host test), procps, sshfs (FUSE over that sshd: a network state
# directory); asyncssh into the venv.
set -euo pipefail
VENV="${VENV:-.venv}"

if [ "$(id -u)" = 0 ]; then
  missing=()
  [ -x /usr/sbin/sshd ] || missing+=(openssh-server)
  command -v ip >/dev/null || missing+=(iproute2)
  command -v pgrep >/dev/null || missing+=(procps)
  command -v ssh-keygen >/dev/null || missing+=(openssh-client)
  command -v sshfs >/dev/null || missing+=(sshfs)   # a state directory on a network mount
  if [ "${#missing[@]}" -gt 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}"
  fi
  mkdir -p /run/sshd   # privilege-separation directory sshd insists on
  chmod 0755 /run/sshd
else
  echo "10-ssh.sh: not root; expecting /usr/sbin/sshd, ssh-keygen and ip to be installed" >&2
fi

if [ -x "$VENV/bin/python" ] && ! "$VENV/bin/python" -c 'import asyncssh' 2>/dev/null; then
  "$VENV/bin/pip" install -q 'asyncssh>=2.14'
fi
