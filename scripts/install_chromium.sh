#!/usr/bin/env bash
# Installs Debian's chromium for the browser tests (tests/e2e/test_browser.py). Idempotent:
# exits 0 at once when chromium is already on PATH; installs it with apt-get when run as
# root; otherwise says what to run and exits 0 (the browser tests then skip, saying why).
set -euo pipefail

if command -v chromium >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing chromium (apt-get, about a minute)…" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends chromium >/dev/null
  command -v chromium >/dev/null 2>&1 && exit 0
  echo "install_chromium.sh: apt-get ran but chromium is not on PATH" >&2
  exit 1
fi
echo "install_chromium.sh: chromium not found; run 'sudo apt-get install -y chromium' (needs root)" >&2
exit 0
