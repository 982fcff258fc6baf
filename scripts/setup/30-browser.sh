#!/usr/bin/env bash
# local tier, the live study dashboard (tests/test_dashboard.py): Debian's headless chromium and
# its chromedriver, which Selenium (the test extra) drives offline. Idempotent.
set -euo pipefail
if [ "$(id -u)" = 0 ]; then
  missing=()
  command -v chromium >/dev/null || missing+=(chromium)
  command -v chromedriver >/dev/null || missing+=(chromium-driver)
  if [ "${#missing[@]}" -gt 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}"
  fi
else
  echo "30-browser.sh: not root; the dashboard test needs chromium and chromium-driver" >&2
fi
