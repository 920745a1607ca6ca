"""Speed of the GGUF-quantized linear layers and of the engine on the quantized model, JSON lines.

- ``kernel``: one SmolLM2 decoder layer's linear layers (qkv, o, gate_up, down; for the K-quants
  down only, ``layers`` = 1: the others' K = 576 is not whole 256-weight blocks) per format at
  M = 1, 4, 32, 256 rows (``--formats``: any of ``ops.quant.FORMATS``, e.g. Q5_0,Q4_K,Q6_K): the
  packed-block kernel with int8 activations, with fp32 activations, dequantize + oneDNN, and fp32
  ``ops.linear`` (oneDNN-packed from 4 rows: what a format dequantized at load runs); GB/s of
  weight bytes read (packed bytes for the quantized paths) and GFLOP/s.
- ``engine``: greedy decode tok/s of ``engine.llm.LLM`` at one stream and a batch of 32 on the Q4_1
  GGUF against the fp32 directory (the fetched default model) or with fp32 activations in the
  quantized kernels (``--variants``), and of llama.cpp on the same file with the same prompts,
  interleaved round by round in one run (``--peer-python``, the venv of
  ``benchmarks/peer/setup_llama_cpp.sh``; ``benchmarks/peer/llama_cpp_bench.py``).

    python benchmarks/kernels/quant_bench.py [--parts kernel,engine] [--budget 0.5] [--rows 1,4,32,256]
    python benchmarks/kernels/quant_bench.py --parts engine --batches 1,32 \\
        --peer-python ~/.cache/pagedserve/peer/llama-cpp-venv/bin/python
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout's root: benchmarks.* importable
import ops
from benchmarks.helpers.timing import best_seconds
from common.openmp_env import peer_environ
from ops.build import cpu_ops
from ops.quant import FORMATS, QuantFormat
from ops.reference.quant import quantize

LAYER_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # SmolLM2: qkv, o, gate_up, down


def layer_shapes(fmt: QuantFormat) -> tuple[tuple[int, int], ...]:
    """The layer's (N, K) shapes whose K is whole blocks of ``fmt``: a K-quant (256-weight blocks)
    gets only down (K = 1536; SmolLM2's K = 576 rows are Q5_0 / Q8_0 in llama.cpp's files)."""
    return tuple((n, k) for n, k in LAYER_SHAPES if k % fmt.block_size == 0)


def _layer_calls(fmt: QuantFormat, rows: int) -> tuple[dict[str, Callable[[], object]], dict[str, float]]:
    gen = torch.Generator().manual_seed(0)
    shapes = layer_shapes(fmt)
    weights = [torch.randn(n, k, generator=gen) * 0.05 for n, k in shapes]
    packed = [quantize(w, fmt.type_id) for w in weights]
    onednn = [ops.pack_weight(w) for w in weights]
    xs = [torch.randn(rows, k, generator=gen) for _, k in shapes]
    outs = [torch.empty(rows, n) for n, _ in shapes]
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
    for fmt in formats:
        flops_per_row = 2.0 * sum(n * k for n, k in layer_shapes(fmt))
        for rows in rows_list:
            calls, sizes = _layer_calls(fmt, rows)
            best = best_seconds(calls, "cpu", budget)
            for name, seconds in best.items():
                print(json.dumps({"part": "kernel", "format": fmt.name, "layers": len(layer_shapes(fmt)),
                                  "rows": rows, "impl": name,
                                  "us": round(seconds * 1e6, 1), "gbps": round(sizes[name] / seconds / 1e9, 2),
                                  "gflops": round(flops_per_row * rows / seconds / 1e9, 2)}), flush=True)


def _engine(model: str, int8_activations: bool) -> Any:
    """An engine on `model`; `int8_activations` set on its decoder layers' quantized linears (the
    lm_head keeps its own setting)."""
    from engine.llm import LLM
    from engine.model.quant_linear import QuantLinear

    engine = LLM(model, kv_cache_memory=1 << 28).engine
    for module in engine.model.model.modules():
        if isinstance(module, QuantLinear):
            module.int8_activations = int8_activations
    return engine


def prompts_for(count: int, length: int, seed: int) -> list[list[int]]:
    """`count` random prompts of `length` token ids (the same lists go to the llama.cpp peer)."""
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(count)]


def engine_round(engine: Any, prompts: list[list[int]], steps: int,
                 loras: list[Any] | None = None) -> tuple[float, float]:
    """Median seconds of a decode step of all `prompts` together, after their prefill, and median
    CPU seconds of this process per step (all its threads: on a loaded machine the steadier figure).
    `loras`: each prompt's LoRA adapter (a `LoRARequest`, or None for the base)."""
    from common.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params, lora_request=loras[i] if loras else None)
    while engine.scheduler.waiting:  # prefill everything first
        engine.step()
    for _ in range(2):  # the last prefill chunks, and one warm decode step
        engine.step()
    times, cpu = [], []
    for _ in range(steps):
        start, start_cpu = time.perf_counter(), time.process_time()
        engine.step()
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    for request_id in list(engine.requests):
        engine.abort_request(request_id)
    return statistics.median(times), statistics.median(cpu)


