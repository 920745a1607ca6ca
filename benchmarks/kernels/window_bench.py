"""Sliding-window paged attention: what a window saves in the CPU kernels, decode and prefill, on a
Mistral-like shape (32 heads over 8 KV heads, head 128, bf16, blocks of 16), each with no window
and with one. About 20 s of alternating rounds, one JSON line per point:
`OMP_NUM_THREADS=1 python benchmarks/kernels/window_bench.py`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout's root: benchmarks.* importable
import ops
from benchmarks.helpers.timing import best_seconds
from tests.ops.paged_inputs import make_paged, make_prefill

HEADS, HEAD_SIZE, BLOCK, DTYPE = (32, 8), 128, 16, torch.bfloat16


def main() -> None:
    scale = HEAD_SIZE**-0.5
    decode = make_paged([4096] * 8, HEADS, HEAD_SIZE, BLOCK, DTYPE, "cpu", 0)
    prefill = make_prefill([(2048, 2048)], HEADS, HEAD_SIZE, BLOCK, DTYPE, "cpu", 1)
    calls = {  # alternating rounds: load from other processes hits both windows alike
        "decode 0": lambda: ops.paged_attention(*decode, scale),
        "decode 512": lambda: ops.paged_attention(*decode, scale, window=512),
        "prefill 0": lambda: ops.paged_prefill_attention(*prefill, scale),
        "prefill 256": lambda: ops.paged_prefill_attention(*prefill, scale, window=256),
    }
    best = best_seconds(calls, "cpu", 20.0)
    for name, seconds in best.items():
        kernel, window = name.split()
        shape = "8 x 4096-token contexts" if kernel == "decode" else "one 2048-token prompt"
        print(json.dumps({"kernel": kernel, "shape": shape, "window": int(window), "ms": round(seconds * 1e3, 3),
                          "speedup": round(best[f"{kernel} 0"] / seconds, 2)}))

if __name__ == "__main__":
    main()
