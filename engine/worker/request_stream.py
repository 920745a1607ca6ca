"""The engine's side of the request stream: consumer group, reads, claims, acks.

Handles both reply shapes of XAUTOCLAIM: Redis 6.2 answers ``[next_id, entries]`` (a
deleted entry shows up as an entry with nil fields), 7.x answers
``[next_id, entries, deleted_ids]``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from engine.protocol import REQUEST_FIELD, Keys


@dataclass(frozen=True, slots=True)
class StreamEntry:
    """One request-stream entry: its id and the raw `m` field (None when the entry is gone)."""

    entry_id: str
    payload: bytes | None


@dataclass(frozen=True, slots=True)
class ClaimResult:
    """What one XAUTOCLAIM call handed over, and where the next scan starts."""

    next_id: str
    entries: list[StreamEntry]
    deleted: list[str]
    num_unknown: int = 0  # deleted entries whose id the client library dropped


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def parse_entries(raw: Any) -> list[StreamEntry]:
    """``[[id, {field: value}], ...]`` (or nil fields for a deleted entry) → entries."""
    entries = []
    for item in raw or []:
        if item is None or item[0] is None:  # redis-py's (None, None) for a deleted entry on 6.2
            entries.append(StreamEntry("", None))
            continue
        entry_id, fields = item[0], item[1] if len(item) > 1 else None
        if isinstance(fields, list):  # RESP without redis-py's pairs-to-dict callback
            fields = dict(zip(fields[::2], fields[1::2], strict=True))
        payload = None
        if fields:
            payload = fields.get(REQUEST_FIELD.encode(), fields.get(REQUEST_FIELD))
        entries.append(StreamEntry(_text(entry_id), payload))
    return entries


def parse_autoclaim(reply: Any) -> ClaimResult:
    """XAUTOCLAIM's reply on Redis 6.2 (2 elements) or 7.x (3 elements)."""
    if not isinstance(reply, (list, tuple)) or len(reply) not in (2, 3):
        raise ValueError(f"unexpected XAUTOCLAIM reply: {reply!r}")
    entries = parse_entries(reply[1])
    deleted = [_text(d) for d in reply[2]] if len(reply) == 3 and reply[2] else []
    deleted += [e.entry_id for e in entries if e.payload is None and e.entry_id]
    unknown = sum(1 for e in entries if not e.entry_id)
    return ClaimResult(_text(reply[0]), [e for e in entries if e.payload is not None], deleted, unknown)


class RequestStream:
    """XREADGROUP / XAUTOCLAIM / XACK on the request stream as consumer `consumer`."""

    def __init__(self, client: aioredis.Redis, keys: Keys, consumer: str) -> None:
        self.client = client
        self.keys = keys
        self.consumer = consumer
        self._claim_cursor = "0-0"

    async def ensure_group(self) -> None:
        """Create the stream and the consumer group if missing (reading from the start)."""
        try:
            await self.client.xgroup_create(self.keys.requests, self.keys.group, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def read_new(self, count: int, block_ms: int | None) -> list[StreamEntry]:
        """Entries never delivered to anyone; blocks up to `block_ms` when given."""
        reply = await self.client.xreadgroup(self.keys.group, self.consumer, {self.keys.requests: ">"},
                                             count=count, block=block_ms)
        return self._flatten(reply)

    async def read_own_pending(self, count: int = 1000) -> list[StreamEntry]:
        """Entries delivered to this consumer name and never acked (a restart under the same id)."""
        reply = await self.client.xreadgroup(self.keys.group, self.consumer, {self.keys.requests: "0"},
                                             count=count)
        return self._flatten(reply)

    async def claim_idle(self, min_idle_ms: int, count: int = 100) -> ClaimResult:
        """Take over entries that no consumer has touched for `min_idle_ms` (a dead engine's)."""
        reply = await self.client.execute_command(
            "XAUTOCLAIM", self.keys.requests, self.keys.group, self.consumer, min_idle_ms,
            self._claim_cursor, "COUNT", count)
        result = parse_autoclaim(reply)
        self._claim_cursor = result.next_id
        if result.num_unknown:  # find their ids in our own pending list, where they now sit
            result.deleted.extend(e.entry_id for e in await self.read_own_pending() if e.payload is None)
        if result.deleted:
            await self.ack(result.deleted)
        return result

    async def consumers(self) -> dict[str, int]:
        """Consumer names of the group and how many entries each holds un-acked."""
        infos = await self.client.xinfo_consumers(self.keys.requests, self.keys.group)
        return {_text(info["name"]): int(info["pending"]) for info in infos}

    async def dead_consumers(self) -> list[str]:
        """Other consumers holding entries while their heartbeat key is gone (crashed engines)."""
        dead = []
        for name, pending in (await self.consumers()).items():
            if name != self.consumer and pending and not await self.client.exists(self.keys.engine(name)):
                dead.append(name)
        return dead

    async def forget(self, consumer: str) -> None:
        """Remove a dead consumer that holds nothing any more."""
        await self.client.xgroup_delconsumer(self.keys.requests, self.keys.group, consumer)

    async def touch(self, entry_ids: list[str]) -> None:
        """Reset the idle time of entries this engine still works on, so nobody claims them."""
        if entry_ids:
            ids: list[Any] = list(entry_ids)
            await self.client.xclaim(self.keys.requests, self.keys.group, self.consumer, 0, ids, justid=True)

    async def ack(self, entry_ids: list[str]) -> None:
        if entry_ids:
            await self.client.xack(self.keys.requests, self.keys.group, *entry_ids)

    @staticmethod
    def _flatten(reply: Any) -> list[StreamEntry]:
        entries: list[StreamEntry] = []
        if isinstance(reply, dict):  # RESP3
            reply = list(reply.items())
        for _stream, raw in reply or []:
            entries.extend(e for e in parse_entries(raw) if e.entry_id)
        return entries
