"""Decode attention over an int8 KV cache at the ladder's head shapes: K/V bytes read per second.

One batch of sequences at one context length per line, random int8 rows with valid fp16 scales,
block tables shuffled over the pool (as a running server's are), block size 16. The figure is the
K and V rows the call must read (values and scales) over its best wall time, beside a streaming read
of this machine (`torch.sum` over 1 GiB) on the same threads. Run it in two checkouts to compare
kernels (the same command in each).

    .venv/bin/python benchmarks/kernels/kv_int8_attention_bench.py [--threads 2] [--contexts 128,1024]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's ops, whichever venv runs it
import ops

# (label, query heads, kv heads, head size) of the ladder's rungs (benchmarks/ladder/shapes.py).
SHAPES = [("qwen2.5-0.5b", 14, 2, 64), ("smollm2-1.7b", 32, 32, 64), ("llama3.2-3b", 24, 8, 128),
          ("llama3.1-8b", 32, 8, 128)]
BLOCK = 16


def read_gb_s(repeats: int = 4) -> float:
    """Best streaming read of a 1 GiB fp32 tensor, GB/s."""
    data = torch.ones(256 << 20, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best / 1e9


def attention_gb_s(seqs: int, heads: int, kv_heads: int, dim: int, context: int, repeats: int) -> tuple[float, float]:
    """Best call of `ops.paged_attention` over an int8 cache: (microseconds, GB/s of K/V rows read)."""
    gen = torch.Generator().manual_seed(0)
    per_seq = (context + BLOCK - 1) // BLOCK
    blocks = seqs * per_seq
    caches = []
    for _ in range(2):
        cache = torch.randint(-127, 128, (blocks, kv_heads, BLOCK, dim + 2), dtype=torch.int8, generator=gen)
        scales = (torch.rand(blocks, kv_heads, BLOCK, 1, generator=gen) * 0.02 + 0.001).to(torch.float16)
        cache[..., dim:] = scales.view(torch.int8)
        caches.append(cache)
    tables = torch.randperm(blocks, generator=gen).to(torch.int32).view(seqs, per_seq)
    lens = torch.full((seqs,), context, dtype=torch.int32)
    query = torch.randn(seqs, heads, dim, generator=gen)
    out = torch.empty_like(query)
    for _ in range(2):
        ops.paged_attention(query, caches[0], caches[1], tables, lens, dim ** -0.5, out=out)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        ops.paged_attention(query, caches[0], caches[1], tables, lens, dim ** -0.5, out=out)
        best = min(best, time.perf_counter() - start)
    return best * 1e6, seqs * context * kv_heads * (dim + 2) * 2 / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seqs", type=int, default=32)
    parser.add_argument("--contexts", default="128,1024")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    read = read_gb_s()
    points = [(shape, int(c)) for shape in SHAPES for c in args.contexts.split(",")]
    for (label, heads, kv_heads, dim), context in tqdm(points, desc="shapes", unit="shape"):
        us, gb_s = attention_gb_s(args.seqs, heads, kv_heads, dim, context, args.repeats)
        print(json.dumps({"bench": "kv_int8_attention", "shape": label, "heads": heads, "kv_heads": kv_heads,
                          "head_size": dim, "seqs": args.seqs, "context": context, "threads": args.threads,
                          "us": round(us, 1), "gb_s": round(gb_s, 2), "read_gb_s": round(read, 2),
                          "share": round(gb_s / read, 3)}), flush=True)


if __name__ == "__main__":
    main()
