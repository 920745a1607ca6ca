"""/v1/responses output shapes against a scripted engine (real gateway app, real Redis): a
reasoning parser's text becomes a `reasoning` item before the message (whole and streamed, in
the spec's event order), text and tool calls of an `auto` answer become a message and
`function_call` items, and an engine failure mid-stream is an `error` event then
`response.failed`. The engine announces the `deepseek_r1` reasoning parser (text before
`</think>` is reasoning), so the gateway's own parser splits the scripted text."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from aiohttp.test_utils import TestClient, TestServer

from common.protocol import ErrorInfo, Keys, SeqOutput
from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.state import BROKER
from gateway.text.tokenizer import ModelTokenizer
from tests.fixtures.gateway import MODEL, FakeEngine, Gateway

TOOLS = [{"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TEXT_EVENTS = ["response.output_item.added", "response.content_part.added", "response.output_text.delta"]


@pytest.fixture
async def gateway(redis_server: str, tiny_tokenizer_dir: Path) -> AsyncIterator[Gateway]:
    """A gateway and one scripted engine that announces the deepseek_r1 reasoning parser."""
    config = GatewayConfig(redis_url=redis_server, sse_ping_s=0.2, request_timeout_s=10.0)
    redis = aioredis.Redis.from_url(redis_server)
    app = create_app(config)
    try:
        async with TestClient(TestServer(app)) as client:
            gw = Gateway(client, FakeEngine(redis, Keys(config.redis_prefix), str(tiny_tokenizer_dir)), config, redis)
            await asyncio.wait_for(app[BROKER].subscribed.wait(), 5)
            gw.engine.max_model_len = 8192  # the fallback tool prompt is long in the near-byte-level tokenizer
            gw.engine.reasoning_parser = "deepseek_r1"
            await gw.engine.beat()
            yield gw
    finally:
        await redis.aclose()


async def _respond(gw: Gateway, body: dict[str, Any], text: str, finish: str = "stop") -> Any:
    """POST /v1/responses, the engine answering `text`; the JSON body, or the stream's events."""
    post = asyncio.create_task(gw.client.post("/v1/responses", json={"model": MODEL, **body}))
    req = await gw.engine.next_request()
    await gw.engine.generate(req, [text], finish=finish, chunk=3)
    resp = await post
    assert resp.status == 200, await resp.text()
    if not body.get("stream"):
        return await resp.json()
    raw = await resp.text()
    assert "[DONE]" not in raw
    blocks = [b for b in raw.split("\n\n") if b]
    events = [json.loads(b.split("data: ", 1)[1]) for b in blocks]
    assert [b.split("\n")[0] for b in blocks] == [f"event: {e['type']}" for e in events]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def _collapse(types: list[str]) -> list[str]:
    """Event types with runs of the same delta event folded into one."""
    return [t for i, t in enumerate(types) if not (t.endswith(".delta") and i and types[i - 1] == t)]


async def test_reasoning_item_comes_before_the_message(gateway: Gateway) -> None:
    body = await _respond(gateway, {"input": "hi"}, "think it over</think>The answer.")
    reasoning, message = body["output"]
    assert reasoning["type"] == "reasoning" and reasoning["summary"] == []
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "think it over"}]
    assert message["type"] == "message" and message["content"][0]["text"] == "The answer."
    assert body["status"] == "completed" and body["usage"]["output_tokens_details"]["reasoning_tokens"] > 0

    events = await _respond(gateway, {"input": "hi", "stream": True}, "think it over</think>The answer.")
    assert _collapse([e["type"] for e in events]) == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        *TEXT_EVENTS, "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed"]
    assert events[2]["item"]["type"] == "reasoning" and events[3]["part"] == {"type": "reasoning_text", "text": ""}
    thought = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    answer = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert thought == "think it over" and answer == "The answer."
    final = events[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["reasoning", "message"]
    assert {e["output_index"] for e in events if e["type"] == "response.reasoning_text.delta"} == {0}
    assert {e["output_index"] for e in events if e["type"] == "response.output_text.delta"} == {1}


async def test_auto_answer_with_text_and_a_call(gateway: Gateway) -> None:
    script = f"plan</think>Let me check.\n{CALL}"
    body = await _respond(gateway, {"input": "weather?", "tools": TOOLS}, script)
    assert [i["type"] for i in body["output"]] == ["reasoning", "message", "function_call"]
    call = body["output"][2]
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris"}
    assert call["call_id"].startswith("call_") and call["id"].startswith("fc_") and call["status"] == "completed"
    assert body["output"][1]["content"][0]["text"] == "Let me check."
    assert body["status"] == "completed" and body["tools"][0]["name"] == "get_weather"

    events = await _respond(gateway, {"input": "weather?", "tools": TOOLS, "stream": True}, script)
    types = _collapse([e["type"] for e in events])
    assert types[-5:] == ["response.output_item.added", "response.function_call_arguments.delta",
                          "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    added = events[-5]["item"]
    assert added["type"] == "function_call" and added["arguments"] == "" and added["status"] == "in_progress"
    assert events[-1]["response"]["output"][2]["arguments"] == events[-3]["arguments"] == call["arguments"]


async def test_length_cut_is_incomplete(gateway: Gateway) -> None:
    body = await _respond(gateway, {"input": "hi", "max_output_tokens": 5}, "x</think>abcd", finish="length")
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["output"][-1]["status"] == "incomplete" and body["max_output_tokens"] == 5


async def test_engine_error_mid_stream_fails_the_response(gateway: Gateway) -> None:
    post = asyncio.create_task(gateway.client.post("/v1/responses", json={"model": MODEL, "input": "hi",
                                                                           "stream": True}))
    req = await gateway.engine.next_request()
    ids = ModelTokenizer(gateway.engine.tokenizer_dir).encode("a</think>bc", add_special_tokens=False)
    await gateway.engine.publish(req, [SeqOutput(index=0, token_ids=ids, offset=0)])
    await gateway.engine.publish(req, [], error=ErrorInfo("the engine broke", "server_error", "engine_failed"))
    resp = await post
    events = [json.loads(b.split("data: ", 1)[1]) for b in (await resp.text()).split("\n\n") if b]
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2]["message"] == "the engine broke" and events[-2]["code"] == "engine_failed"
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"] == {"code": "engine_failed", "message": "the engine broke"}
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
