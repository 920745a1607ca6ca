"""The gateway's side of Redis: submit requests (one script call each), publish aborts, and
ONE reader task that reads this gateway's output stream by id and demultiplexes it into
per-request collectors.

Output comes on a stream, not a pub/sub channel: when the reader's connection drops (a
network blip, `CLIENT KILL`, a Redis restart with persistence) it reconnects and reads on
from the last id it handled, so every token reaches its client exactly once."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from common.log import get_logger
from common.protocol import (
    REQUEST_FIELD,
    AbortMessage,
    EngineRequest,
    ErrorInfo,
    Keys,
    ProtocolError,
    decode_outputs,
)
from common.redis_conn import Epoch, PoolBusy
from gateway.broker.collector import RequestCollector

log = get_logger("gateway.broker")
READ_GRACE_S = 5.0  # seconds an XREAD may run past its BLOCK before it counts as hung

# KEYS: request stream, epoch key. ARGV: group, epoch token, max queued, field, payload.
_SUBMIT_SCRIPT = """
local epoch = redis.call('GET', KEYS[2])
if epoch ~= ARGV[2] then return {'EPOCH', epoch or ''} end
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('XGROUP', 'CREATE', KEYS[1], ARGV[1], '0', 'MKSTREAM')
end
local queued = redis.call('XLEN', KEYS[1])
if queued >= tonumber(ARGV[3]) then return {'FULL', tostring(queued)} end
return {'OK', redis.call('XADD', KEYS[1], '*', ARGV[4], ARGV[5])}
"""


class BrokerUnavailable(Exception):
    """Redis could not be reached."""


class QueueFull(Exception):
    """The model's request stream holds `max_queued` requests already (answer 429)."""

    def __init__(self, model: str, queued: int) -> None:
        super().__init__(f"the queue of model '{model}' is full ({queued} requests waiting or running); retry later")
        self.model = model
        self.queued = queued


