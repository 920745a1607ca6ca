"""Turning a Generation into an HTTP response: SSE chunks (stream) or one JSON body.

A stream's response starts with its first event (or its first keepalive comment, when they
are on): an engine error before that, such as an admission refusal, is raised as
GenerationError and becomes an ordinary JSON error with its 4xx status.

The serving engine's id: a whole response names it in the `x-pagedserve-engine` header and in
`system_fingerprint` ("pagedserve-<engine id>"); a stream in every chunk's `system_fingerprint`
from the first output on (a request resumed on another engine names the new one from then on),
and in the header when the engine was known as the response started (it starts with the first
output, unless an `--sse-keepalive` comment started it earlier)."""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from gateway.api.choice_output import ChoiceOutput, Piece
from gateway.api.endpoint import Endpoint
from gateway.api.generation import Generation, GenerationError
from gateway.api.responses import (
    ENGINE_HEADER,
    chat_chunk,
    completion_chunk,
    full_response,
    reasoning_fields,
    tool_call_deltas,
    tool_call_obj,
    usage_chunk,
    vllm_prompt_logprobs,
)
from gateway.api.sse import SSEStream
from gateway.api.validation import GenerationRequest
from gateway.config import GatewayConfig
from gateway.text.tokenizer import ModelTokenizer


class ClientGone(Exception):
    """The HTTP client closed the connection."""


def check_client(request: web.Request) -> None:
    if request.transport is None or request.transport.is_closing():
        raise ClientGone()


def _chunks(req: GenerationRequest, rid: str, created: int, index: int, piece: Piece,
            fingerprint: str | None) -> list[dict[str, Any]]:
    """The SSE chunks of one piece: logprobs on the first, finish_reason on the last."""
    usage = req.include_usage
    if req.kind is Endpoint.COMPLETION:
        return [completion_chunk(rid, created, req.model, index, piece.text, piece.finish_reason, piece.logprobs,
                                 usage, fingerprint)]
    first: dict[str, Any] = reasoning_fields(piece.reasoning) if piece.reasoning else {}
    if piece.text:
        first["content"] = piece.text
    deltas: list[dict[str, Any]] = [first] if first else []
    for k, call in enumerate(piece.calls):
        deltas.extend(tool_call_deltas(call, piece.first_call_index + k))
    deltas = deltas or [{}]
    return [chat_chunk(rid, created, req.model, index, delta, piece.finish_reason if i == len(deltas) - 1 else None,
                       piece.logprobs if i == 0 else None, usage, fingerprint) for i, delta in enumerate(deltas)]


async def stream(request: web.Request, req: GenerationRequest, gen: Generation, tok: ModelTokenizer,
                 cfg: GatewayConfig) -> tuple[web.StreamResponse, list[str]]:
    """SSE: role chunks, content and tool-call deltas (finish_reason on the last), usage, [DONE].
    Raises GenerationError when the request fails before anything was sent."""
    sse = SSEStream(request, cfg.write_timeout_s)
    rid, created = gen.request_id, int(time.time())
    outs = [ChoiceOutput(req, tok) for _ in range(req.params.n)]
    last_write = time.monotonic()

    async def start() -> None:
        if gen.engine is not None:
            sse.response.headers[ENGINE_HEADER] = gen.engine
        await sse.start()
        if req.kind is Endpoint.CHAT:
            for i in range(req.params.n):
                await sse.send(chat_chunk(rid, created, req.model, i, {"role": "assistant", "content": ""},
                                          include_usage=req.include_usage, fingerprint=gen.system_fingerprint))

    try:
        try:
            async for ev in gen.events():
                check_client(request)
                if ev is None:
                    if cfg.sse_keepalive_s > 0 and time.monotonic() - last_write >= cfg.sse_keepalive_s:
                        if not sse.started:
                            await start()
                        await sse.comment()
                        last_write = time.monotonic()
                    continue
                piece = outs[ev.index].feed(ev, gen.prompt_logprobs)
                if piece.empty:
                    continue
                if not sse.started:
                    await start()
                for chunk in _chunks(req, rid, created, ev.index, piece, gen.system_fingerprint):
                    await sse.send(chunk)
                last_write = time.monotonic()
        except GenerationError as exc:
            if not sse.started:
                raise
            await sse.send({"error": {"message": exc.info.message, "type": exc.info.type, "param": None,
                                      "code": exc.info.code}})
        else:
            if not sse.started:
                await start()
            if req.include_usage:
                await sse.send(usage_chunk(req.kind, rid, created, req.model, gen.usage, gen.system_fingerprint))
        await sse.done()
    except (ClientGone, ConnectionResetError):
        pass  # Generation.close() aborts the request on the engine
    reasons = [o.finish_reason for o in outs if o.finish_reason is not None]
    if not sse.started:  # the client left before anything was sent: nothing to prepare
        return web.Response(status=499), reasons
    return sse.response, reasons


async def complete(request: web.Request, req: GenerationRequest, gen: Generation,
                   tok: ModelTokenizer) -> tuple[web.Response, list[str]]:
    """Non-streaming: gather every choice, answer one JSON object. Raises GenerationError."""
    outs = [ChoiceOutput(req, tok) for _ in range(req.params.n)]
    async for ev in gen.events():
        check_client(request)
        if ev is not None:
            outs[ev.index].feed(ev, gen.prompt_logprobs)
    choices = []
    for i, out in enumerate(outs):
        logprobs = out.whole_logprobs(gen.prompt_logprobs)
        if req.kind is Endpoint.CHAT:
            calls_only = bool(out.calls) or req.tools.constrained  # a grammar made the answer calls
            content = None if (calls_only or out.reasoning) and not out.text else out.text
            message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
            if req.reasoning_parser is not None:
                message.update(reasoning_fields(out.reasoning or None))
            if out.calls:
                message["tool_calls"] = [tool_call_obj(c) for c in out.calls]
            choices.append({"index": i, "message": message, "logprobs": logprobs, "finish_reason": out.finish_reason})
        else:
            choices.append({"index": i, "text": out.text, "logprobs": logprobs, "finish_reason": out.finish_reason})
    body = full_response(req.kind, gen.request_id, int(time.time()), req.model, choices, gen.usage,
                         gen.system_fingerprint)
    if req.params.prompt_logprobs is not None and not req.echo:
        body["prompt_logprobs"] = vllm_prompt_logprobs(tok, req.prompt_token_ids, gen.prompt_logprobs,
                                                       req.params.prompt_logprobs)
    headers = {} if gen.engine is None else {ENGINE_HEADER: gen.engine}
    return web.json_response(body, headers=headers), [o.finish_reason for o in outs if o.finish_reason is not None]
