"""Where new entries come from: this engine's own routed stream first, then the shared stream of
its model, and (work stealing) entries left too long on peers' routed streams."""

from __future__ import annotations

import time

import redis.asyncio as aioredis

from common.log import get_logger
from common.protocol import Keys
from engine.worker.intake.admission import Admission
from engine.worker.request_stream import RequestStream

log = get_logger("worker.intake")


class Sources:
    """Reads new entries for `admission` from the streams this engine serves."""

    def __init__(self, client: aioredis.Redis, keys: Keys, model: str, stream: RequestStream,
                 admission: Admission, routed: RequestStream | None = None,
                 steal_after_ms: int | None = None) -> None:
        self.client = client
        self.keys = keys
        self.model = model
        self.stream = stream  # the model's shared stream
        self.admission = admission
        self.routed = routed  # this engine's own routed stream, read before the shared one; None: no routing
        self.steal_after_ms = steal_after_ms  # None: never steal from peers' routed streams
        self._peers: dict[str, RequestStream] = {}
        self._next_steal = 0.0
        self.routed_taken = 0  # entries read from the own routed stream (metric)
        self.stolen = 0  # entries stolen from peers' routed streams (metric)

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

    def forget_peer(self, key: str) -> None:
        """A peer's routed stream was removed: drop its `RequestStream`."""
        self._peers.pop(key, None)

    async def pull(self, count: int, block_ms: int | None) -> int:
        """Read up to `count` new entries, own routed stream first, then the shared one; with
        `block_ms`, when both are empty, block on both at once (so either wakes the engine; up to
        `count` may then come from each). Nothing there and room left: steal old entries of
        peers' routed streams (`steal_after_ms`). Returns how many arrived."""
        if count <= 0:
            return 0
        admit = self.admission.admit
        total = 0
        if self.routed is not None:
            entries = await self.routed.read_new(count, None)
            self.routed_taken += len(entries)
            await admit(entries, claimed=False)
            total += len(entries)
            if total >= count:
                return total
            entries = await self.stream.read_new(count - total, None)
            await admit(entries, claimed=False)
            total += len(entries)
            if total == 0:
                total = await self.steal(count)
            if total == 0 and block_ms is not None:
                entries = await self.routed.read_new_with(self.stream, count, block_ms)
                self.routed_taken += sum(1 for e in entries if e.stream == self.routed.key)
                await admit(entries, claimed=False)
                total = len(entries)
            return total
        entries = await self.stream.read_new(count, block_ms)
        await admit(entries, claimed=False)
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
                await self.admission.admit(entries, claimed=False)
                total += len(entries)
        return total
