"""Routed streams (issue 40) on a real redis-server: acks grouped by the stream each entry came
from, work stealing of only the entries a peer's stream held longer than the steal age (by
Redis' clock), registration in the routed-streams set, and removal of a gone engine's empty
routed stream by the takeover scan."""

from __future__ import annotations

import redis.asyncio as aioredis

from common.protocol import REQUEST_FIELD, Keys
from engine.worker.intake import Intake
from engine.worker.outbox import Outbox
from engine.worker.request_stream import RequestStream

KEYS = Keys("t")
MODEL = "m"
SHARED = KEYS.requests(MODEL)
ROUTED_SET = KEYS.routed_streams(MODEL)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def routed(client: aioredis.Redis, owner: str, consumer: str | None = None) -> RequestStream:
    return RequestStream(client, KEYS, MODEL, consumer or owner, key=KEYS.routed(MODEL, owner), register=ROUTED_SET)


def test_outbox_acks_by_stream() -> None:
    box = Outbox()
    box.end("r1", "1-0")
    box.end("r2", "1-0", "routed-a")
    box.ack("2-0")
    box.ack("3-0", "routed-b")
    later = Outbox()
    later.end("r3", "4-0", "routed-a")
    box.merge(later)
    assert box.acks(SHARED) == {SHARED: ["1-0", "2-0"], "routed-a": ["1-0", "4-0"], "routed-b": ["3-0"]}
    kept = box.without({"r2"})
    assert kept.acks(SHARED) == {SHARED: ["1-0", "2-0"], "routed-a": ["4-0"], "routed-b": ["3-0"]}


async def test_ensure_group_registers_the_routed_stream(client: aioredis.Redis) -> None:
    stream = routed(client, "a")
    await stream.ensure_group()
    await stream.ensure_group()
    assert await client.smembers(ROUTED_SET) == {KEYS.routed(MODEL, "a").encode()}
    groups = await client.xinfo_groups(stream.key)
    assert [g["name"].decode() for g in groups] == [KEYS.group]


async def test_steal_takes_only_entries_older_than_the_steal_age(client: aioredis.Redis) -> None:
    owner = routed(client, "a")
    await owner.ensure_group()
    seconds, micros = await client.time()
    now_ms = int(seconds) * 1000 + int(micros) // 1000
    old = _text(await client.xadd(owner.key, {REQUEST_FIELD: b"old"}, id=f"{now_ms - 60_000}-0"))
    await client.xadd(owner.key, {REQUEST_FIELD: b"fresh"})
    thief = routed(client, "a", consumer="b")
    stolen = await thief.steal(older_than_ms=30_000, count=10)
    assert [(e.entry_id, e.payload, e.stream) for e in stolen] == [(old, b"old", owner.key)]
    assert await thief.steal(older_than_ms=30_000, count=10) == []  # already delivered: not again
    assert await thief.owned([old]) == {old}  # pending under the thief: it acks it there
    fresh = await owner.read_new(10, None)  # the owner still gets its fresh entry
    assert [e.payload for e in fresh] == [b"fresh"]
    assert await routed(client, "gone", consumer="b").steal(1, 10) == []  # no such stream


async def test_takeover_scan_drops_a_gone_engines_empty_routed_stream(client: aioredis.Redis) -> None:
    shared = RequestStream(client, KEYS, MODEL, "me")
    await shared.ensure_group()
    gone, busy, live = routed(client, "gone"), routed(client, "busy"), routed(client, "live")
    for stream in (gone, busy, live):
        await stream.ensure_group()
    await client.xadd(busy.key, {REQUEST_FIELD: b"waiting"})  # not delivered yet: stealing moves it
    recent = routed(client, "recent")  # gone and empty, but a gateway added (and forgot) an entry just now
    await recent.ensure_group()
    await client.xdel(recent.key, _text(await client.xadd(recent.key, {REQUEST_FIELD: b"forgotten"})))
    await client.set(KEYS.alive(MODEL, "live"), "alive")
    intake = Intake(client, KEYS, shared, MODEL)
    assert await intake.claim(min_idle_ms=0) == 0
    members = {_text(m) for m in await client.smembers(ROUTED_SET)}
    assert members == {busy.key, live.key, recent.key}
    assert not await client.exists(gone.key)
