#!/usr/bin/env bash
# local tier, two users on one machine (tests/test_faults.py): useradd/runuser (passwd, util-linux)
# and setfacl (acl), which lets the throwaway second user enter the directories this Python and
# checkout sit in (here the interpreter lives under /root, mode 0700).
set -euo pipefail
if [ "$(id -u)" = 0 ]; then
  missing=()
  command -v setfacl >/dev/null || missing+=(acl)
  command -v useradd >/dev/null || missing+=(passwd)
  command -v runuser >/dev/null || missing+=(util-linux)
  if [ "${#missing[@]}" -gt 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}"
  fi
else
  echo "15-users.sh: not root; the two-users test needs root and is skipped (or fails if required)" >&2
fi