def peer_line(python: str, gguf: str, prompts_file: str, batch: int, steps: int, threads: int) -> dict[str, Any]:
    """One llama.cpp round (benchmarks/peer/llama_cpp_bench.py in its own venv): its JSON line
    (``step_ms``, and ``buffers``: the weight buffers llama.cpp used)."""
    script = Path(__file__).resolve().parents[1] / "peer" / "llama_cpp_bench.py"
    out = subprocess.run([python, str(script), "--gguf", gguf, "--prompts", prompts_file, "--batches", str(batch),
                          "--rounds", "1", "--steps", str(steps), "--threads", str(threads)],
                         check=True, capture_output=True, text=True, env=peer_environ()).stdout
    line: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return line


def peer_round(python: str, gguf: str, prompts_file: str, batch: int, steps: int, threads: int) -> float:
    """One llama.cpp round's step seconds (`peer_line`)."""
    return float(peer_line(python, gguf, prompts_file, batch, steps, threads)["step_ms"]) / 1e3


def bench_engine(args: argparse.Namespace) -> None:
    """Greedy decode of `--batches` concurrent streams: pagedserve's engines (and llama.cpp with
    `--peer-python`) take turns round by round, so load from other processes hits all alike; the
    best round's median step counts, tok/s = batch / step."""
    from engine.model.fetch import default_gguf_path, default_model_dir

    gguf = str(default_gguf_path())
    known = {"q4_1_gguf": (gguf, True), "q4_1_gguf_fp32_activations": (gguf, False),
             "fp32_dir": (str(default_model_dir(progress=False)), True)}
    engines = {name: _engine(*known[name]) for name in args.variants.split(",")}
    batches = [int(b) for b in args.batches.split(",")]
    prompts = prompts_for(max(batches), args.prompt_len, 1)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(prompts, f)
    systems = [*engines, *(["llama.cpp"] if args.peer_python else [])]
    best = {(s, b): float("inf") for s in systems for b in batches}
    cpu = {(s, b): float("inf") for s in engines for b in batches}
    for _ in range(args.rounds):
        for batch in batches:
            for name in systems:
                if name == "llama.cpp":
                    seconds = peer_round(args.peer_python, gguf, f.name, batch, args.steps, args.threads)
                else:
                    seconds, cpu_seconds = engine_round(engines[name], prompts[:batch], args.steps)
                    cpu[name, batch] = min(cpu[name, batch], cpu_seconds)
                best[name, batch] = min(best[name, batch], seconds)
    for (name, batch), seconds in best.items():
        line = {"part": "engine", "system": name, "batch": batch, "threads": args.threads,
                "tok_s": round(batch / seconds, 2), "step_ms": round(seconds * 1e3, 2)}
        if (name, batch) in cpu:
            line["cpu_ms_per_step"] = round(cpu[name, batch] * 1e3, 2)
        print(json.dumps(line), flush=True)
    if args.peer_python:
        for name in engines:
            for batch in batches:
                print(json.dumps({"part": "ratio", "system": name, "batch": batch, "vs_llama_cpp":
                                  round(best["llama.cpp", batch] / best[name, batch], 3)}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="kernel,engine")
    parser.add_argument("--rows", default="1,4,32,256")
    parser.add_argument("--formats", default="Q4_1,Q4_0,Q8_0")
    parser.add_argument("--budget", type=float, default=0.5, help="seconds of timing per implementation")
    parser.add_argument("--steps", type=int, default=16, help="decode steps per round")
    parser.add_argument("--batches", default="1,32", help="concurrent streams (engine part)")
    parser.add_argument("--variants", default="q4_1_gguf,fp32_dir",
                        help="q4_1_gguf, q4_1_gguf_fp32_activations, fp32_dir")
    parser.add_argument("--peer-python", help="python of the llama-cpp-python venv: llama.cpp rounds interleaved")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (and llama.cpp's)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--prompt-len", type=int, default=64)
    args = parser.parse_args()
    parts: Any = set(args.parts.split(","))
    torch.set_num_threads(args.threads)
    with torch.inference_mode():
        if "kernel" in parts:
            formats = [FORMATS[f] for f in args.formats.split(",")]
            bench_kernels(formats, [int(r) for r in args.rows.split(",")], args.budget)
        if "engine" in parts:
            bench_engine(args)


if __name__ == "__main__":
    main()
