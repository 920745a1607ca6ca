"""How close a one-row GEMV on each eight-row ("r8") layout comes to streaming its weights at the
memory's rate: the kernel's bytes per second over a plain streaming read, on the same threads.

Per format, `--weights` random [N, K] weights (together far past the last-level cache) are quantized,
repacked to the r8 layout and multiplied by one activation row in turn, as a decode step runs its
layers; the read is `torch.sum` over a 1 GiB fp32 tensor. Both are timed in CPU time of the calling
thread (`--threads 1`, the default), so another process's load on the machine slows neither side
much; with more threads, in wall time. Prints one JSON line per format: the kernel's GB/s, the read's,
and their ratio (`share`). Run it in two checkouts to compare kernels (the same command in each).

    .venv/bin/python benchmarks/kernels/stream_share_bench.py [--formats Q4_K,Q6_K,Q4_0,Q8_0] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

import ops
from ops.quant import FORMATS, interleave
from ops.reference import quant as ref


def _clock(threads: int) -> Callable[[], float]:
    """The calling thread's CPU time with one thread (the kernel runs there), else wall time."""
    return time.thread_time if threads == 1 else time.perf_counter


def read_gb_s(threads: int, repeats: int = 4) -> float:
    """Best streaming read of a 1 GiB fp32 tensor, GB/s."""
    data = torch.ones(256 << 20, dtype=torch.float32)
    clock, best = _clock(threads), float("inf")
    for _ in range(repeats):
        start = clock()
        data.sum()
        best = min(best, clock() - start)
    return data.numel() * 4 / best / 1e9


def kernel_gb_s(name: str, n: int, k: int, weights: int, rounds: int, threads: int) -> tuple[float, int]:
    """Best pass of one row through `weights` r8 weights of format `name`: GB/s and the bytes read."""
    gen = torch.Generator().manual_seed(0)
    base = FORMATS[name]
    layers = [interleave(ref.quantize(torch.randn(n, k, generator=gen) * 0.05, base.type_id), base)
              for _ in range(weights)]
    nbytes = sum(w.numel() * w.element_size() for w, _ in layers)
    x = torch.randn(1, k, generator=gen)
    clock, best = _clock(threads), float("inf")
    for _ in range(rounds):
        start = clock()
        for w, fmt in layers:
            ops.quant.quant_linear(x, w, fmt, per_row=True, checked=True)
        best = min(best, clock() - start)
    return nbytes / best / 1e9, nbytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", default="Q4_K,Q6_K,Q4_0,Q8_0")
    parser.add_argument("--n", type=int, default=8192)
    parser.add_argument("--k", type=int, default=2048)
    parser.add_argument("--weights", type=int, default=12, help="weights passed in turn (their bytes pass the cache)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for name in args.formats.split(","):
        kernel, nbytes = kernel_gb_s(name, args.n, args.k, args.weights, args.rounds, args.threads)
        read = read_gb_s(args.threads)
        print(json.dumps({"bench": "stream_share", "format": name, "threads": args.threads, "weight_bytes": nbytes,
                          "kernel_gb_s": round(kernel, 4), "read_gb_s": round(read, 2),
                          "share": round(kernel / read, 3)}), flush=True)


if __name__ == "__main__":
    main()
