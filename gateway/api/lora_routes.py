"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's routes and bodies), fleet-wide:
the adapter goes into its base model's Redis hash (`Keys.loras`), which every engine of that model
applies within a heartbeat interval (`engine.worker.lora_sync`). A load answers once an engine
announces the adapter (200), or every live engine of the base said why it cannot (400, and the
entry is removed); an unload once no engine announces it any more."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from aiohttp import web
from redis.exceptions import RedisError

from gateway.api.body import read_json
from gateway.broker.engines import EngineRegistry, ModelInfo
from gateway.errors import OpenAIError, bad_request, redis_unavailable
from gateway.state import REGISTRY

WAIT_S = 60.0  # how long a load or unload waits for the engines to apply it
POLL_S = 0.2


async def load_lora_adapter(request: web.Request) -> web.Response:
    registry = request.app[REGISTRY]
    body = await _body(request)
    name, path = _text(body, "lora_name"), _text(body, "lora_path")
    try:
        models = await registry.models(refresh=True)
        if name in models:
            raise bad_request(f"The lora adapter '{name}' has already been loaded.", "lora_name", "lora_already_loaded")
        base = _base(models, body.get("model"))
        if not await registry.client.hsetnx(registry.keys.loras(base.name), name, path):
            raise bad_request(f"The lora adapter '{name}' is already being loaded.", "lora_name", "lora_already_loaded")
        try:
            await _until_loaded(registry, base.name, name)
        except BaseException:
            await registry.client.hdel(registry.keys.loras(base.name), name)
            raise
    except RedisError as exc:
        raise redis_unavailable(exc) from exc
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    registry = request.app[REGISTRY]
    name = _text(await _body(request), "lora_name")
    try:
        models = await registry.models(refresh=True)
        bases = {m.parent for m in models.values() if m.parent} | {m.name for m in models.values() if not m.parent}
        removed = [b for b in sorted(bases) if await registry.client.hdel(registry.keys.loras(b), name)]
        if not removed:
            if name in models and models[name].parent:
                raise bad_request(f"The lora adapter '{name}' was given at engine start-up (--lora-modules); "
                                  "it cannot be unloaded", "lora_name", "lora_static")
            raise OpenAIError(404, f"The lora adapter '{name}' cannot be found.", "lora_name", "lora_not_found")
        await _until(registry, lambda beats: not any(name in b.loras for b in beats if b.model in removed),
                     f"engines still serve '{name}' (it is removed once its running requests end)")
    except RedisError as exc:
        raise redis_unavailable(exc) from exc
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


async def _until_loaded(registry: EngineRegistry, base: str, name: str) -> None:
    """Until an engine of `base` serves `name`; 400 once every live one failed to load it."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        beats = [b for b in await registry.live_engines(refresh=True) if b.model == base]
        if any(name in b.loras for b in beats):
            return
        errors = [b.lora_errors[name] for b in beats if name in b.lora_errors]
        if beats and len(errors) == len(beats):
            raise bad_request(errors[0], "lora_path", "lora_invalid")
        await asyncio.sleep(POLL_S)
    raise OpenAIError(504, f"no engine of '{base}' loaded '{name}' within {WAIT_S:g} s", code="timeout")


async def _until(registry: EngineRegistry, done: Any, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if done(await registry.live_engines(refresh=True)):
            return
        await asyncio.sleep(POLL_S)
    raise OpenAIError(504, what, code="timeout")


def _base(models: dict[str, ModelInfo], asked: Any) -> ModelInfo:
    """The base model an adapter is loaded over: `model` in the body, else the only one served."""
    bases = {n: m for n, m in models.items() if not m.parent}
    if asked is not None:
        if not isinstance(asked, str) or asked not in bases:
            raise OpenAIError(404, f"the model '{asked}' does not exist", "model", "model_not_found")
        return bases[asked]
    if len(bases) != 1:
        raise bad_request(f"{len(bases)} models are served: name the base model in 'model'", "model",
                          "missing_required_parameter" if bases else "no_engine")
    return next(iter(bases.values()))


async def _body(request: web.Request) -> dict[str, Any]:
    body = await read_json(request)
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    return body


def _text(body: dict[str, Any], key: str) -> str:
    value = body.get(key)
    if not isinstance(value, str) or not value.strip() or len(value) > 4096:
        raise bad_request(f"'{key}' must be a non-empty string", key, "missing_required_parameter")
    return value


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/load_lora_adapter", load_lora_adapter)
    app.router.add_post("/v1/unload_lora_adapter", unload_lora_adapter)
