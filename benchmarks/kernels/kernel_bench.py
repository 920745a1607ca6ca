"""Kernel benchmarks, one JSON line per (point, implementation) plus a summary line per point:

- decode: paged attention's achieved K/V bandwidth with random and with contiguous (identity)
  block tables, against the torch reference and torch SDPA on contiguous K/V;
- prefill: the batched varlen paged prefill kernel against the per-sequence SDPA loop it replaced
  and the reference (kernel_bench_prefill.py);
- fused: add+RMSNorm, SiLU-and-mul, RoPE+cache write against the unfused torch code (kernel_bench_fused.py).

On CUDA every bandwidth figure also reads as a share of --peak-gbps (H200: 4800).

    python benchmarks/kernels/kernel_bench.py --device cpu [--kernels decode,prefill,fused] [--budget 1]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout's root: benchmarks.* importable
from tqdm import tqdm

import ops
from benchmarks.helpers.timing import bandwidth_fields, best_seconds
from benchmarks.kernels.kernel_bench_fused import CPU_SHAPE, CUDA_SHAPE, bench_fused
from benchmarks.kernels.kernel_bench_prefill import CPU_POINTS as CPU_PREFILL
from benchmarks.kernels.kernel_bench_prefill import CUDA_POINTS as CUDA_PREFILL
from benchmarks.kernels.kernel_bench_prefill import bench_prefill


@dataclass(frozen=True)
class Point:
    """One decode shape: every sequence has the same context length."""

    batch: int
    context: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    dtype: str


CPU_POINTS = [Point(b, c, 32, 8, 128, 16, "float32") for b, c in ((1, 4096), (8, 1024), (8, 4096), (32, 512))]
CPU_POINTS.append(Point(16, 2048, 9, 3, 64, 16, "float32"))  # SmolLM2-135M shape
CUDA_POINTS = [Point(16, 4096, 32, 8, 128, 16, "float16"), Point(64, 1024, 32, 8, 128, 16, "float16")]


Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def make_inputs(p: Point, device: str) -> Inputs:
    """Query, caches, random block tables and context lengths for one point."""
    dtype = getattr(torch, p.dtype)
    blocks_per_seq = (p.context + p.block_size - 1) // p.block_size
    num_blocks = p.batch * blocks_per_seq
    order = torch.randperm(num_blocks)
    tables = order.view(p.batch, blocks_per_seq).to(device=device, dtype=torch.int32)
    shape = (num_blocks, p.num_kv_heads, p.block_size, p.head_size)
    key_cache = torch.randn(shape, device=device, dtype=dtype)
    value_cache = torch.randn(shape, device=device, dtype=dtype)
    query = torch.randn(p.batch, p.num_heads, p.head_size, device=device, dtype=dtype)
    lens = torch.full((p.batch,), p.context, dtype=torch.int32, device=device)
    return query, key_cache, value_cache, tables, lens


def sdpa_call(p: Point, device: str) -> Callable[[], object]:
    """torch SDPA over contiguous K/V of the same size (no paging at all)."""
    dtype = getattr(torch, p.dtype)
    q = torch.randn(p.batch, p.num_heads, 1, p.head_size, device=device, dtype=dtype)
    k = torch.randn(p.batch, p.num_kv_heads, p.context, p.head_size, device=device, dtype=dtype)
    v = torch.randn_like(k)
    return lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def bench_point(p: Point, device: str, budget_s: float, bar: tqdm, peak_gbps: float) -> list[dict]:
    """Time the four implementations at one point; return their JSON rows plus a summary."""
    kv_bytes = 2 * p.batch * p.context * p.num_kv_heads * p.head_size * getattr(torch, p.dtype).itemsize
    scale = p.head_size**-0.5
    paged = make_inputs(p, device)
    # The same caches read through identity tables: any difference is the cost of paging.
    identity = torch.arange(paged[3].numel(), device=device, dtype=torch.int32).view_as(paged[3])
    contiguous: Inputs = (paged[0], paged[1], paged[2], identity, paged[4])
    out = torch.empty_like(paged[0])
    groups: list[dict[str, Callable[[], object]]] = [
        {
            "kernel": lambda: ops.paged_attention(*paged, scale, out=out),
            "kernel_contiguous_tables": lambda: ops.paged_attention(*contiguous, scale, out=out),
        },
        {"reference": lambda: ops.reference.paged_attention(*paged, scale), "sdpa_contiguous": sdpa_call(p, device)},
    ]
    times: dict[str, float] = {}
    for calls in groups:
        bar.set_description(f"{' vs '.join(calls)} b={p.batch} ctx={p.context}")
        times |= best_seconds(calls, device, budget_s)
        bar.update(len(calls))
    rows = []
    for impl, seconds in times.items():
        rows.append({
            "bench": "paged_attention_decode", "impl": impl, "device": device, **asdict(p),
            "ms": round(seconds * 1e3, 3), **bandwidth_fields(kv_bytes, seconds, device, peak_gbps),
        })
    rows.append({
        "bench": "paged_attention_summary", "device": device, **asdict(p),
        "speedup_vs_reference": round(times["reference"] / times["kernel"], 2),
        "paging_overhead_pct": round(100 * (times["kernel"] / times["kernel_contiguous_tables"] - 1), 1),
        "kernel_vs_sdpa": round(times["sdpa_contiguous"] / times["kernel"], 2),
    })
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--budget", type=float, default=1.0, help="seconds of timing per implementation")
    parser.add_argument("--kernels", default="decode,prefill,fused", help="comma-separated subset to run")
    parser.add_argument("--peak-gbps", type=float, default=4800.0, help="device memory bandwidth (H200: 4800)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA device")
    kernels = set(args.kernels.split(","))
    torch.manual_seed(0)
    cuda = args.device == "cuda"
    points = CUDA_POINTS if cuda else CPU_POINTS
    prefill_points = CUDA_PREFILL if cuda else CPU_PREFILL
    ops.paged_attention(*make_inputs(points[0], args.device), 1.0)  # build/load kernels first
    total = 4 * len(points) * ("decode" in kernels) + len(prefill_points) * ("prefill" in kernels)
    with torch.inference_mode(), tqdm(total=total + 3 * ("fused" in kernels), file=sys.stderr, unit="run") as bar:
        rows: list[dict] = []
        if "decode" in kernels:
            for point in points:
                rows += bench_point(point, args.device, args.budget, bar, args.peak_gbps)
                _flush(rows)
        if "prefill" in kernels:
            for prefill in prefill_points:
                bar.set_description(f"prefill {prefill.name} {prefill.num_seqs}x{prefill.q_len}")
                rows += bench_prefill(prefill, args.device, args.budget, with_reference=True)
                _flush(rows)
                bar.update(1)
        if "fused" in kernels:
            for num_rows in (1, 32, 2048):
                bar.set_description(f"fused ops, {num_rows} rows")
                rows += bench_fused(num_rows, CUDA_SHAPE if cuda else CPU_SHAPE, args.device, args.budget,
                                    args.peak_gbps)
                _flush(rows)
                bar.update(1)


def _flush(rows: list[dict]) -> None:
    """Print the rows gathered so far and forget them (results appear as each point finishes)."""
    for row in rows:
        print(json.dumps(row), flush=True)
    rows.clear()


if __name__ == "__main__":
    main()
