#!/usr/bin/env bash
# Compile-check every CUDA source with nvcc (sm_80 and sm_90) when nvcc is present.
set -euo pipefail
cd "$(dirname "$0")/.."
NVCC=${NVCC:-$(command -v nvcc || true)}
if [ -z "$NVCC" ]; then echo "nvcc not found: CUDA compile check skipped"; exit 0; fi
shopt -s nullglob
files=(csrc/*.cu)
if [ ${#files[@]} -eq 0 ]; then echo "no .cu sources"; exit 0; fi
for f in "${files[@]}"; do
  for arch in 80 90; do
    echo "nvcc -c $f (sm_$arch)"
    "$NVCC" -c "$f" -o /dev/null -std=c++17 -O2 -Icsrc \
      -gencode "arch=compute_$arch,code=sm_$arch"
  done
done
