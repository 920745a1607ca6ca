"""Takeover: entries of engines of this model whose heartbeat is gone are claimed and resumed
from their checkpoints, on the shared stream and every routed one; a gone engine's routed
stream is removed once it is empty and quiet."""

from __future__ import annotations

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from common.log import get_logger
from common.protocol import Keys
from common.redis_slots import slot_pipeline
from engine.worker.intake.admission import Admission
from engine.worker.intake.sources import Sources
from engine.worker.request_stream import RequestStream

log = get_logger("worker.intake")
ROUTED_QUIET_MS = 30_000  # a gone engine's empty routed stream is removed after no entry arrived this long


class Takeover:
    """Claims dead engines' entries from `sources`' streams into `admission`."""

    def __init__(self, client: aioredis.Redis, keys: Keys, model: str, sources: Sources,
                 admission: Admission) -> None:
        self.client = client
        self.keys = keys
        self.model = model
        self.sources = sources
        self.admission = admission

    async def claim(self, min_idle_ms: int, rounds: int = 10) -> int:
        """Take over idle entries of engines of this model whose heartbeat is gone, on the
        shared stream and every routed one; a gone engine's routed stream that holds nothing
        any more leaves the set of routed streams."""
        total = 0
        keys = [self.sources.stream.key, *(await self.sources.routed_keys())]
        for key in dict.fromkeys(keys):
            total += await self._claim_on(self.sources.stream_for(key), min_idle_ms, rounds)
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
                await self.admission.admit(entries, claimed=True)
                total += len(entries)
        if dead:
            pending = await stream.consumers()
            for name in dead:
                if pending.get(name, 0) == 0:
                    await stream.forget(name)
        if stream.key != self.sources.stream.key:
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
        self.sources.forget_peer(stream.key)
        log.info("removed a gone engine's empty routed stream", stream=stream.key)
