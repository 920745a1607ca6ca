#!/usr/bin/env bash
# One command on a CUDA machine (about 5-8 minutes on one H200): build the CUDA kernels, run the
# gpu-marked tests, the kernel benchmark (with % of HBM bandwidth), greedy == HF on CUDA in fp32
# and bf16, and the engine benchmark in bf16; then print one summary table (scripts/gpu_summary.py).
#
#   bash scripts/gpu_check.sh                       # logs and JSON under $OUT, else artifacts/gpu_check
#   GPU_CHECK_DEVICE=cpu bash scripts/gpu_check.sh  # the same pipeline on the CPU, small sizes (a dry run)
#
# Needs torch with CUDA, transformers, ninja, nvcc and pytest. Pure-Python packages the machine may
# lack (structlog, pytest-asyncio, pytest-timeout) are installed from $PAGEDSERVE_WHEELS (default
# shared/wheels) when missing; make that folder where a network is available with
#   pip download --no-deps --only-binary=:all: -d shared/wheels structlog pytest-asyncio pytest-timeout
# Nothing is downloaded here: the checks use seeded random-weight Llamas (benchmarks/helpers/random_model.py),
# the engine benchmark one of SmolLM2-135M's exact shape. With two or more GPUs, the tensor-parallel
# check (TP=2 greedy == TP=1 over NCCL, step times: benchmarks/engine/tp_bench.py). Exit status: 0 when the build, the gpu
# tests and fp32 greedy equality all pass.
set -uo pipefail
cd "$(dirname "$0")/.."
LOG=${OUT:-artifacts/gpu_check}
mkdir -p "$LOG"
PY=${PYTHON:-python3}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}  # H200; set 8.0 for an A100
export PAGEDSERVE_CACHE=${PAGEDSERVE_CACHE:-$LOG/cache}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
: > "$LOG/status.tsv"

step() {  # step NAME LIMIT_S CMD...: run under a time limit into $LOG/NAME.log; record exit status and seconds
  local name=$1 limit=$2 start=$SECONDS rc
  shift 2
  echo "[$name] $*" >&2
  timeout "$limit" "$@" > "$LOG/$name.log" 2>&1
  rc=$?
  printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - start))" >> "$LOG/status.tsv"
  echo "[$name] exit $rc after $((SECONDS - start)) s" >&2
  [ "$rc" -eq 0 ] || tail -n 5 "$LOG/$name.log" >&2
}

wheels=${PAGEDSERVE_WHEELS:-shared/wheels}
if ! "$PY" -c "import structlog, pytest_asyncio, pytest_timeout" 2>/dev/null && [ -d "$wheels" ]; then
  step deps 120 "$PY" -m pip install --no-index --find-links "$wheels" structlog pytest-asyncio pytest-timeout
fi
if [ "$DEVICE" = cuda ]; then
  step build 300 "$PY" -c "import ops.build as b; b.cuda_ops(); b.cpu_ops()"
  # gpu-marked tests: the kernels against the reference, tests/ops/test_cuda_defenses.py (error flag,
  # strided indices, >65,535 rows, the small prefill tile), test_cuda_kv_int8.py, test_cuda_multi_token.py
  step gpu_tests 300 "$PY" -m pytest -m gpu -q -p no:cacheprovider -W ignore::pytest.PytestConfigWarning \
    --junitxml="$LOG/gpu_tests.xml" tests/ops tests/engine/model
  step kernel_bench 150 "$PY" benchmarks/kernels/kernel_bench.py --device cuda --budget 0.3
else  # dry run: the CPU build and a quick benchmark; the gpu tests only skip here
  step build 300 "$PY" -c "import ops.build as b; b.cpu_ops()"
  step kernel_bench 300 "$PY" benchmarks/kernels/kernel_bench.py --device cpu --budget 0.05 --kernels prefill,fused
fi
small=()  # the CPU dry run checks fewer, shorter sequences
[ "$DEVICE" = cuda ] || small=(--num-prompts 4 --new-tokens 16)
step greedy_fp32 180 "$PY" benchmarks/quality/greedy_check.py --device "$DEVICE" --dtype float32 ${small[@]+"${small[@]}"}
step greedy_bf16 180 "$PY" benchmarks/quality/greedy_check.py --device "$DEVICE" --dtype bfloat16 ${small[@]+"${small[@]}"}
step random_model 120 "$PY" benchmarks/helpers/random_model.py --shape smollm2 --out "$LOG/smollm2-random"
if [ "$DEVICE" = cuda ]; then
  step engine_bench 300 "$PY" benchmarks/engine/engine_bench.py --model "$LOG/smollm2-random" --device cuda \
    --dtype bfloat16 --num-requests 128
else
  step engine_bench 600 "$PY" benchmarks/engine/engine_bench.py --model "$LOG/smollm2-random" --device cpu \
    --dtype float32 --num-requests 8 --hf-batch-sizes 8
fi
gpus=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ "$DEVICE" = cuda ] && [ "$gpus" -ge 2 ]; then  # tensor parallelism over NCCL: greedy TP=2 == TP=1, step times
  step random_decisive 120 "$PY" benchmarks/helpers/random_model.py --shape decisive --out "$LOG/decisive-random"
  step tp2 300 "$PY" benchmarks/engine/tp_bench.py --parts check,step --device cuda --sizes 1,2 \
    --model "$LOG/decisive-random" --batch 32 --tokens 32  # 8 heads / 2 KV heads: SmolLM2's 9 do not split in 2
else
  echo "[tp2] skipped: $gpus CUDA device(s) here; the TP=2 check needs 2" >&2
fi
"$PY" scripts/gpu_summary.py "$LOG"
