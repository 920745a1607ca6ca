"""K-quant linears at prompt and batch row counts: the bf16 panels against the paths they replaced.

SmolLM2-sized linears whose K is a whole number of 256-weight blocks (SmolLM2's own K = 576 is not:
llama.cpp stores those rows in 32-weight formats), random weights in each K-quant, one call per
path and row count, interleaved, on ``--threads`` threads:

- ``bf16_panels``: ``ops.quant.quant_linear(..., bf16=True)`` on the compiled kernel (AMX tiles, or
  AVX512-BF16 ``vdpbf16ps`` under ``PAGEDSERVE_CPU_ISA=avx512_bf16``): what a K-quant layer's
  many-row steps run on now;
- ``fp32_rows``: ``ops.quant_linear`` with fp32 activations (the packed kernel up to 128 rows,
  dequantize + oneDNN past it): the path K-quant prompt rows took before, with no panels;
- ``fixed_fp32``: the ``quant_fixed_gemm`` kernel (deterministic mode's prompt rows before);
- ``torch_bf16``: the torch fallback bf16 ``quant_linear`` takes for a format without panels;
- ``int8_rows``: the int8-activation kernel (decode rows), for scale.

Prints one JSON object per line (format, shape, rows, path, min and median ms).

    .venv/bin/python benchmarks/kernels/kquant_bf16_bench.py [--iters 20] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

import ops
import ops.quant as oq
from ops.build import cpu_ops
from ops.reference import quant as rq


def _fixed_gemm(x: torch.Tensor, w: torch.Tensor, fmt: oq.QuantFormat) -> torch.Tensor:
    """The ``quant_fixed_gemm`` kernel alone (one fma chain per output over k in order)."""
    out = x.new_empty((x.shape[0], w.shape[0]))
    cpu_ops().quant_fixed_gemm(out, x.contiguous(), w, fmt.type_id, None)
    return out

SHAPES = [(1536, 1536), (576, 1536)]  # (out, in), K a multiple of 256
ROWS = [1, 32, 128, 512]


def paths(x: torch.Tensor, w: torch.Tensor, fmt: oq.QuantFormat) -> dict[str, Callable[[], object]]:
    """The calls compared, by name (module docstring)."""
    found: dict[str, Callable[[], object]] = {
        "fp32_rows": lambda: ops.quant_linear(x, w, fmt, int8_activations=False),
        "fixed_fp32": lambda: _fixed_gemm(x, w, fmt),
        "torch_bf16": lambda: rq.quant_linear_bf16(x, w, fmt.type_id),
        "int8_rows": lambda: ops.quant_linear(x, w, fmt),
    }
    if oq.bf16_kernel() is not None and fmt.name in oq.BF16_FORMATS:
        found["bf16_panels"] = lambda: oq.quant_linear(x, w, fmt, bf16=True)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--formats", default="Q4_K,Q6_K", help="comma-separated K-quants of ops.quant.FORMATS")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    for name in args.formats.split(","):
        fmt = oq.quant_format(name)
        for n, k in SHAPES:
            w = rq.quantize(torch.randn(n, k, generator=gen) * 0.05, fmt.type_id)
            for rows in map(int, args.rows.split(",")):
                x = torch.randn(rows, k, generator=gen)
                calls = paths(x, w, fmt)
                samples: dict[str, list[float]] = {p: [] for p in calls}
                for call in calls.values():  # warm-up: panels' buffers, oneDNN's primitives
                    call()
                for _ in range(args.iters):
                    for p, call in calls.items():
                        start = time.perf_counter()
                        call()
                        samples[p].append(time.perf_counter() - start)
                for p, times in samples.items():
                    print(json.dumps({"format": name, "shape": f"{n}x{k}", "rows": rows, "path": p,
                                      "kernel": oq.bf16_kernel() if p == "bf16_panels" else None,
                                      "threads": args.threads, "min_ms": round(1e3 * min(times), 3),
                                      "median_ms": round(1e3 * statistics.median(times), 3)}), flush=True)


if __name__ == "__main__":
    main()
