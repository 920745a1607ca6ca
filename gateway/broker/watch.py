"""The gateway's watchdog, two loops in one task. Every `interval_s` one refreshes this gateway's
liveness key with this process's token (engines stop the requests of a gateway whose key stayed
gone for their `--gateway-grace`, telling it through its output stream, and at once those whose
token is not the key's any more: a restarted process), on a connection of its
own: through the shared pool the refresh queued behind a burst's submits (a thousand streams
on 8 connections) past the key's TTL plus the engines' grace, and every engine dropped every
request of a gateway that was alive. The other checks the dataset epoch (a Redis that restarted
without persistence lost every in-flight request: they fail with a clear error) and fails the
requests of a model that has had no live engine for `orphan_after_s` (its stream has nobody
left to read it), and, as a backstop, fails requests that no engine holds any more and whose
end never reached this gateway (`check_stalled`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from common.log import get_logger
from common.protocol import REQUEST_FIELD, EngineRequest, ErrorInfo, ProtocolError
from gateway.broker.broker import Broker, BrokerUnavailable
from gateway.broker.collector import RequestCollector
from gateway.broker.engines import EngineRegistry

log = get_logger("gateway.watch")
STALL_AFTER_S = 30.0  # a request with no output this long is checked for an engine still holding it
RECHECK_S = 5.0  # a stalled request found held is looked at again after this long
MAX_CHECKS = 256  # stalled requests looked at per turn
SCAN_COUNT = 256  # entries per XRANGE when looking for a handed-back request


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class Watch:
    """Liveness key, epoch and orphaned-model checks for one gateway."""

    def __init__(self, broker: Broker, registry: EngineRegistry, interval_s: float = 1.0,
                 orphan_after_s: float = 10.0, liveness_client: aioredis.Redis | None = None,
                 stall_after_s: float = STALL_AFTER_S) -> None:
        self.broker = broker
        self.registry = registry
        self.liveness_client = liveness_client or broker.client  # its own connection in the gateway
        self.interval_s = interval_s
        self.orphan_after_s = orphan_after_s
        self.alive_ttl_ms = int(3000 * interval_s)
        self.no_engine_since: dict[str, float] = {}
        self.stall_after_s = stall_after_s
        self.checked_at: dict[str, float] = {}  # stalled request id -> when it was last found held
        self.suspects: dict[str, str] = {}  # request id -> the output stream's last id when it was found unheld
        self.lost = 0  # requests the backstop failed (metric, tests)
        self.stopped = False  # `run` ends at its next turn once set

    async def refresh_liveness(self) -> None:
        broker = self.broker
        await self.liveness_client.set(broker.keys.gateway(broker.gateway_id), broker.token, px=self.alive_ttl_ms)

    async def tick(self) -> None:
        broker = self.broker
        await broker.sync_epoch()
        await broker.check_master()
        await self.fail_orphans()
        await self.check_stalled()

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

    async def check_stalled(self, now: float | None = None) -> int:
        """The backstop for an end that never arrives (its notice trimmed, expired or deleted from the
        output stream while this gateway was away). A request with no output for `stall_after_s`
        whose entry is gone from its request stream and that has no progress checkpoint was ended
        by its engine (or never held), and the engine wrote its end in the same MULTI/EXEC as the
        XDEL: once the reader has read past the output stream's last id seen at that moment and
        the request is still open, its end is lost. It fails with `request_lost`. A request an
        engine handed back (drain) is found again on the shared stream and followed there.
        Returns how many failed."""
        now = time.monotonic() if now is None else now
        broker = self.broker
        failed = 0
        for request_id, tail in list(self.suspects.items()):
            collector = broker.collectors.get(request_id)
            if collector is None or collector.done:
                del self.suspects[request_id]
            elif _id_key(broker.last_id) >= _id_key(tail):
                del self.suspects[request_id]
                collector.fail(ErrorInfo("no engine holds this request any more and its end never reached this "
                                         "gateway (its engine stopped it while this gateway was out of reach of "
                                         "Redis); retry it", "service_unavailable", "request_lost"))
                log.error("request lost: no engine holds it and its end never arrived", id=request_id)
                failed += 1
        self.lost += failed
        live = broker.collectors
        self.checked_at = {rid: at for rid, at in self.checked_at.items() if rid in live}
        stalled = [c for c in live.values()
                   if not c.done and c.entry_id and c.request_id not in self.suspects
                   and now - c.last_output >= self.stall_after_s
                   and now - self.checked_at.get(c.request_id, -1e9) >= RECHECK_S][:MAX_CHECKS]
        if not stalled:
            return failed
        keys = broker.keys
        async with broker.client.pipeline(transaction=False) as pipe:
            for c in stalled:
                pipe.xrange(c.stream or keys.requests(c.model), c.entry_id, c.entry_id)
                pipe.exists(keys.progress(broker.gateway_id, c.request_id))
            pipe.xrevrange(keys.out(broker.gateway_id), count=1)
            replies = await pipe.execute()
        newest = replies[-1]
        tail = _text(newest[0][0]) if newest else "0-0"
        for i, collector in enumerate(stalled):
            self.checked_at[collector.request_id] = now
            if replies[2 * i] or replies[2 * i + 1] or await self._requeued(collector):
                continue  # queued, held (its checkpoint), or handed back: an engine has it or will
            self.suspects[collector.request_id] = tail
        return failed

    async def _requeued(self, collector: RequestCollector) -> bool:
        """A draining engine hands a request back as a new entry of the shared stream (and deletes
        the old one in the same MULTI): look for it there, after the old entry, and follow it."""
        stream = self.broker.keys.requests(collector.model)
        start = f"({collector.entry_id}"
        for _ in range(max(1, self.broker.max_queued // SCAN_COUNT + 1)):
            entries = list(await self.broker.client.xrange(stream, start, "+", count=SCAN_COUNT) or [])
            for entry_id, fields in entries:
                payload = (fields or {}).get(REQUEST_FIELD.encode(), (fields or {}).get(REQUEST_FIELD))
                if isinstance(payload, bytes) and collector.request_id.encode() in payload:
                    try:
                        if EngineRequest.decode(payload).id != collector.request_id:
                            continue
                    except ProtocolError:
                        continue
                    collector.entry_id, collector.stream = _text(entry_id), stream
                    self.broker.unroute(collector)
                    return True
            if len(entries) < SCAN_COUNT:
                return False
            start = f"({_text(entries[-1][0])}"
        return False

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
