"""The engine's side of its model's request stream: consumer group, reads, takeovers, acks.

Takeover only ever moves entries of a *dead* consumer (one whose liveness key, `Keys.alive`,
written with its heartbeat in the model's slot, is gone), in
one Lua script that checks the key and claims atomically: an engine that comes back from a
long pause first rewrites its heartbeat, and from then on nobody can take its entries, so
one ownership check afterwards (`owned`) tells it exactly what it still owns. The claim's
min-idle guard keeps two engines from taking the same entry. A stream or group that
vanished (Redis restarted without persistence) is recreated on NOGROUP."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from common.protocol import REQUEST_FIELD, Keys
from common.redis_slots import slot_pipeline

# KEYS: stream, liveness key of the dead consumer (`Keys.alive`: in the stream's slot).
# ARGV: group, me, min idle ms, dead consumer, count.
# Returns {{id, deliveries, payload}, ...}; entries deleted from the stream are acked and skipped.
_CLAIM_SCRIPT = """
if redis.call('EXISTS', KEYS[2]) == 1 then return {} end
local pending = redis.call('XPENDING', KEYS[1], ARGV[1], 'IDLE', ARGV[3], '-', '+', ARGV[5], ARGV[4])
local out = {}
for _, p in ipairs(pending) do
  local got = redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], ARGV[3], p[1])
  local entry = got[1]
  if entry and entry[2] then
    local payload = false
    for i = 1, #entry[2], 2 do
      if entry[2][i] == ARGV[6] then payload = entry[2][i + 1] end
    end
    if payload then
      table.insert(out, {p[1], p[4] + 1, payload})
    else
      redis.call('XACK', KEYS[1], ARGV[1], p[1])
    end
  elseif #redis.call('XRANGE', KEYS[1], p[1], p[1]) == 0 then
    redis.call('XACK', KEYS[1], ARGV[1], p[1])
  end
