"""Time the int8-activation kernel on a K-quant weight in GGUF order against its eight-row layout
(Q4_Kr8, Q6_Kr8: csrc/cpu/quant_interleaved_k.cpp), in one process, rounds alternating.

Prints one JSON line per format and row count: the minimum milliseconds of `quant_linear(..., per_row=True)`
(a MoE expert's entry: the kernel at every row count) over `--rounds` x `--iters` calls.

    .venv/bin/python benchmarks/kernels/kquant_r8_bench.py --n 4096 --k 2048 --rows 1 4 32 --threads 2
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import ops
from ops.quant import FORMATS, interleave
from ops.reference import quant as ref


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--k", type=int, default=2048)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 32])
    parser.add_argument("--formats", nargs="+", default=["Q4_K", "Q6_K"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    for name in args.formats:
        base = FORMATS[name]
        packed = ref.quantize(torch.randn(args.n, args.k, generator=gen) * 0.05, base.type_id)
        r8, layout = interleave(packed, base)
        for m in args.rows:
            x = torch.randn(m, args.k, generator=gen)
            best = {base.name: float("inf"), layout.name: float("inf")}
            for _ in range(args.rounds):
                for w, fmt in ((packed, base), (r8, layout)):
                    for _ in range(args.iters):
                        start = time.perf_counter()
                        ops.quant.quant_linear(x, w, fmt, per_row=True)
                        best[fmt.name] = min(best[fmt.name], time.perf_counter() - start)
            print(json.dumps({"bench": "kquant_r8", "n": args.n, "k": args.k, "rows": m, "threads": args.threads,
                              "min_ms": {f: round(1e3 * t, 3) for f, t in best.items()}}))


if __name__ == "__main__":
    main()
