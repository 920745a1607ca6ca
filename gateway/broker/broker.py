"""The gateway's side of Redis: submit requests (one script call each), publish aborts, and
ONE reader task that reads this gateway's output stream by id and demultiplexes it into
per-request collectors.

Output comes on a stream, not a pub/sub channel: when the reader's connection drops (a
network blip, `CLIENT KILL`, a Redis restart with persistence, a Sentinel failover) it
reconnects (through the sentinels: to the new master) and reads on from the last id it
handled, so every token reaches its client exactly once; what engines send again after a
failover (outputs the new master may lack) is dropped by the collectors as a repeat.

A request is submitted durably: with replicas to wait for (`ReplicaAck`), the submit script
and a WAIT run on one connection, and a connection lost in between (the master died: the
entry may not have reached a replica) is settled on the next master: the entry is there, or
the request is added again (same request id)."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
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
from common.redis_conn import (
    Epoch,
    MasterView,
    NotReplicated,
    PoolBusy,
    ReplicaAck,
    refused_by_demoted_master,
)
from common.redis_slots import never_connected, pinned_to, slot_moved
from gateway.broker.collector import RequestCollector
from gateway.broker.engines import EngineRegistry
from gateway.broker.reader import Reader, Subscribed
from gateway.broker.redis_errors import CODE_UNAVAILABLE, redis_error
from gateway.broker.router import Route, Router

log = get_logger("gateway.broker")
READ_GRACE_S = 5.0  # seconds an XREAD may run past its BLOCK before it counts as hung
CONFIRM_S = 30.0  # how long a submit whose WAIT was cut off waits for a master to settle it on
RESEND_S = 0.1  # pause before a submit refused by a demoted master is sent to the new one

# KEYS: the stream to add to, the model's epoch key, then every stream of the model counted for the bound
# (the shared one and the live engines' routed ones; the first one included).
# ARGV: group, epoch token, max queued, field, payload.
_SUBMIT_SCRIPT = """
local epoch = redis.call('GET', KEYS[2])
if epoch ~= ARGV[2] then return {'EPOCH', epoch or ''} end
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('XGROUP', 'CREATE', KEYS[1], ARGV[1], '0', 'MKSTREAM')
end
local queued = 0
for i = 3, #KEYS do queued = queued + redis.call('XLEN', KEYS[i]) end
if queued >= tonumber(ARGV[3]) then return {'FULL', tostring(queued)} end
return {'OK', redis.call('XADD', KEYS[1], '*', ARGV[4], ARGV[5])}
"""


class BrokerUnavailable(Exception):
    """Redis could not be reached (or refused the write: out of memory). `code` is the error
    code for the client (`redis_errors`)."""

    def __init__(self, message: str, code: str = CODE_UNAVAILABLE) -> None:
        super().__init__(message)
        self.code = code

    @classmethod
    def of(cls, exc: RedisError) -> BrokerUnavailable:
        """The client-facing form of a Redis failure (OOM named as such, no script hashes)."""
        return cls(*redis_error(exc))


class QueueFull(Exception):
    """The model's request stream holds `max_queued` requests already (answer 429)."""

    def __init__(self, model: str, queued: int) -> None:
        super().__init__(f"the queue of model '{model}' is full ({queued} requests waiting or running); retry later")
        self.model = model
        self.queued = queued


