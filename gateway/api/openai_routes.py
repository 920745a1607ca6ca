"""POST /v1/chat/completions and POST /v1/completions; `serve_generation`, the part of a
request every generating route shares (find the engine, tokenize, submit, hand the running
`Generation` to the route's renderer, count it), which /v1/responses reuses."""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable

from aiohttp import web
from redis.exceptions import RedisError

from common.protocol import EngineRequest
from common.redis_conn import PoolBusy
from gateway.api import reasoning
from gateway.api.body import read_json
from gateway.api.endpoint import Endpoint
from gateway.api.generation import Generation, GenerationError
from gateway.api.offload import off_loop
from gateway.api.prompt import prompt_ids
from gateway.api.ratelimit import admit
from gateway.api.streaming import ClientGone, complete, stream
from gateway.api.structured import check_structured
from gateway.api.validation import GenerationRequest, check_context, parse_request
from gateway.broker.broker import BrokerUnavailable, QueueFull
from gateway.broker.engines import ModelInfo
from gateway.errors import OpenAIError, redis_unavailable
from gateway.state import BROKER, CONFIG, DRAIN, METRICS, REGISTRY
from gateway.text.tokenizer import ModelTokenizer

_ERROR_STATUS = {"invalid_request_error": 400, "service_unavailable": 503, "timeout": 504}
# how a route answers a running generation: the response and the finish reasons it saw
Render = Callable[[Generation, ModelTokenizer], Awaitable[tuple[web.StreamResponse, list[str]]]]


async def find_model(request: web.Request, name: str) -> ModelInfo:
    """503 when Redis is down or no engine is alive, 404 when no engine serves `name`."""
    registry = request.app[REGISTRY]
    try:
        model = await registry.find(name)
        if model is None and not await registry.models():
            raise OpenAIError(503, "no engine is available", code="no_engine")
    except RedisError as exc:
        raise redis_unavailable(exc) from exc
    if model is None:
        raise OpenAIError(404, f"the model '{name}' does not exist", "model", "model_not_found")
    return model


async def guarded(request: web.Request, handler: Callable[[], Awaitable[web.StreamResponse]]
                  ) -> web.StreamResponse:
    """`handler()`, counted open until it answers. While the gateway drains its listener is
    closed: a request that still arrives came on an open connection and is served (the response
    closes the connection)."""
    with request.app[DRAIN].track():
        return await handler()


async def _generate(request: web.Request, kind: Endpoint) -> web.StreamResponse:
    return await guarded(request, lambda: _run_generation(request, kind))


async def _run_generation(request: web.Request, kind: Endpoint) -> web.StreamResponse:
    cfg = request.app[CONFIG]
    req = parse_request(await read_json(request), kind, cfg)

    async def render(gen: Generation, tokenizer: ModelTokenizer) -> tuple[web.StreamResponse, list[str]]:
        if req.stream:
            return await stream(request, req, gen, tokenizer, cfg)
        return await complete(request, req, gen, tokenizer)

    return await serve_generation(request, req, kind.id_prefix, render)


async def serve_generation(request: web.Request, req: GenerationRequest, id_prefix: str,
                           render: Render) -> web.StreamResponse:
    """Run a validated request on an engine and answer it with `render` (see the module docstring)."""
    start = time.monotonic()
    cfg, broker, metrics = request.app[CONFIG], request.app[BROKER], request.app[METRICS]
    if req.params.structured_output is not None:
        await off_loop(request.app, check_structured, req.params.structured_output, req.structured_param)
    model = await find_model(request, req.model)
    if model.runner == "pooling":
        raise OpenAIError(400, f"the model '{model.name}' is served for embeddings (runner pooling): use "
                               "/v1/embeddings, not text generation", "model", "model_not_supported")
    tokenizer = await request.app[REGISTRY].tokenizer(model)
    reasoning.choose(req, cfg, model, tokenizer)
    ids = await off_loop(request.app, prompt_ids, req, tokenizer)  # a 1 MB prompt takes a second
    reasoning.check_constraint(req)
    check_context(req, len(ids), model.max_model_len, cfg)
    await admit(request, len(ids) + req.params.n * req.params.max_tokens)  # per-key limits (429 over them)
    rid = id_prefix + uuid.uuid4().hex
    now = time.time()
    engine_req = EngineRequest(id=rid, gateway=cfg.gateway_id, model=model.base, prompt_token_ids=ids,
                               params=req.params, arrival=now,
                               deadline=now + cfg.request_timeout_s, lora_name=model.lora_name)
    try:
        collector = await broker.submit(engine_req, req.params.n)
    except BrokerUnavailable as exc:
        raise OpenAIError(503, str(exc), code=exc.code) from exc
    except (QueueFull, PoolBusy) as exc:  # overload, not an outage
        metrics.rejected.labels(reason=type(exc).__name__).inc()
        raise OpenAIError(429, f"server busy: {exc}", code="overloaded",
                          headers={"Retry-After": str(cfg.retry_after_s)}) from exc
    gen = Generation(broker, collector, tokenizer, req.stop, len(ids), cfg.request_timeout_s, cfg.sse_ping_s,
                     req.tools.active, req.tools.max_calls, reasoning.factory(req))
    metrics.in_flight.inc()
    try:
        try:
            response, reasons = await render(gen, tokenizer)
        except ClientGone:
            return web.Response(status=499)
        except GenerationError as exc:  # before the first byte of the response
            raise OpenAIError(_ERROR_STATUS.get(exc.info.type, 500), exc.info.message, None,
                              exc.info.code, exc.info.type) from exc
        if gen.finished:
            usage = gen.usage
            metrics.observe_request(reasons, usage.prompt_tokens, usage.completion_tokens, start,
                                    gen.first_token_at, time.monotonic())
            metrics.observe_served(model.name, gen.engine)
        return response
    finally:
        metrics.in_flight.dec()
        await gen.close()


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, Endpoint.CHAT)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, Endpoint.COMPLETION)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
