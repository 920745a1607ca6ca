"""What deterministic mode costs: the offline trace with `deterministic` on and off, interleaved.

The trace is engine_bench's (ShareGPT-shaped lengths, fixed output lengths); the model is `up`'s
default (SmolLM2's Q4_1 GGUF, int8 KV, dtype auto) unless `--model` names another. Each repeat
runs both modes in a fresh engine, alternating which goes first. Prints one JSON line per run
(tokens/s, seconds) and a summary line (each mode's best, the ratio on/off). Run it under
`PAGEDSERVE_CPU_ISA=avx2|avx512|...` to measure a lower ISA level.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/engine/deterministic_cost.py --num-requests 128 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout's root: benchmarks.* importable
from benchmarks.engine.engine_bench import make_trace
from common.sampling_params import SamplingParams
from engine.llm import LLM
from engine.model.fetch import default_gguf_path
from ops import isa


def run(model: str, deterministic: bool, trace: list[tuple[list[int], int]], kv_cache_dtype: str) -> dict:
    """One engine, the whole trace: tokens/s over the generated tokens."""
    llm = LLM(model, dtype="auto", kv_cache_dtype=kv_cache_dtype, deterministic=deterministic)
    prompts = [p for p, _ in trace]
    params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for _, o in trace]
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"deterministic": deterministic, "tokens": tokens, "seconds": round(seconds, 2),
            "tokens_per_s": round(tokens / seconds, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF file or HF directory (default: up's default GGUF)")
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--kv-cache-dtype", default="int8")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    model = args.model or str(default_gguf_path())
    trace = make_trace(args.num_requests, 49152, args.seed, 16, 256)
    best: dict[bool, float] = {}
    for repeat in range(args.repeats):
        order = (True, False) if repeat % 2 == 0 else (False, True)
        for mode in order:
            record = run(model, mode, trace, args.kv_cache_dtype) | {"repeat": repeat, "isa": isa.level()}
            print(json.dumps(record), flush=True)
            best[mode] = max(best.get(mode, 0.0), record["tokens_per_s"])
    print(json.dumps({"summary": True, "isa": isa.level(), "deterministic_tok_s": best[True],
                      "fastest_tok_s": best[False], "ratio": round(best[True] / best[False], 3)}), flush=True)


if __name__ == "__main__":
    main()
