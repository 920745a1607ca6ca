#!/usr/bin/env bash
# Validate docker-compose.yml with Compose v1 (`docker-compose config -q`), which needs no Docker
# engine. Compose v1 lives in its own virtualenv (.venv-compose), installed once with the
# constraint cython<3 (PyYAML 5 does not build with Cython 3). Skipped, with a message, when pip
# cannot install it (offline machine).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${COMPOSE_VENV:-.venv-compose}
COMPOSE="$VENV/bin/docker-compose"

if [ ! -x "$COMPOSE" ]; then
    constraint=$(mktemp)
    trap 'rm -f "$constraint"' EXIT
    echo 'cython<3' > "$constraint"
    if ! { python3 -m venv "$VENV" \
           && PIP_CONSTRAINT="$constraint" "$VENV/bin/pip" install -q --disable-pip-version-check \
              'docker-compose==1.29.2'; } >"${TMPDIR:-/tmp}/check_compose.log" 2>&1; then
        echo "check_compose: skipped (could not install docker-compose 1.29.2; see ${TMPDIR:-/tmp}/check_compose.log)"
        rm -rf "$VENV"
        exit 0
    fi
fi
"$COMPOSE" -f docker-compose.yml config -q
echo "check_compose: docker-compose.yml is valid"
