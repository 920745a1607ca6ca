"""Hostile inputs: each gets a 4xx with an OpenAI error body, never a 500, and nothing reaches
the request stream: a list as a message role, template kwargs that override `messages`, deep
nesting, lone surrogates, ids past the vocabulary or past 2^64 (msgpack cannot carry them)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.fixtures.gateway import MODEL, Gateway, gateway

__all__ = ["gateway"]

MSG = [{"role": "user", "content": "hi"}]
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
DEEP = b'{"model": "tiny", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
NESTED_70 = b'{"model": "tiny", "prompt": "x", "user": ' + b'{"a": ' * 70 + b"1" + b"}" * 70 + b"}"

HOSTILE: list[tuple[str, str, Any, str | None]] = [
    ("list as role", CHAT, {"model": MODEL, "messages": [{"role": ["user"], "content": "x"}]}, "messages[0].role"),
    ("dict as role", CHAT, {"model": MODEL, "messages": [{"role": {"a": 1}, "content": "x"}]}, "messages[0].role"),
    ("kwargs override messages", CHAT, {"model": MODEL, "messages": MSG, "chat_template_kwargs": {"messages": []}},
     "chat_template_kwargs"),
    ("kwargs override add_generation_prompt", CHAT, {"model": MODEL, "messages": MSG,
                                                     "chat_template_kwargs": {"add_generation_prompt": False}},
     "chat_template_kwargs"),
    ("kwargs override tools", CHAT, {"model": MODEL, "messages": MSG, "chat_template_kwargs": {"tools": 5}},
     "chat_template_kwargs"),
    ("kwargs not an object", CHAT, {"model": MODEL, "messages": MSG, "chat_template_kwargs": [1]},
     "chat_template_kwargs"),
    ("deep nesting (C parser limit)", CHAT, DEEP, None),
    ("nesting past 64 levels", COMP, NESTED_70, None),
    ("lone surrogate in content", CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "a\ud800b"}]},
     "messages[0].content"),
    ("lone surrogate in prompt", COMP, {"model": MODEL, "prompt": "\udfff"}, "prompt"),
    ("lone surrogate in a key", COMP, {"model": MODEL, "prompt": "x", "\ud801": 1}, None),
    ("lone surrogate in stop", COMP, {"model": MODEL, "prompt": "x", "stop": ["\ud800"]}, "stop[0]"),
    ("stop_token_ids past 2^64", COMP, {"model": MODEL, "prompt": "hi", "stop_token_ids": [2**70]},
     "stop_token_ids"),
    ("stop_token_ids past the vocabulary", COMP, {"model": MODEL, "prompt": "hi", "max_tokens": 4, "min_tokens": 1,
                                                  "stop_token_ids": [1_000_000_000]}, "stop_token_ids"),
    ("stop_token_ids negative", COMP, {"model": MODEL, "prompt": "hi", "stop_token_ids": [-1]}, "stop_token_ids"),
    ("stop_token_ids too many", COMP, {"model": MODEL, "prompt": "hi", "stop_token_ids": [1] * 2000},
     "stop_token_ids"),
    ("logit_bias key past the vocabulary", COMP, {"model": MODEL, "prompt": "hi", "logit_bias": {"99999": 5}},
     "logit_bias"),
    ("logit_bias key past 2^64", COMP, {"model": MODEL, "prompt": "hi", "logit_bias": {str(2**80): 5}},
     "logit_bias"),
    ("logit_bias key not a number", COMP, {"model": MODEL, "prompt": "hi", "logit_bias": {"abc": 5}}, "logit_bias"),
    ("logit_bias value out of range", COMP, {"model": MODEL, "prompt": "hi", "logit_bias": {"5": 500}},
     "logit_bias"),
    ("logit_bias value a string", COMP, {"model": MODEL, "prompt": "hi", "logit_bias": {"5": "x"}}, "logit_bias"),
    ("token prompt past 2^64", COMP, {"model": MODEL, "prompt": [1, 2**65]}, "prompt"),
    ("seed past 2^64", COMP, {"model": MODEL, "prompt": "hi", "seed": 2**65}, "seed"),
    ("huge integer literal", COMP, b'{"model": "tiny", "prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}", None),
    ("n as a float", COMP, {"model": MODEL, "prompt": "hi", "n": 1.5}, "n"),
    ("temperature NaN literal", COMP, b'{"model": "tiny", "prompt": "x", "temperature": NaN}', "temperature"),
    ("top_p Infinity literal", COMP, b'{"model": "tiny", "prompt": "x", "top_p": Infinity}', "top_p"),
    ("repetition_penalty 0", COMP, {"model": MODEL, "prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
    ("frequency_penalty string", COMP, {"model": MODEL, "prompt": "hi", "frequency_penalty": "1"},
     "frequency_penalty"),
    ("prompt_logprobs too many", COMP, {"model": MODEL, "prompt": "hi", "prompt_logprobs": 99}, "prompt_logprobs"),
    ("tool_calls not a list", CHAT, {"model": MODEL, "messages": [{"role": "assistant", "tool_calls": 5}]},
     "messages[0].tool_calls"),
    ("tool_call without function", CHAT, {"model": MODEL, "messages": [
        {"role": "assistant", "tool_calls": [{"id": "a", "type": "function"}]}]}, "messages[0].tool_calls[0]"),
    ("tool_call arguments a number", CHAT, {"model": MODEL, "messages": [{"role": "assistant", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": 3}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ("tool_call_id not a string", CHAT, {"model": MODEL, "messages": [
        {"role": "tool", "content": "x", "tool_call_id": 3}]}, "messages[0].tool_call_id"),
    ("tools not a list", CHAT, {"model": MODEL, "messages": MSG, "tools": {"a": 1}}, "tools"),
    ("tool name with spaces", CHAT, {"model": MODEL, "messages": MSG, "tools": [
        {"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ("tool parameters a list", CHAT, {"model": MODEL, "messages": MSG, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": [1]}}]}, "tools[0].function.parameters"),
    ("tool_choice names an unknown function", CHAT, {"model": MODEL, "messages": MSG, "tools": [
        {"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function",
                                                                          "function": {"name": "g"}}},
     "tool_choice"),
    ("tool_choice required without tools", CHAT, {"model": MODEL, "messages": MSG, "tool_choice": "required"},
     "tool_choice"),
    ("tool_choice a number", CHAT, {"model": MODEL, "messages": MSG, "tool_choice": 3}, "tool_choice"),
    ("parallel_tool_calls a string", CHAT, {"model": MODEL, "messages": MSG, "parallel_tool_calls": "no"},
     "parallel_tool_calls"),
    ("functions (legacy)", CHAT, {"model": MODEL, "messages": MSG, "functions": [{"name": "f"}]}, "functions"),
    ("response_format unknown type", CHAT, {"model": MODEL, "messages": MSG, "response_format": {"type": "xml"}},
     "response_format"),
    ("response_format a string", CHAT, {"model": MODEL, "messages": MSG, "response_format": "json"},
     "response_format"),
    ("json_schema without schema", CHAT, {"model": MODEL, "messages": MSG, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
    ("two output constraints", COMP, {"model": MODEL, "prompt": "x", "guided_regex": "a+",
                                      "response_format": {"type": "json_object"}}, "guided_regex"),
    ("guided_choice empty", COMP, {"model": MODEL, "prompt": "x", "guided_choice": []}, "guided_choice"),
    ("structured_outputs two kinds", COMP, {"model": MODEL, "prompt": "x", "structured_outputs": {
        "regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ("response_format with required tools", CHAT, {"model": MODEL, "messages": MSG, "tool_choice": "required",
                                                   "tools": [{"type": "function", "function": {"name": "f"}}],
                                                   "response_format": {"type": "json_object"}}, "response_format"),
    ("structured output with beam search", COMP, {"model": MODEL, "prompt": "x", "use_beam_search": True,
                                                  "temperature": 0, "guided_regex": "a+"}, "guided_regex"),
    ("prompt_logprobs streamed", COMP, {"model": MODEL, "prompt": "x", "prompt_logprobs": 1, "stream": True},
     "prompt_logprobs"),
]


@pytest.mark.parametrize(("name", "path", "payload", "param"), HOSTILE, ids=[h[0] for h in HOSTILE])
async def test_hostile_input_is_a_4xx(gateway: Gateway, name: str, path: str, payload: Any,
                                      param: str | None) -> None:
    import json

    data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    resp = await gateway.client.post(path, data=data, headers={"Content-Type": "application/json"})
    body = await resp.json()
    assert resp.status == 400, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param, error
    assert await gateway.redis.xlen(gateway.engine.keys.requests(MODEL)) == 0


UNSUPPORTED_SCHEMAS = [
    ({"type": "object", "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}}, "if"),
    ({"type": "array", "uniqueItems": True}, "uniqueItems"),
    ({"not": {"type": "string"}}, "not"),
    ({"$ref": "http://example.com/schema.json"}, "example.com"),
    ({"type": "string", "pattern": "(?=a)b"}, "look-around"),
]


@pytest.mark.parametrize(("schema", "named"), UNSUPPORTED_SCHEMAS, ids=[u[1] for u in UNSUPPORTED_SCHEMAS])
async def test_unsupported_schema_feature_is_named(gateway: Gateway, schema: dict[str, Any], named: str) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    resp = await gateway.client.post(CHAT, json={"model": MODEL, "messages": MSG, "response_format": fmt})
    error = (await resp.json())["error"]
    assert resp.status == 400 and error["code"] == "unsupported_schema"
    assert named in error["message"] and error["param"] == "response_format"


@pytest.mark.parametrize(("field", "value"), [("guided_regex", "[a-z"), ("guided_grammar", 'start: "a" missing'),
                                              ("guided_grammar", "root ::= [")])
async def test_bad_regex_and_grammar_are_4xx(gateway: Gateway, field: str, value: str) -> None:
    resp = await gateway.client.post(COMP, json={"model": MODEL, "prompt": "x", field: value})
    error = (await resp.json())["error"]
    assert resp.status == 400 and error["param"] == field and error["code"] == "unsupported_schema", error
