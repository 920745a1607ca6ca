"""One MULTI/EXEC per engine step: a PUBLISH per gateway carrying every one of its requests'
messages, the progress checkpoint of each message (so what a client saw is always
recoverable), and the XACK of requests that ended."""

from __future__ import annotations

from dataclasses import dataclass, field

import redis.asyncio as aioredis

from engine.protocol import Keys, OutputMessage, encode_outputs


@dataclass(slots=True)
class Outbox:
    """Messages of one step, grouped by gateway, plus the stream entries to acknowledge."""

    by_gateway: dict[str, list[OutputMessage]] = field(default_factory=dict)
    ended: list[tuple[str, str]] = field(default_factory=list)  # (request id, entry id)
    ack_only: list[str] = field(default_factory=list)

    def add(self, gateway: str, message: OutputMessage) -> None:
        self.by_gateway.setdefault(gateway, []).append(message)

    def end(self, request_id: str, entry_id: str) -> None:
        """The request is over: acknowledge its entry and drop its checkpoint."""
        self.ended.append((request_id, entry_id))

    def __bool__(self) -> bool:
        return bool(self.by_gateway or self.ended or self.ack_only)


async def flush(client: aioredis.Redis, keys: Keys, outbox: Outbox, progress_ttl_s: int) -> None:
    """Send an outbox in one transaction."""
    if not outbox:
        return
    ended = {request_id for request_id, _ in outbox.ended}
    async with client.pipeline(transaction=True) as pipe:
        for gateway, messages in outbox.by_gateway.items():
            pipe.publish(keys.out(gateway), encode_outputs(messages))
            for message in messages:
                if message.id not in ended:
                    key = keys.progress(message.id)
                    pipe.rpush(key, message.encode())
                    pipe.expire(key, progress_ttl_s)
        if ended:
            pipe.delete(*(keys.progress(request_id) for request_id in ended))
        entry_ids = [entry_id for _, entry_id in outbox.ended] + outbox.ack_only
        if entry_ids:
            pipe.xack(keys.requests, keys.group, *entry_ids)
        await pipe.execute()
