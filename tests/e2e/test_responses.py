"""/v1/responses end to end with the official `openai` client and the OpenAI Agents SDK: two
in-process gateways on one real Redis, a real engine process (tiny random Llama with a
4096-token context: the fallback tool prompt is long).

Plain and streamed responses (every event in the spec's order with consecutive sequence
numbers, the deltas adding up to the final text, the same text as the whole response), forced
tool calls through the grammar (function_call items whose arguments validate), a conversation
continued with `previous_response_id` on the other gateway (the same prompt as replaying it
by hand), json_schema output that validates, stored responses (GET, DELETE, store false, the
byte bound), errors as 4xx OpenAI bodies, and an Agents SDK agent that calls its tool."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import jsonschema
import openai
import pytest
import redis.asyncio as aioredis
from openai import AsyncOpenAI

from common.protocol import Keys
from pagedserve.launch.redis_server import RedisServer
from tests.e2e.agents_support import assert_called_once_and_answered, run_weather_agent
from tests.e2e.support import EngineProcess, serve_gateway, start_engines
from tests.fixtures.models import make_tiny_model_dir

MODEL = "tiny"
LONG = {"ignore_eos": True}
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS: list[Any] = [{"type": "function", "name": "get_weather", "description": "Weather", "parameters": WEATHER,
                     "strict": True}]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-long"), max_position_embeddings=4096)


@pytest.fixture(scope="module")
def stack(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, EngineProcess]]:
    with RedisServer() as server:
        [engine] = start_engines(model_dir, server.url, tmp_path_factory.mktemp("e2e-responses"), ["resp-0"],
                                 "--served-model-name", MODEL, "--kv-cache-memory", "8MiB")
        try:
            yield server.url, engine
        finally:
            engine.stop()


def _client(url: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


async def test_plain_response_and_get(stack: tuple[str, EngineProcess]) -> None:
    redis_url, engine = stack
    async with serve_gateway(redis_url) as url, _client(url) as client:
        resp = await client.responses.create(model=MODEL, input="Tell me a story.", instructions="Be brief.",
                                             max_output_tokens=8, temperature=0, extra_body=LONG)
        assert resp.id.startswith("resp_") and resp.object == "response"
        assert resp.status == "incomplete" and resp.incomplete_details is not None
        assert resp.incomplete_details.reason == "max_output_tokens"
        [item] = resp.output
        assert item.type == "message" and item.role == "assistant"
        assert [p.type for p in item.content] == ["output_text"]
        assert resp.output_text and resp.output_text == item.content[0].text  # type: ignore[union-attr]
        usage = resp.usage
        assert usage is not None and usage.output_tokens == 8 and usage.input_tokens > 0
        assert usage.total_tokens == usage.input_tokens + usage.output_tokens
        assert usage.input_tokens_details.cached_tokens >= 0 and usage.output_tokens_details.reasoning_tokens == 0
        assert resp.instructions == "Be brief." and resp.max_output_tokens == 8 and resp.store is True

        same = await client.responses.create(model=MODEL, instructions="Be brief.", max_output_tokens=8,
                                             temperature=0, extra_body=LONG, input=[
                                                 {"role": "user", "content": [{"type": "input_text",
                                                                               "text": "Tell me a story."}]}])
        assert same.output_text == resp.output_text  # a string input is one user message
        assert same.usage is not None and same.usage.input_tokens == usage.input_tokens

        got = await client.responses.retrieve(resp.id)
        assert got.id == resp.id and got.output_text == resp.output_text and got.status == "incomplete"
        await client.responses.delete(resp.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(resp.id)
        unstored = await client.responses.create(model=MODEL, input="hi", max_output_tokens=2, store=False)
        assert unstored.store is False
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(unstored.id)
    engine.wait_drained()


async def test_streamed_events(stack: tuple[str, EngineProcess]) -> None:
    redis_url, engine = stack
    async with serve_gateway(redis_url) as url, _client(url) as client:
        whole = await client.responses.create(model=MODEL, input="Count to ten.", max_output_tokens=12,
                                              temperature=0, extra_body=LONG)
        stream = await client.responses.create(model=MODEL, input="Count to ten.", max_output_tokens=12,
                                               temperature=0, extra_body=LONG, stream=True)
        events = [event async for event in stream]
    types = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) >= 1
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * len(deltas),
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    created, final = events[0].response, events[-1].response  # type: ignore[union-attr]
    assert created.status == "in_progress" and created.output == [] and created.id == final.id
    text = "".join(d.delta for d in deltas)  # type: ignore[union-attr]
    assert text == events[-4].text == final.output_text == whole.output_text  # type: ignore[union-attr]
    assert {d.item_id for d in deltas} == {final.output[0].id}  # type: ignore[union-attr]
    assert final.usage.output_tokens == 12 and final.incomplete_details.reason == "max_output_tokens"
    engine.wait_drained()


def _calls(output: list[Any]) -> list[Any]:
    calls = [item for item in output if item.type == "function_call"]
    assert calls and all(item.type in ("function_call", "reasoning") for item in output), output
    for call in calls:
        assert call.name == "get_weather" and call.call_id and call.status == "completed"
        jsonschema.validate(json.loads(call.arguments), WEATHER)
    return calls


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "get_weather"}],
                         ids=["required", "named"])
async def test_tool_calls_and_previous_response_on_another_gateway(stack: tuple[str, EngineProcess],
                                                                   tool_choice: Any) -> None:
    """A forced call (the grammar makes any sampled output a valid one), streamed the same way;
    then gateway B continues gateway A's stored response with the tool's output: the prompt is
    the one a client replaying the whole conversation builds, and so is the greedy answer."""
    redis_url, engine = stack
    ask = "What's the weather in Paris?"
    async with serve_gateway(redis_url) as url_a, serve_gateway(redis_url) as url_b, \
            _client(url_a) as a, _client(url_b) as b:
        first = await a.responses.create(model=MODEL, input=ask, tools=TOOLS, tool_choice=tool_choice,
                                         parallel_tool_calls=False, temperature=1.0, extra_body={"seed": 3},
                                         max_output_tokens=300)
        assert first.status == "completed"
        [call] = _calls(first.output)

        stream = await a.responses.create(model=MODEL, input=ask, tools=TOOLS, tool_choice=tool_choice,
                                          parallel_tool_calls=False, temperature=1.0, extra_body={"seed": 3},
                                          max_output_tokens=300, stream=True)
        events = [event async for event in stream]
        assert [e.type for e in events] == [
            "response.created", "response.in_progress", "response.output_item.added",
            "response.function_call_arguments.delta", "response.function_call_arguments.done",
            "response.output_item.done", "response.completed"]
        assert events[2].item.type == "function_call" and events[2].item.arguments == ""  # type: ignore[union-attr]
        assert events[3].delta == events[4].arguments == call.arguments  # type: ignore[union-attr]  # same seed
        assert events[5].item.call_id == events[6].response.output[0].call_id  # type: ignore[union-attr]

        result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "clear"}'}
        follow = await b.responses.create(model=MODEL, previous_response_id=first.id, input=[result],
                                          tools=TOOLS, tool_choice="none", temperature=0, max_output_tokens=6,
                                          extra_body=LONG)
        assert follow.previous_response_id == first.id and follow.output[0].type == "message"
        replay = await b.responses.create(model=MODEL, tools=TOOLS, tool_choice="none", temperature=0,
                                          max_output_tokens=6, extra_body=LONG, store=False, input=[
                                              {"role": "user", "content": ask},
                                              {"type": "function_call", "call_id": call.call_id, "name": call.name,
                                               "arguments": call.arguments}, result])
        assert follow.usage is not None and replay.usage is not None
        alone = await b.responses.create(model=MODEL, input=[result], tools=TOOLS, tool_choice="none",
                                         max_output_tokens=1, store=False)  # type: ignore[list-item]
        assert alone.usage is not None
        assert follow.usage.input_tokens == replay.usage.input_tokens > alone.usage.input_tokens
        assert follow.output_text == replay.output_text
        got = await b.responses.retrieve(first.id)  # stored by A, read through B
        assert got.output[0].call_id == call.call_id  # type: ignore[union-attr]
    engine.wait_drained()


async def test_json_schema_output_validates(stack: tuple[str, EngineProcess]) -> None:
    redis_url, engine = stack
    fmt: Any = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    async with serve_gateway(redis_url) as url, _client(url) as client:
        for seed in range(3):
            resp = await client.responses.create(model=MODEL, input="Describe a person as JSON.", text={"format": fmt},
                                                 temperature=1.0, extra_body={"seed": seed}, max_output_tokens=200)
            assert resp.status == "completed"
            jsonschema.validate(json.loads(resp.output_text), PERSON)
            assert resp.text is not None and resp.text.format.type == "json_schema"
        obj = await client.responses.create(model=MODEL, input="JSON please", temperature=1.0, extra_body={"seed": 9},
                                            max_output_tokens=300, text={"format": {"type": "json_object"}})
        assert isinstance(json.loads(obj.output_text), dict)
    engine.wait_drained()


BAD: list[tuple[dict[str, Any], str]] = [  # body (model added), the param the error names
    ({"input": 5}, "input"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0]"),
    ({"input": [{"role": "wizard", "content": "x"}]}, "input[0].role"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "tools": [{"type": "function", "name": "bad name!"}]}, "tools[0].name"),
    ({"input": "x", "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": "x", "max_output_tokens": -1}, "max_output_tokens"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "schema": 3}}}, "text.format"),
    ({"input": "x", "temperature": "hot"}, "temperature"),
    ({"input": "x", "previous_response_id": 7}, "previous_response_id"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "store": "yes"}, "store"),
]


async def test_errors_are_openai_4xx(stack: tuple[str, EngineProcess]) -> None:
    redis_url, _ = stack
    async with serve_gateway(redis_url) as url, _client(url) as client, aiohttp.ClientSession() as session:
        with pytest.raises(openai.NotFoundError) as info:
            await client.responses.create(model=MODEL, input="x", previous_response_id="resp_missing")
        assert info.value.body["code"] == "response_not_found"  # type: ignore[index]
        assert info.value.body["param"] == "previous_response_id"  # type: ignore[index]
        with pytest.raises(openai.BadRequestError):
            await client.responses.create(model=MODEL, input=[{"type": "item_reference", "id": "x"}])  # type: ignore[list-item]
        for body, param in BAD:
            async with session.post(f"{url}/v1/responses", json={"model": MODEL, **body}) as resp:
                error = (await resp.json())["error"]
                assert resp.status == 400, (body, error)
                assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, (body, error)
        for method in ("GET", "DELETE"):
            async with session.request(method, f"{url}/v1/responses/resp_nope") as resp:
                assert resp.status == 404 and (await resp.json())["error"]["code"] == "response_not_found"


async def test_byte_bound_and_ttl(stack: tuple[str, EngineProcess]) -> None:
    """A record past --responses-max-bytes is not kept (the response says store: false); a kept
    one expires after --responses-ttl."""
    redis_url, engine = stack
    async with serve_gateway(redis_url, responses_max_bytes=2000, responses_ttl_s=50) as url, _client(url) as client:
        small = await client.responses.create(model=MODEL, input="hi", max_output_tokens=2, temperature=0)
        large = await client.responses.create(model=MODEL, input="hi " * 400, max_output_tokens=2, temperature=0)
        assert small.store is True and large.store is False
        redis = aioredis.Redis.from_url(redis_url)
        try:
            assert 0 < await redis.ttl(Keys().response(small.id)) <= 50
            assert not await redis.exists(Keys().response(large.id))
        finally:
            await redis.aclose()
        assert (await client.responses.retrieve(small.id)).id == small.id
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(large.id)
    engine.wait_drained()


async def test_agents_sdk_runs_a_tool(stack: tuple[str, EngineProcess], model_dir: Path) -> None:
    """An Agents SDK agent over /v1/responses (tests/e2e/agents_support.py) on the random model."""
    redis_url, engine = stack
    async with serve_gateway(redis_url) as url, _client(url) as client:
        calls, result = await run_weather_agent(client, MODEL, model_dir, "Weather in Oslo?", temperature=1.0,
                                                max_tokens=100, extra_body={"seed": 5})
    assert_called_once_and_answered(calls, result)
    engine.wait_drained()
