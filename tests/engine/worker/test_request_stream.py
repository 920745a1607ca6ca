"""The engine's stream plumbing on a real redis-server (6.2 and 7.x): consumer group, reads,
takeover of a dead consumer's entries (only while its heartbeat is gone), ownership after a
takeover, acks that delete, NOGROUP recovery."""

from __future__ import annotations

import redis.asyncio as aioredis

from common.protocol import REQUEST_FIELD, Keys
from engine.worker.request_stream import RequestStream

KEYS = Keys("t")
MODEL = "m"
STREAM = KEYS.requests(MODEL)


async def _add(client: aioredis.Redis, payload: bytes) -> str:
    return (await client.xadd(STREAM, {REQUEST_FIELD: payload})).decode()


def _stream(client: aioredis.Redis, name: str) -> RequestStream:
    return RequestStream(client, KEYS, MODEL, name)


async def test_group_read_ack_and_own_pending(client: aioredis.Redis) -> None:
    stream = _stream(client, "a")
    await stream.ensure_group()
    await stream.ensure_group()  # idempotent
    ids = [await _add(client, b"one"), await _add(client, b"two")]
    entries = await stream.read_new(10, None)
    assert [(e.entry_id, e.payload) for e in entries] == [(ids[0], b"one"), (ids[1], b"two")]
    assert await stream.read_new(10, None) == []
    await stream.ack([ids[0]])
    assert [e.entry_id for e in await stream.read_own_pending()] == [ids[1]]  # a restart finds it
    assert await stream.consumers() == {"a": 1}
    assert await client.xlen(STREAM) == 1  # acked entries are deleted: the stream stays bounded


async def test_takeover_only_from_a_consumer_whose_heartbeat_is_gone(client: aioredis.Redis) -> None:
    a, b, c = _stream(client, "a"), _stream(client, "b"), _stream(client, "c")
    await a.ensure_group()
    entry = await _add(client, b"work")
    await a.read_new(1, None)
    await client.set(KEYS.alive(MODEL, "a"), "alive")
    assert await b.dead_consumers() == []
    assert await b.claim_from("a", min_idle_ms=0) == []  # alive: nothing moves
    await client.delete(KEYS.alive(MODEL, "a"))
    assert await b.dead_consumers() == ["a"]
    claimed = await b.claim_from("a", min_idle_ms=0)
    assert [(e.entry_id, e.payload, e.deliveries) for e in claimed] == [(entry, b"work", 2)]
    assert await c.claim_from("b", min_idle_ms=60_000) == []  # just claimed: not idle, c cannot take it
    assert await a.owned([entry]) == set() and await b.owned([entry]) == {entry}
    assert await b.consumers() == {"a": 0, "b": 1}
    await b.forget("a")
    assert await b.consumers() == {"b": 1}


async def test_takeover_acks_entries_deleted_from_the_stream(client: aioredis.Redis) -> None:
    a, b = _stream(client, "a"), _stream(client, "b")
    await a.ensure_group()
    gone = await _add(client, b"gone")
    await a.read_new(1, None)
    await client.xdel(STREAM, gone)
    assert await b.claim_from("a", min_idle_ms=0) == []
    assert (await client.xpending(STREAM, KEYS.group))["pending"] == 0


async def test_read_recreates_a_lost_group(client: aioredis.Redis) -> None:
    stream = _stream(client, "a")
    await stream.ensure_group()
    await client.flushall()  # what a Redis restart without persistence leaves
    assert await stream.read_new(10, None) == []  # NOGROUP: group recreated
    entry = await _add(client, b"after")
    assert [e.entry_id for e in await stream.read_new(10, None)] == [entry]
