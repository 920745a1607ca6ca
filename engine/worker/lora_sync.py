"""The LoRA adapters loaded over this engine's model at run time: the Redis hash `Keys.loras`
(name -> PEFT folder, written by `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`) is
read every interval and applied on the engine thread: adapters new in the hash are added, those
gone from it removed (one still in use stays until its requests end; the next pass retries).
What it serves and what failed go out with the heartbeat (`loras`, `lora_errors`)."""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis

from common.log import get_logger
from common.protocol import Keys
from engine.sched.admission import RequestRejected
from engine.worker.engine_thread import EngineThread
from engine.worker.heartbeat import Heartbeat

log = get_logger("worker.lora")


class LoRASync:
    """Applies `Keys.loras(model)` to the engine; the `--lora-modules` adapters are never removed."""

    def __init__(self, client: aioredis.Redis, keys: Keys, model: str, thread: EngineThread, beat: Heartbeat) -> None:
        self.client, self.key, self.thread, self.beat = client, keys.loras(model), thread, beat
        self.added: dict[str, str] = {}  # name -> path of the adapters this sync added
        self.failed: dict[str, tuple[str, str]] = {}  # name -> (path, why) of those it could not add

    async def sync(self) -> None:
        """One pass: read the hash, add and remove, update the heartbeat's lists."""
        raw: dict[Any, Any] = await self.client.hgetall(self.key)
        wanted = {_text(k): _text(v) for k, v in raw.items()}
        engine = self.thread.engine
        served = set(await self.thread.call(engine.lora_names))
        for name, path in wanted.items():
            if self.added.get(name) == path or (name in served and name not in self.added):
                continue  # already served (a --lora-modules one keeps its own folder)
            if self.failed.get(name, ("", ""))[0] == path:
                continue
            try:
                if name in self.added:  # the same name with another folder: the old one goes first
                    await self.thread.call(engine.remove_lora, name)
                    del self.added[name]
                await self.thread.call(engine.add_lora, _request(name, path))
            except RequestRejected as exc:
                self.failed[name] = (path, str(exc))
                log.warning("lora adapter not loaded", lora=name, path=path, error=str(exc))
                continue
            self.added[name] = path
            self.failed.pop(name, None)
            log.info("lora adapter loaded", lora=name, path=path)
        for name in [n for n in self.added if n not in wanted]:
            try:
                await self.thread.call(engine.remove_lora, name)
            except RequestRejected:
                continue  # still in use: the next pass
            del self.added[name]
            log.info("lora adapter unloaded", lora=name)
        self.failed = {n: f for n, f in self.failed.items() if wanted.get(n) == f[0]}
        self.beat.loras = list(await self.thread.call(engine.lora_names))
        self.beat.lora_errors = {n: why for n, (_, why) in self.failed.items()}


def _request(name: str, path: str) -> Any:
    from engine.model.lora import LoRARequest

    return LoRARequest(name, 0, path)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
