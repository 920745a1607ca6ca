"""Timing helper shared by the kernel benchmarks: alternating rounds, best time per function."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def best_seconds(calls: dict[str, Callable[[], object]], device: str, budget_s: float) -> dict[str, float]:
    """Best time per call of each function, timed in alternating rounds so that load from other
    processes hits all of them alike (min over rounds: the least disturbed run)."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for fn in calls.values():
        fn()
    sync()
    best = dict.fromkeys(calls, float("inf"))
    spent, rounds = 0.0, 0
    while spent < budget_s * len(calls) or rounds < 3:
        for name, fn in calls.items():
            start = time.perf_counter()
            fn()
            sync()
            elapsed = time.perf_counter() - start
            best[name], spent = min(best[name], elapsed), spent + elapsed
        rounds += 1
    return best


def bandwidth_fields(num_bytes: float, seconds: float, device: str, peak_gbps: float) -> dict[str, float]:
    """Achieved GB/s, plus its share of the device's memory bandwidth on CUDA."""
    gbps = num_bytes / seconds / 1e9
    fields = {"gbps": round(gbps, 2)}
    if device == "cuda":
        fields["hbm_pct"] = round(100 * gbps / peak_gbps, 1)
    return fields
