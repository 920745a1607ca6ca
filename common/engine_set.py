"""The set of live engines, shared by both sides.

``{prefix}:engines`` is a sorted set of engine ids scored by the wall-clock time (epoch seconds,
the `time` field of the heartbeat) of each engine's last heartbeat; every beat writes it with
the heartbeat hash (`Keys.engine`, with its TTL) and the engine's liveness key in its model's
slot (`Keys.alive`, same TTL): in one MULTI/EXEC on a single Redis, one per slot on a cluster
(liveness key, hash, then set member). Readers take the set's members and read their hashes:
discovery costs one ZRANGE and one HGETALL per engine, never a SCAN of a keyspace an application
may share. A reader with an age bound first prunes members older than it, by score (atomic on
the server: a beat that refreshed the member in between keeps it). A stopped engine removes its
member and hash; a killed one drops out when its hash expires (a member without a hash is
skipped) and leaves the set at the next reader's prune."""

from __future__ import annotations

import time
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline

from common.protocol import EngineHeartbeat, Keys
from common.redis_slots import SlotBatch


def queue_beat(pipe: Pipeline | SlotBatch, keys: Keys, beat: EngineHeartbeat, ttl_ms: int) -> None:
    """Queue the heartbeat's writes on `pipe` (a MULTI/EXEC one: all or nothing): the liveness
    key in the model's slot, then replace the hash (stale stat fields disappear), set its TTL,
    score the engine in the set."""
    key = keys.engine(beat.engine_id)
    pipe.set(keys.alive(beat.model, beat.engine_id), beat.time, px=ttl_ms)
    pipe.delete(key)
    pipe.hset(key, mapping=beat.to_hash())  # type: ignore[arg-type]
    pipe.pexpire(key, ttl_ms)
    pipe.zadd(keys.engines, {beat.engine_id: beat.time})


def queue_removal(pipe: Pipeline | SlotBatch, keys: Keys, engine_id: str, model: str) -> None:
    """Queue the removal of an engine's liveness key, hash and set member (a clean stop)."""
    pipe.delete(keys.alive(model, engine_id))
    pipe.delete(keys.engine(engine_id))
    pipe.zrem(keys.engines, engine_id)


async def read_heartbeats(client: aioredis.Redis, keys: Keys, max_age_s: float | None) -> list[dict[Any, Any]]:
    """The raw heartbeat hashes of the set's engines (decode each with
    `EngineHeartbeat.from_hash`). With `max_age_s`, members whose last beat is older are
    pruned first and not read; with None every member whose hash still exists is returned.
    Raises RedisError when Redis fails."""
    async with client.pipeline(transaction=False) as pipe:
        if max_age_s is not None:
            pipe.zremrangebyscore(keys.engines, "-inf", f"({time.time() - max_age_s!r}")
        pipe.zrange(keys.engines, 0, -1)
        replies = await pipe.execute()
    ids = [m.decode() if isinstance(m, bytes) else str(m) for m in replies[-1]]
    if not ids:
        return []
    async with client.pipeline(transaction=False) as pipe:
        for engine_id in ids:
            pipe.hgetall(keys.engine(engine_id))
        hashes = await pipe.execute()
    return [raw for raw in hashes if raw]
