"""Two gateways and two engine processes on one real Redis: load is shared, and a `kill -9`
of an engine mid-generation is invisible to clients (its requests resume on the other
engine; every text equals an undisturbed greedy run, no token lost or doubled)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from gateway.clients.sse_reader import sse_events
from pagedserve.launch.redis_server import RedisServer
from tests.e2e.support import EngineProcess, owner_of_most, serve_gateway, start_engines

MODEL = "tiny"


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: Path,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, list[EngineProcess]]]:
    with RedisServer() as server:
        engines = start_engines(tiny_llama_dir, server.url, tmp_path_factory.mktemp("e2e-cluster"),
                                ["cl-0", "cl-1"], "--served-model-name", MODEL, "--kv-cache-memory", "8MiB")
        try:
            yield server.url, engines
        finally:
            for engine in engines:
                engine.stop()


async def stream_text(session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int,
                      started: asyncio.Event | None = None) -> tuple[str, str | None, int]:
    """Stream a greedy completion; returns (text, finish_reason, completion_tokens)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    text, finish, tokens, chunks = "", None, 0, 0
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for event in sse_events(resp):
            assert "error" not in event, event
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            for choice in event["choices"]:
                text += choice["text"]
                finish = choice["finish_reason"] or finish
                chunks += 1
            if started is not None and chunks >= 5:
                started.set()
    return text, finish, tokens


async def test_two_gateways_two_engines_100_streams(cluster: tuple[str, list[EngineProcess]]) -> None:
    redis_url, engines = cluster
    before = [e.stats().get("finished_length", 0.0) for e in engines]
    async with serve_gateway(redis_url) as url_a, serve_gateway(redis_url) as url_b, \
            aiohttp.ClientSession() as session:
        results = await asyncio.gather(*(stream_text(session, (url_a, url_b)[i % 2], f"request {i}:", 24)
                                         for i in range(100)))
    assert all(finish == "length" and tokens == 24 and text for text, finish, tokens in results)
    deadline = time.monotonic() + 10  # heartbeats carry the figures, a beat later
    while True:
        served = [e.stats().get("finished_length", 0.0) - b for e, b in zip(engines, before, strict=True)]
        if sum(served) == 100 or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    assert sum(served) == 100
    assert min(served) > 0, f"one engine served nothing: {served}"
    for engine in engines:
        engine.wait_drained()


async def test_kill_9_engine_mid_generation(cluster: tuple[str, list[EngineProcess]]) -> None:
    """Run last in the module: it kills an engine."""
    redis_url, engines = cluster
    prompts = [f"The story number {i} begins" for i in range(8)]
    async with serve_gateway(redis_url) as url_a, serve_gateway(redis_url) as url_b, \
            aiohttp.ClientSession() as session:
        urls = [url_a, url_b]
        reference = await asyncio.gather(*(stream_text(session, urls[i % 2], p, 200) for i, p in enumerate(prompts)))
        started = [asyncio.Event() for _ in prompts]
        tasks = [asyncio.create_task(stream_text(session, urls[i % 2], p, 200, started[i]))
                 for i, p in enumerate(prompts)]
        await asyncio.wait_for(asyncio.gather(*(s.wait() for s in started)), 60)
        # Freeze both, then pick the victim from the stream's pending entries: a heartbeat's figures
        # lag by up to a beat (once both read in_flight 0 while the engines held every request).
        for engine in engines:
            os.kill(engine.proc.pid, signal.SIGSTOP)
        victim = owner_of_most(redis_url, MODEL, engines)  # asserts it holds at least one request
        victim.kill()
        killed_at = time.monotonic()
        survivor = next(e for e in engines if e is not victim)
        os.kill(survivor.proc.pid, signal.SIGCONT)
        disturbed = await asyncio.wait_for(asyncio.gather(*tasks), 120)
    assert "resuming request" in survivor.log_tail(200_000)
    for i, (ref, got) in enumerate(zip(reference, disturbed, strict=True)):
        assert got[1] == "length" and got[2] == 200, (i, got[1:])
        assert got[0] == ref[0], f"prompt {i}: text differs from the undisturbed run"
    survivor.wait_drained()
    assert time.monotonic() - killed_at < 120
