"""`create_app(config)`: the aiohttp application. No module-level state: the Redis client,
the broker and its single listener task live in the app and die with it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import redis.asyncio as aioredis
from aiohttp import web
from aiohttp.typedefs import Middleware
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from common.protocol import Keys
from common.redis_conn import MeteredPool, ReplicaAck, pooled_client, single_client
from common.shutdown import shut_down
from gateway.api.embeddings import add_routes as add_embedding_routes
from gateway.api.lora_routes import add_routes as add_lora_routes
from gateway.api.misc_routes import add_routes as add_misc_routes
from gateway.api.offload import cpu_pool_ctx
from gateway.api.openai_routes import add_routes as add_openai_routes
from gateway.api.ratelimit import install as install_rate_limits
from gateway.api.responses_api import add_routes as add_responses_routes
from gateway.broker.broker import Broker
from gateway.broker.engines import EngineRegistry
from gateway.broker.router import Router
from gateway.broker.watch import Watch
from gateway.config import GatewayConfig
from gateway.drain import Drain
from gateway.errors import Handler, auth_middleware, error_middleware
from gateway.metrics import GatewayMetrics
from gateway.state import BROKER, CONFIG, DRAIN, METRICS, REGISTRY
from gateway.ui.routes import add_routes as add_ui_routes


async def _redis_ctx(app: web.Application) -> AsyncIterator[None]:
    """Redis clients, broker, engine registry, the reader and watch tasks for the app's lifetime."""
    cfg = app[CONFIG]
    # short retries: when Redis is down a client should get its 503 fast, not after seconds
    retry = Retry(ExponentialBackoff(cap=0.5, base=0.05), retries=2)
    options: dict[str, Any] = {"socket_connect_timeout": 2.0, "socket_timeout": 10.0,
                               "health_check_interval": 10, "retry": retry}
    spec = cfg.redis_spec
    if cfg.redis_pool == "plain" and spec.mode == "url":  # redis-py's plain pool, kept to measure against
        client = aioredis.Redis.from_url(spec.url, max_connections=cfg.redis_pool_size, **options)
    else:
        client = pooled_client(spec, cfg.redis_pool_size, cfg.redis_pool_timeout_s, **options)
    # the output reader blocks on XREAD: its own connection, named so operators (and tests) can find it
    def new_reader() -> aioredis.Redis:
        return single_client(spec, socket_connect_timeout=2.0, socket_timeout=10.0,
                             client_name=f"{cfg.redis_prefix}-out-{cfg.gateway_id}")

    keys = Keys(cfg.redis_prefix)
    broker = Broker(client, keys, cfg.gateway_id, new_reader(), cfg.max_queued_per_model, new_reader,
                    ack=ReplicaAck.of(spec), mode=spec.mode)
    registry = EngineRegistry(client, keys, cfg.models, cfg.engine_stale_s)
    app[BROKER] = broker
    app[REGISTRY] = registry
    if cfg.routing:
        broker.use_router(router := Router(keys, cfg.route_load_slack), registry)
        app[METRICS].watch_router(router)
    pool = getattr(client, "connection_pool", None)  # a cluster client has one per node
    if isinstance(pool, MeteredPool):
        app[METRICS].watch_pool(pool)
    # the liveness key's refresh must not queue behind a burst in the pool: a connection of its own
    liveness = single_client(spec, socket_connect_timeout=2.0, socket_timeout=10.0,
                             client_name=f"{cfg.redis_prefix}-live-{cfg.gateway_id}")
    watch = Watch(broker, registry, cfg.watch_interval_s, cfg.orphan_after_s, liveness_client=liveness)
    tasks = [asyncio.create_task(broker.supervise(), name=f"reader-{cfg.gateway_id}"),
             asyncio.create_task(watch.run(), name=f"watch-{cfg.gateway_id}")]
    yield
    await _shut(tasks, broker, watch, client, keys.gateway(cfg.gateway_id), keys.out(cfg.gateway_id))


async def _shut(tasks: list[asyncio.Task[None]], broker: Broker, watch: Watch, client: aioredis.Redis,
                *keys: str) -> None:
    """Stop the loops, drop this gateway's keys, close every connection, each step bounded."""
    broker.stop()
    watch.stopped = True
    await shut_down("gateway", tasks, [client.delete(*keys), broker.reader.aclose(),
                                       watch.liveness_client.aclose(close_connection_pool=True),
                                       client.aclose(close_connection_pool=True)])


def _metrics_middleware(metrics: GatewayMetrics) -> Middleware:
    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        response = await handler(request)
        route = request.match_info.route.resource.canonical if request.match_info.route.resource else "other"
        metrics.http_requests.labels(route=route, status=str(response.status)).inc()
        return response

    return middleware


def create_app(config: GatewayConfig) -> web.Application:
    """The gateway application for `config`; RateLimitConfigError (a ValueError) when its rate
    limits file is bad."""
    metrics = GatewayMetrics()
    app = web.Application(
        client_max_size=config.max_body_bytes,
        middlewares=[_metrics_middleware(metrics), error_middleware, auth_middleware(config.api_keys)],
    )
    app[CONFIG] = config
    app[METRICS] = metrics
    app[DRAIN] = drain = Drain()
    app.on_response_prepare.append(drain.close_connections)
    app.cleanup_ctx.append(cpu_pool_ctx)
    app.cleanup_ctx.append(_redis_ctx)
    if config.rate_limits_path:  # after the Redis context: the limiter uses its client
        install_rate_limits(app, config.rate_limits_path)
    add_openai_routes(app)
    add_embedding_routes(app)
    add_responses_routes(app)
    add_misc_routes(app)
    add_lora_routes(app)
    add_ui_routes(app)
    return app
