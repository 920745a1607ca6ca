"""One MULTI/EXEC per engine step: an XADD per gateway output stream carrying every one of
its requests' messages, the progress checkpoint of each message (so what a client saw is
always recoverable), the XACK + XDEL of requests that ended, on the stream each came from (so the request streams hold
only queued and running work), and two probes read back for free: the liveness token each
gateway's key holds (None: the key is gone) and the dataset epoch. On a Redis Cluster the same
writes go as one transaction per gateway's slot, then one in the model's slot (`_flush_sharded`).

The transaction is fenced by the engine's liveness key (`Keys.alive`, written with its
heartbeat): other engines take over an engine's entries only once that key is gone, so the
flush WATCHes it, checks that it still holds (and that
the engine's own clock says it cannot have lapsed), and EXEC aborts if the key expired or changed
in between. Without the fence, a process frozen between its freshness check and its EXEC would,
once thawed, write checkpoints and acks for requests another engine had already taken over and
finished.

With replicas to wait for (`ReplicaAck`), WAIT follows the EXEC on the same connection: a
flush counts as sent only once a replica has it (Sentinel promotes the replica with the most
data). When the connection drops between EXEC and WAIT the flush raises NotReplicated and the
worker sends the same outbox again: every part of it is idempotent for its readers (gateways
drop repeated output by `seq` and token offset, checkpoints merge by offset, XACK/XDEL and
DEL repeat harmlessly; only a hand-back's requeue may then run twice, and its output is
deduplicated the same way).

With a `CheckpointLog` (engine/worker/checkpoints.py) each request's progress list stays bounded:
past its entry limit, this engine's entries are replaced by one snapshot in the same MULTI."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, fields

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline

from common.protocol import REQUEST_FIELD, Keys, OutputMessage, encode_outputs
from common.redis_conn import ReplicaAck, pinned
from common.redis_slots import is_cluster, pinned_to
from engine.worker.checkpoints import CheckpointLog

OUT_MAXLEN = 10_000  # entries kept per gateway output stream (approximate; gateways trim what they read)
OUT_TTL_MS = 600_000  # a gateway that never comes back leaves no stream behind


@dataclass(slots=True)
class Outbox:
    """Messages of one step, grouped by gateway, plus the stream entries to acknowledge."""

    by_gateway: dict[str, list[OutputMessage]] = field(default_factory=dict)
    ended: list[tuple[str, str]] = field(default_factory=list)  # (request id, entry id)
    ack_only: list[str] = field(default_factory=list)
    requeue: list[bytes] = field(default_factory=list)  # payloads handed back to the stream (drain)
    forget_progress: list[str] = field(default_factory=list)  # checkpoints of requests dropped here
    # entries of other request streams (a routed one): ended request id -> its stream, and
    # (stream, entry id) pairs acknowledged without a request; the rest are on the flush's stream
    stream_of: dict[str, str] = field(default_factory=dict)
    ack_on: list[tuple[str, str]] = field(default_factory=list)
    # request id -> its gateway, whose slot holds the request's checkpoints (`Keys.progress`)
    gateway_of: dict[str, str] = field(default_factory=dict)

    def add(self, gateway: str, message: OutputMessage) -> None:
        self.by_gateway.setdefault(gateway, []).append(message)
        self.gateway_of[message.id] = gateway

    def end(self, request_id: str, entry_id: str, stream: str = "", gateway: str = "") -> None:
        """The request is over here: acknowledge its entry (on `stream`, default the flush's)
        and drop its checkpoint (kept by `gateway`: without one, nor a message of the request
        in this outbox, the checkpoint is left to its TTL)."""
        self.ended.append((request_id, entry_id))
        if stream:
            self.stream_of[request_id] = stream
        if gateway:
            self.gateway_of[request_id] = gateway

    def ack(self, entry_id: str, stream: str = "") -> None:
        """Acknowledge and delete an entry (on `stream`, default the flush's) with no request."""
        if stream:
            self.ack_on.append((stream, entry_id))
        else:
            self.ack_only.append(entry_id)

    def acks(self, default: str) -> dict[str, list[str]]:
        """Entry ids to XACK + XDEL, by stream (`default` for those without one)."""
        out: dict[str, list[str]] = {}
        for request_id, entry_id in self.ended:
            out.setdefault(self.stream_of.get(request_id, default), []).append(entry_id)
        if self.ack_only:
            out.setdefault(default, []).extend(self.ack_only)
        for stream, entry_id in self.ack_on:
            out.setdefault(stream, []).append(entry_id)
        return out

    def merge(self, later: Outbox) -> None:
        """Append a later outbox (a failed flush is retried together with the next one)."""
        for gateway, messages in later.by_gateway.items():
            self.by_gateway.setdefault(gateway, []).extend(messages)
        self.stream_of.update(later.stream_of)
        self.gateway_of.update(later.gateway_of)
        for f in fields(self):
            if f.name not in _MAPS:
                getattr(self, f.name).extend(getattr(later, f.name))

    def without(self, request_ids: set[str]) -> Outbox:
        """A copy less every message and ended entry of these requests (acks of other entries,
        hand-backs and checkpoints to forget are kept)."""
        kept = Outbox()
        for f in fields(self):
            if f.name not in _MAPS:
                setattr(kept, f.name, list(getattr(self, f.name)))
        kept.stream_of = {rid: stream for rid, stream in self.stream_of.items() if rid not in request_ids}
        kept.gateway_of = {rid: gateway for rid, gateway in self.gateway_of.items() if rid not in request_ids}
        for gateway, messages in self.by_gateway.items():
            for message in messages:
                if message.id not in request_ids:
                    kept.add(gateway, message)
        kept.ended = [(rid, entry) for rid, entry in self.ended if rid not in request_ids]
        return kept

    def __bool__(self) -> bool:
        return any(getattr(self, f.name) for f in fields(self) if f.name != "gateway_of")


_MAPS = ("by_gateway", "stream_of", "gateway_of")  # Outbox's fields that are not lists


class FenceLost(Exception):
    """The heartbeat key is gone or may have lapsed: check what this engine still owns first."""


@dataclass(slots=True)
class Fence:
    """The heartbeat key a flush is conditional on, and the engine's own view of whether it can
    have lapsed since the last write (a freeze longer than the TTL)."""

    key: str
    fresh: Callable[[], bool]


@dataclass(slots=True)
class FlushReply:
    """What the probes of a flush read: each probed gateway's liveness token (the value of its
    key; None when the key is gone), the epoch."""

    alive: dict[str, str | None]
    epoch: str | None


async def flush(client: aioredis.Redis, keys: Keys, stream: str, outbox: Outbox, progress_ttl_s: int,
                probe_gateways: list[str], fence: Fence | None = None, ack: ReplicaAck | None = None,
                log: CheckpointLog | None = None, epoch_key: str | None = None) -> FlushReply:
    """Send an outbox in one transaction; `stream` is the model's shared request stream (hand-backs
    go there, and acks of entries the outbox names no other stream for). A request
    handed back keeps its checkpoint (its next engine resumes from it). With a `fence`: raises
    FenceLost when the liveness key is gone or may have lapsed, and redis' WatchError when it
    changed before EXEC (this engine's own heartbeat did, or it expired): nothing was written.
    With an enabled `ack`: WAIT after EXEC on the same connection; raises NotReplicated when
    that connection was lost in between (send the outbox again). With a `log`, checkpoints are
    bounded per request (see CheckpointLog) and the log follows what was written. With an
    `epoch_key` (the model's `Keys.epoch`) the epoch is read back.

    On a Redis Cluster the writes go as one transaction per slot (`_flush_sharded`)."""
    if is_cluster(client):
        return await _flush_sharded(client, keys, stream, outbox, progress_ttl_s, probe_gateways, fence, ack, log,
                                    epoch_key)
    if ack is None or not ack.enabled:
        return await _flush(client, keys, stream, outbox, progress_ttl_s, probe_gateways, fence, log, epoch_key)
    async with pinned(client) as conn:
        reply = await _flush(conn, keys, stream, outbox, progress_ttl_s, probe_gateways, fence, log, epoch_key)
        await ack.wait(conn)
    return reply


def _queue_output(pipe: Pipeline, keys: Keys, gateway: str, messages: list[OutputMessage], ended: set[str],
                  progress_ttl_s: int, log: CheckpointLog | None, entries_after: dict[str, int]) -> None:
    """One gateway's output entry and the checkpoints of its requests that go on."""
    out = keys.out(gateway)
    pipe.xadd(out, {REQUEST_FIELD: encode_outputs(messages)}, maxlen=OUT_MAXLEN, approximate=True)
    pipe.pexpire(out, OUT_TTL_MS)
    for message in messages:
        if message.id not in ended:
            key = keys.progress(gateway, message.id)
            if log is None:
                pipe.rpush(key, message.checkpoint().encode())
            else:
                write = log.plan(message, entries_after.get(message.id))
                if write.trim:
                    pipe.ltrim(key, 0, -(write.trim + 1))
                pipe.rpush(key, write.entry)
                entries_after[message.id] = write.entries_after
            pipe.expire(key, progress_ttl_s)


def _forgotten(keys: Keys, outbox: Outbox, ended: set[str]) -> dict[str, list[str]]:
    """Checkpoint keys to delete (of ended and forgotten requests), by gateway. A request whose
    gateway the outbox does not know leaves its checkpoints to their TTL."""
    out: dict[str, list[str]] = {}
    for request_id in sorted(ended | set(outbox.forget_progress)):
        gateway = outbox.gateway_of.get(request_id)
        if gateway is not None:
            out.setdefault(gateway, []).append(keys.progress(gateway, request_id))
    return out


def _queue_model_writes(pipe: Pipeline, keys: Keys, stream: str, outbox: Outbox) -> None:
    """Hand-backs to the shared stream, XACK + XDEL of the entries that ended (model's slot)."""
    for payload in outbox.requeue:
        pipe.xadd(stream, {REQUEST_FIELD: payload})
    for key, entry_ids in outbox.acks(stream).items():
        pipe.xack(key, keys.group, *entry_ids)
        pipe.xdel(key, *entry_ids)


async def _flush(client: aioredis.Redis, keys: Keys, stream: str, outbox: Outbox, progress_ttl_s: int,
                 probe_gateways: list[str], fence: Fence | None, log: CheckpointLog | None,
                 epoch_key: str | None) -> FlushReply:
    ended = {request_id for request_id, _ in outbox.ended}
    entries_after: dict[str, int] = {}  # this engine's entries per list once this flush is written
    async with client.pipeline(transaction=True) as pipe:
        if fence is not None:
            await pipe.watch(fence.key)
            if not await pipe.exists(fence.key) or not fence.fresh():
                raise FenceLost(fence.key)
            pipe.multi()
        for gateway, messages in outbox.by_gateway.items():
            _queue_output(pipe, keys, gateway, messages, ended, progress_ttl_s, log, entries_after)
        _queue_model_writes(pipe, keys, stream, outbox)
        forgotten = [key for found in _forgotten(keys, outbox, ended).values() for key in found]
        if forgotten:
            pipe.delete(*forgotten)
        for gateway in probe_gateways:
            pipe.get(keys.gateway(gateway))
        if epoch_key is not None:
            pipe.get(epoch_key)
        replies = await pipe.execute()
    _written(log, entries_after, ended, outbox)
    probes = replies[len(replies) - len(probe_gateways) - (epoch_key is not None):]
    epoch = probes.pop() if epoch_key is not None else None
    alive = {gateway: _text(token) for gateway, token in zip(probe_gateways, probes, strict=True)}
    return FlushReply(alive, _text(epoch))


def _written(log: CheckpointLog | None, entries_after: dict[str, int], ended: set[str], outbox: Outbox) -> None:
    if log is not None:
        log.written(entries_after)
        log.forget(ended | set(outbox.forget_progress))


@contextlib.asynccontextmanager
async def _writer(client: aioredis.Redis, key: str, ack: ReplicaAck | None) -> AsyncIterator[aioredis.Redis]:
    """A client on a connection pinned to the master of `key`'s slot (a transaction there is a
    plain MULTI/EXEC); with replicas to wait for, WAIT there on the way out."""
    async with pinned_to(client, key) as conn:
        yield conn
        if ack is not None and ack.enabled:
            await ack.wait(conn)


async def _flush_sharded(client: aioredis.Redis, keys: Keys, stream: str, outbox: Outbox, progress_ttl_s: int,
                         probe_gateways: list[str], fence: Fence | None, ack: ReplicaAck | None,
                         log: CheckpointLog | None, epoch_key: str | None) -> FlushReply:
    """`flush` on a Redis Cluster: first one transaction per gateway (its output entry with the
    checkpoints it carries, so what its clients saw stays recoverable; deletes of its ended
    requests' checkpoints; its liveness probe), then one in the model's slot, fenced on the
    liveness key there (hand-backs, acks, the epoch probe). A fence lost in between leaves
    output written and acks not: the retry sends the outbox again, and repeated output is
    dropped by the gateways as any resent output is."""
    if fence is not None and (not await client.exists(fence.key) or not fence.fresh()):
        raise FenceLost(fence.key)
    ended = {request_id for request_id, _ in outbox.ended}
    entries_after: dict[str, int] = {}
    forgotten = _forgotten(keys, outbox, ended)
    probed = set(probe_gateways)
    alive: dict[str, str | None] = {}
    for gateway in dict.fromkeys([*outbox.by_gateway, *forgotten, *probe_gateways]):
        messages = outbox.by_gateway.get(gateway)
        writes = ack if messages or forgotten.get(gateway) else None  # a probe alone needs no WAIT
        async with _writer(client, keys.out(gateway), writes) as conn, conn.pipeline(transaction=True) as pipe:
            if messages:
                _queue_output(pipe, keys, gateway, messages, ended, progress_ttl_s, log, entries_after)
            if forgotten.get(gateway):
                pipe.delete(*forgotten[gateway])
            if gateway in probed:
                pipe.get(keys.gateway(gateway))
            replies = await pipe.execute()
        if gateway in probed:
            alive[gateway] = _text(replies[-1])
    writes = ack if outbox.requeue or outbox.acks(stream) else None
    async with _writer(client, stream, writes) as conn, conn.pipeline(transaction=True) as pipe:
        if fence is not None:
            await pipe.watch(fence.key)
            if not await pipe.exists(fence.key) or not fence.fresh():
                raise FenceLost(fence.key)
            pipe.multi()
        _queue_model_writes(pipe, keys, stream, outbox)
        if epoch_key is not None:
            pipe.get(epoch_key)
        replies = await pipe.execute()
    _written(log, entries_after, ended, outbox)
    epoch = replies[-1] if epoch_key is not None else None
    return FlushReply({gateway: alive[gateway] for gateway in probe_gateways}, _text(epoch))


def _text(value: object) -> str | None:
    return None if value is None else value.decode() if isinstance(value, bytes) else str(value)
