"""Stored /v1/responses responses in Redis, where every gateway finds them: one JSON string
per response (`Keys.response`) holding the response object and its whole conversation (the
previous conversation, this request's input items, the output as input items), with a TTL
(`--responses-ttl`). A record larger than `--responses-max-bytes`, or one Redis refuses, is
not kept: the response then says ``store: false``."""

from __future__ import annotations

import json
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from common.log import get_logger
from common.protocol import Keys
from gateway.errors import OpenAIError, redis_unavailable

log = get_logger("gateway")


def not_found(response_id: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(404, f"Response with id '{response_id[:100]}' not found.", param, "response_not_found")


class ResponseStore:
    """Save, load and delete stored responses (see the module docstring)."""

    def __init__(self, client: aioredis.Redis, keys: Keys, ttl_s: int, max_bytes: int) -> None:
        self.client = client
        self.keys = keys
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes

    @property
    def enabled(self) -> bool:
        return self.ttl_s > 0 and self.max_bytes > 0

    async def save(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> bool:
        """Keep `response` (whose `store` is true) and its conversation; False when it was not kept."""
        data = json.dumps({"response": response, "conversation": conversation}, ensure_ascii=False,
                          separators=(",", ":")).encode()
        if not self.enabled or len(data) > self.max_bytes:
            return False
        try:
            await self.client.set(self.keys.response(response["id"]), data, ex=self.ttl_s)
        except RedisError as exc:
            log.warning("cannot store a response", response_id=response["id"], error=str(exc))
            return False
        return True

    async def load(self, response_id: str, param: str | None = None) -> dict[str, Any]:
        """The stored record ``{"response", "conversation"}``; 404 naming `param` when there is none."""
        try:
            data = await self.client.get(self.keys.response(response_id))
        except RedisError as exc:
            raise redis_unavailable(exc) from exc
        if data is None:
            raise not_found(response_id, param)
        record: dict[str, Any] = json.loads(data)
        return record

    async def delete(self, response_id: str) -> None:
        """Forget a stored response; 404 when there is none."""
        try:
            removed = await self.client.delete(self.keys.response(response_id))
        except RedisError as exc:
            raise redis_unavailable(exc) from exc
        if not removed:
            raise not_found(response_id)
