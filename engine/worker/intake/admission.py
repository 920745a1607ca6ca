"""Admission: stream entries become tracked requests and engine jobs. Claimed entries, handed-back
ones (and this engine's own after a restart) resume from their progress checkpoints. An entry
that does not decode, or one delivered too many times, goes to the dead-letter stream: a request
that kills every engine it lands on must not take the whole model down."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable

import redis.asyncio as aioredis

from common.log import get_logger
from common.protocol import REQUEST_FIELD, EngineRequest, Keys, Progress, ProtocolError, merge_progress
from common.redis_conn import Epoch
from engine.worker.intake.aborts import Aborts
from engine.worker.intake.table import RequestTable
from engine.worker.request_stream import RequestStream, StreamEntry
from engine.worker.tracked import Tracked, error_output, resume

log = get_logger("worker.intake")
DEAD_LETTER_MAXLEN = 1000


class Admission:
    """Decodes, checks and starts entries into `table`. `lock` is held while entries are admitted:
    pulls, takeovers and re-adoption may see one entry at once."""

    def __init__(self, client: aioredis.Redis, keys: Keys, model: str, stream: RequestStream, table: RequestTable,
                 aborts: Aborts, max_claims: int = 3, epoch: Epoch | None = None,
                 on_data_lost: Callable[[], object] | None = None) -> None:
        self.client = client
        self.keys = keys
        self.model = model
        self.stream = stream  # the shared stream: its entries carry no stream name in the table
        self.table = table
        self.aborts = aborts
        self.max_claims = max_claims
        self.epoch = epoch
        self.on_data_lost = on_data_lost  # a request from a newer dataset epoch: Redis lost its data
        self.dead_lettered = 0  # entries moved to the dead-letter stream (metric)
        self.lock = asyncio.Lock()

    async def admit(self, entries: list[StreamEntry], claimed: bool) -> None:
        """Decode entries; claimed ones, handed-back ones (and this engine's own after a
        restart) resume from their checkpoints. An entry that does not decode is dead-lettered
        with its reason and raw bytes and acknowledged, before anything else can fail on it."""
        async with self.lock:
            await self.admit_held(entries, claimed)

    def local(self, entry: StreamEntry) -> StreamEntry:
        """The shared stream is the outbox's default: its entries carry no stream."""
        return dataclasses.replace(entry, stream="") if entry.stream == self.stream.key else entry

    async def admit_held(self, entries: list[StreamEntry], claimed: bool) -> None:
        """`admit`, for a caller that holds `lock`."""
        for entry in map(self.local, entries):
            try:
                request = EngineRequest.decode(entry.payload or b"")
            except ProtocolError as exc:
                await self._dead_letter_raw(entry, f"undecodable: {exc}")
                continue
            if request.id in self.table.tracked:
                continue
            if entry.deliveries - 1 > self.max_claims:
                await self._dead_letter(request, entry)
                continue
            await self._sync_epoch(request.epoch)
            if self.aborts.recently_aborted(request.id):
                self.table.pending.end(request.id, entry.entry_id, entry.stream, request.gateway)
                continue
            await self._start(request, entry, claimed)

    async def _start(self, request: EngineRequest, entry: StreamEntry, claimed: bool) -> None:
        progress = await self._progress(request) if claimed or request.handoffs else Progress()
        resumed = resume(request, entry.entry_id, progress, entry.stream, self.stream.consumer)
        pending = self.table.pending
        if resumed is None:  # its client already got everything
            pending.end(request.id, entry.entry_id, entry.stream, request.gateway)
            return
        tracked, job = resumed
        if request.deadline is not None and time.time() > request.deadline:
            pending.add(request.gateway, error_output(tracked, "request deadline passed", "timeout", "timeout"))
            pending.end(request.id, entry.entry_id, entry.stream, request.gateway)
            return
        if tracked.resumed:
            log.info("resuming request", request_id=request.id, tokens=len(job.generated), seq=tracked.seq)
        self.table.track(tracked, job)

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
            self.table.pending.ack(entry.entry_id, entry.stream)

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
        pending = self.table.pending
        pending.add(request.gateway, error_output(tracked, message, "server_error", "request_dead_lettered"))
        pending.end(request.id, entry.entry_id, entry.stream, request.gateway)

    async def _progress(self, request: EngineRequest) -> Progress:
        request_id = request.id
        try:
            entries = await self.client.lrange(self.keys.progress(request.gateway, request_id), 0, -1)
            return merge_progress([e if isinstance(e, bytes) else e.encode() for e in entries])
        except ProtocolError as exc:
            log.warning("unreadable progress, restarting request", request_id=request_id, error=str(exc))
            return Progress()
