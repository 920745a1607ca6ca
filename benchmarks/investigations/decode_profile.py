"""Where a decode step's time goes: the engine at one batch size under the torch profiler.

Prints one JSON line per batch size: step time and the top operators' share of CPU self time
(``aten::mm``/``addmm`` are torch's GEMM, ``pagedserve_cpu::small_gemm`` and
``mkldnn::_linear_pointwise`` ours, ``paged_attention`` the decode attention).

    python benchmarks/investigations/decode_profile.py --batches 1,32,64
    python benchmarks/investigations/decode_profile.py --gguf --by-shape --batches 32,1 --threads 2
    python benchmarks/investigations/decode_profile.py --model FILE.gguf --modules --by-shape --batches 32

``--gguf`` profiles the default Q4_1 GGUF (quantized kernels) instead of the fp32 directory;
``--by-shape`` keys operators by their input shapes too (one ``quant_linear`` per layer kind:
qkv, o, gate_up, down and the lm_head), with CPU milliseconds per step and calls per step.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout's root: benchmarks.* importable
from torch.profiler import ProfilerActivity, profile

from benchmarks.engine.decode_bench import add_requests, drain, make_engine


def profile_batch(engine: Any, batch: int, steps: int, top: int, by_shape: bool = False) -> dict[str, Any]:
    add_requests(engine, f"prof{batch}", batch, 128, steps + 8, batch)
    while engine.scheduler.waiting:
        engine.step()
    for _ in range(3):
        engine.step()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=by_shape) as prof:
        for _ in range(steps):
            engine.step()
    step_ms = (time.perf_counter() - start) / steps * 1e3
    events = sorted(prof.key_averages(group_by_input_shape=by_shape), key=lambda e: e.self_cpu_time_total,
                    reverse=True)
    total = sum(e.self_cpu_time_total for e in events) or 1
    drain(engine)
    result: dict[str, Any] = {"bench": "decode_profile", "batch": batch, "step_ms_profiled": round(step_ms, 2),
                              "top_self_cpu_share": {_key(e, by_shape): round(e.self_cpu_time_total / total, 3)
                                                     for e in events[:top]}}
    if by_shape:
        result["top_self_cpu_ms_per_step"] = {_key(e, by_shape): [round(e.self_cpu_time_total / steps / 1e3, 3),
                                                                   e.count // steps] for e in events[:top]}
    return result


def _key(event: Any, by_shape: bool) -> str:
    return f"{event.key} {event.input_shapes}" if by_shape else str(event.key)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--batches", default="1,32,64")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--gguf", action="store_true", help="the default Q4_1 GGUF instead of the fp32 directory")
    parser.add_argument("--by-shape", action="store_true", help="operators keyed by input shapes too")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--modules", action="store_true",
                        help="the decoder's modules instead of its one fused C++ call (whose linears the "
                             "profiler cannot tell apart), so --by-shape splits a step by layer kind")
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto | int8 (what `up` serves a GGUF with)")
    parser.add_argument("--kv-cache-memory", type=int, default=1 << 30, help="bytes")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.model is None:
        from engine.model.fetch import default_gguf_path, default_model_dir

        args.model = str(default_gguf_path() if args.gguf else default_model_dir(progress=False))
    engine = make_engine(args.model, args.kv_cache_memory, args.kv_cache_dtype)
    if args.modules:
        import dataclasses

        model = engine.runner.model
        model._policy = dataclasses.replace(model.policy, fused_decoder=False)
    for batch in (int(b) for b in args.batches.split(",")):
        print(json.dumps(profile_batch(engine, batch, args.steps, args.top, args.by_shape)), flush=True)


if __name__ == "__main__":
    main()
