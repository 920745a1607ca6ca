"""What flows into an engine worker: new stream entries, entries claimed from dead engines
(resumed from their progress checkpoints), and aborts from the abort channel."""

from __future__ import annotations

import contextlib
import time

import redis.asyncio as aioredis

from engine.log import get_logger
from engine.protocol import AbortMessage, EngineRequest, Keys, Progress, ProtocolError, merge_progress
from engine.pubsub import subscribe_forever
from engine.worker.engine_thread import AddJob
from engine.worker.outbox import Outbox
from engine.worker.request_stream import RequestStream, StreamEntry
from engine.worker.tracked import Tracked, error_output, resume

log = get_logger("worker.intake")
ABORT_MEMORY_S = 300.0


class Intake:
    """Turns stream entries and aborts into engine jobs; owns the `tracked` requests table."""

    def __init__(self, client: aioredis.Redis, keys: Keys, stream: RequestStream) -> None:
        self.client = client
        self.keys = keys
        self.stream = stream
        self.tracked: dict[str, Tracked] = {}
        self.jobs: list[AddJob] = []
        self.aborts: set[str] = set()
        self.recent_aborts: dict[str, float] = {}
        self.pending = Outbox()  # errors and acks produced while admitting

    # ----- admission ---------------------------------------------------------------------------
    async def admit(self, entries: list[StreamEntry], claimed: bool) -> None:
        """Decode entries; claimed ones (and this engine's own after a restart) resume."""
        for entry in entries:
            try:
                request = EngineRequest.decode(entry.payload or b"")
            except ProtocolError as exc:
                log.error("undecodable request dropped", entry=entry.entry_id, error=str(exc))
                self.pending.ack_only.append(entry.entry_id)
                continue
            if request.id in self.tracked:
                continue
            if request.id in self.recent_aborts:
                self.pending.end(request.id, entry.entry_id)
                continue
            progress = await self._progress(request.id) if claimed else Progress()
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
        jobs = [job for job in self.jobs if job.request_id not in aborts]
        for job in self.jobs:
            if job.request_id in aborts:
                tracked = self.tracked.pop(job.request_id)
                self.pending.end(job.request_id, tracked.entry_id)
        self.jobs = []
        return jobs, [rid for rid in aborts if rid in self.tracked]

    # ----- sources -----------------------------------------------------------------------------
    async def pull(self, count: int, block_ms: int | None) -> int:
        """Read up to `count` new entries; returns how many arrived."""
        if count <= 0:
            return 0
        entries = await self.stream.read_new(count, block_ms)
        await self.admit(entries, claimed=False)
        return len(entries)

    async def claim(self, min_idle_ms: int, rounds: int = 10) -> int:
        """Take over idle entries when some engine holding entries has lost its heartbeat (a
        full scan is at most `rounds` calls). Live engines keep theirs fresh with `touch`, so
        only the dead engine's entries are idle long enough; a slow live engine is safe twice."""
        dead = await self.stream.dead_consumers()
        if not dead:
            return 0
        total = 0
        for _ in range(rounds):
            result = await self.stream.claim_idle(min_idle_ms)
            if result.entries:
                log.info("claimed entries", count=len(result.entries), dead_engines=dead)
                await self.admit(result.entries, claimed=True)
            total += len(result.entries)
            if result.next_id == "0-0":
                break
        pending = await self.stream.consumers()
        for name in dead:
            if pending.get(name, 0) == 0:
                await self.stream.forget(name)
        return total

    async def touch(self) -> None:
        """Keep this engine's pending entries fresh so no live engine claims them."""
        await self.stream.touch([t.entry_id for t in self.tracked.values()])

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

    async def listen_aborts(self) -> None:
        """Run forever: the abort channel (resubscribing after errors)."""
        await subscribe_forever(self.client, self.keys.abort, self._on_abort_message)
