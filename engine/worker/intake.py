"""What flows into an engine worker: new stream entries, entries taken over from dead engines
of the same model or handed back by a draining one (resumed from their progress
checkpoints), and aborts from the abort channel. A request delivered too many times goes to
the dead-letter stream with an error for its client: a request that kills every engine it
lands on must not take the whole model down."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from types import MappingProxyType

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from common.log import get_logger
from common.protocol import REQUEST_FIELD, AbortMessage, EngineRequest, Keys, Progress, ProtocolError, merge_progress
from common.pubsub import subscribe_forever
from common.redis_conn import Epoch
from common.redis_slots import slot_pipeline
from engine.outputs import RequestOutput
from engine.worker.engine_thread import AddJob, StepResult
from engine.worker.outbox import Outbox
from engine.worker.request_stream import RequestStream, StreamEntry
from engine.worker.tracked import Tracked, error_output, resume, to_wire

log = get_logger("worker.intake")
ABORT_MEMORY_S = 300.0
MAX_REMEMBERED_ABORTS = 100_000
DEAD_LETTER_MAXLEN = 1000
ROUTED_QUIET_MS = 30_000  # a gone engine's empty routed stream is removed after no entry arrived this long


class Intake:
    """Turns stream entries and aborts into engine jobs, and owns the table of requests this
    engine serves (`tracked`, read-only to everyone else) and the outbox of what admission,
    drops and failures produce (`take_pending`). Every change to either goes through a method
    here."""

    def __init__(self, client: aioredis.Redis, keys: Keys, stream: RequestStream, model: str,
                 max_claims: int = 3, epoch: Epoch | None = None,
                 on_data_lost: Callable[[], None] | None = None, routed: RequestStream | None = None,
                 steal_after_ms: int | None = None) -> None:
        self.client = client
        self.routed = routed  # this engine's own routed stream, read before the shared one; None: no routing
        self.steal_after_ms = steal_after_ms  # None: never steal from peers' routed streams
        self._peers: dict[str, RequestStream] = {}
        self._next_steal = 0.0
        self.routed_taken = 0  # entries read from the own routed stream (metric)
        self.stolen = 0  # entries stolen from peers' routed streams (metric)
        self.epoch = epoch
        self.on_data_lost = on_data_lost
        self.keys = keys
        self.stream = stream
        self.model = model
        self.max_claims = max_claims
        self._tracked: dict[str, Tracked] = {}
        self.tracked: Mapping[str, Tracked] = MappingProxyType(self._tracked)
        self.jobs: list[AddJob] = []
        self.aborts: set[str] = set()
        self.forced_aborts: set[str] = set()  # already ended here; the engine must still drop them
        self.recent_aborts: OrderedDict[str, float] = OrderedDict()  # id -> when, oldest first
        self.bad_aborts = 0
        self._pending = Outbox()  # errors and acks produced between two steps
        self.dead_lettered = 0  # entries moved to the dead-letter stream (metric)
        self.readopted = 0  # own entries found pending but untracked after Redis trouble (metric)
        self.gateway_gone = 0  # requests ended: their gateway's liveness key stayed gone past the grace (metric)
        self.gateway_restarted = 0  # requests ended: their gateway restarted under the same id (metric)
        self.gateways_missing = 0  # gateways of tracked requests whose liveness key is gone, within the grace
        self._admitting = asyncio.Lock()  # pull, takeovers and re-adoption may see one entry at once

    # ----- the table and the pending outbox ----------------------------------------------------
    @property
    def has_work(self) -> bool:
        """Jobs or aborts wait for the engine thread."""
        return bool(self.jobs or self.aborts or self.forced_aborts)

    @property
    def is_empty(self) -> bool:
        """Nothing tracked, nothing to tell the engine, nothing to publish."""
        return not (self._tracked or self.forced_aborts or self._pending)

    def counters(self) -> dict[str, float]:
        """What the intake refused so far (for metrics and heartbeats)."""
        return {"dead_lettered": float(self.dead_lettered), "bad_aborts": float(self.bad_aborts),
                "readopted": float(self.readopted), "in_flight": float(len(self._tracked)),
                "routed_taken": float(self.routed_taken), "stolen": float(self.stolen),
                "gateway_gone_aborted": float(self.gateway_gone),
                "gateway_restart_aborted": float(self.gateway_restarted),
                "gateways_missing": float(self.gateways_missing)}

    def take_pending(self) -> Outbox:
        """What was produced since the last call, to publish with the next step's outputs."""
        pending, self._pending = self._pending, Outbox()
        return pending

    def fail(self, request_id: str, message: str, type_: str, code: str) -> None:
        """End a tracked request with an error for its client (the engine drops it next step)."""
        for tracked in self.drop([request_id]):
            self._pending.add(tracked.gateway, error_output(tracked, message, type_, code))
            self._pending.end(request_id, tracked.entry_id, tracked.stream, tracked.gateway)

    def end(self, request_ids: list[str]) -> list[str]:
        """Stop serving these requests without a message (their client is gone): acknowledge
        their entries; returns those that were tracked."""
        dropped = self.drop(request_ids)
        for tracked in dropped:
            self._pending.end(tracked.request_id, tracked.entry_id, tracked.stream, tracked.gateway)
        return [t.request_id for t in dropped]

    def lose(self, request_ids: set[str]) -> None:
        """Requests this engine no longer owns: stop them and publish nothing for them."""
        self.drop(sorted(request_ids))
        self._pending = self._pending.without(request_ids)

    def forget_all(self) -> set[str]:
        """Redis lost its data: drop every request, and the checkpoints written since the loss."""
        lost = set(self._tracked)
        dropped = self.drop(sorted(lost))
        self._pending = Outbox(forget_progress=sorted(lost), gateway_of={t.request_id: t.gateway for t in dropped})
        return lost

    def hand_back(self, outbox: Outbox) -> int:
        """Put every tracked request back on the stream (`handoffs` + 1, so its next engine
        resumes it from its checkpoint) and acknowledge our entries; returns how many."""
        dropped = self.drop(list(self._tracked))
        for tracked in dropped:
            again = dataclasses.replace(tracked.request, handoffs=tracked.request.handoffs + 1)
            outbox.requeue.append(again.encode())
            outbox.ack(tracked.entry_id, tracked.stream)
        return len(dropped)

    def collect(self, result: StepResult, outbox: Outbox) -> list[tuple[Tracked, RequestOutput]]:
        """One step's deltas, refusals, failures and aborts → wire messages and acks in `outbox`;
        returns the requests that finished cleanly with their last delta (for metrics)."""
        for request_id, (message, code) in result.rejected.items():
            self._end_with(outbox, request_id, message, "invalid_request_error", code)
        for request_id, message in result.failed.items():
            self._end_with(outbox, request_id, message, "server_error", "engine_step_failed")
        for request_id in result.aborted:
            aborted = self._tracked.pop(request_id, None)
            if aborted is not None:
                outbox.end(request_id, aborted.entry_id, aborted.stream, aborted.gateway)
        finished = []
        for out in result.outputs:
            live = self._tracked.get(out.request_id)
            if live is None:
                continue
            outbox.add(live.gateway, to_wire(live, out))
            if out.finished:
                del self._tracked[out.request_id]
                outbox.end(out.request_id, live.entry_id, live.stream)
                if out.error is None:
                    finished.append((live, out))
        return finished

    def _end_with(self, outbox: Outbox, request_id: str, message: str, type_: str, code: str) -> None:
        tracked = self._tracked.pop(request_id, None)
        if tracked is not None:
            outbox.add(tracked.gateway, error_output(tracked, message, type_, code))
            outbox.end(request_id, tracked.entry_id, tracked.stream, tracked.gateway)

    # ----- admission ---------------------------------------------------------------------------
    async def admit(self, entries: list[StreamEntry], claimed: bool) -> None:
        """Decode entries; claimed ones, handed-back ones (and this engine's own after a
        restart) resume from their checkpoints. An entry that does not decode is dead-lettered
        with its reason and raw bytes and acknowledged, before anything else can fail on it."""
        async with self._admitting:
            await self._admit(entries, claimed)

    async def readopt(self) -> int:
        """Resume (or just acknowledge) entries pending under this engine that it does not track:
        after a failover the new master may lack the last writes the old one acknowledged (a
        finished request's XACK/XDEL, an XREADGROUP's reply), which left them there for good.
        Resuming goes by the request's checkpoint (one whose client got everything is only
        acknowledged; the gateway drops repeated output). Returns how many were found."""
        async with self._admitting:
            acking = self._pending.acks(self.stream.key)
            found = 0
            for stream in self.own_streams:
                known = {t.entry_id for t in self._tracked.values() if (t.stream or self.stream.key) == stream.key}
                known |= set(acking.get(stream.key, []))
                orphans = await stream.own_pending_except(known)
                if orphans:
                    log.warning("untracked entries pending under this engine: resuming them", count=len(orphans),
                                stream=stream.key)
                    self.readopted += len(orphans)
                    for e in map(self._local, orphans):
                        if e.payload is None:
                            self._pending.ack(e.entry_id, e.stream)
                    await self._admit([e for e in orphans if e.payload is not None], claimed=True)
                found += len(orphans)
            return found

    def _local(self, entry: StreamEntry) -> StreamEntry:
        """The shared stream is the outbox's default: its entries carry no stream."""
        return dataclasses.replace(entry, stream="") if entry.stream == self.stream.key else entry

    async def _admit(self, entries: list[StreamEntry], claimed: bool) -> None:
        for entry in map(self._local, entries):
            try:
                request = EngineRequest.decode(entry.payload or b"")
            except ProtocolError as exc:
                await self._dead_letter_raw(entry, f"undecodable: {exc}")
                continue
            if request.id in self._tracked:
                continue
            if entry.deliveries - 1 > self.max_claims:
                await self._dead_letter(request, entry)
                continue
            await self._sync_epoch(request.epoch)
            if request.id in self.recent_aborts:
                self._pending.end(request.id, entry.entry_id, entry.stream, request.gateway)
                continue
            await self._start(request, entry, claimed)

    async def _start(self, request: EngineRequest, entry: StreamEntry, claimed: bool) -> None:
        progress = await self._progress(request) if claimed or request.handoffs else Progress()
        resumed = resume(request, entry.entry_id, progress, entry.stream, self.stream.consumer)
        if resumed is None:  # its client already got everything
            self._pending.end(request.id, entry.entry_id, entry.stream, request.gateway)
            return
        tracked, job = resumed
        if request.deadline is not None and time.time() > request.deadline:
            self._pending.add(request.gateway, error_output(tracked, "request deadline passed", "timeout",
                                                            "timeout"))
            self._pending.end(request.id, entry.entry_id, entry.stream, request.gateway)
            return
        if tracked.resumed:
            log.info("resuming request", request_id=request.id, tokens=len(job.generated), seq=tracked.seq)
        self._tracked[request.id] = tracked
        self.jobs.append(job)

    async def _dead_letter_raw(self, entry: StreamEntry, reason: str) -> None:
        """Park an entry nobody can serve (with why, and its bytes as they came) and ack it."""
        log.error("request entry dead-lettered", entry=entry.entry_id, reason=reason[:300],
                  stream=self.keys.dead(self.model))
        self.dead_lettered += 1
        fields: dict[str, bytes | str | int] = {REQUEST_FIELD: entry.payload or b"", "reason": reason[:1000],
                                                "entry": entry.entry_id}
        try:
            await self.client.xadd(self.keys.dead(self.model), fields,  # type: ignore[arg-type]
                                   maxlen=DEAD_LETTER_MAXLEN, approximate=True)
        finally:
            self._pending.ack(entry.entry_id, entry.stream)

    async def _sync_epoch(self, token: str) -> None:
        """A request from another dataset epoch: Redis lost its data since we last looked."""
        if self.epoch is None or not token or token == self.epoch.token:
            return
        if await self.epoch.check(self.client) and self.on_data_lost is not None:
            self.on_data_lost()

    async def _dead_letter(self, request: EngineRequest, entry: StreamEntry) -> None:
        """Park a request taken over more than `max_claims` times and tell its client."""
        claims = entry.deliveries - 1
        log.error("request taken over too often: dead-lettered", request_id=request.id, claims=claims)
        self.dead_lettered += 1
        await self.client.xadd(self.keys.dead(self.model), {REQUEST_FIELD: entry.payload or b"", "claims": claims,
                                                            "reason": f"taken over {claims} times"},
                               maxlen=DEAD_LETTER_MAXLEN, approximate=True)
        progress = await self._progress(request)
        tracked = Tracked(request, entry.entry_id, seq=progress.last_seq + 1, stream=entry.stream,
                          engine=self.stream.consumer)
        message = (f"request abandoned after {claims} engine takeovers (each engine that ran it stopped); "
                   f"it was moved to {self.keys.dead(self.model)}")
        self._pending.add(request.gateway, error_output(tracked, message, "server_error", "request_dead_lettered"))
        self._pending.end(request.id, entry.entry_id, entry.stream, request.gateway)

    async def _progress(self, request: EngineRequest) -> Progress:
        request_id = request.id
        try:
            entries = await self.client.lrange(self.keys.progress(request.gateway, request_id), 0, -1)
            return merge_progress([e if isinstance(e, bytes) else e.encode() for e in entries])
        except ProtocolError as exc:
            log.warning("unreadable progress, restarting request", request_id=request_id, error=str(exc))
            return Progress()

    def take_jobs(self) -> tuple[list[AddJob], list[str]]:
        """Jobs and aborts for the next engine step; aborted jobs never reach the engine."""
        aborts, self.aborts = self.aborts, set()
        forced, self.forced_aborts = self.forced_aborts, set()
        jobs = [job for job in self.jobs if job.request_id not in aborts and job.request_id not in forced]
        for job in self.jobs:
            if job.request_id in aborts:
                tracked = self._tracked.pop(job.request_id)
                self._pending.end(job.request_id, tracked.entry_id, tracked.stream, tracked.gateway)
        queued = {job.request_id for job in self.jobs}
        self.jobs = []
        return jobs, [rid for rid in aborts if rid in self.tracked] + [rid for rid in forced if rid not in queued]

    def drop(self, request_ids: list[str]) -> list[Tracked]:
        """Stop tracking these requests (the engine drops them at its next step); returns them."""
        dropped = [t for t in (self._tracked.pop(rid, None) for rid in request_ids) if t is not None]
        self.forced_aborts.update(t.request_id for t in dropped)
        return dropped

    # ----- sources -----------------------------------------------------------------------------
    @property
    def own_streams(self) -> list[RequestStream]:
        """The streams this engine reads new entries from: its routed one first, then the shared one."""
        return [self.stream] if self.routed is None else [self.routed, self.stream]

    def stream_for(self, key: str) -> RequestStream:
        """The `RequestStream` of a stream key (own, shared or a peer's routed one), as this consumer."""
        for own in self.own_streams:
            if own.key == key:
                return own
        if key not in self._peers:
            self._peers[key] = RequestStream(self.client, self.keys, self.model, self.stream.consumer, key=key)
        return self._peers[key]

    async def pull(self, count: int, block_ms: int | None) -> int:
        """Read up to `count` new entries, own routed stream first, then the shared one; with
        `block_ms`, when both are empty, block on both at once (so either wakes the engine; up to
        `count` may then come from each). Nothing there and room left: steal old entries of
        peers' routed streams (`steal_after_ms`). Returns how many arrived."""
        if count <= 0:
            return 0
        total = 0
        if self.routed is not None:
            entries = await self.routed.read_new(count, None)
            self.routed_taken += len(entries)
            await self.admit(entries, claimed=False)
            total += len(entries)
            if total >= count:
                return total
            entries = await self.stream.read_new(count - total, None)
            await self.admit(entries, claimed=False)
            total += len(entries)
            if total == 0:
                total = await self.steal(count)
            if total == 0 and block_ms is not None:
                entries = await self.routed.read_new_with(self.stream, count, block_ms)
                self.routed_taken += sum(1 for e in entries if e.stream == self.routed.key)
                await self.admit(entries, claimed=False)
                total = len(entries)
            return total
        entries = await self.stream.read_new(count, block_ms)
        await self.admit(entries, claimed=False)
        return len(entries)

    async def routed_keys(self) -> list[str]:
        """Every routed stream of this model (``Keys.routed_streams``), sorted."""
        members = await self.client.smembers(self.keys.routed_streams(self.model))
        return sorted(m.decode() if isinstance(m, bytes) else str(m) for m in members)

    async def steal(self, count: int) -> int:
        """Work stealing: entries waiting longer than `steal_after_ms` on peers' routed streams
        (a busy, frozen or gone engine), at most one scan per `steal_after_ms / 2`."""
        if self.steal_after_ms is None or count <= 0:
            return 0
        now = time.monotonic()
        if now < self._next_steal:
            return 0
        self._next_steal = now + self.steal_after_ms / 2000
        total = 0
        mine = {s.key for s in self.own_streams}
        for key in await self.routed_keys():
            if key in mine or total >= count:
                continue
            entries = await self.stream_for(key).steal(self.steal_after_ms, count - total)
            if entries:
                log.info("stole entries", count=len(entries), stream=key)
                self.stolen += len(entries)
                await self.admit(entries, claimed=False)
                total += len(entries)
        return total

    async def claim(self, min_idle_ms: int, rounds: int = 10) -> int:
        """Take over idle entries of engines of this model whose heartbeat is gone, on the
        shared stream and every routed one; a gone engine's routed stream that holds nothing
        any more leaves the set of routed streams."""
        total = 0
        keys = [self.stream.key, *(await self.routed_keys())]
        for key in dict.fromkeys(keys):
            total += await self._claim_on(self.stream_for(key), min_idle_ms, rounds)
        return total

    async def _claim_on(self, stream: RequestStream, min_idle_ms: int, rounds: int) -> int:
        total = 0
        dead = await self._dead_consumers(stream)
        for name in dead:
            for _ in range(rounds):
                entries = await stream.claim_from(name, min_idle_ms)
                if not entries:
                    break
                log.info("claimed entries", count=len(entries), dead_engine=name, stream=stream.key)
                await self.admit(entries, claimed=True)
                total += len(entries)
        if dead:
            pending = await stream.consumers()
            for name in dead:
                if pending.get(name, 0) == 0:
                    await stream.forget(name)
        if stream.key != self.stream.key:
            await self._drop_if_gone(stream)
        return total

    async def _dead_consumers(self, stream: RequestStream) -> list[str]:
        try:
            return await stream.dead_consumers()
        except ResponseError:  # a routed stream that is gone (or has no group yet)
            return []

    async def _drop_if_gone(self, stream: RequestStream) -> None:
        """Remove a routed stream whose engine's heartbeat is gone once it holds no entry and
        got none for `ROUTED_QUIET_MS` (by Redis' clock): a gateway that read the heartbeat just
        before it expired may still add to it for a moment, and that entry must not land on a
        stream nobody scans."""
        owner = stream.key.removeprefix(self.keys.routed(self.model, ""))
        if await self.client.exists(self.keys.alive(self.model, owner)) or await self.client.xlen(stream.key):
            return
        try:
            info = await self.client.xinfo_stream(stream.key)
        except ResponseError:  # already gone
            info = {"last-generated-id": b"0-0"}
        last = info.get("last-generated-id", b"0-0")
        last_ms = int((last.decode() if isinstance(last, bytes) else str(last)).split("-")[0])
        seconds, micros = await self.client.time()
        if int(seconds) * 1000 + int(micros) // 1000 - last_ms < ROUTED_QUIET_MS:
            return
        async with slot_pipeline(self.client, stream.key) as pipe:
            pipe.srem(self.keys.routed_streams(self.model), stream.key)
            pipe.delete(stream.key)
            await pipe.execute()
        self._peers.pop(stream.key, None)
        log.info("removed a gone engine's empty routed stream", stream=stream.key)

    def on_abort(self, ids: list[str]) -> None:
        """Stop tracked requests at the next step; remember the others for `ABORT_MEMORY_S`
        (their entry may still be queued) in insertion order, so expiry is O(1) per id."""
        now = time.monotonic()
        for request_id in ids:
            if request_id in self._tracked:
                self.aborts.add(request_id)
            else:
                self.recent_aborts.pop(request_id, None)
                self.recent_aborts[request_id] = now
        while self.recent_aborts and (len(self.recent_aborts) > MAX_REMEMBERED_ABORTS
                                      or next(iter(self.recent_aborts.values())) < now - ABORT_MEMORY_S):
            self.recent_aborts.popitem(last=False)

    def _on_abort_message(self, data: bytes) -> None:
        try:
            message = AbortMessage.decode(data)
        except ProtocolError as exc:
            self.bad_aborts += 1
            log.warning("undecodable abort message ignored", error=str(exc)[:200])
            return
        if not message.model or message.model == self.model:
            self.on_abort(message.ids)

    async def listen_aborts(self, running: Callable[[], bool] = lambda: True) -> None:
        """Run while `running()`: the abort channel (resubscribing after errors)."""
        await subscribe_forever(self.client, self.keys.abort, self._on_abort_message, running=running)
