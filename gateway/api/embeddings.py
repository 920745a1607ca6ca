"""POST /v1/embeddings: each input becomes one `EngineRequest` with `pooling` set, XADDed to the
model's stream like any generation request; a pooling engine prefills it and answers with the
pooled vector, which the request's collector hands back. The response keeps the input order."""

from __future__ import annotations

import asyncio
import base64
import time
import uuid

from aiohttp import web
from redis.exceptions import RedisError

from common.pooling_params import embedding_floats
from common.protocol import EngineRequest
from common.redis_conn import PoolBusy
from common.sampling_params import SamplingParams
from gateway.api.body import read_json
from gateway.api.embedding_request import EmbeddingRequest, parse_embedding_request
from gateway.api.offload import off_loop
from gateway.api.openai_routes import find_model, guarded
from gateway.api.prompt import check_vocab
from gateway.api.ratelimit import admit
from gateway.broker.broker import Broker, BrokerUnavailable, QueueFull
from gateway.broker.collector import RequestCollector
from gateway.errors import OpenAIError, bad_request, redis_unavailable
from gateway.state import BROKER, CONFIG, METRICS, REGISTRY
from gateway.text.tokenizer import ModelTokenizer

_ERROR_STATUS = {"invalid_request_error": 400, "service_unavailable": 503, "timeout": 504}


def _token_ids(req: EmbeddingRequest, tokenizer: ModelTokenizer, max_model_len: int) -> list[list[int]]:
    """Each input's token ids (text tokenized), checked against the vocabulary and the context."""
    out = []
    for i, item in enumerate(req.inputs):
        ids = tokenizer.encode(item) if isinstance(item, str) else item
        if not ids:
            raise bad_request(f"'input[{i}]' has no tokens", "input")
        check_vocab(ids, tokenizer, "input")
        if max_model_len > 0 and len(ids) >= max_model_len:
            raise OpenAIError(400, f"'input[{i}]' has {len(ids)} tokens; this model's context takes at most "
                                   f"{max_model_len - 1}", "input", "context_length_exceeded")
        out.append(ids)
    return out


async def _vector(collector: RequestCollector, deadline: float) -> bytes:
    """The request's vector once its engine finished it; OpenAIError for an engine error or a timeout."""
    while True:
        update = await collector.next_update(max(0.0, deadline - time.monotonic()))
        if update is None and time.monotonic() >= deadline:
            raise OpenAIError(504, "request timed out", code="timeout")
        if update is None:
            continue
        if update.error is not None:
            info = update.error
            raise OpenAIError(_ERROR_STATUS.get(info.type, 500), info.message, None, info.code, info.type)
        if update.done:
            if update.embedding is None:
                raise OpenAIError(500, "the engine finished the request without a vector", code="engine_error")
            return update.embedding


async def _submit_all(broker: Broker, requests: list[EngineRequest]) -> list[RequestCollector]:
    collectors: list[RequestCollector] = []
    try:
        for engine_req in requests:
            collectors.append(await broker.submit(engine_req, 1))
    except BaseException:
        await _release(broker, collectors)
        raise
    return collectors


async def _release(broker: Broker, collectors: list[RequestCollector]) -> None:
    """Forget the collectors; stop on the engines what did not finish (an error, a client gone)."""
    unfinished = [c.request_id for c in collectors if not c.done]
    for collector in collectors:
        broker.release(collector.request_id)
    if unfinished:
        await broker.abort(unfinished, collectors[0].model)


async def embeddings(request: web.Request) -> web.StreamResponse:
    return await guarded(request, lambda: _embed(request))


async def _embed(request: web.Request) -> web.Response:
    cfg, broker, metrics = request.app[CONFIG], request.app[BROKER], request.app[METRICS]
    req = parse_embedding_request(await read_json(request))
    model = await find_model(request, req.model)
    if model.runner != "pooling":
        raise OpenAIError(400, f"the model '{model.name}' is served for generation, not embeddings (start its "
                               "engine with --runner pooling)", "model", "model_not_supported")
    tokenizer = await request.app[REGISTRY].tokenizer(model)
    token_lists = await off_loop(request.app, _token_ids, req, tokenizer, model.max_model_len)
    total = sum(len(ids) for ids in token_lists)
    await admit(request, total)
    now = time.time()
    params = SamplingParams(max_tokens=1)
    requests = [EngineRequest(id="embd-" + uuid.uuid4().hex, gateway=cfg.gateway_id, model=model.base,
                              prompt_token_ids=ids, params=params, arrival=now, deadline=now + cfg.request_timeout_s,
                              lora_name=model.lora_name, pooling=req.pooling) for ids in token_lists]
    try:
        collectors = await _submit_all(broker, requests)
    except BrokerUnavailable as exc:
        raise OpenAIError(503, str(exc), code=exc.code) from exc
    except (QueueFull, PoolBusy) as exc:
        metrics.rejected.labels(reason=type(exc).__name__).inc()
        raise OpenAIError(429, f"server busy: {exc}", code="overloaded",
                          headers={"Retry-After": str(cfg.retry_after_s)}) from exc
    except RedisError as exc:
        raise redis_unavailable(exc) from exc
    try:
        deadline = time.monotonic() + cfg.request_timeout_s
        vectors = await asyncio.gather(*(_vector(c, deadline) for c in collectors))
    finally:
        await _release(broker, collectors)
    data = [{"object": "embedding", "index": i,
             "embedding": base64.b64encode(v).decode() if req.encoding_format == "base64" else embedding_floats(v)}
            for i, v in enumerate(vectors)]
    return web.json_response({"object": "list", "data": data, "model": model.name,
                              "usage": {"prompt_tokens": total, "total_tokens": total}})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/embeddings", embeddings)
