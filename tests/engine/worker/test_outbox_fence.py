"""The outbox flush fenced by the engine's heartbeat key, on a real redis-server: it writes only
while the key has held since the flush looked, so a process frozen between its check and its
EXEC cannot write for requests another engine took over meanwhile."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest
import redis
import redis.asyncio as aioredis
from redis.exceptions import WatchError

from common.protocol import Keys, OutputMessage, SeqOutput
from engine.worker.outbox import Fence, FenceLost, Outbox, flush

KEYS = Keys("fence")
STREAM = KEYS.requests("m")
BEAT = KEYS.engine("eng-x")


@pytest.fixture
async def client(redis_server: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_server)
    await client.delete(BEAT, KEYS.progress("gw", "r1"), KEYS.out("gw"))
    yield client
    await client.aclose()


def _outbox() -> Outbox:
    box = Outbox()
    box.add("gw", OutputMessage(id="r1", seq=0, outputs=[SeqOutput(index=0, token_ids=[5, 6], offset=0)]))
    return box


async def _flush(client: aioredis.Redis, fence: Fence) -> None:
    await flush(client, KEYS, STREAM, _outbox(), 60, [], fence)


async def test_writes_while_the_heartbeat_key_holds(client: aioredis.Redis) -> None:
    await client.set(BEAT, "1", px=10_000)
    await _flush(client, Fence(BEAT, lambda: True))
    assert await client.exists(KEYS.progress("gw", "r1")) and await client.xlen(KEYS.out("gw")) == 1


async def test_a_missing_key_or_a_possible_lapse_writes_nothing(client: aioredis.Redis) -> None:
    with pytest.raises(FenceLost):
        await _flush(client, Fence(BEAT, lambda: True))  # the key is gone: others may own our work
    await client.set(BEAT, "1", px=10_000)
    with pytest.raises(FenceLost):
        await _flush(client, Fence(BEAT, lambda: False))  # our clock says it may have lapsed
    assert not await client.exists(KEYS.progress("gw", "r1")) and not await client.exists(KEYS.out("gw"))


@pytest.mark.parametrize("change", ["rewritten", "expired"])
async def test_a_key_that_changes_before_exec_aborts_the_flush(client: aioredis.Redis, redis_server: str,
                                                             change: str) -> None:
    """The change lands after the flush looked at the key and before its EXEC: exactly where a
    frozen process would be."""
    await client.set(BEAT, "1", px=10_000)
    other = redis.Redis.from_url(redis_server)

    def fresh_then_change() -> bool:
        if change == "rewritten":
            other.set(BEAT, "2", px=10_000)
        else:
            other.pexpire(BEAT, 1)
            time.sleep(0.05)
        return True

    try:
        with pytest.raises(WatchError):
            await _flush(client, Fence(BEAT, fresh_then_change))
    finally:
        other.close()
    assert not await client.exists(KEYS.progress("gw", "r1")) and not await client.exists(KEYS.out("gw"))
