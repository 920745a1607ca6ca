"""Two `pagedserve gateway` processes on one Redis share one per-API-key
budget (`--rate-limits`): whichever gateway a client reaches, the key's requests per window
add up, and the one over the limit gets 429 with Retry-After. A bad limits file stops a gateway
from starting."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis

from common.protocol import Keys
from pagedserve.launch.redis_server import RedisServer
from tests.e2e.support import GatewayProcess
from tests.fixtures.gateway import MODEL, FakeEngine

BODY = {"model": MODEL, "prompt": "Hello", "max_tokens": 3, "temperature": 0}


def _wait_listening(gateway: GatewayProcess, timeout: float = 120.0) -> None:
    """Until the gateway answers /health at all (503 too: no engine beats before the test)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"{gateway.url}/health", timeout=2):
                return
        except urllib.error.HTTPError:
            return
        except (urllib.error.URLError, OSError):
            pass
        if gateway.proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"gateway {gateway.gateway_id} not listening: {gateway.log_tail()}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, list[GatewayProcess], Path]]:
    """Redis and two limited gateways; the engine is the scripted one of the gateway tests (the
    limits act in the gateways, before any engine sees a request)."""
    log_dir = tmp_path_factory.mktemp("e2e-ratelimit")
    limits = log_dir / "limits.json"
    limits.write_text(json.dumps({"default": {"requests_per_minute": 3, "tokens_per_minute": 100_000}}))
    with RedisServer() as server:
        gateways: list[GatewayProcess] = []
        try:
            for name in ("rl-gw-a", "rl-gw-b"):
                gateways.append(GatewayProcess(server.url, name, log_dir, "--rate-limits", str(limits)))
            for gateway in gateways:
                _wait_listening(gateway)
            yield server.url, gateways, limits
        finally:
            for process in gateways:
                process.stop()


async def _post(session: aiohttp.ClientSession, url: str, headers: dict[str, str]) -> tuple[int, Any, Any]:
    async with session.post(f"{url}/v1/completions", json=BODY, headers=headers) as resp:
        return resp.status, resp.headers, await resp.json()


async def _served(engine: FakeEngine, session: aiohttp.ClientSession, url: str,
                  headers: dict[str, str]) -> tuple[int, Any, Any]:
    """A request the scripted engine answers."""
    await engine.beat()  # fresh, whatever the time since the last request
    post = asyncio.create_task(_post(session, url, headers))
    await engine.generate(await engine.next_request(timeout=30), [" ok"])
    return await post


async def test_two_gateways_share_one_budget(limited: tuple[str, list[GatewayProcess], Path],
                                             tiny_tokenizer_dir: Path) -> None:
    redis_url, (a, b), limits = limited
    key = {"Authorization": "Bearer sk-shared"}
    client = aioredis.Redis.from_url(redis_url)
    engine = FakeEngine(client, Keys(), str(tiny_tokenizer_dir))
    await engine.beat()
    async with aiohttp.ClientSession() as session:
        remaining = []
        for gateway in (a, b, a):
            status, headers, body = await _served(engine, session, gateway.url, key)
            assert status == 200, body
            remaining.append(headers["x-ratelimit-remaining-requests"])
        assert remaining == ["2", "1", "0"]
        for gateway in (b, a):  # the budget is spent on both gateways
            status, headers, body = await _post(session, gateway.url, key)
            assert status == 429, body
            assert int(headers["Retry-After"]) >= 1
            assert body["error"]["type"] == "requests" and body["error"]["code"] == "rate_limit_exceeded"
        other = {"Authorization": "Bearer sk-other"}  # another key has its own budget
        status, headers, body = await _served(engine, session, b.url, other)
        assert status == 200, body
        assert headers["x-ratelimit-remaining-requests"] == "2"
        async with session.get(f"{b.url}/metrics") as resp:
            assert 'pagedserve_gateway_rate_limited_total{type="requests"} 1.0' in await resp.text()
        # SIGHUP re-reads the file: same size and mtime, so only the signal can have done it
        stamp, size = limits.stat().st_mtime_ns, limits.stat().st_size
        limits.write_text(json.dumps({"default": {"requests_per_minute": 9}}).ljust(size))
        os.utime(limits, ns=(stamp, stamp))
        a.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 60
        while "rate limits reloaded" not in a.log_tail(100_000):
            assert a.proc.poll() is None and time.monotonic() < deadline, a.log_tail()
            await asyncio.sleep(0.05)
        status, headers, body = await _served(engine, session, a.url, {"Authorization": "Bearer sk-third"})
        assert status == 200 and headers["x-ratelimit-limit-requests"] == "9", body
    await client.aclose()


def test_bad_limits_file_refuses_start(tmp_path: Path) -> None:
    bad = tmp_path / "limits.json"
    bad.write_text('{"default": {"requests_per_minute": "lots"}}')
    gateway = GatewayProcess("redis://127.0.0.1:1/0", "rl-bad", tmp_path, "--rate-limits", str(bad))
    try:
        assert gateway.proc.wait(60) == 2
    finally:
        gateway.stop()
    assert "requests_per_minute" in gateway.log_tail()
