"""The engine heartbeat: a Redis hash with a TTL carrying what gateways need (model name,
tokenizer directory, max_model_len), the engine's figures and a block-pool snapshot."""

from __future__ import annotations

import time
from typing import Any

import redis.asyncio as aioredis

from engine.protocol import EngineHeartbeat, Keys


def flatten_stats(stats: dict[str, Any]) -> dict[str, float]:
    """Numbers only: nested counters become `preemptions_swap`, `finished_stop`, ..."""
    flat: dict[str, float] = {}
    for key, value in stats.items():
        if isinstance(value, dict):
            flat.update({f"{key}_{k}": float(v) for k, v in value.items()})
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            flat[key] = float(value)
    return flat


class Heartbeat:
    """Writes ``{prefix}:engine:<id>`` with a TTL of `ttl_s`."""

    def __init__(self, client: aioredis.Redis, keys: Keys, engine_id: str, model: str, tokenizer: str,
                 max_model_len: int, ttl_s: float) -> None:
        self.client = client
        self.key = keys.engine(engine_id)
        self.engine_id = engine_id
        self.model = model
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.ttl_ms = max(1000, int(ttl_s * 1000))
        self.started = time.time()

    def build(self, stats: dict[str, Any], pool: list[list[int]], extra: dict[str, float]) -> EngineHeartbeat:
        """`stats` may carry ``block_tables`` (a list, so `flatten_stats` leaves it out)."""
        now = time.time()
        figures = flatten_stats(stats) | extra | {"uptime_s": now - self.started}
        return EngineHeartbeat(self.engine_id, self.model, self.tokenizer, self.max_model_len, now, figures, pool,
                               list(stats.get("block_tables", [])))

    async def beat(self, stats: dict[str, Any], pool: list[list[int]], extra: dict[str, float]) -> None:
        """Replace the hash (stale stat fields disappear) and set its TTL, atomically."""
        fields = self.build(stats, pool, extra).to_hash()
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.delete(self.key)
            pipe.hset(self.key, mapping=fields)  # type: ignore[arg-type]
            pipe.pexpire(self.key, self.ttl_ms)
            await pipe.execute()

    async def remove(self) -> None:
        await self.client.delete(self.key)
