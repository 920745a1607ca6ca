"""Issue 24's tool_choice semantics end to end with the official `openai` client on SmolLM2
(a real engine process, an in-process gateway, real Redis), greedy, whole and streamed: a named
function or `parallel_tool_calls: false` is exactly one call, `required` one or more, each
answer ends with `finish_reason: "tool_calls"` well before max_tokens, `content` is null and
no ``<tool_call>`` markup reaches content (nor any streamed content delta), and every call's
arguments parse as JSON matching the function's schema. Skipped without the model."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from openai import AsyncOpenAI

from pagedserve.launch.redis_server import RedisServer
from tests.e2e.support import EngineProcess, serve_gateway, start_engines

SMOL = Path.home() / ".cache" / "pagedserve" / "models" / "SmolLM2-135M-Instruct"
MODEL = "smol"
WEATHER = {"type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]}
TOOLS: list[Any] = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                                     "parameters": WEATHER}}]
ASK: list[Any] = [{"role": "user", "content": "What's the weather like in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
CASES: list[tuple[str, Any, bool | None, bool]] = [  # id, tool_choice, parallel_tool_calls, exactly one call
    ("named", NAMED, None, True),
    ("named-no-parallel", NAMED, False, True),
    ("required", "required", None, False),
    ("required-no-parallel", "required", False, True),
]

pytestmark = pytest.mark.skipif(not (SMOL / "config.json").is_file(), reason="SmolLM2 is not fetched")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, EngineProcess]]:
    with RedisServer() as server:
        [engine] = start_engines(SMOL, server.url, tmp_path_factory.mktemp("e2e-tool-choice"), ["tc-0"],
                                 "--served-model-name", MODEL, "--kv-cache-memory", "64MiB")
        try:
            yield server.url, engine
        finally:
            engine.stop()


def _args(tool_choice: Any, parallel: bool | None) -> dict[str, Any]:
    args: dict[str, Any] = {"model": MODEL, "messages": ASK, "tools": TOOLS, "tool_choice": tool_choice,
                            "temperature": 0, "max_tokens": 300}
    if parallel is not None:
        args["parallel_tool_calls"] = parallel
    return args


def _check(calls: list[tuple[str, str]], one: bool) -> None:
    assert len(calls) == 1 if one else len(calls) >= 1, calls
    for name, arguments in calls:
        assert name == "get_weather"
        jsonschema.validate(json.loads(arguments), WEATHER)


@pytest.mark.parametrize(("tool_choice", "parallel", "one"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
async def test_tool_choice_ends_with_calls(stack: tuple[str, EngineProcess], tool_choice: Any,
                                           parallel: bool | None, one: bool) -> None:
    redis_url, engine = stack
    async with serve_gateway(redis_url, request_timeout_s=600.0) as url, \
            AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300) as client:
        reply = await client.chat.completions.create(**_args(tool_choice, parallel))
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None, choice.message.content
        assert choice.message.tool_calls
        _check([(c.function.name, c.function.arguments) for c in choice.message.tool_calls], one)  # type: ignore[union-attr]
        assert reply.usage is not None and reply.usage.completion_tokens < 300

        stream = await client.chat.completions.create(stream=True, **_args(tool_choice, parallel))
        calls: dict[int, dict[str, str]] = {}
        content, reasons = "", []
        async for chunk in stream:
            for c in chunk.choices:
                if c.finish_reason:
                    reasons.append(c.finish_reason)
                content += c.delta.content or ""
                for tc in c.delta.tool_calls or []:
                    entry = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                    entry["name"] += (tc.function.name if tc.function else None) or ""
                    entry["arguments"] += (tc.function.arguments if tc.function else None) or ""
        assert reasons == ["tool_calls"] and content == "", (reasons, content)
        _check([(e["name"], e["arguments"]) for e in calls.values()], one)
        assert [(e["name"], e["arguments"]) for e in calls.values()] == [
            (c.function.name, c.function.arguments) for c in choice.message.tool_calls]  # type: ignore[union-attr]
    engine.wait_drained()


async def test_auto_still_answers(stack: tuple[str, EngineProcess]) -> None:
    """`auto` is unconstrained: whatever the model says, markup never shows as content when it
    parses as calls, and the finish reason matches what came back."""
    redis_url, engine = stack
    async with serve_gateway(redis_url, request_timeout_s=600.0) as url, \
            AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300) as client:
        reply = await client.chat.completions.create(**_args("auto", None))
        choice = reply.choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason in ("tool_calls", "length")
            assert "<tool_call>" not in (choice.message.content or "")
        else:
            assert choice.finish_reason in ("stop", "length") and choice.message.content
    engine.wait_drained()
