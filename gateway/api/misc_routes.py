"""GET /v1/models, GET /health, GET /metrics (and the tokenize routes' registration)."""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST
from redis.exceptions import RedisError

from gateway.api.tokenize_routes import add_routes as add_tokenize_routes
from gateway.broker.broker import BrokerUnavailable
from gateway.drain import DRAIN_CODE
from gateway.errors import OpenAIError, redis_unavailable
from gateway.state import BROKER, CONFIG, DRAIN, METRICS, REGISTRY


async def list_models(request: web.Request) -> web.Response:
    """Models served by at least one live engine, in OpenAI's list format."""
    try:
        models = await request.app[REGISTRY].models(refresh=True)
    except RedisError as exc:
        raise redis_unavailable(exc) from exc
    data = [{"id": m.name, "object": "model", "created": m.created, "owned_by": "pagedserve",
             "root": m.tokenizer_dir, "parent": m.parent or None, "max_model_len": m.max_model_len,
             "engines": len(m.engines), "runner": m.runner}
            for m in models.values()]
    return web.json_response({"object": "list", "data": data})


async def health(request: web.Request) -> web.Response:
    """200 when Redis answers, this gateway reads its output stream and at least one engine
    that is not draining can consume, else 503 with the reason (code "draining" while this
    gateway drains: load balancers stop sending). `gateway` is this gateway's id and
    `engine_ids` the consuming engines it sees (`pagedserve up`'s rolling restart waits on both).
    `redis` says which master is in use and whether
    writes are acknowledged by a replica."""
    broker = request.app[BROKER]
    if request.app[DRAIN].draining:
        raise OpenAIError(503, "the gateway is draining (shutting down)", code=DRAIN_CODE)
    if not await broker.ping():
        raise OpenAIError(503, "cannot reach Redis", code="redis_unavailable")
    try:
        await broker.sync_epoch()
        engines = [e for e in await request.app[REGISTRY].live_engines(refresh=True) if not e.draining]
    except BrokerUnavailable as exc:
        raise OpenAIError(503, str(exc), code=exc.code) from exc
    except RedisError as exc:
        raise redis_unavailable(exc) from exc
    if not broker.subscribed.is_set():
        raise OpenAIError(503, "not reading the output stream yet", code="redis_unavailable")
    if not engines:
        raise OpenAIError(503, "no live engine", code="no_engine")
    models: dict[str, list[str]] = {}
    for engine in engines:
        models.setdefault(engine.model, []).append(engine.engine_id)
    return web.json_response({"status": "ok", "gateway": request.app[CONFIG].gateway_id, "engines": len(engines),
                              "engine_ids": sorted(e.engine_id for e in engines), "models": sorted(models),
                              "conflicts": request.app[REGISTRY].conflicts(engines), "redis": broker.redis_status()})


async def metrics(request: web.Request) -> web.Response:
    body = request.app[METRICS].render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def add_routes(app: web.Application) -> None:
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    add_tokenize_routes(app)
