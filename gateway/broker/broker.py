"""The gateway's side of Redis: submit requests, publish aborts, and ONE listener task that
demultiplexes this gateway's output channel into per-request collectors."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from engine.log import get_logger
from engine.protocol import (
    REQUEST_FIELD,
    AbortMessage,
    EngineRequest,
    ErrorInfo,
    Keys,
    ProtocolError,
    decode_outputs,
)
from engine.pubsub import subscribe_forever
from gateway.broker.collector import RequestCollector

log = get_logger("gateway.broker")


class BrokerUnavailable(Exception):
    """Redis could not be reached."""


class Broker:
    """Redis client, collectors of in-flight requests and the listener loop."""

    def __init__(self, client: aioredis.Redis, keys: Keys, gateway_id: str) -> None:
        self.client = client
        self.keys = keys
        self.gateway_id = gateway_id
        self.collectors: dict[str, RequestCollector] = {}
        self.subscribed = asyncio.Event()

    async def submit(self, request: EngineRequest, n: int) -> RequestCollector:
        """Register a collector, then XADD the request (collector first: no lost output)."""
        collector = RequestCollector(request.id, n)
        self.collectors[request.id] = collector
        try:
            await self.client.xadd(self.keys.requests, {REQUEST_FIELD: request.encode()})
        except RedisError as exc:
            self.collectors.pop(request.id, None)
            raise BrokerUnavailable(f"cannot reach Redis: {exc}") from exc
        return collector

    def release(self, request_id: str) -> None:
        self.collectors.pop(request_id, None)

    async def abort(self, request_ids: list[str]) -> None:
        """Tell engines to stop these requests; best effort (Redis may be down)."""
        try:
            await self.client.publish(self.keys.abort, AbortMessage(request_ids).encode())
        except RedisError as exc:
            log.warning("abort not published", ids=request_ids, error=str(exc))

    async def ping(self) -> bool:
        try:
            return bool(await self.client.ping())
        except RedisError:
            return False

    def dispatch(self, data: bytes) -> None:
        """Route one pub/sub message to the collectors it concerns."""
        try:
            outputs = decode_outputs(data)
        except ProtocolError as exc:
            log.error("bad output message", error=str(exc))
            return
        for out in outputs:
            collector = self.collectors.get(out.id)
            if collector is not None:
                collector.feed(out)

    def _fail_all(self, message: str) -> None:
        for collector in self.collectors.values():
            collector.fail(ErrorInfo(message, "service_unavailable", "redis_unavailable"))

    def _on_subscribed(self) -> None:
        self.subscribed.set()
        log.info("listening", channel=self.keys.out(self.gateway_id))

    def _on_lost(self, exc: Exception) -> None:
        """In-flight requests fail: their outputs may have been published while we were away."""
        self.subscribed.clear()
        if self.collectors:
            self._fail_all(f"lost connection to Redis: {exc}")

    async def listen(self, retry_s: float = 0.5) -> None:
        """Run forever: subscribe to this gateway's output channel and dispatch."""
        try:
            await subscribe_forever(self.client, self.keys.out(self.gateway_id), self.dispatch,
                                    on_subscribed=self._on_subscribed, on_lost=self._on_lost, retry_s=retry_s)
        finally:
            self.subscribed.clear()
