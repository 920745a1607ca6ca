"""Speed of the GGUF-quantized linear layers and of the engine on the quantized model, JSON lines.

- ``kernel``: one SmolLM2 decoder layer's linear layers (qkv, o, gate_up, down) per format at
  M = 1, 4, 32, 256 rows: the packed-block kernel with int8 activations, with fp32 activations,
  dequantize + oneDNN, and fp32 ``ops.linear`` (oneDNN-packed from 4 rows); GB/s of weight bytes
  read (packed bytes for the quantized paths) and GFLOP/s.
- ``engine``: one-stream decode tok/s of ``engine.llm.LLM`` on the Q4_1 GGUF against the fp32
  directory (the fetched default model), and with fp32 activations in the quantized kernels.

    python benchmarks/quant_bench.py [--parts kernel,engine] [--budget 0.5] [--rows 1,4,32,256]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from timing import best_seconds

import ops
from ops.build import cpu_ops
from ops.quant import FORMATS, QuantFormat
from ops.reference.quant import quantize

LAYER_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # SmolLM2: qkv, o, gate_up, down


def _layer_calls(fmt: QuantFormat, rows: int) -> tuple[dict[str, Callable[[], object]], dict[str, float]]:
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=gen) * 0.05 for n, k in LAYER_SHAPES]
    packed = [quantize(w, fmt.type_id) for w in weights]
    onednn = [ops.pack_weight(w) for w in weights]
    xs = [torch.randn(rows, k, generator=gen) for _, k in LAYER_SHAPES]
    outs = [torch.empty(rows, n) for n, _ in LAYER_SHAPES]
    lib = cpu_ops()

    def gemv(int8: bool) -> Callable[[], object]:
        triples = list(zip(outs, xs, packed, strict=True))
        return lambda: [lib.quant_linear(o, x, q, fmt.type_id, None, int8) for o, x, q in triples]

    calls: dict[str, Callable[[], object]] = {
        "int8_act": gemv(True),
        "fp32_act": gemv(False),
        "dequant_onednn": lambda: [F.linear(x, ops.dequantize(q, fmt)) for x, q in zip(xs, packed, strict=True)],
        "fp32_linear": lambda: [ops.linear(x, w, None, p) for x, w, p in zip(xs, weights, onednn, strict=True)],
    }
    qbytes = float(sum(q.numel() for q in packed))
    fbytes = float(sum(w.numel() * 4 for w in weights))
    sizes = {"int8_act": qbytes, "fp32_act": qbytes, "dequant_onednn": qbytes, "fp32_linear": fbytes}
    return calls, sizes


def bench_kernels(formats: list[QuantFormat], rows_list: list[int], budget: float) -> None:
    flops_per_row = 2.0 * sum(n * k for n, k in LAYER_SHAPES)
    for fmt in formats:
        for rows in rows_list:
            calls, sizes = _layer_calls(fmt, rows)
            best = best_seconds(calls, "cpu", budget)
            for name, seconds in best.items():
                print(json.dumps({"part": "kernel", "format": fmt.name, "rows": rows, "impl": name,
                                  "us": round(seconds * 1e6, 1), "gbps": round(sizes[name] / seconds / 1e9, 2),
                                  "gflops": round(flops_per_row * rows / seconds / 1e9, 2)}), flush=True)


def _engine(model: str, total_steps: int, prompt_len: int, int8_activations: bool) -> Any:
    """An engine with one greedy request prefilled, `total_steps` decode steps to go."""
    from common.sampling_params import SamplingParams
    from engine.llm import LLM
    from engine.model.quant_linear import QuantLinear

    engine = LLM(model, kv_cache_memory=1 << 28).engine
    for module in engine.model.model.modules():  # the decoder layers (the lm_head stays fp32-activation)
        if isinstance(module, QuantLinear):
            module.int8_activations = int8_activations
    params = SamplingParams(temperature=0.0, max_tokens=total_steps + 4, ignore_eos=True)
    gen = torch.Generator().manual_seed(1)
    engine.add_request("one", torch.randint(100, 40000, (prompt_len,), generator=gen).tolist(), params)
    engine.step()  # prefill
    return engine


def bench_engine(steps: int, rounds: int, prompt_len: int) -> None:
    """One-stream decode: the engines alternate rounds of `steps` steps (load from other processes
    hits all alike); the best round's median step counts."""
    from engine.model.fetch import default_gguf_path, default_model_dir

    directory = default_model_dir(progress=False)
    gguf = str(default_gguf_path())
    variants = {"q4_1_gguf": (gguf, True), "q4_1_gguf_fp32_activations": (gguf, False),
                "fp32_dir": (str(directory), True)}
    engines = {name: _engine(model, steps * rounds + 2, prompt_len, int8) for name, (model, int8) in variants.items()}
    best = dict.fromkeys(engines, float("inf"))
    for _ in range(rounds):
        for name, engine in engines.items():
            times = []
            for _ in range(steps):
                start = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - start)
            best[name] = min(best[name], statistics.median(times))
    for name, seconds in best.items():
        print(json.dumps({"part": "engine", "model": name, "single_stream_tok_s": round(1 / seconds, 2),
                          "step_ms": round(seconds * 1e3, 2)}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="kernel,engine")
    parser.add_argument("--rows", default="1,4,32,256")
    parser.add_argument("--formats", default="Q4_1,Q4_0,Q8_0")
    parser.add_argument("--budget", type=float, default=0.5, help="seconds of timing per implementation")
    parser.add_argument("--steps", type=int, default=16, help="decode steps per round")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--prompt-len", type=int, default=64)
    args = parser.parse_args()
    parts: Any = set(args.parts.split(","))
    with torch.inference_mode():
        if "kernel" in parts:
            formats = [FORMATS[f] for f in args.formats.split(",")]
            bench_kernels(formats, [int(r) for r in args.rows.split(",")], args.budget)
        if "engine" in parts:
            bench_engine(args.steps, args.rounds, args.prompt_len)


if __name__ == "__main__":
    main()
