"""Single-stream decode of llama.cpp (llama-cpp-python) on a GGUF, one JSON line: the peer of
``benchmarks/quant_bench.py --parts engine``. Run it with the venv of ``setup_llama_cpp.sh``:

    ~/.cache/pagedserve/peer/llama-cpp-venv/bin/python benchmarks/peer/llama_cpp_bench.py \\
        --gguf ~/.cache/pagedserve/models/SmolLM2-135M-Instruct/SmolLM2-135M-Instruct.Q4_1.gguf

Greedy (top_k=1, temp 0) over random prompt tokens, EOS ignored (``generate`` does not stop at
it), the same prompt length and step count as quant_bench's engine part; the best of ``--rounds``
rounds' median token time counts. The model is loaded without llama.cpp's extra weight buffers
(``use_extra_bufts=False``): its AMX matmul dies with SIGILL on the VMs that report AMX.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any


def load(path: str, threads: int, **options: Any) -> Any:
    """A `llama_cpp.Llama` on `path` without the extra weight buffers (`options`: more Llama
    arguments, e.g. draft_model)."""
    import llama_cpp

    default_params = llama_cpp.llama_cpp.llama_model_default_params

    def params_without_extra_bufts() -> Any:
        params = default_params()
        params.use_extra_bufts = False
        return params

    llama_cpp.llama_cpp.llama_model_default_params = params_without_extra_bufts
    try:
        return llama_cpp.Llama(model_path=path, n_threads=threads, n_batch=512, n_ctx=2048, verbose=False,
                               **options)
    finally:
        llama_cpp.llama_cpp.llama_model_default_params = default_params


def round_median(llm: Any, prompt: list[int], steps: int) -> float:
    """Median seconds per decoded token over `steps` tokens after a fresh prefill of `prompt`."""
    llm.reset()
    times: list[float] = []
    last = time.perf_counter()
    for i, _ in enumerate(llm.generate(prompt, top_k=1, temp=0.0, reset=True)):
        now = time.perf_counter()
        if i > 0:  # the first token includes the prefill
            times.append(now - last)
        last = now
        if len(times) >= steps:
            break
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--prompt-len", type=int, default=64)
    args = parser.parse_args()
    llm = load(args.gguf, args.threads)
    rng = random.Random(1)
    best = float("inf")
    for _ in range(args.rounds):
        prompt = [rng.randrange(100, 40000) for _ in range(args.prompt_len)]  # fresh: no prompt-cache hit
        best = min(best, round_median(llm, prompt, args.steps))
    print(json.dumps({"part": "peer", "system": "llama.cpp", "threads": args.threads,
                      "single_stream_tok_s": round(1 / best, 2), "step_ms": round(best * 1e3, 2)}), flush=True)


if __name__ == "__main__":
    main()
