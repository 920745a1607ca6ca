#!/usr/bin/env bash
# Compile-check the CUDA sources without a GPU: every csrc/*.cu with nvcc (sm_90 by default; the
# sources have no per-architecture code, so a second architecture doubles the time and checks
# only its resource limits: CUDA_CHECK_ARCHS="80 90" for both; no torch headers needed), then a
# syntax-only pass over the CUDA bindings (csrc/bindings.cpp)
# with torch's and CUDA's include paths, as torch.utils.cpp_extension would build them.
set -euo pipefail
cd "$(dirname "$0")/.."
NVCC=${NVCC:-$(command -v nvcc || true)}
if [ -z "$NVCC" ]; then echo "nvcc not found: CUDA compile check skipped"; exit 0; fi
shopt -s nullglob
files=(csrc/*.cu)
if [ ${#files[@]} -eq 0 ]; then echo "no .cu sources"; exit 0; fi
STD=${CUDA_CHECK_STD:-c++20}  # torch 2.13's cpp_extension compiles with C++20
gencode=()
for arch in ${CUDA_CHECK_ARCHS:-90}; do gencode+=(-gencode "arch=compute_$arch,code=sm_$arch"); done
# One nvcc per file, all at once (the int8-cache kernels doubled the attention instantiations);
# each file's output is printed after it, and any failure fails the check.
logs=$(mktemp -d)
pids=()
for f in "${files[@]}"; do
  echo "nvcc -c $f (sm ${CUDA_CHECK_ARCHS:-90})"
  "$NVCC" -c "$f" -o /dev/null -std="$STD" -O3 -Icsrc "${gencode[@]}" > "$logs/$(basename "$f").log" 2>&1 &
  pids+=($!)
done
failed=0
for i in "${!files[@]}"; do
  if ! wait "${pids[$i]}"; then echo "FAILED: ${files[$i]}"; failed=1; fi
  cat "$logs/$(basename "${files[$i]}").log"
done
rm -rf "$logs"
[ "$failed" -eq 0 ] || exit 1

PYTHON=${PYTHON:-.venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=python3
if [ -f csrc/bindings.cpp ] && torch_inc=$("$PYTHON" -c \
    "from torch.utils.cpp_extension import include_paths as p; print(' '.join('-I' + x for x in p()))" 2>/dev/null); then
  cuda_inc="$(dirname "$(dirname "$(readlink -f "$NVCC")")")/include"
  # The nvcc on PATH may be a wrapper script: ask it where the toolkit lives.
  [ -f "$cuda_inc/cuda_runtime_api.h" ] || cuda_inc="$("$NVCC" --dryrun -c -x cu /dev/null 2>&1 \
    | sed -n 's/^#\$ INCLUDES="-I\([^"]*\)".*/\1/p' | head -n1)"
  echo "c++ -fsyntax-only csrc/bindings.cpp"
  # shellcheck disable=SC2086
  ${CXX:-c++} -fsyntax-only -std="$STD" -DC10_CUDA_NO_CMAKE_CONFIGURE_FILE $torch_inc -I"$cuda_inc" -Icsrc \
    csrc/bindings.cpp
else
  echo "torch not importable: bindings syntax check skipped"
fi
echo "CUDA compile check passed"
