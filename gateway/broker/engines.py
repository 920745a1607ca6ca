"""Which models are served: live engines' heartbeats (plus `--model NAME=DIR` overrides),
and the tokenizer of each model, loaded once per directory."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace

import redis.asyncio as aioredis

from common.engine_set import read_heartbeats
from common.log import get_logger
from common.protocol import EngineHeartbeat, Keys, ProtocolError
from gateway.text.tokenizer import ModelTokenizer

log = get_logger("gateway.engines")


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """A served model: its name, tokenizer directory, context length, owning engines; for a LoRA
    adapter, `parent` names its base model (whose request stream it goes to), else empty."""

    name: str
    tokenizer_dir: str
    max_model_len: int
    engines: tuple[str, ...]
    created: int
    runner: str = "generate"  # "pooling": served for /v1/embeddings only
    reasoning_parser: str = ""  # what its engines announce (--reasoning-parser): a name, "none" or ""
    parent: str = ""

    @property
    def base(self) -> str:
        """The model whose engines run it: the parent of an adapter, else itself."""
        return self.parent or self.name

    @property
    def lora_name(self) -> str:
        """The adapter the engines apply ("" for a base model)."""
        return self.name if self.parent else ""


class EngineRegistry:
    """Reads engine heartbeats from Redis (the set of live engines, then their hashes), cached
    for `cache_s` seconds."""

    def __init__(self, client: aioredis.Redis, keys: Keys, static_models: tuple[tuple[str, str], ...],
                 stale_s: float, cache_s: float = 1.0) -> None:
        self.client = client
        self.keys = keys
        self.static_models = dict(static_models)
        self.stale_s = stale_s
        self.cache_s = cache_s
        self._cached: list[EngineHeartbeat] = []
        self._cached_at = -1e9
        self._tokenizers: dict[str, ModelTokenizer] = {}
        self._tokenizer_lock = asyncio.Lock()
        self._refresh_lock = asyncio.Lock()  # one read at a time: a burst must not read once per request

    async def live_engines(self, refresh: bool = False) -> list[EngineHeartbeat]:
        """Heartbeats younger than `stale_s`. Raises RedisError when Redis is down."""
        if not refresh and time.monotonic() - self._cached_at < self.cache_s:
            return self._cached
        asked = time.monotonic()
        async with self._refresh_lock:
            if self._cached_at >= asked:  # refreshed by another caller while we waited
                return self._cached
            return await self._read()

    async def _read(self) -> list[EngineHeartbeat]:
        """The set of live engines (`common.engine_set`), pruned of members older than
        `stale_s`; no SCAN, whatever else the Redis holds."""
        hashes = await read_heartbeats(self.client, self.keys, self.stale_s)
        now = time.time()
        engines = []
        for raw in hashes:
            try:
                beat = EngineHeartbeat.from_hash(raw)
            except ProtocolError as exc:
                log.warning("bad heartbeat", error=str(exc))
                continue
            if now - beat.time <= self.stale_s:
                engines.append(beat)
        self._cached, self._cached_at = engines, time.monotonic()
        for name, ids in self.conflicts(engines).items():
            log.error("engines serve one model name with different weights/tokenizer/length", model=name,
                      engines=ids)
        return engines

    async def models(self, refresh: bool = False) -> dict[str, ModelInfo]:
        """Served models by name (only models with at least one live engine)."""
        by_name: dict[str, list[EngineHeartbeat]] = {}
        for beat in await self.live_engines(refresh):
            by_name.setdefault(beat.model, []).append(beat)
        models = {}
        for name, beats in sorted(by_name.items()):
            tokenizer_dir = self.static_models.get(name) or beats[0].tokenizer
            max_len = min((b.max_model_len for b in beats if b.max_model_len > 0), default=0)
            models[name] = ModelInfo(name, tokenizer_dir, max_len, tuple(b.engine_id for b in beats),
                                     int(min(b.time - b.stats.get("uptime_s", 0.0) for b in beats)), beats[0].runner,
                                     next((b.reasoning_parser for b in beats if b.reasoning_parser), ""))
        for base in list(models.values()):  # each LoRA adapter as a model of its own, parent = its base
            for lora in sorted({n for b in by_name[base.name] for n in b.loras}):
                if lora in models:
                    log.warning("lora adapter name shadowed by a model", lora=lora, parent=base.name)
                    continue
                engines = tuple(b.engine_id for b in by_name[base.name] if lora in b.loras)
                models[lora] = replace(base, name=lora, engines=engines, parent=base.name)
        return models

    @staticmethod
    def conflicts(engines: list[EngineHeartbeat]) -> dict[str, list[str]]:
        """Model names announced by engines that disagree on weights, tokenizer or length
        (failover between them would change answers): name -> engine ids."""
        by_name: dict[str, list[EngineHeartbeat]] = {}
        for beat in engines:
            by_name.setdefault(beat.model, []).append(beat)
        return {name: sorted(b.engine_id for b in beats) for name, beats in by_name.items()
                if len({b.identity() for b in beats}) > 1}

    async def find(self, name: str) -> ModelInfo | None:
        """The model called `name`; refreshes the cache once before giving up."""
        model = (await self.models()).get(name)
        return model if model is not None else (await self.models(refresh=True)).get(name)

    async def tokenizer(self, model: ModelInfo) -> ModelTokenizer:
        """The model's tokenizer, loaded off the event loop the first time."""
        cached = self._tokenizers.get(model.tokenizer_dir)
        if cached is not None:
            return cached
        async with self._tokenizer_lock:
            if model.tokenizer_dir not in self._tokenizers:
                loop = asyncio.get_running_loop()
                self._tokenizers[model.tokenizer_dir] = await loop.run_in_executor(
                    None, ModelTokenizer, model.tokenizer_dir)
            return self._tokenizers[model.tokenizer_dir]

