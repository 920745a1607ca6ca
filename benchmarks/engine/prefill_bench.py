"""Uncached prefill of a quantized GGUF: prompt rows on fp32 activations (the default) against int8
ones (`--int8-prompt-activations`, `LLM(exact_prompt_rows=False)`), on spec_bench's grounded prompts
(132, 159 and 300 tokens). Each sample is `generate(max_tokens=1)` right after
`LLM.reset_prefix_cache()`, the two engines alternating; the median per prompt. JSON lines.

    .venv/bin/python benchmarks/engine/prefill_bench.py [--model FILE.gguf] [--threads 2] [--samples 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout's root: benchmarks.* importable
from benchmarks.engine.spec_bench import GROUNDED, chat_ids
from common.sampling_params import SamplingParams
from engine.llm import LLM

MODEL = Path.home() / ".cache/pagedserve/models/SmolLM2-135M-Instruct/SmolLM2-135M-Instruct.Q4_1.gguf"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(MODEL))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--samples", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engines = {"fp32_prompt_rows": LLM(args.model, kv_cache_memory=512 << 20),
               "int8_prompt_rows": LLM(args.model, kv_cache_memory=512 << 20, exact_prompt_rows=False)}
    tokenizer = engines["fp32_prompt_rows"].tokenizer
    first = SamplingParams(temperature=0.0, max_tokens=1)
    for name, text in GROUNDED.items():
        prompt = [chat_ids(tokenizer, text)]
        samples: dict[str, list[float]] = {mode: [] for mode in engines}
        for _ in range(args.samples):
            for mode, llm in engines.items():
                llm.reset_prefix_cache()
                start = time.perf_counter()
                llm.generate(prompt, first)
                samples[mode].append(time.perf_counter() - start)
        ms = {mode: round(1e3 * statistics.median(v), 1) for mode, v in samples.items()}
        print(json.dumps({"prompt": name, "prompt_tokens": len(prompt[0]), "ms": ms,
                          "speedup": round(ms["fp32_prompt_rows"] / ms["int8_prompt_rows"], 3)}), flush=True)


if __name__ == "__main__":
    main()