end
return out
"""


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamEntry:
    """One request-stream entry: its id, the raw `m` field (None when the entry is gone) and
    how many times it has been delivered (1 on the first read, +1 per takeover)."""

    entry_id: str
    payload: bytes | None
    deliveries: int = 1
    stream: str = ""  # the stream it was read from (empty: not known, the model's shared one)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def parse_entries(raw: Any) -> list[StreamEntry]:
    """``[[id, {field: value}], ...]`` (or nil fields for a deleted entry) → entries."""
    entries = []
    for item in raw or []:
        if item is None or item[0] is None:
            continue
        entry_id, fields = item[0], item[1] if len(item) > 1 else None
        if isinstance(fields, list):  # RESP without redis-py's pairs-to-dict callback
            fields = dict(zip(fields[::2], fields[1::2], strict=True))
        payload = None
        if fields:
            payload = fields.get(REQUEST_FIELD.encode(), fields.get(REQUEST_FIELD))
        entries.append(StreamEntry(entry_id=_text(entry_id), payload=payload))
    return entries


def is_nogroup(exc: Exception) -> bool:
    return isinstance(exc, ResponseError) and "NOGROUP" in str(exc)


class RequestStream:
    """XREADGROUP / takeover / XACK+XDEL on one request stream of a model as consumer `consumer`:
    the model's shared stream, or with `key` another one (an engine's routed stream). With
    `register`, `ensure_group` also adds the key to that set (``Keys.routed_streams``)."""

    def __init__(self, client: aioredis.Redis, keys: Keys, model: str, consumer: str, key: str | None = None,
                 register: str | None = None) -> None:
        self.client = client
        self.keys = keys
        self.model = model
        self.key = key or keys.requests(model)
        self.consumer = consumer
        self.register = register
        self._claim = client.register_script(_CLAIM_SCRIPT)

    async def ensure_group(self) -> None:
        """Create the stream and the consumer group if missing (reading from the start)."""
        try:
            await self.client.xgroup_create(self.key, self.keys.group, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        if self.register:
            await self.client.sadd(self.register, self.key)

    async def read_new(self, count: int, block_ms: int | None) -> list[StreamEntry]:
        """Entries never delivered to anyone; blocks up to `block_ms` when given. Recreates
        the group when Redis lost it."""
        try:
            reply = await self.client.xreadgroup(self.keys.group, self.consumer, {self.key: ">"},
                                                 count=count, block=block_ms)
        except ResponseError as exc:
            if not is_nogroup(exc):
                raise
            await self.ensure_group()
            return []
        return self._flatten(reply)

    async def read_new_with(self, other: RequestStream, count: int, block_ms: int | None) -> list[StreamEntry]:
        """`read_new` on this stream and `other` in one XREADGROUP (up to `count` from each),
        blocking until either has an entry. Recreates a group Redis lost."""
        try:
            reply = await self.client.xreadgroup(self.keys.group, self.consumer, {self.key: ">", other.key: ">"},
                                                 count=count, block=block_ms)
        except ResponseError as exc:
            if not is_nogroup(exc):
                raise
            await self.ensure_group()
            await other.ensure_group()
            return []
        return self._flatten(reply)

    async def steal(self, older_than_ms: int, count: int) -> list[StreamEntry]:
        """Up to `count` entries of this (a peer's) stream never delivered to anyone and older
        than `older_than_ms` by Redis' clock (entry ids are Redis times), read through the group
        as this consumer: from then on they are pending under it, so a gateway's XDEL, the
        takeover of a dead engine and XACK work as for any other entry."""
        try:
            groups = await self.client.xinfo_groups(self.key)
        except ResponseError:  # no such stream (any more)
            return []
        last = next((_text(g["last-delivered-id"]) for g in groups if _text(g["name"]) == self.keys.group), None)
        if last is None:
            return []
        seconds, micros = await self.client.time()
        cutoff = int(seconds) * 1000 + int(micros) // 1000 - older_than_ms
        if cutoff <= 0:
            return []
        old = await self.client.xrange(self.key, min="(" + last, max=str(cutoff), count=count)
        if not old:
            return []
        reply = await self.client.xreadgroup(self.keys.group, self.consumer, {self.key: ">"}, count=len(old))
        return self._flatten(reply)

    async def read_own_pending(self, count: int = 1000) -> list[StreamEntry]:
        """Entries delivered to this consumer name and never acked (a restart under the same id)."""
        reply = await self.client.xreadgroup(self.keys.group, self.consumer, {self.key: "0"}, count=count)
        return self._flatten(reply)

    async def own_pending_except(self, known: set[str]) -> list[StreamEntry]:
        """Entries pending under this consumer other than `known` (ids), with their payloads, read
        without counting a delivery (XPENDING, then XRANGE per entry): entries this engine holds in
        Redis but no longer tracks, e.g. a request's XACK lost with a master that had acknowledged
        it, or an XREADGROUP whose reply was lost. An entry deleted meanwhile comes back with
        payload None."""
        orphans: list[StreamEntry] = []
        start = "-"
        while True:
            rows = await self.client.xpending_range(self.key, self.keys.group, min=start, max="+", count=1000,
                                                    consumername=self.consumer)
            for row in rows:
                entry_id = _text(row["message_id"])
                if entry_id not in known:
                    found = parse_entries(await self.client.xrange(self.key, min=entry_id, max=entry_id))
                    payload = found[0].payload if found else None
                    orphans.append(StreamEntry(entry_id=entry_id, payload=payload,
                                               deliveries=int(row["times_delivered"]), stream=self.key))
            if len(rows) < 1000:
                return orphans
            start = "(" + _text(rows[-1]["message_id"])

    async def claim_from(self, dead: str, min_idle_ms: int, count: int = 100) -> list[StreamEntry]:
        """Take over up to `count` idle entries of consumer `dead`, if its liveness key is still gone."""
        reply = await self._claim(keys=[self.key, self.keys.alive(self.model, dead)],
                                  args=[self.keys.group, self.consumer, min_idle_ms, dead, count, REQUEST_FIELD])
        return [StreamEntry(entry_id=_text(entry_id), payload=payload, deliveries=int(deliveries), stream=self.key)
                for entry_id, deliveries, payload in reply]

    async def owned(self, entry_ids: list[str]) -> set[str]:
        """Which of these entries are still pending under this consumer."""
        owned: set[str] = set()
        if not entry_ids:
            return owned
        start = "-"
        while True:
            rows = await self.client.xpending_range(self.key, self.keys.group, min=start, max="+", count=1000,
                                                    consumername=self.consumer)
            owned.update(_text(row["message_id"]) for row in rows)
            if len(rows) < 1000:
                return owned & set(entry_ids)
            start = "(" + _text(rows[-1]["message_id"])

    async def consumers(self) -> dict[str, int]:
        """Consumer names of the group and how many entries each holds un-acked."""
        infos = await self.client.xinfo_consumers(self.key, self.keys.group)
        return {_text(info["name"]): int(info["pending"]) for info in infos}

    async def dead_consumers(self) -> list[str]:
        """Other consumers holding entries while their liveness key is gone (crashed engines)."""
        dead = []
        for name, pending in (await self.consumers()).items():
            if name != self.consumer and pending and not await self.client.exists(self.keys.alive(self.model, name)):
                dead.append(name)
        return dead

    async def forget(self, consumer: str) -> None:
        """Remove a dead consumer that holds nothing any more."""
        await self.client.xgroup_delconsumer(self.key, self.keys.group, consumer)

    async def ack(self, entry_ids: list[str]) -> None:
        """Acknowledge and delete: a finished request leaves nothing in Redis."""
        if entry_ids:
            async with slot_pipeline(self.client, self.key) as pipe:
                pipe.xack(self.key, self.keys.group, *entry_ids)
                pipe.xdel(self.key, *entry_ids)
                await pipe.execute()

    @staticmethod
    def _flatten(reply: Any) -> list[StreamEntry]:
        """XREADGROUP's reply → entries tagged with the stream each came from."""
        entries: list[StreamEntry] = []
        if isinstance(reply, dict):  # RESP3
            reply = list(reply.items())
        for stream, raw in reply or []:
            entries.extend(dataclasses.replace(e, stream=_text(stream)) for e in parse_entries(raw) if e.entry_id)
        return entries
