"""POST /v1/chat/completions and POST /v1/completions."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from aiohttp import web
from redis.exceptions import RedisError

from engine.protocol import EngineRequest
from engine.redis_conn import PoolBusy
from gateway.api.endpoint import Endpoint
from gateway.api.generation import Generation, GenerationError
from gateway.api.streaming import ClientGone, complete, stream
from gateway.api.validation import GenerationRequest, check_context, parse_request
from gateway.broker.broker import BrokerUnavailable, QueueFull
from gateway.broker.engines import ModelInfo
from gateway.errors import OpenAIError, bad_request
from gateway.state import BROKER, CONFIG, METRICS, REGISTRY
from gateway.text.tokenizer import ModelTokenizer, TemplateError

_ERROR_STATUS = {"invalid_request_error": 400, "service_unavailable": 503, "timeout": 504}


async def read_json(request: web.Request) -> Any:
    """The body as JSON; 413 past the size limit, 400 when it is not JSON."""
    limit = request.app[CONFIG].max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        raise OpenAIError(413, f"request body too large (limit {limit} bytes)", code="request_too_large")
    raw = await request.read()
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise bad_request(f"request body is not valid JSON: {exc}", code="invalid_json") from exc


async def find_model(request: web.Request, name: str) -> ModelInfo:
    """503 when Redis is down or no engine is alive, 404 when no engine serves `name`."""
    registry = request.app[REGISTRY]
    try:
        model = await registry.find(name)
        if model is None and not await registry.models():
            raise OpenAIError(503, "no engine is available", code="no_engine")
    except RedisError as exc:
        raise OpenAIError(503, f"cannot reach Redis: {exc}", code="redis_unavailable") from exc
    if model is None:
        raise OpenAIError(404, f"the model '{name}' does not exist", "model", "model_not_found")
    return model


def prompt_ids(req: GenerationRequest, tokenizer: ModelTokenizer) -> list[int]:
    try:
        if req.kind is Endpoint.CHAT:
            return tokenizer.encode_chat(req.messages, **req.extra_template_args)
    except TemplateError as exc:
        raise bad_request(str(exc), "messages", "invalid_messages") from exc
    if isinstance(req.prompt, list):
        if any(t >= tokenizer.vocab_size for t in req.prompt):
            raise bad_request("prompt token id out of the vocabulary", "prompt")
        return req.prompt
    return tokenizer.encode(req.prompt)


async def _generate(request: web.Request, kind: Endpoint) -> web.StreamResponse:
    start = time.monotonic()
    cfg, broker, metrics = request.app[CONFIG], request.app[BROKER], request.app[METRICS]
    req = parse_request(await read_json(request), kind, cfg)
    model = await find_model(request, req.model)
    tokenizer = await request.app[REGISTRY].tokenizer(model)
    ids = prompt_ids(req, tokenizer)
    check_context(req, len(ids), model.max_model_len, cfg)
    rid = kind.id_prefix + uuid.uuid4().hex
    now = time.time()
    engine_req = EngineRequest(rid, cfg.gateway_id, model.name, ids, req.params.to_dict(), now,
                               now + cfg.request_timeout_s)
    try:
        collector = await broker.submit(engine_req, req.params.n)
    except BrokerUnavailable as exc:
        raise OpenAIError(503, str(exc), code="redis_unavailable") from exc
    except (QueueFull, PoolBusy) as exc:  # overload, not an outage
        metrics.rejected.labels(reason=type(exc).__name__).inc()
        raise OpenAIError(429, f"server busy: {exc}", code="overloaded",
                          headers={"Retry-After": str(cfg.retry_after_s)}) from exc
    gen = Generation(broker, collector, tokenizer, req.stop, len(ids), cfg.request_timeout_s, cfg.sse_ping_s)
    metrics.in_flight.inc()
    try:
        if req.stream:
            response, reasons = await stream(request, req, gen, tokenizer)
        else:
            try:
                response, reasons = await complete(request, req, gen, tokenizer)
            except ClientGone:
                return web.Response(status=499)
            except GenerationError as exc:
                raise OpenAIError(_ERROR_STATUS.get(exc.info.type, 500), exc.info.message, None,
                                  exc.info.code, exc.info.type) from exc
        if gen.finished:
            usage = gen.usage
            metrics.observe_request(reasons, usage.prompt_tokens, usage.completion_tokens, start,
                                    gen.first_token_at, time.monotonic())
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
