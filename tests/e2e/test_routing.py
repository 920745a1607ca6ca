"""Cache-aware routing end to end (issue 40), real processes: one Redis, two engines of one
tiny model reading their own routed streams, an in-process gateway routing by prefix.

- multi-turn conversations with distinct system prompts land on the engine that holds their
  prefix: later turns find most of their resent history cached;
- work stealing: requests routed to an engine that is frozen (SIGSTOP) complete on the other."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
import redis

from common.protocol import Keys
from pagedserve.launch.redis_server import RedisServer
from tests.e2e.routing_support import (
    announced,
    assert_turns_follow_their_prefix,
    complete,
    fresh_stats,
    system_prompt,
)
from tests.e2e.support import EngineProcess, serve_gateway, start_engines

MODEL = "tiny"
ENGINE_ARGS = ("--served-model-name", MODEL, "--kv-cache-memory", "8MiB", "--steal-after", "0.5")


@pytest.fixture(scope="module")
def stack(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, list[EngineProcess]]]:
    logs = tmp_path_factory.mktemp("routing")
    with RedisServer() as server:
        engines = start_engines(tiny_llama_dir, server.url, logs, ["route-a", "route-b"], *ENGINE_ARGS)
        try:
            yield server.url, engines
        finally:
            for engine in engines:
                engine.stop()


async def test_engines_register_their_routed_streams(stack: tuple[str, list[EngineProcess]]) -> None:
    url, engines = stack
    announced(engines)
    with redis.Redis.from_url(url) as client:
        members = {m.decode() for m in client.smembers(Keys().routed_streams(MODEL))}
        assert members == {Keys().routed(MODEL, e.engine_id) for e in engines}
        for engine in engines:
            groups = client.xinfo_groups(Keys().routed(MODEL, engine.engine_id))
            assert [g["name"].decode() for g in groups] == [Keys().group]


async def test_multi_turn_conversations_stay_on_their_prefix(stack: tuple[str, list[EngineProcess]]) -> None:
    url, engines = stack
    await assert_turns_follow_their_prefix(url, engines, MODEL)


async def owner(session: aiohttp.ClientSession, gateway: str, engines: list[EngineProcess],
                prompt: str) -> EngineProcess:
    """Send one request alone and tell which engine's routed stream it came from."""
    before = [fresh_stats(e, time.time()).get("routed_taken", 0.0) for e in engines]
    await complete(session, gateway, MODEL, prompt)
    after = [fresh_stats(e, time.time()).get("routed_taken", 0.0) for e in engines]
    grown = [e for e, b, a in zip(engines, before, after, strict=True) if a > b]
    assert len(grown) == 1, f"routed_taken before {before}, after {after}"
    return grown[0]


async def test_requests_routed_to_a_frozen_engine_are_stolen(stack: tuple[str, list[EngineProcess]]) -> None:
    url, engines = stack
    announced(engines)
    async with aiohttp.ClientSession() as session, serve_gateway(url) as gateway:
        prompt = system_prompt(9)
        frozen = await owner(session, gateway, engines, prompt)
        other = next(e for e in engines if e is not frozen)
        stolen_before = fresh_stats(other, time.time()).get("stolen", 0.0)
        frozen.proc.send_signal(signal.SIGSTOP)
        try:
            # at once, while its heartbeat is fresh: the gateway routes them to the frozen engine's stream
            follow_ups = [prompt + f"\nUser: question {k}?\n" for k in range(3)]
            replies = await asyncio.wait_for(
                asyncio.gather(*(complete(session, gateway, MODEL, p) for p in follow_ups)), 120)
            assert all(r["choices"][0]["text"] for r in replies)
            stats = fresh_stats(other, time.time())
        finally:
            frozen.proc.send_signal(signal.SIGCONT)
        assert stats.get("stolen", 0.0) - stolen_before >= 1, stats
        announced(engines)


async def test_no_routing_engine_serves_the_shared_stream(stack: tuple[str, list[EngineProcess]],
                                                          tiny_llama_dir: Path,
                                                          tmp_path_factory: pytest.TempPathFactory) -> None:
    """`--no-routing`: no routed stream, no `routed` in the heartbeat; its model's requests go
    through the shared stream as before."""
    url, _ = stack
    logs = tmp_path_factory.mktemp("no-routing")
    (plain,) = start_engines(tiny_llama_dir, url, logs, ["plain-0"], "--served-model-name", "plain",
                             "--kv-cache-memory", "8MiB", "--no-routing")
    try:
        beat = plain.heartbeat()
        assert beat is not None and not beat.routed and not beat.cached
        body = {"model": "plain", "prompt": "Hello there", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        async with aiohttp.ClientSession() as session, serve_gateway(url) as gateway, \
                session.post(f"{gateway}/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            assert (await resp.json())["usage"]["completion_tokens"] == 4
        with redis.Redis.from_url(url) as client:
            assert not client.exists(Keys().routed_streams("plain"))
            assert not client.exists(Keys().routed("plain", "plain-0"))
    finally:
        plain.stop()
