"""How an engine worker survives Redis failover and Redis data loss. The state it acts on
(what a failed flush left, the checkpoint log, whether a re-adoption is due) lives in
`engine.worker.recovery`; the flush that keeps what failed is `engine.worker.outbox`.

- failover: the new master may lack writes the old one acknowledged, so once Redis answers
  again after trouble the engine re-adopts what is still pending under its name
  (`engine.worker.intake.readopt`);
- data loss: a restart without persistence shows as a new dataset epoch (read back with every
  flush, or carried by a request); every in-flight request is gone from Redis then (its gateway
  fails it with a clear error), so the engine drops them all and publishes nothing for them."""

from __future__ import annotations

from collections.abc import Callable

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from common.log import get_logger
from common.redis_conn import Epoch
from engine.worker.intake import Intake
from engine.worker.recovery import RecoveryState

log = get_logger("worker")


def data_loss_hook(recovery: RecoveryState) -> Callable[[set[str]], None]:
    """The intake's `on_data_lost`: it dropped every request (`lost`); nothing unsent or
    checkpointed for them survives either."""

    def lost(request_ids: set[str]) -> None:
        log.error("Redis lost its data (epoch changed): dropped in-flight requests", requests=len(request_ids))
        recovery.data_lost()

    return lost


class Failover:
    """The worker's reactions to Redis trouble, run after each flush (`after_flush`)."""

    def __init__(self, client: aioredis.Redis, intake: Intake, recovery: RecoveryState, epoch: Epoch) -> None:
        self.client = client
        self.intake = intake
        self.recovery = recovery
        self.epoch = epoch

    async def after_flush(self, seen: str | None) -> bool:
        """A flush went through and read the epoch `seen`: re-adopt when due, and when the epoch
        changed drop everything (`redis_lost`). False when Redis lost its data."""
        if self.recovery.take_readopt():  # writes the old master acknowledged may be missing from this one
            await self.readopt()
        if self.epoch.token is not None and seen != self.epoch.token:
            await self.redis_lost(seen)
            return False
        return True

    async def readopt(self) -> None:
        """`Intake.readopt` once Redis answers again (due again when it fails)."""
        try:
            await self.intake.readopt()
        except (RedisError, OSError) as exc:
            log.warning("cannot check this engine's pending entries; will retry", error=str(exc))
            self.recovery.note_redis_trouble()

    async def redis_lost(self, seen: str | None) -> None:
        """Drop everything once, adopt the epoch the flush read (`seen`), then set one up when there
        was none and recreate the consumer groups. Redis has just come back and pooled connections
        may still point at the old server: a failure here is logged, not raised, since the next
        read recreates the group on NOGROUP and the next flush reads the epoch again."""
        self.intake.data_lost()
        if seen is not None:
            self.epoch.token = seen  # requests admitted from now on are not dropped again
        try:
            await self.epoch.check(self.client)
            for own in self.intake.own_streams:
                await own.ensure_group()
        except (RedisError, OSError) as exc:
            log.warning("after the data loss: epoch or consumer group not set up yet; will retry", error=str(exc))