class Broker:
    """Redis clients, collectors of in-flight requests and the reader loop."""

    def __init__(self, client: aioredis.Redis, keys: Keys, gateway_id: str, reader: aioredis.Redis | None = None,
                 max_queued: int = 4096, new_reader: Callable[[], aioredis.Redis] | None = None) -> None:
        self.client = client
        self.reader = reader or client
        self.new_reader = new_reader  # a fresh reader client, for `supervise` to replace a stuck one
        self.read_at = time.monotonic()  # when the reader loop last made progress
        self._generation = 0  # the reader loop that owns `reader`; an older one stops
        self.stopped = False  # set by `stop`: every loop of this broker ends at its next turn
        self._closing: set[asyncio.Task[None]] = set()
        self.keys = keys
        self.gateway_id = gateway_id
        self.max_queued = max_queued
        self.collectors: dict[str, RequestCollector] = {}
        self.subscribed = asyncio.Event()
        self.epoch = Epoch(keys.epoch)
        self.last_id = "0-0"
        self._submit = client.register_script(_SUBMIT_SCRIPT)

    async def submit(self, request: EngineRequest, n: int) -> RequestCollector:
        """Register a collector, then XADD the request to its model's stream (collector first:
        no lost output). Raises QueueFull, PoolBusy, BrokerUnavailable."""
        collector = RequestCollector(request.id, n, request.model)
        self.collectors[request.id] = collector
        try:
            collector.entry_id = await self._add(request)
        except BaseException:
            self.collectors.pop(request.id, None)
            raise
        return collector

    async def _add(self, request: EngineRequest) -> str:
        for _ in range(2):
            if self.epoch.token is None:
                await self.sync_epoch()
            request.epoch = self.epoch.token or ""
            try:
                status, value = await self._submit(
                    keys=[self.keys.requests(request.model), self.keys.epoch],
                    args=[self.keys.group, request.epoch, self.max_queued, REQUEST_FIELD, request.encode()])
            except PoolBusy:
                raise
            except RedisError as exc:
                raise BrokerUnavailable(f"cannot reach Redis: {exc}") from exc
            status, text = _text(status), _text(value)
            if status == "OK":
                return text
            if status == "FULL":
                raise QueueFull(request.model, int(text))
            await self.sync_epoch()  # EPOCH: Redis lost its data since we looked
        raise BrokerUnavailable("cannot reach Redis: its dataset keeps changing")

    async def sync_epoch(self) -> bool:
        """Adopt the current epoch; when it changed, fail every in-flight request (Redis lost
        them). Returns True when it changed."""
        try:
            changed = await self.epoch.check(self.client)
        except RedisError as exc:
            raise BrokerUnavailable(f"cannot reach Redis: {exc}") from exc
        if changed:
            log.error("Redis lost its data (restart without persistence): failing in-flight requests",
                      requests=len(self.collectors))
            self.fail_all(ErrorInfo("Redis restarted without persistence and lost this request; retry it",
                                    "service_unavailable", "redis_restarted"))
        return changed

    def release(self, request_id: str) -> None:
        self.collectors.pop(request_id, None)

    async def abort(self, request_ids: list[str], model: str = "") -> None:
        """Tell engines (of `model`, when given) to stop these requests; best effort (Redis may be down)."""
        try:
            await self.client.publish(self.keys.abort, AbortMessage(request_ids, model).encode())
        except RedisError as exc:
            log.warning("abort not published", ids=request_ids, error=str(exc))

    async def forget(self, collectors: list[RequestCollector]) -> None:
        """Delete these requests' stream entries (failed here: nobody should run them)."""
        async with self.client.pipeline(transaction=False) as pipe:
            for collector in collectors:
                if collector.entry_id:
                    pipe.xdel(self.keys.requests(collector.model), collector.entry_id)
            await pipe.execute()

    async def ping(self) -> bool:
        try:
            return bool(await self.client.ping())
        except RedisError:
            return False

    def dispatch(self, data: bytes) -> None:
        """Route one output-stream entry to the collectors it concerns."""
        try:
            outputs = decode_outputs(data)
        except ProtocolError as exc:
            log.error("bad output message", error=str(exc))
            return
        for out in outputs:
            collector = self.collectors.get(out.id)
            if collector is not None:
                collector.feed(out)

    def _dispatch_guarded(self, data: bytes) -> None:
        """`dispatch`, with a failure logged and confined to that entry (its requests then see a
        gap and fail cleanly) instead of ending the reader every request depends on."""
        try:
            self.dispatch(data)
        except Exception:  # a bug in one entry must not end the reader
            log.exception("output entry could not be dispatched")

    def fail_all(self, error: ErrorInfo, model: str | None = None) -> list[RequestCollector]:
        failed = [c for c in self.collectors.values() if model is None or c.model == model]
        for collector in failed:
            collector.fail(error)
        return failed

    async def supervise(self, block_ms: int = 1000, check_s: float = 1.0) -> None:
        """Run the reader loop, and replace it when it stops making progress: a fresh loop on a
        fresh connection reads on from the last id handled (nothing was trimmed past it), whatever
        wedged the old one. CI once saw a reader whose connection had its reply and whose loop
        never ran again; every request of the gateway then waits for nothing."""
        stale_s = block_ms / 1000 + 2 * READ_GRACE_S
        task = asyncio.create_task(self.listen(block_ms=block_ms), name=f"reader-{self.gateway_id}")
        try:
            while not self.stopped:
                await asyncio.sleep(check_s)
                if task.done() or time.monotonic() - self.read_at > stale_s:
                    log.error("output stream reader stalled; starting a new one",
                              stalled_s=round(time.monotonic() - self.read_at, 1), ended=task.done())
                    task.cancel()  # not awaited: a wedged task may never finish cancelling
                    self._replace_reader()
                    self.subscribed.clear()
                    self.read_at = time.monotonic()
                    task = asyncio.create_task(self.listen(block_ms=block_ms), name=f"reader-{self.gateway_id}")
        finally:
            task.cancel()

    def stop(self) -> None:
        """End the supervisor and reader loops at their next turn, whether or not a cancellation
        reaches them (a library that swallows one must not keep the app's cleanup waiting)."""
        self.stopped = True
        self._generation += 1

    def _replace_reader(self) -> None:
        """A fresh reader client (its old connection may be the trouble); the old one is closed
        in the background."""
        if self.new_reader is None:
            return
        old, self.reader = self.reader, self.new_reader()
        self._closing.add(task := asyncio.create_task(_close_quietly(old)))
        task.add_done_callback(self._closing.discard)

    async def listen(self, retry_s: float = 0.5, block_ms: int = 1000, trim_every_s: float = 1.0) -> None:
        """Run until a newer loop takes over: read this gateway's output stream from the last id
        handled."""
        key = self.keys.out(self.gateway_id)
        trimmed_at = 0.0
        self._generation += 1
        mine = self._generation
        try:
            while mine == self._generation and not self.stopped:
                self.read_at = time.monotonic()
                try:
                    if not self.subscribed.is_set():
                        await self._start_reading(key)
                    # bounded: a read that outlives its BLOCK by seconds is hung, not waiting
                    reply = await asyncio.wait_for(
                        self.reader.xread({key: self.last_id}, count=512, block=block_ms),
                        block_ms / 1000 + READ_GRACE_S)
                    if mine != self._generation:
                        return  # replaced while it waited: what it read is the new loop's to read
                    for _stream, entries in _streams(reply):
                        for entry_id, fields in entries:
                            self.last_id = _text(entry_id)
                            payload = fields.get(REQUEST_FIELD.encode(), fields.get(REQUEST_FIELD))
                            if payload is not None:
                                self._dispatch_guarded(payload)
                    if time.monotonic() - trimmed_at > trim_every_s and self.last_id != "0-0":
                        trimmed_at = time.monotonic()
                        await self.client.xtrim(key, minid=self.last_id, approximate=False)
                except (RedisError, OSError) as exc:  # TimeoutError included
                    if self.subscribed.is_set():
                        log.warning("output stream read failed; reconnecting", error=str(exc) or repr(exc))
                    self._replace_reader()
                    self.subscribed.clear()
                    await asyncio.sleep(retry_s)
                except Exception:  # this task serves every request of the gateway: it must not end
                    log.exception("output stream reader failed; reconnecting")
                    self._replace_reader()
                    self.subscribed.clear()
                    await asyncio.sleep(retry_s)
        finally:
            if mine == self._generation:
                self.subscribed.clear()

    async def _start_reading(self, key: str) -> None:
        """(Re)connect: check the epoch (a lost dataset fails what was in flight and resets
        the read position), and on the first start skip what an earlier run left."""
        if await self.sync_epoch():
            self.last_id = "0-0"
        if self.last_id == "0-0" and not self.collectors:
            newest = await self.client.xrevrange(key, count=1)
            if newest:
                self.last_id = _text(newest[0][0])
        self.subscribed.set()
        log.info("reading output stream", stream=key, from_id=self.last_id)


async def _close_quietly(client: aioredis.Redis) -> None:
    with contextlib.suppress(Exception):
        await asyncio.wait_for(client.aclose(), 5)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _streams(reply: Any) -> list[Any]:
    """XREAD's reply as ``[(stream, [(id, fields), ...]), ...]`` (RESP2 and RESP3)."""
    return list(reply.items()) if isinstance(reply, dict) else list(reply or [])
