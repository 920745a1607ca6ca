"""Compute rate of the eight-row ("r8") kernels at a decode batch's row counts: int8 activation rows
times one weight held in the last-level cache, so the kernel's arithmetic, not the memory, sets the
time (``stream_share_bench.py`` measures the one-row, memory-bound side).

Per format and row count M: a random [N, K] weight quantized and repacked to its r8 layout, M
activation rows through ``ops.quant.quant_linear`` (int8 activations, every row on the C++ kernel),
timed in CPU time of the calling thread (``--threads 1``), best of ``--rounds``. Prints one JSON
line per format and M: GMAC/s (M * N * K multiply-adds per second). Run it in two checkouts to
compare kernels, or with ``PAGEDSERVE_ISA`` set to compare ISA levels.

    .venv/bin/python benchmarks/kernels/rows_bench.py [--formats Q4_K,Q6_K,Q4_0,Q8_0] [--rows 1,4,32]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import ops
from ops.quant import FORMATS, interleave
from ops.reference import quant as ref


def gmac_s(name: str, n: int, k: int, rows: int, rounds: int, calls: int) -> float:
    """Best rate of `calls` passes of `rows` rows through one r8 weight of format `name`."""
    gen = torch.Generator().manual_seed(0)
    base = FORMATS[name]
    w, fmt = interleave(ref.quantize(torch.randn(n, k, generator=gen) * 0.05, base.type_id), base)
    x = torch.randn(rows, k, generator=gen)
    out = torch.empty(rows, n)
    best = float("inf")
    for _ in range(rounds):
        start = time.thread_time()
        for _ in range(calls):
            ops.quant.quant_linear(x, w, fmt, per_row=True, checked=True, out=out)
        best = min(best, time.thread_time() - start)
    return rows * n * k * calls / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", default="Q4_K,Q6_K,Q4_0,Q8_0")
    parser.add_argument("--rows", default="1,4,32")
    parser.add_argument("--n", type=int, default=1024)
    parser.add_argument("--k", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for name in args.formats.split(","):
        for rows in (int(r) for r in args.rows.split(",")):
            rate = gmac_s(name, args.n, args.k, rows, args.rounds, args.calls)
            print(json.dumps({"bench": "rows", "format": name, "rows": rows, "n": args.n, "k": args.k,
                              "gmac_s": round(rate, 2)}), flush=True)


if __name__ == "__main__":
    main()
