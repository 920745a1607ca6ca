"""Tool calling on the gateway, against a scripted engine: how tools reach the prompt (the
model's own template, or the fallback system prompt), the grammar sent for required and named
choices (sampled here through llguidance: every path it allows parses as a valid call), and how
calls in the output come back, whole and streamed, through the official `openai` client."""

from __future__ import annotations

import asyncio
import json
import random
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from llguidance import LLMatcher, LLTokenizer
from openai import AsyncOpenAI

from gateway.api.structured import llguidance_grammar
from gateway.text.tokenizer import ModelTokenizer
from gateway.text.tool_parser import ToolCallParser
from tests.fixtures.gateway import MODEL, Gateway, open_gateway

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
MSG = [{"role": "user", "content": "Weather in Paris?"}]
CALL_TEXT = 'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}' \
            "\n</tool_call>"
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTOOLS:{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} city={{ c.function.arguments.city }}{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture
async def gateway(redis_server: str, tiny_tokenizer_dir: Path) -> AsyncIterator[Gateway]:
    """A scripted engine with room for the tool prompts (the test tokenizer is nearly byte-level)."""
    async with open_gateway(redis_server, tiny_tokenizer_dir) as gw:
        gw.engine.max_model_len = 8192
        await gw.engine.beat()
        yield gw


def _client(gw: Gateway) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=str(gw.client.make_url("/v1")), api_key="x", max_retries=0, timeout=20)


