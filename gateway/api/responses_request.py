"""A /v1/responses body → a `ResponsesRequest`: the equivalent chat completion request
(validated by `validation.parse_request`, so every rule of the chat route holds here) and what
the Responses API adds (input items, instructions, store, previous_response_id, the fields a
response echoes). Errors name the Responses field (`responses_param`)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from gateway.api.endpoint import Endpoint
from gateway.api.fields import as_bool
from gateway.api.responses_input import chat_messages, input_items
from gateway.api.validation import GenerationRequest, parse_request
from gateway.config import GatewayConfig
from gateway.errors import OpenAIError, bad_request

# fields handed to the chat request as they are (beyond OpenAI's Responses fields: vLLM's extras)
PASSED = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "logit_bias", "ignore_eos", "min_tokens", "parallel_tool_calls", "stream",
          "chat_template_kwargs")
# fields refused when set: what the gateway cannot honour
REFUSED = {"background": "background responses", "conversation": "conversations (use previous_response_id)",
           "prompt": "prompt templates"}
_RENAMES = [(re.compile(r"^messages.*"), "input"), (re.compile(r"^max_tokens$"), "max_output_tokens"),
            (re.compile(r"^response_format(\.json_schema)?"), "text.format"),
            (re.compile(r"^tools\[(\d+)\]\.function"), r"tools[\1]")]


@dataclass(slots=True)
class ResponsesRequest:
    """A validated /v1/responses request. `history` is the stored conversation of
    `previous_response_id` (its input and output items), `items` this request's input."""

    chat: GenerationRequest
    items: list[dict[str, Any]]
    history: list[dict[str, Any]] = field(default_factory=list)
    instructions: str | None = None
    store: bool = True
    previous_response_id: str | None = None
    echo: dict[str, Any] = field(default_factory=dict)  # request fields every response object repeats


def previous_id(body: Any) -> str | None:
    """`previous_response_id` of a body (None when absent); 400 when it is not a string."""
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object", code="invalid_type")
    value = body.get("previous_response_id")
    if value is not None and (not isinstance(value, str) or not value):
        raise bad_request("'previous_response_id' must be a non-empty string", "previous_response_id", "invalid_type")
    return value


def parse_responses(body: dict[str, Any], history: list[dict[str, Any]], cfg: GatewayConfig) -> ResponsesRequest:
    """Validate a /v1/responses body (after `previous_id`), `history` the previous conversation."""
    _refuse(body)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad_request("'instructions' must be a string", "instructions", "invalid_type")
    items = input_items(body.get("input"))
    messages = chat_messages(instructions, [*history, *items])
    fmt, text = _text_format(body.get("text"))
    chat_body: dict[str, Any] = {"model": body.get("model"), "messages": messages, "tools": _tools(body.get("tools")),
                                 "tool_choice": _tool_choice(body.get("tool_choice")), "response_format": fmt,
                                 "max_tokens": body.get("max_output_tokens")}
    chat_body.update({name: body[name] for name in PASSED if name in body})
    try:
        chat = parse_request(chat_body, Endpoint.CHAT, cfg)
    except OpenAIError as exc:
        exc.param = responses_param(exc.param)
        raise
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise bad_request("'metadata' must be an object", "metadata", "invalid_type")
    echo = {"model": chat.model, "instructions": instructions, "metadata": metadata or {},
            "max_output_tokens": chat.params.max_tokens if chat.max_tokens_given else None,
            "temperature": body.get("temperature", 1.0), "top_p": body.get("top_p", 1.0),
            "parallel_tool_calls": chat.tools.parallel, "tool_choice": _choice_echo(chat),
            "tools": [_flat_tool(t["function"]) for t in chat.tools.tools], "text": text,
            "truncation": "disabled", "reasoning": None, "previous_response_id": body.get("previous_response_id")}
    return ResponsesRequest(chat, items, history, instructions, as_bool(body, "store", True),
                            body.get("previous_response_id"), echo)


def responses_param(param: str | None) -> str | None:
    """The Responses field behind a chat request's field name."""
    if param is None:
        return None
    for pattern, name in _RENAMES:
        if pattern.match(param):
            return pattern.sub(name, param, count=1)
    return param


def _refuse(body: dict[str, Any]) -> None:
    for name, what in REFUSED.items():
        if body.get(name):
            raise bad_request(f"{what} are not supported", name, "unsupported_parameter")
    if body.get("truncation") not in (None, "disabled"):
        raise bad_request("only 'truncation': 'disabled' is supported (an input past the context is a 400)",
                          "truncation", "unsupported_parameter")
    if body.get("top_logprobs") not in (None, 0):
        raise bad_request("'top_logprobs' is not supported on /v1/responses", "top_logprobs", "unsupported_parameter")


def _text_format(text: Any) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """`text.format` as a chat `response_format`, and the `text` a response echoes."""
    if text is None:
        return None, {"format": {"type": "text"}}
    if not isinstance(text, dict):
        raise bad_request("'text' must be an object", "text", "invalid_type")
    fmt = text.get("format")
    if fmt is None:
        return None, {"format": {"type": "text"}}
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise bad_request("text.format must be {'type': 'text' | 'json_object' | 'json_schema', ...}", "text.format",
                          "invalid_value")
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}, {"format": {"type": fmt["type"]}}
    wrapper = {key: fmt[key] for key in ("name", "schema", "strict", "description") if fmt.get(key) is not None}
    return {"type": "json_schema", "json_schema": wrapper}, {"format": {"type": "json_schema", **wrapper}}


def _tools(value: Any) -> list[dict[str, Any]] | None:
    """Responses' flat function tools in the chat shape (`tools.parse_tools` checks the rest)."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise bad_request("'tools' must be an array", "tools", "invalid_type")
    out = []
    for i, tool in enumerate(value):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise bad_request(f"tools[{i}]: only function tools are supported, got type {str(kind)[:40]!r}",
                              f"tools[{i}].type", "unsupported_parameter")
        if tool.get("strict") is not None and not isinstance(tool["strict"], bool):
            raise bad_request(f"tools[{i}].strict must be a boolean", f"tools[{i}].strict", "invalid_type")
        out.append({"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters")
                                                     if tool.get(k) is not None}})
    return out


def _tool_choice(value: Any) -> Any:
    """Responses' ``{"type": "function", "name": ...}`` in the chat shape; strings as they are."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and value.get("type") == "function":
        return {"type": "function", "function": {"name": value.get("name")}}
    raise bad_request("'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}",
                      "tool_choice", "invalid_value")


def _flat_tool(fn: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "name": fn["name"], "description": fn.get("description"),
            "parameters": fn.get("parameters"), "strict": False}


def _choice_echo(chat: GenerationRequest) -> Any:
    tools = chat.tools
    return {"type": "function", "name": tools.named} if tools.choice == "named" else tools.choice
