"""Reasoning kept apart from the answer, end to end: a real engine process (`--reasoning-parser
qwen3`, announced in its heartbeat) serving a Qwen3-style model whose weights make greedy decoding
write ``<think>…</thi`` ``nk>`` then an answer with a tool call (tests/fixtures/scripted_model.py),
a real gateway process, real Redis, the official `openai` client. Whole and streamed answers keep
the thinking in `reasoning_content` / `reasoning` and out of `content`; with tools the call is read
from the answer; `enable_thinking: false` renders the template's closed think block, and the model
then answers at once, all content."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from openai import AsyncOpenAI

from pagedserve.launch.redis_server import RedisServer
from tests.e2e.support import EngineProcess, GatewayProcess, start_engines
from tests.fixtures.scripted_model import make_scripted_model_dir

MODEL = "qwen3-scripted"
QWEN3_TEMPLATE = (  # Qwen3's shape: tools rendered natively, enable_thinking false closes an empty think block
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
THOUGHT = "The user asks about the weather."
ANSWER = "Sure, checking."
CALL = '\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
SCRIPT = ["<think>", f"\n{THOUGHT}\n", "</thi", "nk>", "\n\n", ANSWER, "<tool_call>", CALL, "</tool_call>"]
RAW_ANSWER = f"{ANSWER}<tool_call>{CALL}</tool_call>"
TOOLS: list[Any] = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
ASK: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, EngineProcess]]:
    model_dir = make_scripted_model_dir(tmp_path_factory.mktemp("qwen3-scripted"), SCRIPT, QWEN3_TEMPLATE)
    logs = tmp_path_factory.mktemp("e2e-reasoning")
    with RedisServer() as server:
        [engine] = start_engines(model_dir, server.url, logs, ["reason-0"], "--served-model-name", MODEL,
                                 "--kv-cache-memory", "16MiB", "--reasoning-parser", "qwen3")
        gateway = GatewayProcess(server.url, "reason-gw", logs)
        try:
            gateway.wait_healthy()
            yield gateway.url, engine
        finally:
            gateway.stop()
            engine.stop()


def _client(url: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


async def _streamed(client: AsyncOpenAI, **args: Any) -> tuple[str, str, str, list[Any], list[str]]:
    """Joined reasoning, reasoning_content and content deltas, tool-call deltas, finish reasons."""
    reasoning = reasoning_content = content = ""
    calls: list[Any] = []
    reasons: list[str] = []
    async for chunk in await client.chat.completions.create(stream=True, **args):
        for c in chunk.choices:
            delta = c.delta
            assert "think>" not in (delta.content or ""), delta
            reasoning += getattr(delta, "reasoning", None) or ""
            reasoning_content += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
            calls.extend(delta.tool_calls or [])
            reasons += [c.finish_reason] if c.finish_reason else []
    return reasoning, reasoning_content, content, calls, reasons


async def test_thinking_apart_whole_and_streamed(stack: tuple[str, EngineProcess]) -> None:
    url, engine = stack
    beat = engine.heartbeat()
    assert beat is not None and beat.reasoning_parser == "qwen3"
    args: dict[str, Any] = {"model": MODEL, "messages": ASK, "temperature": 0, "max_tokens": 40}
    async with _client(url) as client:
        reply = await client.chat.completions.create(**args)
        message = reply.choices[0].message
        assert getattr(message, "reasoning_content", None) == getattr(message, "reasoning", None) == THOUGHT
        assert message.content == RAW_ANSWER and not message.tool_calls  # no tools: the answer as written
        assert reply.choices[0].finish_reason == "stop"
        assert reply.usage is not None and reply.usage.completion_tokens == len(SCRIPT) + 1  # + EOS

        reasoning, reasoning_content, content, _, reasons = await _streamed(client, **args)
        assert (reasoning, reasoning_content, content, reasons) == (THOUGHT, THOUGHT, RAW_ANSWER, ["stop"])
    engine.wait_drained()


async def test_tool_call_read_from_the_answer(stack: tuple[str, EngineProcess]) -> None:
    url, engine = stack
    args: dict[str, Any] = {"model": MODEL, "messages": ASK, "tools": TOOLS, "temperature": 0, "max_tokens": 40}
    async with _client(url) as client:
        reply = await client.chat.completions.create(**args)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == ANSWER
        assert getattr(choice.message, "reasoning_content", None) == THOUGHT
        assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []] == [  # type: ignore[union-attr]
            ("get_weather", '{"city": "Paris"}')]

        reasoning, _, content, calls, reasons = await _streamed(client, **args)
        assert (reasoning, content, reasons) == (THOUGHT, ANSWER, ["tool_calls"])
        assert calls[0].function.name == "get_weather"
        assert "".join(c.function.arguments or "" for c in calls) == '{"city": "Paris"}'
    engine.wait_drained()


async def test_enable_thinking_false(stack: tuple[str, EngineProcess]) -> None:
    url, engine = stack
    args: dict[str, Any] = {"model": MODEL, "messages": ASK, "temperature": 0, "max_tokens": 40,
                            "extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}
    async with _client(url) as client:
        reply = await client.chat.completions.create(**args)
        message = reply.choices[0].message
        assert message.content == RAW_ANSWER and getattr(message, "reasoning_content", "missing") is None
        reasoning, _, content, _, _ = await _streamed(client, **args)
        assert (reasoning, content) == ("", RAW_ANSWER)
        # the prompt the template rendered closes the thinking
    async with aiohttp.ClientSession() as http, http.post(f"{url}/tokenize", json={
            "model": MODEL, "messages": ASK, "chat_template_kwargs": {"enable_thinking": False},
            "return_token_strs": True}) as resp:
        tokens = await resp.json()
    assert "".join(tokens["token_strs"]).endswith("assistant\n<think>\n\n</think>\n\n")
    engine.wait_drained()
