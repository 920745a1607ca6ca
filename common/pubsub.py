"""One resilient pub/sub subscription, shared by the gateway's output listener and the
engine's abort listener: subscribe, hand every message to a callback, and after a lost
connection report it and subscribe again, with a backoff (doubling from `retry_s` up to
`max_retry_s`, reset by a subscription that holds). On a Sentinel-managed client the new
subscription asks the sentinels for the master (Sentinel also drops the subscribers of a
demoted master), so aborts keep arriving after a failover. Torch-free."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from common.log import get_logger

log = get_logger("pubsub")


async def subscribe_forever(
    client: aioredis.Redis, channel: str, on_message: Callable[[bytes], None], *,
    on_subscribed: Callable[[], None] | None = None, on_lost: Callable[[Exception], None] | None = None,
    retry_s: float = 0.5, poll_s: float = 1.0, running: Callable[[], bool] = lambda: True,
    max_retry_s: float = 4.0,
) -> None:
    """Run until cancelled or, within `poll_s`, until `running()` turns false (a cancellation
    can be lost in a race with a poll's timeout; a flag cannot). `on_message` must not block
    (the listener serves every request)."""
    failures = 0
    while running():
        pubsub = client.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(channel)
            if on_subscribed is not None:
                on_subscribed()
            while running():
                failures = 0
                message = await pubsub.get_message(timeout=poll_s)
                if message is not None and message.get("type") == "message":
                    on_message(message["data"])
        except (RedisError, OSError) as exc:
            if on_lost is not None:
                on_lost(exc)
            log.warning("subscription lost", channel=channel, error=str(exc))
            await asyncio.sleep(min(max_retry_s, retry_s * 2 ** failures))
            failures += 1
        finally:
            with contextlib.suppress(RedisError, OSError):
                await pubsub.aclose()
