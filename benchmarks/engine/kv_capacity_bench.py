"""What an 8-bit KV cache buys at a fixed memory budget: the same burst of requests through the
engine with an fp32 (the model dtype here) and an int8 cache of the same bytes. One JSON line per
cache dtype (blocks, tokens, preemptions, peak running sequences, tokens/s), then the ratios.

The pool is sized so the float cache must preempt (a burst of `--requests` x (`--prompt-len` +
`--output-len`) tokens against `--kv-cache-memory`); the int8 pool holds 1.94x the tokens at
SmolLM2's head size 64, so it runs more sequences at once and preempts less. In-process (`LLM`),
SmolLM2, greedy, fixed lengths (ignore_eos).

    python benchmarks/engine/kv_capacity_bench.py [--model DIR] [--kv-cache-memory 48MiB] [--requests 48]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from common.sampling_params import SamplingParams
from common.sizes import parse_size
from engine.llm import LLM
from engine.model.fetch import default_model_dir


def run(model: str, kv_dtype: str, kv_bytes: int, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
    llm = LLM(model=model, dtype="float32", kv_cache_dtype=kv_dtype, kv_cache_memory=kv_bytes,
              enable_prefix_caching=False)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    peak, tokens, start = 0, 0, time.perf_counter()
    while engine.has_unfinished_requests():
        tokens += sum(len(c.token_ids) for out in engine.step() for c in out.outputs)
        peak = max(peak, engine.queue_lengths()[0])
    seconds = time.perf_counter() - start
    stats = engine.stats()
    return {"kv_cache_dtype": kv_dtype, "blocks": stats["num_blocks"], "tokens_in_pool":
            stats["num_blocks"] * stats["block_size"], "preemptions": sum(stats["preemptions"].values()),
            "peak_running": peak, "generated": tokens, "seconds": round(seconds, 2),
            "tok_per_s": round(tokens / seconds, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--kv-cache-memory", default="48MiB")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--prompt-len", type=int, default=96)
    parser.add_argument("--output-len", type=int, default=96)
    args = parser.parse_args()
    model = args.model or str(default_model_dir())
    prompts = [[(7 * i + 13 * j) % 4000 + 100 for j in range(args.prompt_len)] for i in range(args.requests)]
    rows = [run(model, dtype, parse_size(args.kv_cache_memory), prompts, args.output_len)
            for dtype in ("float32", "int8")]
    for row in rows:
        print(json.dumps(row), flush=True)
    base, int8 = rows
    print(json.dumps({"summary": "int8 vs float32 KV at the same bytes",
                      "tokens_ratio": round(int8["tokens_in_pool"] / base["tokens_in_pool"], 3),
                      "throughput_ratio": round(int8["tok_per_s"] / base["tok_per_s"], 3),
                      "preemptions": [base["preemptions"], int8["preemptions"]],
                      "peak_running": [base["peak_running"], int8["peak_running"]]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