async def _prompt_of(gw: Gateway, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """Send a chat request, read what reached the engine (decoded prompt, params), finish it."""
    post = asyncio.create_task(gw.client.post("/v1/chat/completions", json={"model": MODEL, **body}))
    req = await gw.engine.next_request()
    await gw.engine.generate(req, ["ok"])
    assert (await post).status == 200
    return ModelTokenizer(gw.engine.tokenizer_dir).decode(req.prompt_token_ids, False), req.params.to_dict()


async def test_fallback_prompt_lists_tools_and_rewrites_history(gateway: Gateway) -> None:
    history = [*MSG, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                      "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "22 degrees"}]
    prompt, params = await _prompt_of(gateway, {"messages": history, "tools": TOOLS})
    assert params["structured_output"] is None  # auto: free output, parsed afterwards
    assert prompt.startswith("<|im_start|>system\n# Tools") and "<tools>" in prompt
    assert json.dumps(TOOLS[1]) in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>' \
        in prompt
    assert "<|im_start|>user\n<tool_response>\n22 degrees\n</tool_response>" in prompt
    prompt, _ = await _prompt_of(gateway, {"messages": history, "tools": TOOLS, "tool_choice": "none"})
    assert "<tools>" not in prompt and "<tool_response>" in prompt  # none: history only


@pytest.fixture
async def tool_template_gateway(redis_server: str, tiny_tokenizer_dir: Path, tmp_path: Path
                                ) -> AsyncIterator[Gateway]:
    shutil.copy(tiny_tokenizer_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    config = json.loads((tiny_tokenizer_dir / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TOOL_TEMPLATE}))
    async with open_gateway(redis_server, tmp_path) as gw:
        gw.engine.max_model_len = 8192
        await gw.engine.beat()
        yield gw


async def test_template_that_knows_tools_renders_them(tool_template_gateway: Gateway) -> None:
    history = [*MSG, {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}]
    prompt, _ = await _prompt_of(tool_template_gateway, {"messages": history, "tools": TOOLS})
    assert "TOOLS: get_weather add" in prompt and "# Tools" not in prompt
    assert "CALL get_weather city=Oslo" in prompt  # arguments handed over as an object


def _sample_paths(grammar: str, tokenizer_json: Path, seeds: range) -> list[str]:
    """Texts a random walk through the grammar's allowed tokens produces (what any model could emit)."""
    tok = LLTokenizer(str(tokenizer_json))
    texts = []
    for seed in seeds:
        rng, matcher, out = random.Random(seed), LLMatcher(tok, grammar), []
        assert not matcher.is_error(), matcher.get_error()
        for _ in range(3000):
            allowed = [i for i, b in enumerate(matcher.compute_logit_bias()) if b and i != tok.eos_token]
            if matcher.is_stopped() or (matcher.is_accepting() and rng.random() < 0.5) or not allowed:
                break
            token = rng.choice(allowed)
            assert matcher.consume_token(token)
            out.append(token)
        assert matcher.is_accepting(), tok.decode_str(out)
        texts.append(tok.decode_str(out))
    return texts


@pytest.mark.parametrize(("choice", "names"), [("required", {"get_weather", "add"}),
                                               ({"type": "function", "function": {"name": "add"}}, {"add"})])
async def test_required_and_named_calls_are_constrained(gateway: Gateway, choice: Any, names: set[str]) -> None:
    _, params = await _prompt_of(gateway, {"messages": MSG, "tools": TOOLS, "tool_choice": choice})
    structured = params["structured_output"]
    assert structured["kind"] == "grammar"
    seen = set()
    for text in _sample_paths(llguidance_grammar(structured), Path(gateway.engine.tokenizer_dir) / "tokenizer.json",
                              range(12)):
        parser = ToolCallParser()
        content = parser.feed(text)[0] + parser.finish()[0]
        assert content == "" and parser.calls, text
        for call in parser.calls:
            assert call.name in names
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
            seen.add(call.name)
    assert seen == names


async def test_single_call_grammar_without_parallel(gateway: Gateway) -> None:
    _, params = await _prompt_of(gateway, {"messages": MSG, "tools": TOOLS, "tool_choice": "required",
                                           "parallel_tool_calls": False})
    for text in _sample_paths(llguidance_grammar(params["structured_output"]),
                              Path(gateway.engine.tokenizer_dir) / "tokenizer.json", range(6)):
        assert text.count("<tool_call>") == 1


async def test_calls_in_the_output_come_back_as_tool_calls(gateway: Gateway) -> None:
    async with _client(gateway) as client:
        task = asyncio.create_task(client.chat.completions.create(model=MODEL, messages=MSG, tools=TOOLS))  # type: ignore[arg-type]
        req = await gateway.engine.next_request()
        await gateway.engine.generate(req, [CALL_TEXT])
        reply = await task
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    [call] = choice.message.tool_calls or []
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}  # type: ignore[union-attr]


async def test_streamed_tool_call_deltas(gateway: Gateway) -> None:
    two_calls = CALL_TEXT + '\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    async with _client(gateway) as client:
        # the response starts with the first event: create the stream while the engine answers
        task = asyncio.create_task(client.chat.completions.create(model=MODEL, messages=MSG, tools=TOOLS,  # type: ignore[arg-type]
                                                                  stream=True))
        req = await gateway.engine.next_request()
        await gateway.engine.generate(req, [two_calls], chunk=1)
        stream = await task
        content, calls, reasons = "", {}, []  # type: str, dict[int, dict[str, str]], list[str | None]
        async for chunk in stream:
            delta = chunk.choices[0].delta
            content += delta.content or ""
            reasons.append(chunk.choices[0].finish_reason)
            for tc in delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                entry["id"] += tc.id or ""
                entry["name"] += (tc.function.name if tc.function else None) or ""
                entry["arguments"] += (tc.function.arguments if tc.function else None) or ""
    assert content == "Let me check."
    assert [c["name"] for c in calls.values()] == ["get_weather", "add"]
    assert json.loads(calls[1]["arguments"]) == {"a": 1, "b": 2}
    assert all(c["id"].startswith("call_") for c in calls.values()) and calls[0]["id"] != calls[1]["id"]
    assert reasons[-1] == "tool_calls" and all(r is None for r in reasons[:-1])
    assert "<tool_call>" not in content


async def test_no_tools_or_choice_none_leaves_text_alone(gateway: Gateway) -> None:
    for extra in ({}, {"tools": TOOLS, "tool_choice": "none"}):
        post = asyncio.create_task(gateway.client.post("/v1/chat/completions",
                                                       json={"model": MODEL, "messages": MSG, **extra}))
        req = await gateway.engine.next_request()
        await gateway.engine.generate(req, [CALL_TEXT])
        choice = (await (await post).json())["choices"][0]
        assert choice["message"]["content"] == CALL_TEXT and "tool_calls" not in choice["message"]
        assert choice["finish_reason"] == "stop"


async def test_malformed_call_stays_content(gateway: Gateway) -> None:
    text = "<tool_call>\n{not json}\n</tool_call>"
    post = asyncio.create_task(gateway.client.post("/v1/chat/completions",
                                                   json={"model": MODEL, "messages": MSG, "tools": TOOLS}))
    req = await gateway.engine.next_request()
    await gateway.engine.generate(req, [text])
    choice = (await (await post).json())["choices"][0]
    assert choice["message"]["content"] == text and choice["finish_reason"] == "stop"


def _after_one_call(grammar: str, tokenizer_json: Path) -> tuple[LLMatcher, LLTokenizer]:
    """A matcher advanced over one whole get_weather call."""
    tok = LLTokenizer(str(tokenizer_json))
    matcher = LLMatcher(tok, grammar)
    call = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris","unit":"celsius"}}\n</tool_call>'
    assert matcher.consume_tokens(tok.tokenize_str(call)), matcher.get_error()
    return matcher, tok


@pytest.mark.parametrize(("body", "more"), [
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, False),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "parallel_tool_calls": True}, False),
    ({"tool_choice": "required", "parallel_tool_calls": False}, False),
    ({"tool_choice": "required"}, True),
], ids=["named", "named-parallel", "required-single", "required-parallel"])
async def test_grammar_may_end_after_each_call(gateway: Gateway, body: dict[str, Any], more: bool) -> None:
    """After one whole call EOS is allowed; a named function or parallel_tool_calls false allows
    nothing else (so the engine ends there), required with parallel calls allows another call."""
    _, params = await _prompt_of(gateway, {"messages": MSG, "tools": TOOLS, **body})
    matcher, tok = _after_one_call(llguidance_grammar(params["structured_output"]),
                                   Path(gateway.engine.tokenizer_dir) / "tokenizer.json")
    assert matcher.is_accepting()
    allowed = [i for i, b in enumerate(matcher.compute_logit_bias()) if b]
    assert tok.eos_token in allowed
    assert (set(allowed) != {tok.eos_token}) is more, [tok.decode_str([i]) for i in allowed[:5]]
    if more:
        assert matcher.consume_tokens(tok.tokenize_str('\n<tool_call>\n{"name":"add","arguments":{"a":1,"b":2}}'))


