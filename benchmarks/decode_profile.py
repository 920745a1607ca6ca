"""Where a decode step's time goes: the engine at one batch size under the torch profiler.

Prints one JSON line per batch size: step time and the top operators' share of CPU self time
(``aten::mm``/``addmm`` are torch's GEMM, ``pagedserve_cpu::small_gemm`` and
``mkldnn::_linear_pointwise`` ours, ``paged_attention`` the decode attention).

    python benchmarks/decode_profile.py --batches 1,32,64
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from decode_bench import add_requests, drain, make_engine
from torch.profiler import ProfilerActivity, profile


def profile_batch(engine: Any, batch: int, steps: int, top: int) -> dict[str, Any]:
    add_requests(engine, f"prof{batch}", batch, 128, steps + 8, batch)
    while engine.scheduler.waiting:
        engine.step()
    for _ in range(3):
        engine.step()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    step_ms = (time.perf_counter() - start) / steps * 1e3
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) or 1
    drain(engine)
    return {"bench": "decode_profile", "batch": batch, "step_ms_profiled": round(step_ms, 2),
            "top_self_cpu_share": {e.key: round(e.self_cpu_time_total / total, 3) for e in events[:top]}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--batches", default="1,32,64")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--top", type=int, default=8)
    args = parser.parse_args()
    if args.model is None:
        from engine.model.fetch import default_model_dir

        args.model = str(default_model_dir(progress=False))
    engine = make_engine(args.model, 1 << 30)
    for batch in (int(b) for b in args.batches.split(",")):
        print(json.dumps(profile_batch(engine, batch, args.steps, args.top)), flush=True)


if __name__ == "__main__":
    main()
