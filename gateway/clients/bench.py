"""`pagedserve bench`: replay a workload against a running gateway, streaming every request,
and report throughput, TTFT, TPOT, end-to-end latency percentiles and errors (JSON out)."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from tqdm import tqdm

from gateway.clients.bench_trace import BenchRequest, load_trace, poisson_arrivals, synthetic
from gateway.clients.sse_reader import sse_events


@dataclass(slots=True)
class Result:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str = ""


async def _one(session: aiohttp.ClientSession, url: str, model: str, req: BenchRequest,
               headers: dict[str, str]) -> Result:
    payload = {"model": model, "prompt": req.prompt, "max_tokens": req.max_tokens, "n": req.n,
               "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
               "temperature": 0.0}
    start = time.perf_counter()
    ttft, chunks, usage = 0.0, 0, None
    try:
        async with session.post(url, json=payload, headers=headers) as resp:
            if resp.status != 200:
                return Result(False, error=f"HTTP {resp.status}: {(await resp.text())[:200]}")
            async for obj in sse_events(resp):
                if "error" in obj:
                    return Result(False, error=str(obj["error"].get("message")))
                if obj.get("usage"):
                    usage = obj["usage"]
                if obj.get("choices") and obj["choices"][0].get("text"):
                    chunks += 1
                    ttft = ttft or time.perf_counter() - start
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return Result(False, error=f"{type(exc).__name__}: {exc}")
    out = usage["completion_tokens"] if usage else chunks
    return Result(True, ttft, time.perf_counter() - start, out, usage["prompt_tokens"] if usage else 0)


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": math.nan, "p50": math.nan, "p90": math.nan, "p99": math.nan}
    ordered = sorted(values)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]

    return {"mean": sum(ordered) / len(ordered), "p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99)}


def summarize(results: list[Result], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error] = errors.get(r.error, 0) + 1
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
        "duration_s": duration, "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput_tok_s": out_tokens / duration if duration else 0.0,
        "total_throughput_tok_s": (out_tokens + sum(r.prompt_tokens for r in ok)) / duration if duration else 0.0,
        "ttft_s": percentiles([r.ttft for r in ok]), "tpot_s": percentiles(tpot),
        "e2e_s": percentiles([r.e2e for r in ok]), "errors": errors,
    }


async def run_bench(base_url: str, model: str, requests: list[BenchRequest], rate: float,
                    max_concurrency: int | None, api_key: str | None = None, progress: bool = True,
                    seed: int = 0) -> dict[str, Any]:
    """Send `requests` at Poisson `rate` (inf: all at once), at most `max_concurrency` in flight."""
    url = base_url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    arrivals = poisson_arrivals(len(requests), rate, seed)
    bar = tqdm(total=len(requests), desc="bench", unit="req", disable=not progress, file=sys.stderr)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        start = time.perf_counter()

        async def launch(req: BenchRequest, at: float) -> Result:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            if limit is None:
                result = await _one(session, url, model, req, headers)
            else:
                async with limit:
                    result = await _one(session, url, model, req, headers)
            bar.update(1)
            return result

        results = await asyncio.gather(*(launch(r, t) for r, t in zip(requests, arrivals, strict=True)))
        duration = time.perf_counter() - start
    bar.close()
    report = summarize(list(results), duration)
    report.update({"model": model, "request_rate": rate if math.isfinite(rate) else "inf",
                   "max_concurrency": max_concurrency})
    return report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="gateway base URL")
    parser.add_argument("--model", required=True, help="model name as /v1/models lists it")
    parser.add_argument("--trace", type=Path, help="JSONL trace (prompt or prompt_len, max_tokens or output_len)")
    parser.add_argument("--num-prompts", type=int, default=100, help="synthetic requests when no --trace")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (default inf)")
    parser.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, help="also write the JSON report here")
    parser.add_argument("--no-progress", action="store_true")


def run(args: argparse.Namespace) -> int:
    requests = load_trace(args.trace, args.seed) if args.trace else synthetic(
        args.num_prompts, args.prompt_len, args.output_len, args.seed)
    report = asyncio.run(run_bench(args.url, args.model, requests, args.request_rate, args.max_concurrency,
                                   args.api_key, not args.no_progress, args.seed))
    text = json.dumps(report, indent=2)
    print(text)
    if args.output:
        args.output.write_text(text + "\n")
    return 0 if report["completed"] else 1
