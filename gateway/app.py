"""`create_app(config)`: the aiohttp application. No module-level state: the Redis client,
the broker and its single listener task live in the app and die with it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import redis.asyncio as aioredis
from aiohttp import web
from aiohttp.typedefs import Middleware
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from engine.protocol import Keys
from gateway.api.misc_routes import add_routes as add_misc_routes
from gateway.api.openai_routes import add_routes as add_openai_routes
from gateway.broker.broker import Broker
from gateway.broker.engines import EngineRegistry
from gateway.config import GatewayConfig
from gateway.errors import Handler, auth_middleware, error_middleware
from gateway.metrics import GatewayMetrics
from gateway.state import BROKER, CONFIG, METRICS, REGISTRY
from gateway.ui.routes import add_routes as add_ui_routes


async def _redis_ctx(app: web.Application) -> AsyncIterator[None]:
    """Redis client, broker, engine registry and the listener task for the app's lifetime."""
    cfg = app[CONFIG]
    # short retries: when Redis is down a client should get its 503 fast, not after seconds
    retry = Retry(ExponentialBackoff(cap=0.5, base=0.05), retries=2)
    client = aioredis.Redis.from_url(cfg.redis_url, socket_connect_timeout=2.0, socket_timeout=10.0,
                                     health_check_interval=10, retry=retry)
    keys = Keys(cfg.redis_prefix)
    broker = Broker(client, keys, cfg.gateway_id)
    app[BROKER] = broker
    app[REGISTRY] = EngineRegistry(client, keys, cfg.models, cfg.engine_stale_s)
    listener = asyncio.create_task(broker.listen(), name=f"listener-{cfg.gateway_id}")
    yield
    listener.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await listener
    await client.aclose()


def _metrics_middleware(metrics: GatewayMetrics) -> Middleware:
    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        response = await handler(request)
        route = request.match_info.route.resource.canonical if request.match_info.route.resource else "other"
        metrics.http_requests.labels(route=route, status=str(response.status)).inc()
        return response

    return middleware


def create_app(config: GatewayConfig) -> web.Application:
    """The gateway application for `config`."""
    metrics = GatewayMetrics()
    app = web.Application(
        client_max_size=config.max_body_bytes,
        middlewares=[_metrics_middleware(metrics), error_middleware, auth_middleware(config.api_keys)],
    )
    app[CONFIG] = config
    app[METRICS] = metrics
    app.cleanup_ctx.append(_redis_ctx)
    add_openai_routes(app)
    add_misc_routes(app)
    add_ui_routes(app)
    return app
