"""POST /v1/responses (OpenAI's Responses API, as vLLM serves it), GET and DELETE
/v1/responses/{id}.

A request becomes the equivalent chat request (`responses_request`) and runs through the chat
route's machinery (`openai_routes.serve_generation`: drain, engine lookup, chat template, tool
and output grammars, rate limits); only the answer's shape differs: output items built by
`responses_events.OutputBuilder`, whole or as the Responses stream of typed events. With
`store` (the default) the response and its conversation go to Redis (`responses_store`), so a
`previous_response_id` continues it on any gateway."""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from gateway.api.body import read_json
from gateway.api.generation import Generation, GenerationError
from gateway.api.openai_routes import guarded, serve_generation
from gateway.api.responses import ENGINE_HEADER
from gateway.api.responses_events import Event, OutputBuilder, response_object, usage_obj
from gateway.api.responses_input import output_as_input
from gateway.api.responses_output import ResponseOutput
from gateway.api.responses_request import ResponsesRequest, parse_responses, previous_id, responses_param
from gateway.api.responses_store import ResponseStore
from gateway.api.sse import SSEStream
from gateway.api.streaming import ClientGone, check_client
from gateway.errors import OpenAIError
from gateway.state import BROKER, CONFIG
from gateway.text.tokenizer import ModelTokenizer

ID_PREFIX = "resp_"


def _store(request: web.Request) -> ResponseStore:
    cfg, broker = request.app[CONFIG], request.app[BROKER]
    return ResponseStore(broker.client, broker.keys, cfg.responses_ttl_s, cfg.responses_max_bytes)


async def create_response(request: web.Request) -> web.StreamResponse:
    return await guarded(request, lambda: _create(request))


async def _create(request: web.Request) -> web.StreamResponse:
    store = _store(request)
    try:
        body = await read_json(request)
        prev = previous_id(body)
        history = (await store.load(prev, "previous_response_id"))["conversation"] if prev else []
        req = parse_responses(body, history, request.app[CONFIG])

        async def render(gen: Generation, tokenizer: ModelTokenizer) -> tuple[web.StreamResponse, list[str]]:
            return await _answer(request, req, gen, tokenizer, store)

        return await serve_generation(request, req.chat, ID_PREFIX, render)
    except OpenAIError as exc:
        exc.param = responses_param(exc.param)
        raise


class _Answer:
    """One response being built: its output, the request fields it echoes, its finish."""

    def __init__(self, request: web.Request, req: ResponsesRequest, gen: Generation, tokenizer: ModelTokenizer,
                 store: ResponseStore) -> None:
        self.req, self.gen, self.store = req, gen, store
        self.out = ResponseOutput(req.chat, tokenizer)
        self.builder = OutputBuilder(first_seq=2)  # 0 and 1: response.created and response.in_progress
        self.created = int(time.time())

    def obj(self, status: str, usage: dict[str, Any] | None = None, error: dict[str, Any] | None = None,
            store: bool | None = None) -> dict[str, Any]:
        output = self.builder.output if status != "in_progress" else []
        return response_object(self.gen.request_id, self.req.echo, status, output, usage,
                               self.req.store if store is None else store, self.created, error)

    async def finish(self) -> tuple[list[Event], dict[str, Any]]:
        """The closing events and the final response, stored when asked for."""
        incomplete = self.out.finish_reason == "length"
        events = self.builder.finish(incomplete)
        usage = usage_obj(self.gen.usage, self.out.reasoning_tokens)
        final = self.obj("incomplete" if incomplete else "completed", usage)
        if self.req.store:
            conversation = [*self.req.history, *self.req.items, *output_as_input(self.builder.output)]
            final["store"] = await self.store.save(final, conversation)
        return events, final


async def _answer(request: web.Request, req: ResponsesRequest, gen: Generation, tokenizer: ModelTokenizer,
                  store: ResponseStore) -> tuple[web.StreamResponse, list[str]]:
    answer = _Answer(request, req, gen, tokenizer, store)
    if req.chat.stream:
        return await _stream(request, answer)
    async for ev in gen.events():
        check_client(request)
        if ev is not None:
            answer.builder.step(answer.out.feed(ev))
    _, final = await answer.finish()
    headers = {} if gen.engine is None else {ENGINE_HEADER: gen.engine}
    return web.json_response(final, headers=headers), [answer.out.finish_reason or "stop"]


async def _stream(request: web.Request, answer: _Answer) -> tuple[web.StreamResponse, list[str]]:
    """The Responses event stream. Raises GenerationError when the request fails before anything
    was sent; after that a failure is an `error` event and `response.failed`."""
    cfg, gen, builder = request.app[CONFIG], answer.gen, answer.builder
    sse = SSEStream(request, cfg.write_timeout_s)
    last_write = time.monotonic()

    async def send(events: list[Event]) -> None:
        if not sse.started:
            if gen.engine is not None:
                sse.response.headers[ENGINE_HEADER] = gen.engine
            await sse.start()
            opening = answer.obj("in_progress")
            events = [{"type": "response.created", "sequence_number": 0, "response": opening},
                      {"type": "response.in_progress", "sequence_number": 1, "response": opening}, *events]
        for event in events:
            await sse.send(event, event["type"])

    try:
        try:
            async for ev in gen.events():
                check_client(request)
                if ev is None:
                    if cfg.sse_keepalive_s > 0 and time.monotonic() - last_write >= cfg.sse_keepalive_s:
                        await send([])
                        await sse.comment()
                        last_write = time.monotonic()
                    continue
                events = builder.step(answer.out.feed(ev))
                if events:
                    await send(events)
                    last_write = time.monotonic()
        except GenerationError as exc:
            if not sse.started:
                raise
            info = exc.info
            failed = answer.obj("failed", error={"code": info.code or "server_error", "message": info.message},
                                store=False)
            await send([builder.event("error", code=info.code, message=info.message, param=None),
                        builder.event("response.failed", response=failed)])
        else:
            events, final = await answer.finish()
            await send([*events, builder.event(f"response.{final['status']}", response=final)])
        await sse.end()
    except (ClientGone, ConnectionResetError):
        pass  # Generation.close() aborts the request on the engine
    reasons = [answer.out.finish_reason] if answer.out.finish_reason is not None else []
    if not sse.started:
        return web.Response(status=499), reasons
    return sse.response, reasons


async def get_response(request: web.Request) -> web.Response:
    record = await _store(request).load(request.match_info["response_id"])
    return web.json_response(record["response"])


async def delete_response(request: web.Request) -> web.Response:
    response_id = request.match_info["response_id"]
    await _store(request).delete(response_id)
    return web.json_response({"id": response_id, "object": "response", "deleted": True})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/responses", create_response)
    app.router.add_get("/v1/responses/{response_id}", get_response)
    app.router.add_delete("/v1/responses/{response_id}", delete_response)
