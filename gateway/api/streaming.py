"""Turning a Generation into an HTTP response: SSE chunks (stream) or one JSON body."""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from engine.protocol import TokenLogprob
from gateway.api.endpoint import Endpoint
from gateway.api.generation import ChoiceEvent, Generation, GenerationError
from gateway.api.responses import (
    chat_chunk,
    chat_logprobs,
    completion_chunk,
    completion_logprobs,
    full_response,
    usage_chunk,
)
from gateway.api.sse import SSEStream
from gateway.api.validation import GenerationRequest
from gateway.text.tokenizer import ModelTokenizer


class ClientGone(Exception):
    """The HTTP client closed the connection."""


def _check_client(request: web.Request) -> None:
    if request.transport is None or request.transport.is_closing():
        raise ClientGone()


def _logprobs(req: GenerationRequest, tok: ModelTokenizer, ids: list[int], lps: list[TokenLogprob],
              offset: int) -> dict[str, Any] | None:
    if req.top_logprobs is None:
        return None
    if req.kind is Endpoint.CHAT:
        return chat_logprobs(tok, ids, lps, req.top_logprobs)
    return completion_logprobs(tok, ids, lps, req.top_logprobs, offset)


def _chunk(req: GenerationRequest, rid: str, created: int, ev: ChoiceEvent,
           logprobs: dict[str, Any] | None) -> dict[str, Any]:
    if req.kind is Endpoint.CHAT:
        delta = {"content": ev.text} if ev.text else {}
        return chat_chunk(rid, created, req.model, ev.index, delta, ev.finish_reason, logprobs, req.include_usage)
    return completion_chunk(rid, created, req.model, ev.index, ev.text, ev.finish_reason, logprobs,
                            req.include_usage)


async def stream(request: web.Request, req: GenerationRequest, gen: Generation,
                 tok: ModelTokenizer) -> tuple[web.StreamResponse, list[str]]:
    """SSE: role chunks, content deltas (finish_reason on the last), usage chunk, [DONE]."""
    sse = await SSEStream(request).start()
    rid, created = gen.request_id, int(time.time())
    offsets = [0] * req.params.n
    reasons: list[str] = []
    try:
        if req.kind is Endpoint.CHAT:
            for i in range(req.params.n):
                await sse.send(chat_chunk(rid, created, req.model, i, {"role": "assistant", "content": ""},
                                          include_usage=req.include_usage))
        try:
            async for ev in gen.events():
                _check_client(request)
                if ev is None:
                    await sse.ping()
                    continue
                logprobs = _logprobs(req, tok, ev.token_ids, ev.logprobs, offsets[ev.index])
                offsets[ev.index] += len(ev.text)
                await sse.send(_chunk(req, rid, created, ev, logprobs))
                if ev.finish_reason is not None:
                    reasons.append(ev.finish_reason)
        except GenerationError as exc:
            await sse.send({"error": {"message": exc.info.message, "type": exc.info.type, "param": None,
                                      "code": exc.info.code}})
        else:
            if req.include_usage:
                await sse.send(usage_chunk(req.kind, rid, created, req.model, gen.usage))
        await sse.done()
    except (ClientGone, ConnectionResetError):
        pass  # Generation.close() aborts the request on the engine
    return sse.response, reasons


async def complete(request: web.Request, req: GenerationRequest, gen: Generation,
                   tok: ModelTokenizer) -> tuple[web.Response, list[str]]:
    """Non-streaming: gather every choice, answer one JSON object. Raises GenerationError."""
    n = req.params.n
    texts, ids = [""] * n, [[] for _ in range(n)]  # type: list[str], list[list[int]]
    lps: list[list[TokenLogprob]] = [[] for _ in range(n)]
    reasons: list[str | None] = [None] * n
    async for ev in gen.events():
        _check_client(request)
        if ev is None:
            continue
        texts[ev.index] += ev.text
        ids[ev.index].extend(ev.token_ids)
        lps[ev.index].extend(ev.logprobs)
        reasons[ev.index] = ev.finish_reason or reasons[ev.index]
    choices = []
    for i in range(n):
        logprobs = _logprobs(req, tok, ids[i], lps[i], 0)
        if req.kind is Endpoint.CHAT:
            message = {"role": "assistant", "content": texts[i], "refusal": None}
            choices.append({"index": i, "message": message, "logprobs": logprobs, "finish_reason": reasons[i]})
        else:
            choices.append({"index": i, "text": texts[i], "logprobs": logprobs, "finish_reason": reasons[i]})
    body = full_response(req.kind, gen.request_id, int(time.time()), req.model, choices, gen.usage)
    return web.json_response(body), [r for r in reasons if r is not None]
