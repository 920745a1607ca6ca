"""Engine discovery reads the set of live engines, never SCANs: in a Redis holding 100k
unrelated keys, the gateway (`/health`, `/v1/models`) and the engine's start-up conflict
check find the engines that the engine's own heartbeat code announced, Redis counts no SCAN
(INFO commandstats), a stopped engine drops out at once and a killed one (no more beats)
when its hash expires, and its member is pruned once older than the gateway's bound; set
members without a valid hash are skipped."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import redis.asyncio as aioredis

from common.protocol import Keys
from engine.worker.heartbeat import Heartbeat
from tests.fixtures.gateway import MODEL, Gateway, open_gateway

UNRELATED_KEYS = 100_000


async def _calls(client: aioredis.Redis, command: str) -> int:
    stats = await client.info("commandstats")
    return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))


async def _until(condition: Callable[[], Awaitable[bool]], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not await condition():
        assert time.monotonic() < deadline, f"not within {timeout}s: {what}"
        await asyncio.sleep(0.1)


async def _health_engines(gw: Gateway) -> int:
    resp = await gw.client.get("/health")
    return int((await resp.json())["engines"]) if resp.status == 200 else 0


async def test_discovery_without_scan(redis_server: str, tiny_tokenizer_dir: Path) -> None:
    client = aioredis.Redis.from_url(redis_server)
    keys = Keys()
    try:
        for start in range(0, UNRELATED_KEYS, 10_000):  # an application sharing the Redis
            await client.mset({f"app:item:{i}": "x" for i in range(start, start + 10_000)})

        def engine(engine_id: str, ttl_s: float, max_model_len: int = 512) -> Heartbeat:
            return Heartbeat(client, keys, engine_id, MODEL, str(tiny_tokenizer_dir), max_model_len, ttl_s=ttl_s)

        live, stopped, killed = engine("e-live", 30), engine("e-stopped", 30), engine("e-killed", 1)
        for beat in (live, stopped, killed):
            await beat.beat({}, [], {})
        assert await client.dbsize() == UNRELATED_KEYS + 7  # 3 hashes, 3 liveness keys, the set
        async with open_gateway(redis_server, tiny_tokenizer_dir, engine_stale_s=4.0) as gw:
            scans, zranges = await _calls(client, "scan"), await _calls(client, "zrange")
            assert await _health_engines(gw) == 3
            models = (await (await gw.client.get("/v1/models")).json())["data"]
            assert [(m["id"], m["engines"]) for m in models] == [(MODEL, 3)]
            assert await _calls(client, "zrange") > zranges  # it read the set...

            # members no engine wrote (a garbage hash, none at all) are skipped, not fatal
            await client.zadd(keys.engines, {"poison": time.time(), "no-hash": time.time()})
            await client.hset(keys.engine("poison"), mapping={"engine_id": "", "time": "nan", "pool": "x"})
            assert await _health_engines(gw) == 3

            # the engine's own check sees the others through the set too
            other = engine("e-other", 30, max_model_len=256)
            found = {c.split()[0] for c in await other.conflicts()}  # e-killed's hash may be gone
            assert {"e-live", "e-stopped"} <= found <= {"e-live", "e-stopped", "e-killed"}

            await stopped.remove()  # a clean stop: gone at the next read
            assert await client.zscore(keys.engines, "e-stopped") is None
            assert await _health_engines(gw) == 2

            async def killed_gone() -> bool:
                await live.beat({}, [], {})  # the live engine keeps beating
                return await _health_engines(gw) == 1

            await _until(killed_gone, 20, "the killed engine's hash expired and it left /health")
            assert await client.zscore(keys.engines, "e-killed") is not None  # younger than the bound

            async def pruned() -> bool:
                await live.beat({}, [], {})
                await gw.client.get("/health")
                return await client.zscore(keys.engines, "e-killed") is None

            await _until(pruned, 20, "the killed engine's member was pruned by score")
            assert await _health_engines(gw) == 1
            assert await _calls(client, "scan") == scans  # ...and never scanned
    finally:
        await client.aclose()
