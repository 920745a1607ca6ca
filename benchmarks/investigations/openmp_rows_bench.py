"""Same-run A/B of the CPU kernels' threading for a step of few rows: one SmolLM2 Q4_1 decoder
layer's four linears (quant_linear) at 1 and 5 rows (a speculative row of 1 + 4 tokens), with
`openmp_rows` 4 (every kernel of a 4+ row step on OpenMP's threads: the old setting) and 129 (the
chunk pool below 129 rows: what the engine sets for quantized weights), 1 and 2 threads,
interleaved so load from other work hits every setting alike. One JSON line per setting.

    .venv/bin/python benchmarks/investigations/openmp_rows_bench.py [--reps 60] [--gguf FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from engine.llm import LLM
from ops.parallel import set_openmp_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default = Path.home() / ".cache/pagedserve/models/SmolLM2-135M-Instruct/SmolLM2-135M-Instruct.Q4_1.gguf"
    parser.add_argument("--gguf", default=str(default))
    parser.add_argument("--reps", type=int, default=60)
    args = parser.parse_args()
    llm = LLM(args.gguf, kv_cache_memory=16 << 20)
    layer = llm.engine.model.model.layers[0]
    linears = [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
    times: dict[tuple[int, int, int], list[float]] = {}
    with torch.inference_mode():
        for _ in range(args.reps):
            for threads in (1, 2):
                torch.set_num_threads(threads)
                for openmp_rows in (4, 129):
                    set_openmp_rows(openmp_rows)
                    for rows in (1, 5):
                        xs = [torch.randn(rows, m.in_features) for m in linears]
                        start = time.perf_counter()
                        for m, x in zip(linears, xs, strict=True):
                            m(x)
                        times.setdefault((threads, openmp_rows, rows), []).append(time.perf_counter() - start)
    for (threads, openmp_rows, rows), t in sorted(times.items()):
        t.sort()
        print(json.dumps({"threads": threads, "openmp_rows": openmp_rows, "rows": rows,
                          "median_us": round(statistics.median(t) * 1e6), "p90_us": round(t[int(0.9 * len(t))] * 1e6),
                          "min_us": round(t[0] * 1e6)}), flush=True)


if __name__ == "__main__":
    main()
