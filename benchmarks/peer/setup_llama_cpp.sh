#!/usr/bin/env bash
# Installs llama-cpp-python 0.3.36 (llama.cpp built from source for this CPU) into a virtualenv
# of its own, for benchmarks/peer/llama_cpp_bench.py. A benchmark tool, never a pagedserve
# dependency: nothing here touches the project's .venv. Idempotent: a finished install is left alone.
#
#   bash benchmarks/peer/setup_llama_cpp.sh      # venv in ${PAGEDSERVE_CACHE:-~/.cache/pagedserve}/peer/llama-cpp-venv
#   LLAMA_CPP_VENV=/some/dir bash benchmarks/peer/setup_llama_cpp.sh
#
# The build takes ~16 minutes of wall time on two cores (../shared/NOTES.md, "llama.cpp");
# GGML_NATIVE=ON targets this CPU's instruction set, as pagedserve's -march=native does. Where the
# CPU reports AMX, llama.cpp's AMX matmul dies with SIGILL on these VMs, so the build switches AMX
# off (-mno-amx-*, GGML_AMX_*=OFF): its repacked (interleaved) weight layouts, which its users get
# by default, then still run. The default model params are never changed by the benchmarks.
set -euo pipefail

VERSION=0.3.36
VENV="${LLAMA_CPP_VENV:-${PAGEDSERVE_CACHE:-$HOME/.cache/pagedserve}/peer/llama-cpp-venv}"
PYTHON="${PYTHON:-python3}"

check() {
    [ -x "$VENV/bin/python" ] || return 1
    "$VENV/bin/python" - "$VERSION" <<'PY' >/dev/null 2>&1
import sys
from importlib.metadata import version
assert version("llama_cpp_python") == sys.argv[1], version("llama_cpp_python")
import llama_cpp  # noqa: F401  (the shared library loads)
PY
}

if check; then
    echo "llama-cpp-python $VERSION already installed in $VENV"
    exit 0
fi
mkdir -p "$(dirname "$VENV")"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --upgrade --quiet pip
echo "building llama.cpp from source (~16 min on two cores) into $VENV"
CMAKE_ARGS="-DGGML_NATIVE=ON"
if grep -qw amx_tile /proc/cpuinfo; then
    echo "this CPU reports AMX: building llama.cpp with AMX switched off (its repack path still runs)"
    NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    CMAKE_ARGS="$CMAKE_ARGS -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
    CMAKE_ARGS="$CMAKE_ARGS -DCMAKE_C_FLAGS='$NO_AMX' -DCMAKE_CXX_FLAGS='$NO_AMX'"
fi
CMAKE_ARGS="$CMAKE_ARGS" "$VENV/bin/python" -m pip install --no-cache-dir "llama-cpp-python==$VERSION"
check || { echo "llama-cpp-python $VERSION did not import after the build" >&2; exit 1; }
echo "llama-cpp-python $VERSION ready: $VENV/bin/python"
