"""The 8-bit KV cache's concurrency gain, served: the same burst through `pagedserve up` (redis-server,
engine and gateway processes, `pagedserve bench` as the client) once per KV cache dtype, every
server given the same `--kv-cache-memory`. One JSON line per dtype (pool tokens, preemptions, peak
running requests, output tok/s, TTFT p50/p99, failures), then a line of same-run ratios.

The pool is sized so that the model-dtype cache (fp32 on a CPU without native bf16; bf16 where the
CPU computes it) cannot hold the burst and preempts, while the int8 cache of the same bytes holds
it all. Preemptions and running requests are read from the engine's Prometheus page
(`--metrics-port`), sampled every 0.2 s while the burst runs.

    python benchmarks/serving/kv_served_bench.py [--model DIR|FILE.gguf] [--kv-cache-memory 112MiB] \
        [--num-prompts 32] [--prompt-len 128] [--output-len 128] [--kv-dtypes float32,int8]
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout's root: benchmarks.* importable
from benchmarks.peer.counters import metric_value
from benchmarks.serving.serving_bench import bench_client, pagedserve_up
from common.ports import free_port


class EngineSampler:
    """Polls an engine's Prometheus page in a thread: peak running requests and the last counters."""

    def __init__(self, url: str, interval: float = 0.2) -> None:
        self.url, self.interval = url, interval
        self.peak_running = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def page(self) -> str:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as resp:
            return str(resp.read().decode())

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak_running = max(self.peak_running, metric_value(self.page(), "pagedserve_requests_running"))

    def __enter__(self) -> EngineSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def served_run(model: str | None, kv_dtype: str, args: argparse.Namespace) -> dict[str, Any]:
    """One `pagedserve up` with `kv_dtype`: warm-up, then the measured burst."""
    metrics_port = free_port()
    extra = ["--kv-cache-dtype", kv_dtype, "--metrics-port", str(metrics_port)] + (["--model", model] if model else [])
    with pagedserve_up(extra, args.kv_cache_memory, args.max_num_seqs, engine_args=args.engine_args) as (url, name):
        engine = EngineSampler(f"http://127.0.0.1:{metrics_port}")
        bench_client(url, name, 2, args.prompt_len, 4, args.seed + 1, concurrency=1)  # warm-up, another trace
        before = engine.page()
        with engine:
            report = bench_client(url, name, args.num_prompts, args.prompt_len, args.output_len, args.seed)
        after = engine.page()
    preempted = {mode: metric_value(after, f"pagedserve_preemptions_total{{mode=\"{mode}\"}}")
                 - metric_value(before, f"pagedserve_preemptions_total{{mode=\"{mode}\"}}")
                 for mode in ("recompute", "swap")}
    blocks = metric_value(after, 'pagedserve_kv_blocks_total{device="cpu"}')
    return {"kv_cache_dtype": kv_dtype, "kv_cache_memory": args.kv_cache_memory, "pool_blocks": int(blocks),
            "pool_tokens": int(blocks) * 16,
            "burst_tokens_nominal": args.num_prompts * (args.prompt_len + args.output_len),
            "preemptions": int(sum(preempted.values())), "preemptions_by_mode": preempted,
            "peak_running": int(engine.peak_running), **report}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model directory or .gguf (default: `pagedserve up`'s default)")
    parser.add_argument("--kv-cache-memory", default="112MiB")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--kv-dtypes", default="float32,int8", help="comma-separated `--kv-cache-dtype` values")
    parser.add_argument("--engine-args", default="", help="more `pagedserve engine` flags for every server")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rows = []
    for kv_dtype in (d.strip() for d in args.kv_dtypes.split(",") if d.strip()):
        rows.append(served_run(args.model, kv_dtype, args))
        print(json.dumps(rows[-1]), flush=True)
    base, *others = rows
    for other in others:
        print(json.dumps({
            "summary": f"{other['kv_cache_dtype']} vs {base['kv_cache_dtype']} KV, same bytes, served",
            "pool_tokens_ratio": round(other["pool_tokens"] / base["pool_tokens"], 3),
            "throughput_ratio": round(other["output_throughput_tok_s"] / base["output_throughput_tok_s"], 3),
            "ttft_p50_ratio": round(other["ttft_s"]["p50"] / base["ttft_s"]["p50"], 3),
            "ttft_p99_ratio": round(other["ttft_s"]["p99"] / base["ttft_s"]["p99"], 3),
            "preemptions": [base["preemptions"], other["preemptions"]],
            "peak_running": [base["peak_running"], other["peak_running"]]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
