"""Step by step, where a grounded request's time goes with and without speculation: for each of
spec_bench's grounded prompts, a plain and an ngram engine (in one process, alternating), the first
step (the prompt's prefill; a prefix-cache hit from the second round on), the number of steps and
the mean time of the rest. Prints one JSON object per line.

    .venv/bin/python benchmarks/investigations/spec_steps.py [--k 4] [--rounds 2] [--threads 2] [--max-tokens 96]
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
from benchmarks.engine.spec_bench import GROUNDED, chat_ids
from common.sampling_params import SamplingParams
from engine.llm import LLM

MODEL = Path.home() / ".cache/pagedserve/models/SmolLM2-135M-Instruct/SmolLM2-135M-Instruct.Q4_1.gguf"


def timed_request(llm: LLM, request_id: str, prompt: list[int], params: SamplingParams) -> dict[str, Any]:
    """Run one request alone through `llm`'s engine, timing every step."""
    engine = llm.engine
    steps: list[float] = []
    tokens = 0
    start = time.perf_counter()
    engine.add_request(request_id, prompt, params)
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        deltas = engine.step()
        steps.append(time.perf_counter() - t)
        tokens += sum(len(s.token_ids) for d in deltas for s in d.outputs)
    rest = steps[1:]
    return {"tokens": tokens, "seconds": round(time.perf_counter() - start, 3), "steps": len(steps),
            "first_step_ms": round(1e3 * steps[0], 1),
            "later_step_ms_mean": round(1e3 * sum(rest) / max(1, len(rest)), 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(MODEL))
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4}
    engines = {"plain": LLM(args.model, kv_cache_memory=512 << 20),
               "ngram": LLM(args.model, kv_cache_memory=512 << 20, speculative_config=spec)}
    for llm in engines.values():
        llm.generate([chat_ids(llm.tokenizer, "Say hello.")], SamplingParams(temperature=0.0, max_tokens=8))
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    for name, text in GROUNDED.items():
        for r in range(args.rounds):
            for mode, llm in engines.items():
                figures = timed_request(llm, f"{name}-{r}", chat_ids(llm.tokenizer, text), greedy)
                spec_stats = llm.engine.speculator.stats() if llm.engine.speculator is not None else None
                print(json.dumps({"bench": "spec_steps", "prompt": name, "round": r, "mode": mode, **figures,
                                  "spec_so_far": spec_stats}), flush=True)


if __name__ == "__main__":
    main()
