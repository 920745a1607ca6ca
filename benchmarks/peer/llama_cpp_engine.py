"""Greedy decode speed of pagedserve and llama.cpp on the same GGUF files, interleaved, JSON lines.

    .venv/bin/python benchmarks/peer/llama_cpp_engine.py --gguf FILE[,FILE...] --batches 1,32 \\
        --peer-python ~/.cache/pagedserve/peer/llama-cpp-venv/bin/python [--rounds 4]

``kernels/quant_bench.py --parts engine`` over several files: in each round every file's engine
(``engine.llm.LLM`` on the file, int8 activations in the decoder's quantized linears, ``--dtype``
and ``--kv-cache-dtype`` as ``up`` takes them) and llama.cpp on the same file
(``peer/llama_cpp_bench.py``, one round per call) decode the same random prompts, one batch size
after the other, so load from other processes hits all alike. Per file and batch: each system's best
round (tok/s = batch / median step), and the ratio pagedserve / llama.cpp as best over best and as
the median, lowest and highest of the rounds' own ratios (the spread). ``PAGEDSERVE_CPU_ISA`` caps
pagedserve's side; llama.cpp's library is built for this CPU (``GGML_NATIVE``) and has no run-time cap.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout's root: benchmarks.* importable
from benchmarks.kernels.quant_bench import engine_round, peer_round, prompts_for


def load(gguf: str, dtype: str, kv_cache_dtype: str, tokenizer: str | None = None) -> Any:
    """The engine on `gguf` (`tokenizer`: a folder to take the tokenizer from instead of the file),
    int8 activations in the decoder layers' quantized linears."""
    from engine.llm import LLM
    from engine.model.quant_linear import QuantLinear

    engine = LLM(gguf, tokenizer=tokenizer, dtype=dtype, kv_cache_dtype=kv_cache_dtype, kv_cache_memory=1 << 28).engine
    for module in engine.model.model.modules():
        if isinstance(module, QuantLinear):
            module.int8_activations = True
    return engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", help="comma-separated GGUF files (default: the fetched Q4_1)")
    parser.add_argument("--peer-python", required=True, help="python of the llama-cpp-python venv")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=16, help="decode steps per round")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (and llama.cpp's)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--tokenizer", help="a folder with the tokenizer (default: the GGUF's own)")
    args = parser.parse_args()
    import torch

    from engine.model.fetch import default_gguf_path

    torch.set_num_threads(args.threads)
    files = [str(Path(g).expanduser()) for g in args.gguf.split(",")] if args.gguf else [str(default_gguf_path())]
    batches = [int(b) for b in args.batches.split(",")]
    prompts = prompts_for(max(batches), args.prompt_len, 1)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(prompts, f)
    times: dict[tuple[str, str, int], list[float]] = {}
    with torch.inference_mode():
        engines = {g: load(g, args.dtype, args.kv_cache_dtype, args.tokenizer) for g in files}
        for r in range(args.rounds):
            for batch in batches:
                for g in files:
                    ours, _ = engine_round(engines[g], prompts[:batch], args.steps)
                    peer = peer_round(args.peer_python, g, f.name, batch, args.steps, args.threads)
                    times.setdefault((g, "pagedserve", batch), []).append(ours)
                    times.setdefault((g, "llama.cpp", batch), []).append(peer)
                    print(json.dumps({"part": "round", "round": r, "gguf": Path(g).name, "batch": batch,
                                      "pagedserve_ms": round(ours * 1e3, 2), "llama_cpp_ms": round(peer * 1e3, 2)}),
                          file=sys.stderr, flush=True)
    Path(f.name).unlink()
    isa = os.environ.get("PAGEDSERVE_CPU_ISA") or "machine"
    for g in files:
        for batch in batches:
            ours, peer = times[g, "pagedserve", batch], times[g, "llama.cpp", batch]
            for system, seconds in (("pagedserve", ours), ("llama.cpp", peer)):
                print(json.dumps({"part": "engine", "gguf": Path(g).name, "system": system, "batch": batch,
                                  "isa_cap": isa, "tok_s": round(batch / min(seconds), 2),
                                  "step_ms": round(min(seconds) * 1e3, 2)}), flush=True)
            per_round = [p / o for o, p in zip(ours, peer, strict=True)]
            print(json.dumps({"part": "ratio", "gguf": Path(g).name, "batch": batch, "isa_cap": isa,
                              "best_over_best": round(min(peer) / min(ours), 3),
                              "round_median": round(statistics.median(per_round), 3),
                              "round_min": round(min(per_round), 3), "round_max": round(max(per_round), 3),
                              "rounds": len(per_round)}), flush=True)


if __name__ == "__main__":
    main()
