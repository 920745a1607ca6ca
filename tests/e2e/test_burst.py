"""A burst of 1,000 streaming requests (issues 10 and 13), real processes: redis-server, two
engines (tiny random Llama), two gateways whose Redis pools hold 8 connections each, far fewer than the
requests in flight. A client opens every connection at once (no connection limit, all released
by one barrier). Every request completes with its tokens and `[DONE]`; none gets a 5xx or a
429 (a busy pool waits, it is never an outage); the engines end with every block free. With
redis-py's plain pool (`--redis-pool plain`) this burst got 940 503s out of 1,000."""

from __future__ import annotations

import asyncio
import resource
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from gateway.clients.sse_reader import SSE_DONE, sse_payloads
from pagedserve.launch.redis_server import RedisServer
from tests.e2e.support import EngineProcess, GatewayProcess, start_engines

MODEL = "tiny"
REQUESTS = 1000
MAX_TOKENS = 4
POOL = 8


@pytest.fixture(scope="module")
def stack(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[tuple[list[EngineProcess], list[GatewayProcess]]]:
    log_dir = tmp_path_factory.mktemp("burst")
    with RedisServer() as server:
        engines = start_engines(tiny_llama_dir, server.url, log_dir, ["burst-eng0", "burst-eng1"],
                                "--served-model-name", MODEL, "--kv-cache-memory", "16MiB", "--max-num-seqs", "256")
        gateways = [GatewayProcess(server.url, f"burst-gw{i}", log_dir, "--redis-pool-size", str(POOL),
                                   "--redis-pool-timeout", "120") for i in range(2)]
        try:
            for gateway in gateways:
                gateway.wait_healthy()
            yield engines, gateways
        finally:
            for process in [*gateways, *engines]:
                process.stop()


async def _stream(session: aiohttp.ClientSession, url: str, i: int, gate: asyncio.Event) -> str:
    """One streamed completion; its outcome: "ok", or the HTTP status / what went wrong."""
    await gate.wait()
    body = {"model": MODEL, "prompt": f"Burst {i}:", "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    try:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                return f"http {resp.status}"
            tokens, done = 0, False
            async for event in sse_payloads(resp.content):
                if event == SSE_DONE:
                    done = True
                else:
                    if "error" in event:
                        return f"error {event['error'].get('code')}"
                    if event.get("usage"):
                        tokens = event["usage"]["completion_tokens"]
            return "ok" if done and tokens == MAX_TOKENS else f"incomplete ({tokens} tokens, done={done})"
    except aiohttp.ClientError as exc:
        return f"client error {type(exc).__name__}"


def _metric(url: str, name: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"{name} missing from {url}/metrics")


async def test_a_thousand_streams_at_once_all_complete(
        stack: tuple[list[EngineProcess], list[GatewayProcess]]) -> None:
    engines, gateways = stack
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 4 * REQUESTS:  # one socket per stream here, plus the gateways' own
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 8 * REQUESTS), hard))
    gate = asyncio.Event()
    timeout = aiohttp.ClientTimeout(total=600, sock_read=300)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        tasks = [asyncio.create_task(_stream(session, gateways[i % 2].url, i, gate)) for i in range(REQUESTS)]
        await asyncio.sleep(0)
        gate.set()
        outcomes = Counter(await asyncio.gather(*tasks))
    assert outcomes == Counter({"ok": REQUESTS}), outcomes
    waited = sum(_metric(g.url, "pagedserve_redis_pool_wait_seconds_count") for g in gateways)
    assert waited >= REQUESTS, "the requests did not go through the gateways' pools"
    for engine in engines:
        engine.wait_drained()