class Broker:
    """Redis clients, collectors of in-flight requests and the reader loop."""

    def __init__(self, client: aioredis.Redis, keys: Keys, gateway_id: str, reader: aioredis.Redis | None = None,
                 max_queued: int = 4096, new_reader: Callable[[], aioredis.Redis] | None = None,
                 ack: ReplicaAck | None = None, mode: str = "url") -> None:
        self.client = client
        self.ack = ack or ReplicaAck(0, 1)
        self.mode = mode  # "url", "sentinel" or "cluster": for /health and which failures are re-sent
        self.master = MasterView()
        self.new_reader = new_reader  # a fresh reader client, for `_swap` to replace a stuck or failed one
        self._reader = Reader(0, reader or client)  # the current generation; written by `_swap` alone
        self.subscribed = Subscribed(lambda: self._reader)  # the current generation reads the output stream
        self.stopped = False  # set by `stop`: every loop of this broker ends at its next turn
        self._closing: set[asyncio.Task[None]] = set()
        self.keys = keys
        self.gateway_id = gateway_id
        # this process's liveness token: the value of its liveness key and carried in each request, so a
        # process restarted under the same id is a new client and engines stop the old one's requests at once
        self.token = secrets.token_hex(8)
        self.max_queued = max_queued
        self.collectors: dict[str, RequestCollector] = {}
        self.epochs: dict[str, Epoch] = {}  # by model: each model's keys (its epoch among them) share a slot
        self._submit = client.register_script(_SUBMIT_SCRIPT)
        self.router: Router | None = None  # cache-aware routing (`use_router`); None: the shared stream
        self.registry: EngineRegistry | None = None

    @property
    def reader(self) -> aioredis.Redis:
        """The current reader generation's connection."""
        return self._reader.client

    @property
    def last_id(self) -> str:
        """The last output-stream id the current reader generation handled."""
        return self._reader.last_id

    @property
    def read_at(self) -> float:
        """When the current reader generation last made progress (monotonic)."""
        return self._reader.read_at

    def use_router(self, router: Router, registry: EngineRegistry) -> None:
        """Route each request by `router` over `registry`'s live heartbeats."""
        self.router, self.registry = router, registry

    async def route(self, request: EngineRequest) -> Route:
        """The stream for `request`: the router's choice, or the shared stream without routing
        (or when the heartbeats cannot be read: the shared stream needs none)."""
        shared = Route(self.keys.requests(request.model), None, "shared")
        if self.router is None or self.registry is None:
            return shared
        try:
            self.router.refresh(await self.registry.live_engines())
        except RedisError:
            return shared
        return self.router.choose(request.model, request.prompt_token_ids, request.lora_name)

    def counted_streams(self, model: str) -> list[str]:
        """The streams whose lengths bound a model's queue: the shared one and the routed ones
        of the model's live routed engines (what a dead engine's stream holds is taken over
        by its peers)."""
        streams = [self.keys.requests(model)]
        view = self.router.models.get(model) if self.router is not None else None
        if view is not None:
            streams += [self.keys.routed(model, engine_id) for engine_id in sorted(view.engines)]
        return streams

    async def submit(self, request: EngineRequest, n: int) -> RequestCollector:
        """Register a collector, then XADD the request to the stream `route` chose (collector
        first: no lost output). Raises QueueFull, PoolBusy, BrokerUnavailable."""
        request.gateway_token = self.token
        route = await self.route(request)
        collector = RequestCollector(request.id, n, request.model, route.stream)
        collector.routed_engine = route.engine_id
        self.collectors[request.id] = collector
        try:
            collector.entry_id = await self._add(request, route.stream)
        except BaseException:
            self.release(request.id)
            raise
        return collector

    def unroute(self, collector: RequestCollector) -> None:
        """The request no longer counts as load on the engine routing chose (it ended, or a
        draining engine handed it back to the shared stream)."""
        if collector.routed_engine is not None and self.router is not None:
            self.router.done(collector.model, collector.routed_engine)
        collector.routed_engine = None

    async def _add(self, request: EngineRequest, stream: str) -> str:
        """Add `request` to `stream`; the entry id. A submit refused by a master just demoted (a
        `switch-master` pauses writes, then the paused ones get READONLY) wrote nothing: it is
        sent again, to the master the sentinels report now, for up to CONFIRM_S (with a plain URL
        a replica stays one: refused at once)."""
        deadline = time.monotonic() + CONFIRM_S
        epoch_changes = 0
        while True:
            epoch = self.epoch_of(request.model)
            if epoch.token is None:
                await self.sync_epoch(request.model)
            request.epoch = epoch.token or ""
            try:
                status, text = await self._submit_once(request, stream)
            except PoolBusy:
                raise
            except NotReplicated as exc:
                log.warning("request sent but not confirmed by a replica; settling it on the next master",
                            id=request.id, error=str(exc))
                return await self._settle(request, stream, exc.args[1] if len(exc.args) > 1 else "")
            except RedisError as exc:
                if not self._unsent(exc) or time.monotonic() > deadline:
                    raise BrokerUnavailable.of(exc) from exc
                log.info("request refused by a demoted master; sending it to the new one", id=request.id,
                         error=str(exc)[:200])
                await asyncio.sleep(RESEND_S)
                continue
            if status == "OK":
                return text
            if status == "FULL":
                raise QueueFull(request.model, int(text))
            await self.sync_epoch(request.model)  # EPOCH: Redis lost its data since we looked
            epoch_changes += 1
            if epoch_changes == 2:
                raise BrokerUnavailable("cannot reach Redis: its dataset keeps changing")

    def submit_keys(self, model: str, stream: str) -> list[str]:
        """The submit script's KEYS for adding to `stream` (all in `model`'s slot)."""
        return [stream, self.keys.epoch(model), *dict.fromkeys([stream, *self.counted_streams(model)])]

    def _unsent(self, exc: RedisError) -> bool:
        """A submit that certainly wrote nothing and may go again to the master of the moment:
        refused by a demoted master (Sentinel, cluster), or on a cluster answered by a node that
        no longer serves the slot, or not connected at all (its master is down until a replica
        takes over)."""
        if self.mode == "url":
            return False
        if refused_by_demoted_master(exc):
            return True
        return self.mode == "cluster" and (slot_moved(exc) or never_connected(exc))

    async def _submit_once(self, request: EngineRequest, stream: str) -> tuple[str, str]:
        """The submit script (adding to `stream`, bounding the model's queue), then, with replicas
        to wait for, WAIT on the same connection. Raises NotReplicated with the entry id as its
        second argument when the connection was lost after the XADD."""
        keys = self.submit_keys(request.model, stream)
        args: list[str | bytes | int] = [self.keys.group, request.epoch, self.max_queued, REQUEST_FIELD,
                                         request.encode()]
        if not self.ack.enabled:
            status, value = await self._submit(keys=keys, args=args)
            return _text(status), _text(value)
        async with pinned_to(self.client, stream) as conn:
            status, value = await self._submit(keys=keys, args=args, client=conn)
            if _text(status) == "OK":
                try:
                    await self.ack.wait(conn)
                except NotReplicated as exc:
                    raise NotReplicated(str(exc), _text(value)) from exc
        return _text(status), _text(value)

    async def _settle(self, request: EngineRequest, stream: str, entry_id: str) -> str:
        """After a WAIT cut off by a lost connection: once a master answers, keep the entry if it
        is there (or an engine already answered), else add the request again. Up to CONFIRM_S."""
        deadline = time.monotonic() + CONFIRM_S
        while True:
            try:
                collector = self.collectors.get(request.id)
                if collector is not None and collector.next_seq > 0:
                    return entry_id  # an engine has it
                if entry_id and await self.client.xrange(stream, entry_id, entry_id):
                    return entry_id
                status, text = await self._submit_once(request, stream)
                if status == "OK":
                    log.info("request added again after a failover", id=request.id)
                    return text
                if status == "FULL":
                    raise QueueFull(request.model, int(text))
                await self.sync_epoch(request.model)
                request.epoch = self.epoch_of(request.model).token or ""
            except NotReplicated as exc:
                entry_id = exc.args[1] if len(exc.args) > 1 else entry_id
            except PoolBusy:
                raise
            except RedisError as exc:
                if time.monotonic() > deadline:
                    raise BrokerUnavailable.of(exc) from exc
            await asyncio.sleep(0.25)

    def epoch_of(self, model: str) -> Epoch:
        """The dataset epoch of `model`'s keys (adopted at its first check)."""
        epoch = self.epochs.get(model)
        if epoch is None:
            epoch = self.epochs[model] = Epoch(self.keys.epoch(model))
        return epoch

    async def sync_epoch(self, model: str | None = None) -> bool:
        """Adopt the current epoch of `model` (None: of every model submitted to so far); where
        one changed, fail every in-flight request of that model (Redis lost them). Returns True
        when one changed."""
        changed = []
        try:
            for name in [model] if model is not None else list(self.epochs):
                if await self.epoch_of(name).check(self.client):
                    changed.append(name)
        except RedisError as exc:
            raise BrokerUnavailable.of(exc) from exc
        for name in changed:
            failed = self.fail_all(ErrorInfo("Redis restarted without persistence and lost this request; retry it",
                                             "service_unavailable", "redis_restarted"), model=name)
            log.error("Redis lost its data (restart without persistence): failing in-flight requests",
                      model=name, requests=len(failed))
        return bool(changed)

    async def check_master(self) -> None:
        """Refresh which master is in use; a new one (a failover) with the same epoch lost
        nothing, so it is only logged (the epoch check fails requests when data was lost)."""
        if await self.master.refresh(self.client):
            log.warning("Redis master changed (failover or restart)", master=self.master.address,
                        run_id=self.master.run_id, failovers=self.master.changes)

    def redis_status(self) -> dict[str, Any]:
        """For /health: the master in use and whether writes are acknowledged by a replica."""
        master = self.master
        return {"mode": self.mode, "master": master.address, "run_id": master.run_id, "replicas": master.replicas,
                "master_changes": master.changes, "wait_replicas": self.ack.replicas,
                "writes_acknowledged": self.ack.acked, "unacknowledged_waits": self.ack.figures.timeouts}

    def release(self, request_id: str) -> None:
        collector = self.collectors.pop(request_id, None)
        if collector is not None:
            self.unroute(collector)

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
                    pipe.xdel(collector.stream or self.keys.requests(collector.model), collector.entry_id)
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
        wedged the old one. A reader whose connection has its reply but whose loop never runs
        again would leave every request of the gateway waiting for nothing."""
        stale_s = block_ms / 1000 + 2 * READ_GRACE_S
        task = asyncio.create_task(self.listen(block_ms=block_ms), name=f"reader-{self.gateway_id}")
        try:
            while not self.stopped:
                await asyncio.sleep(check_s)
                if task.done() or time.monotonic() - self.read_at > stale_s:
                    log.error("output stream reader stalled; starting a new one",
                              stalled_s=round(time.monotonic() - self.read_at, 1), ended=task.done())
                    task.cancel()  # not awaited: a wedged task may never finish cancelling
                    task = asyncio.create_task(self.listen(block_ms=block_ms, reader=self._swap(fresh=True)),
                                               name=f"reader-{self.gateway_id}")
        finally:
            task.cancel()

    def stop(self) -> None:
        """End the supervisor and reader loops at their next turn, whether or not a cancellation
        reaches them (a library that swallows one must not keep the app's cleanup waiting)."""
        self.stopped = True

    def _swap(self, fresh: bool) -> Reader:
        """The one writer of the reader state: retire the current generation and make the next,
        reading on from its last id; with `fresh` (and a `new_reader`), on a new client (the old
        connection may be the trouble; it is closed in the background). Returns the new one."""
        old = self._reader
        client = self.new_reader() if fresh and self.new_reader is not None else old.client
        self._reader = old.successor(client)
        old.retire()
        if client is not old.client:
            self._closing.add(task := asyncio.create_task(_close_quietly(old.client)))
            task.add_done_callback(self._closing.discard)
        return self._reader

    async def listen(self, retry_s: float = 0.5, block_ms: int = 1000, trim_every_s: float = 1.0,
                     reader: Reader | None = None) -> None:
        """Read this gateway's output stream from the last id handled, as generation `reader`
        (default: a new one, taking over from whatever loop ran), until a newer one takes over;
        a failed read moves this loop to a new generation on a fresh connection."""
        key = self.keys.out(self.gateway_id)
        trimmed_at = 0.0
        failures = 0  # in a row: the retry delay doubles up to 4 s (a failover takes seconds)
        reader = self._swap(fresh=False) if reader is None else reader
        try:
            while reader is self._reader and not self.stopped:
                reader.touch()
                try:
                    if not reader.subscribed.is_set():
                        await self._start_reading(reader, key)
                    # bounded: a read that outlives its BLOCK by seconds is hung, not waiting
                    reply = await asyncio.wait_for(
                        reader.client.xread({key: reader.last_id}, count=512, block=block_ms),
                        block_ms / 1000 + READ_GRACE_S)
                    if reader is not self._reader or self.stopped:
                        return  # replaced while it waited: what it read is the new loop's to read
                    for _stream, entries in _streams(reply):
                        for entry_id, fields in entries:
                            reader.handled(_text(entry_id))
                            payload = fields.get(REQUEST_FIELD.encode(), fields.get(REQUEST_FIELD))
                            if payload is not None:
                                self._dispatch_guarded(payload)
                    if time.monotonic() - trimmed_at > trim_every_s and reader.last_id != "0-0":
                        trimmed_at = time.monotonic()
                        await self.client.xtrim(key, minid=reader.last_id, approximate=False)
                    failures = 0
                except (RedisError, OSError, BrokerUnavailable) as exc:  # TimeoutError included
                    if reader is not self._reader:
                        return  # a replaced loop's failure is not the current reader's
                    if reader.subscribed.is_set():
                        log.warning("output stream read failed; reconnecting", error=str(exc) or repr(exc))
                    reader = self._swap(fresh=True)
                    await asyncio.sleep(min(4.0, retry_s * 2 ** failures))
                    failures += 1
                except Exception:  # this task serves every request of the gateway: it must not end
                    if reader is not self._reader:
                        return
                    log.exception("output stream reader failed; reconnecting")
                    reader = self._swap(fresh=True)
                    await asyncio.sleep(retry_s)
        finally:
            if reader is self._reader and not self.stopped:
                reader.subscribed.clear()  # this loop ended without a successor: nothing reads

    async def _start_reading(self, reader: Reader, key: str) -> None:
        """(Re)connect: check the epoch (a lost dataset fails what was in flight and resets
        the read position), and on the first start skip what an earlier run left."""
        if await self.sync_epoch():
            reader.start_at("0-0")
        if reader.last_id == "0-0" and not self.collectors:
            newest = await self.client.xrevrange(key, count=1)
            if newest:
                reader.start_at(_text(newest[0][0]))
        reader.subscribed.set()
        log.info("reading output stream", stream=key, from_id=reader.last_id)


async def _close_quietly(client: aioredis.Redis) -> None:
    with contextlib.suppress(Exception):
        await asyncio.wait_for(client.aclose(), 5)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _streams(reply: Any) -> list[Any]:
    """XREAD's reply as ``[(stream, [(id, fields), ...]), ...]`` (RESP2 and RESP3)."""
    return list(reply.items()) if isinstance(reply, dict) else list(reply or [])
