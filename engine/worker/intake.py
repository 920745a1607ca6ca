"""What flows into an engine worker: new stream entries, entries taken over from dead engines
of the same model or handed back by a draining one (resumed from their progress
checkpoints), and aborts from the abort channel. A request delivered too many times goes to
the dead-letter stream with an error for its client: a request that kills every engine it
lands on must not take the whole model down."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import redis.asyncio as aioredis

from engine.log import get_logger
from engine.protocol import REQUEST_FIELD, AbortMessage, EngineRequest, Keys, Progress, ProtocolError, merge_progress
from engine.pubsub import subscribe_forever
from engine.redis_conn import Epoch
from engine.worker.engine_thread import AddJob
from engine.worker.outbox import Outbox
from engine.worker.request_stream import RequestStream, StreamEntry
from engine.worker.tracked import Tracked, error_output, resume

log = get_logger("worker.intake")
ABORT_MEMORY_S = 300.0
DEAD_LETTER_MAXLEN = 1000


class Intake:
    """Turns stream entries and aborts into engine jobs; owns the `tracked` requests table."""

    def __init__(self, client: aioredis.Redis, keys: Keys, stream: RequestStream, model: str,
                 max_claims: int = 3, epoch: Epoch | None = None,
                 on_data_lost: Callable[[], None] | None = None) -> None:
        self.client = client
        self.epoch = epoch
        self.on_data_lost = on_data_lost
        self.keys = keys
        self.stream = stream
        self.model = model
        self.max_claims = max_claims
        self.tracked: dict[str, Tracked] = {}
        self.jobs: list[AddJob] = []
        self.aborts: set[str] = set()
        self.forced_aborts: set[str] = set()  # already ended here; the engine must still drop them
        self.recent_aborts: dict[str, float] = {}
        self.pending = Outbox()  # errors and acks produced while admitting

    # ----- admission ---------------------------------------------------------------------------
    async def admit(self, entries: list[StreamEntry], claimed: bool) -> None:
        """Decode entries; claimed ones, handed-back ones (and this engine's own after a
        restart) resume from their checkpoints."""
        for entry in entries:
            try:
                request = EngineRequest.decode(entry.payload or b"")
            except ProtocolError as exc:
                log.error("undecodable request dropped", entry=entry.entry_id, error=str(exc))
                self.pending.ack_only.append(entry.entry_id)
                continue
            if request.id in self.tracked:
                continue
            await self._sync_epoch(request.epoch)
            if request.id in self.recent_aborts:
                self.pending.end(request.id, entry.entry_id)
                continue
            if entry.deliveries - 1 > self.max_claims:
                await self._dead_letter(request, entry)
                continue
            progress = await self._progress(request.id) if claimed or request.handoffs else Progress()
            resumed = resume(request, entry.entry_id, progress)
            if resumed is None:  # its client already got everything
                self.pending.end(request.id, entry.entry_id)
                continue
            tracked, job = resumed
            if request.deadline is not None and time.time() > request.deadline:
                self.pending.add(request.gateway, error_output(tracked, "request deadline passed", "timeout",
                                                               "timeout"))
                self.pending.end(request.id, entry.entry_id)
                continue
            if tracked.resumed:
                log.info("resuming request", request_id=request.id, tokens=len(job.generated), seq=tracked.seq)
            self.tracked[request.id] = tracked
            self.jobs.append(job)

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
        await self.client.xadd(self.keys.dead(self.model), {REQUEST_FIELD: entry.payload or b"", "claims": claims},
                               maxlen=DEAD_LETTER_MAXLEN, approximate=True)
        progress = await self._progress(request.id)
        tracked = Tracked(request, entry.entry_id, seq=progress.last_seq + 1)
        message = (f"request abandoned after {claims} engine takeovers (each engine that ran it stopped); "
                   f"it was moved to {self.keys.dead(self.model)}")
        self.pending.add(request.gateway, error_output(tracked, message, "server_error", "request_dead_lettered"))
        self.pending.end(request.id, entry.entry_id)

    async def _progress(self, request_id: str) -> Progress:
        try:
            entries = await self.client.lrange(self.keys.progress(request_id), 0, -1)
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
                tracked = self.tracked.pop(job.request_id)
                self.pending.end(job.request_id, tracked.entry_id)
        queued = {job.request_id for job in self.jobs}
        self.jobs = []
        return jobs, [rid for rid in aborts if rid in self.tracked] + [rid for rid in forced if rid not in queued]

    def drop(self, request_ids: list[str]) -> list[Tracked]:
        """Stop tracking these requests (the engine drops them at its next step); returns them."""
        dropped = [t for t in (self.tracked.pop(rid, None) for rid in request_ids) if t is not None]
        self.forced_aborts.update(t.request_id for t in dropped)
        return dropped

    # ----- sources -----------------------------------------------------------------------------
    async def pull(self, count: int, block_ms: int | None) -> int:
        """Read up to `count` new entries; returns how many arrived."""
        if count <= 0:
            return 0
        entries = await self.stream.read_new(count, block_ms)
        await self.admit(entries, claimed=False)
        return len(entries)

    async def claim(self, min_idle_ms: int, rounds: int = 10) -> int:
        """Take over idle entries of engines of this model whose heartbeat is gone."""
        total = 0
        dead = await self.stream.dead_consumers()
        for name in dead:
            for _ in range(rounds):
                entries = await self.stream.claim_from(name, min_idle_ms)
                if not entries:
                    break
                log.info("claimed entries", count=len(entries), dead_engine=name)
                await self.admit(entries, claimed=True)
                total += len(entries)
        if dead:
            pending = await self.stream.consumers()
            for name in dead:
                if pending.get(name, 0) == 0:
                    await self.stream.forget(name)
        return total

    def on_abort(self, ids: list[str]) -> None:
        now = time.monotonic()
        for request_id in ids:
            if request_id in self.tracked:
                self.aborts.add(request_id)
            else:
                self.recent_aborts[request_id] = now
        if len(self.recent_aborts) > 10_000:
            cutoff = now - ABORT_MEMORY_S
            self.recent_aborts = {k: t for k, t in self.recent_aborts.items() if t >= cutoff}

    def _on_abort_message(self, data: bytes) -> None:
        with contextlib.suppress(ProtocolError):
            self.on_abort(AbortMessage.decode(data).ids)

    async def listen_aborts(self, running: Callable[[], bool] = lambda: True) -> None:
        """Run while `running()`: the abort channel (resubscribing after errors)."""
        await subscribe_forever(self.client, self.keys.abort, self._on_abort_message, running=running)
