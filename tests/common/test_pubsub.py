"""`subscribe_forever` on a real redis-server: delivers published messages, and ends within a
poll once its `running` flag turns false, even when its cancellation is lost."""

from __future__ import annotations

import asyncio
import contextlib

import redis.asyncio as aioredis

from common.pubsub import subscribe_forever


async def test_delivers_then_ends_on_its_flag_without_a_cancellation(redis_server: str) -> None:
    client = aioredis.Redis.from_url(redis_server)
    got: list[bytes] = []
    subscribed = asyncio.Event()
    running = True
    task = asyncio.create_task(subscribe_forever(client, "ps-test:chan", got.append, on_subscribed=subscribed.set,
                                                 poll_s=0.05, running=lambda: running))
    try:
        await asyncio.wait_for(subscribed.wait(), 10)
        await client.publish("ps-test:chan", b"one")
        for _ in range(200):
            if got:
                break
            await asyncio.sleep(0.05)
        assert got == [b"one"]
        running = False  # no task.cancel(): the flag alone must end it
        await asyncio.wait_for(task, 30)
        assert task.done() and task.exception() is None
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await client.aclose()
