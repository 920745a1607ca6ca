#!/usr/bin/env bash
# The whole test suite, as CI runs it: lint, CUDA compile check, model fetch, pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
export PATH="$PWD/$VENV/bin:$PATH"

echo "== ruff"
ruff check .

echo "== nvcc compile check"
bash scripts/check_cuda.sh

echo "== docker-compose.yml (Compose v1 config -q)"
bash scripts/check_compose.sh

echo "== pytest"
exec python -m pytest "$@"
