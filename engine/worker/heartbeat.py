"""The engine heartbeat: a Redis hash with a TTL carrying what gateways need (model name,
tokenizer directory, max_model_len, the model's identity), the engine's figures and a
block-pool snapshot.

It runs from its own task on cached figures, so a long step never silences it. It also
tells the worker when its key may have expired (a frozen process, a Redis outage): then
other engines may have taken its requests over, and ownership must be checked before the
worker publishes anything again."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from common.engine_set import queue_beat, queue_removal, read_heartbeats
from common.protocol import EngineHeartbeat, Keys, ProtocolError
from common.redis_slots import SlotBatch


def flatten_stats(stats: dict[str, Any]) -> dict[str, float]:
    """Numbers only: nested counters become `preemptions_swap`, `finished_stop`, ..."""
    flat: dict[str, float] = {}
    for key, value in stats.items():
        if isinstance(value, dict):
            flat.update({f"{key}_{k}": float(v) for k, v in value.items()})
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            flat[key] = float(value)
    return flat


_SAMPLE = 1 << 20
_WEIGHTS = (".safetensors", ".bin", ".gguf", ".pt")


def _sample_file(digest: Any, path: Path) -> None:
    """Size, first and last MiB of a weights file: different checkpoints of one architecture
    differ there, and reading a whole multi-GB file at every start would be too slow."""
    size = path.stat().st_size
    digest.update(f"{path.name}:{size}".encode())
    with open(path, "rb") as f:
        digest.update(f.read(_SAMPLE))
        if size > 2 * _SAMPLE:
            f.seek(size - _SAMPLE)
            digest.update(f.read(_SAMPLE))


def model_config_hash(model_dir: str) -> str:
    """A short hash of what decides a model's answers: config, tokenizer and (sampled) weights."""
    digest = hashlib.blake2b(digest_size=8)
    root = Path(model_dir)
    if root.is_file():  # a .gguf file
        _sample_file(digest, root)
        return digest.hexdigest()
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        path = root / name
        if path.is_file():
            digest.update(name.encode() + b"\0" + path.read_bytes())
    for path in sorted(p for p in root.iterdir() if p.suffix in _WEIGHTS and p.is_file()):
        _sample_file(digest, path)
    return digest.hexdigest()


class Heartbeat:
    """Writes the heartbeat hash (`Keys.engine`) and the liveness key in the model's slot
    (`Keys.alive`) with a TTL of `ttl_s`, and its member of ``{prefix}:engines``; `last_ok` is
    when a write last succeeded (monotonic), `suspect` is set when the key may have expired in
    between (and cleared by `ownership_checked`: only this object writes it).

    With a `routed_block_size` the engine reads its own routed stream and each beat announces
    it with the cached keys (by that block size); None: no routing. `loras` are the adapters
    served at start; `engine.worker.lora_sync` replaces them at run time."""

    def __init__(self, client: aioredis.Redis, keys: Keys, engine_id: str, model: str, tokenizer: str,
                 max_model_len: int, ttl_s: float, config_hash: str = "", vocab_size: int = 0,
                 runner: str = "generate",
                 reasoning_parser: str = "", routed_block_size: int | None = None,
                 loras: list[str] | None = None) -> None:
        self.client = client
        self.keys = keys
        self.key = keys.engine(engine_id)
        self.alive_key = keys.alive(model, engine_id)  # what takeovers check and flushes are fenced on
        self.engine_id = engine_id
        self.model = model
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.config_hash = config_hash
        self.vocab_size = vocab_size
        self.runner = runner
        self.reasoning_parser = reasoning_parser  # --reasoning-parser, passed on to gateways
        self.ttl_s = ttl_s
        self.ttl_ms = max(1000, int(ttl_s * 1000))
        self.started = time.time()
        self.draining = False
        self.last_ok = -1e9
        self._suspect = False
        self.beats = 0
        self.routed_block_size = routed_block_size
        self.loras: list[str] = list(loras or [])  # the LoRA adapters it serves over `model`
        self.lora_errors: dict[str, str] = {}  # adapters of `Keys.loras` it could not load, and why

    def build(self, stats: dict[str, Any], pool: list[list[int]], extra: dict[str, float]) -> EngineHeartbeat:
        """`stats` may carry ``block_tables`` and ``cached_keys`` (lists, so `flatten_stats`
        leaves them out); with a `routed_block_size` the beat announces ``routed`` and those keys."""
        now = time.time()
        figures = flatten_stats(stats) | extra | {"uptime_s": now - self.started}
        routed = self.routed_block_size is not None
        return EngineHeartbeat(engine_id=self.engine_id, model=self.model, tokenizer=self.tokenizer,
                               max_model_len=self.max_model_len, time=now, stats=figures, pool=pool,
                               tables=list(stats.get("block_tables", [])), config_hash=self.config_hash,
                               vocab_size=self.vocab_size,
                               draining=self.draining, routed=routed, block_size=self.routed_block_size or 0,
                               cached=list(stats.get("cached_keys", [])) if routed else [],
                               runner=self.runner, reasoning_parser=self.reasoning_parser,
                               loras=list(self.loras), lora_errors=dict(self.lora_errors))

    def fresh(self, margin_s: float) -> bool:
        """The key certainly still exists (written less than ttl - margin ago, no gap since)."""
        return not self._suspect and time.monotonic() - self.last_ok < self.ttl_s - margin_s

    async def beat(self, stats: dict[str, Any], pool: list[list[int]], extra: dict[str, float]) -> None:
        """Replace the hash (stale stat fields disappear), set its TTL and score this engine
        in the set of live engines, atomically (`common.engine_set`)."""
        heartbeat = self.build(stats, pool, extra)
        sent = time.monotonic()
        batch = SlotBatch(self.client)
        queue_beat(batch, self.keys, heartbeat, self.ttl_ms)
        await batch.execute()
        if self.beats and sent - self.last_ok >= self.ttl_s:
            self._suspect = True  # the key may have expired meanwhile: others may own our work now
        self.last_ok = sent
        self.beats += 1

    @property
    def suspect(self) -> bool:
        """The key may have expired since the last ownership check: others may own our work now."""
        return self._suspect

    def ownership_checked(self) -> None:
        """The worker rewrote the key and dropped what others took over: trusted again."""
        self._suspect = False

    async def conflicts(self) -> list[str]:
        """Live engines announcing this model name with other weights, tokenizer or length."""
        found = []
        for raw in await read_heartbeats(self.client, self.keys, None):
            try:
                other = EngineHeartbeat.from_hash(raw)
            except ProtocolError:
                continue  # not a heartbeat an engine wrote: it serves nothing
            if other.engine_id == self.engine_id or other.model != self.model:
                continue
            mine = (self.config_hash, self.vocab_size, self.max_model_len)
            if other.identity() != mine:
                found.append(f"{other.engine_id} {json.dumps(other.identity())} vs this {json.dumps(mine)}")
        return found

    async def remove(self) -> None:
        """A clean stop: the hash and the set member go at once."""
        batch = SlotBatch(self.client)
        queue_removal(batch, self.keys, self.engine_id, self.model)
        await batch.execute()
