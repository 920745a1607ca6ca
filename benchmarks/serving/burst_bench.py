"""A burst through the whole stack: redis-server, 2 engine processes, 2 gateway processes, and
N streaming completions whose connections all open at once (one asyncio client, no
connection limit, every request released by one barrier). Prints one JSON line per gateway
pool variant: completed, 429s, 5xx, other failures, latency p50/p99, tokens/s, gateway RSS
and the pool's longest wait.

    python benchmarks/serving/burst_bench.py --model DIR --requests 1000 --max-tokens 8 --pools blocking,plain
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp

from common.ports import free_port
from common.protocol import Keys
from gateway.clients.sse_reader import SSE_DONE, sse_payloads
from pagedserve.launch.redis_server import RedisServer

ROOT = Path(__file__).resolve().parents[2]


def _start(args: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, "-m", "pagedserve.cli", *args], cwd=ROOT, stdout=out,
                                stderr=subprocess.STDOUT, env={**os.environ, **env})


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):  # peak resident set
            return int(line.split()[1]) / 1024
    return 0.0


def _metric(url: str, name: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return 0.0


async def _one(session: aiohttp.ClientSession, url: str, model: str, i: int, max_tokens: int,
               gate: asyncio.Event) -> tuple[int, float, int]:
    """(status: 200 ok / HTTP code / -1 broken stream, seconds, tokens)."""
    body = {"model": model, "prompt": f"Burst request {i}", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    await gate.wait()
    start = time.perf_counter()
    tokens, done = 0, False
    try:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                await resp.read()
                return resp.status, time.perf_counter() - start, 0
            async for event in sse_payloads(resp.content):
                if event == SSE_DONE:
                    done = True
                else:
                    if "error" in event:
                        return 500 if event["error"].get("type") != "rate_limit_error" else 429, 0.0, 0
                    if event.get("usage"):
                        tokens = event["usage"]["completion_tokens"]
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return -1, time.perf_counter() - start, 0
    return (200 if done else -1), time.perf_counter() - start, tokens


async def burst(urls: list[str], model: str, requests: int, max_tokens: int) -> dict[str, Any]:
    gate = asyncio.Event()
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        tasks = [asyncio.create_task(_one(session, urls[i % len(urls)], model, i, max_tokens, gate))
                 for i in range(requests)]
        await asyncio.sleep(0.5)  # every task is waiting at the gate
        start = time.perf_counter()
        gate.set()
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    ok = sorted(t for status, t, _ in results if status == 200)
    q = statistics.quantiles(ok, n=100) if len(ok) >= 2 else [0.0] * 99
    return {"requests": requests, "completed": len(ok), "http_429": sum(s == 429 for s, _, _ in results),
            "http_5xx": sum(s >= 500 for s, _, _ in results),
            "other_failures": sum(s == -1 or 200 < s < 429 for s, _, _ in results),
            "latency_p50_s": round(q[49], 3), "latency_p99_s": round(q[98], 3), "duration_s": round(duration, 2),
            "output_tok_s": round(sum(n for _, _, n in results) / duration, 1)}


def run_variant(model: str, pool: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    with RedisServer() as redis:
        env = {"PAGEDSERVE_REDIS_URL": redis.url}
        engines = [_start(["engine", "--model", model, "--served-model-name", "bench", "--engine-id", f"b-{pool}-{i}",
                           "--kv-cache-memory", args.kv_cache_memory, "--max-num-seqs", str(args.max_num_seqs)],
                          workdir / f"engine-{pool}-{i}.log", env) for i in range(args.engines)]
        ports = [free_port() for _ in range(args.gateways)]
        gateways = [_start(["gateway", "--host", "127.0.0.1", "--port", str(port), "--redis-pool", pool,
                            "--redis-pool-size", str(args.pool_size), "--max-queued", str(args.max_queued)],
                           workdir / f"gateway-{pool}-{port}.log", env) for port in ports]
        urls = [f"http://127.0.0.1:{port}" for port in ports]
        try:
            deadline = time.monotonic() + 300
            while not all(_healthy(u) for u in urls) or not _all_engines(redis.url, args.engines):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"stack not ready; logs in {workdir}")
                time.sleep(0.5)
            result = asyncio.run(burst(urls, "bench", args.requests, args.max_tokens))
            result |= {"pool": pool, "pool_size": args.pool_size, "gateways": args.gateways, "engines": args.engines,
                       "gateway_peak_rss_mib": [round(_rss_mib(g.pid), 1) for g in gateways],
                       "pool_max_wait_s": [_metric(u, "pagedserve_redis_pool_max_wait_seconds") for u in urls]}
            return result
        finally:
            for proc in [*gateways, *engines]:
                proc.terminate()
            for proc in [*gateways, *engines]:
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()


def _all_engines(redis_url: str, count: int) -> bool:
    import redis

    with redis.Redis.from_url(redis_url) as client:
        return len(list(client.scan_iter(match=Keys().engine_pattern))) >= count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="model directory (a tiny one for a pure serving test)")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--gateways", type=int, default=2)
    parser.add_argument("--pool-size", type=int, default=64, help="gateway Redis connections")
    parser.add_argument("--max-queued", type=int, default=4096)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--kv-cache-memory", default="64MiB")
    parser.add_argument("--pools", default="blocking,plain", help="gateway pool variants, side by side")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="burst-bench-") as tmp:
        for pool in args.pools.split(","):
            print(json.dumps(run_variant(args.model, pool, args, Path(tmp))), flush=True)


if __name__ == "__main__":
    main()