SECOND_CALL = '\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


@pytest.mark.parametrize(("body", "text", "calls"), [
    ({"tool_choice": "required"}, CALL_TEXT + CALL_TEXT[13:] * 6, 1),  # the same call over and over
    ({"tool_choice": "required"}, CALL_TEXT + SECOND_CALL + CALL_TEXT[13:], 2),
    ({"tool_choice": "auto", "parallel_tool_calls": False}, CALL_TEXT + SECOND_CALL, 1),
    ({}, CALL_TEXT + '\n<tool_call>\n{"name": "get_weather", "arguments": {"unit": "celsius", "city": "Paris"}}'
         "\n</tool_call>", 1),  # the same arguments in another order
], ids=["repeated", "repeated-after-another", "one-call-auto", "reordered-repeat"])
async def test_answer_ends_at_a_repeated_or_extra_call(gateway: Gateway, body: dict[str, Any], text: str,
                                                       calls: int) -> None:
    """The engine is aborted and the answer ends with tool_calls at the first call that repeats
    an earlier one or exceeds parallel_tool_calls false; no markup shows as content."""
    for stream in (False, True):
        post = asyncio.create_task(gateway.client.post("/v1/chat/completions", json={
            "model": MODEL, "messages": MSG, "tools": TOOLS, "stream": stream, **body}))
        req = await gateway.engine.next_request()
        await gateway.engine.generate(req, [text], finish="length", chunk=2)
        resp = await post
        if stream:
            from tests.fixtures.gateway import parse_sse

            events = [e for e in parse_sse(await resp.text()) if e != "[DONE]"]
            deltas = [e["choices"][0] for e in events]
            content = "".join(d["delta"].get("content") or "" for d in deltas)
            names = [tc["function"]["name"] for d in deltas for tc in d["delta"].get("tool_calls", [])
                     if "name" in tc.get("function", {})]
            reason = deltas[-1]["finish_reason"]
        else:
            choice = (await resp.json())["choices"][0]
            content = choice["message"]["content"]
            names = [c["function"]["name"] for c in choice["message"]["tool_calls"]]
            reason = choice["finish_reason"]
        assert reason == "tool_calls" and len(names) == calls, (reason, names)
        assert "<tool_call>" not in (content or "") and "</tool_call>" not in (content or "")


async def test_cut_off_call_under_required_is_not_content(gateway: Gateway) -> None:
    """A grammar-constrained answer cut by max_tokens inside a call: the whole calls come back,
    the partial block is dropped, content is null."""
    text = CALL_TEXT[14:] + '\n<tool_call>\n{"name": "add", "argu'
    post = asyncio.create_task(gateway.client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": MSG, "tools": TOOLS, "tool_choice": "required"}))
    req = await gateway.engine.next_request()
    await gateway.engine.generate(req, [text], finish="length")
    choice = (await (await post).json())["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] is None
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_weather"]


def test_closed_schema_allows_only_declared_properties() -> None:
    from gateway.api.tools import closed_schema

    schema = {"type": "object", "properties": {"loc": {"type": "string"}, "opts": {
        "type": "object", "properties": {"unit": {"type": "string"}}}, "list": {"type": "array", "items": {
            "type": "object", "properties": {"x": {"type": "integer"}}}}}, "required": ["loc"],
        "$defs": {"d": {"type": "object", "properties": {"y": {}}}}}
    closed = closed_schema(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["opts"]["additionalProperties"] is False
    assert closed["properties"]["list"]["items"]["additionalProperties"] is False
    assert closed["$defs"]["d"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the caller's schema is untouched
    for kept in ({"type": "object", "properties": {"a": {}}, "additionalProperties": True},
                 {"allOf": [{"type": "object", "properties": {"a": {}}}, {"properties": {"b": {}}}]},
                 {"type": "object"}):
        assert closed_schema(kept) == kept
    jsonschema.validate({"loc": "Paris", "opts": {"unit": "c"}}, closed)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"loc": "Paris", "description": "sunny"}, closed)
