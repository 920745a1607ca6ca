"""The gateway's watchdog, two loops in one task. Every `interval_s` one refreshes this gateway's
liveness key (engines drop the requests of a gateway whose key is gone), on a connection of its
own: through the shared pool the refresh queued behind a burst's submits (a thousand streams
on 8 connections) past the key's TTL plus the engines' grace, and every engine dropped every
request of a gateway that was alive. The other checks the dataset epoch (a Redis that restarted
without persistence lost every in-flight request: they fail with a clear error) and fails the
requests of a model that has had no live engine for `orphan_after_s` (its stream has nobody
left to read it)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from common.log import get_logger
from common.protocol import ErrorInfo
from gateway.broker.broker import Broker, BrokerUnavailable
from gateway.broker.engines import EngineRegistry

log = get_logger("gateway.watch")


class Watch:
    """Liveness key, epoch and orphaned-model checks for one gateway."""

    def __init__(self, broker: Broker, registry: EngineRegistry, interval_s: float = 1.0,
                 orphan_after_s: float = 10.0, liveness_client: aioredis.Redis | None = None) -> None:
        self.broker = broker
        self.registry = registry
        self.liveness_client = liveness_client or broker.client  # its own connection in the gateway
        self.interval_s = interval_s
        self.orphan_after_s = orphan_after_s
        self.alive_ttl_ms = int(3000 * interval_s)
        self.no_engine_since: dict[str, float] = {}
        self.stopped = False  # `run` ends at its next turn once set

    async def refresh_liveness(self) -> None:
        broker = self.broker
        await self.liveness_client.set(broker.keys.gateway(broker.gateway_id), "1", px=self.alive_ttl_ms)

    async def tick(self) -> None:
        broker = self.broker
        await broker.sync_epoch()
        await broker.check_master()
        await self.fail_orphans()

    async def fail_orphans(self, now: float | None = None) -> int:
        """Fail in-flight requests of models without a live engine for `orphan_after_s`."""
        now = time.monotonic() if now is None else now
        waiting = {c.model for c in self.broker.collectors.values() if not c.done}
        if not waiting:
            self.no_engine_since.clear()
            return 0
        served = await self.registry.models(refresh=True)
        failed = 0
        for model in waiting:
            if model in served:
                self.no_engine_since.pop(model, None)
                continue
            since = self.no_engine_since.setdefault(model, now)
            if now - since < self.orphan_after_s:
                continue
            collectors = self.broker.fail_all(ErrorInfo(
                f"no engine serves model '{model}' any more (all its engines stopped)", "service_unavailable",
                "no_engine"), model=model)
            log.error("engines of a model gone: failing its requests", model=model, requests=len(collectors))
            await self.broker.forget(collectors)
            failed += len(collectors)
        return failed

    async def run(self) -> None:
        await asyncio.gather(self._every_interval(self.refresh_liveness, "liveness refresh"),
                             self._every_interval(self.tick, "gateway watch"))

    async def _every_interval(self, step: Callable[[], Awaitable[None]], what: str) -> None:
        while not self.stopped:
            try:
                await step()
            except (RedisError, OSError, BrokerUnavailable) as exc:
                log.warning(f"{what} failed", error=str(exc))
            await asyncio.sleep(self.interval_s)
