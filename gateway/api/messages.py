"""Chat `messages` → plain dicts for the chat template: text content (parts joined),
assistant `tool_calls` (arguments kept as JSON text) and thinking (`reasoning_content`), and
`role: tool` results."""

from __future__ import annotations

import json
from typing import Any

from gateway.errors import bad_request

ROLES = ("system", "developer", "user", "assistant", "tool")


def parse_messages(messages: Any) -> list[dict[str, Any]]:
    """Validated messages, each ``{"role", "content", ...}`` with string content."""
    if messages is None:
        raise bad_request("'messages' is required", "messages", "missing_required_parameter")
    if not isinstance(messages, list):
        raise bad_request("'messages' must be an array", "messages", "invalid_type")
    if not messages:
        raise bad_request("'messages' must contain at least one message", "messages", "empty_array")
    return [_message(msg, f"messages[{i}]") for i, msg in enumerate(messages)]


def _message(msg: Any, where: str) -> dict[str, Any]:
    if not isinstance(msg, dict):
        raise bad_request(f"{where} must be an object", where, "invalid_type")
    role = msg.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise bad_request(f"{where}.role must be one of {list(ROLES)}, got {_short(role)}", where + ".role",
                          "invalid_value")
    content = msg.get("content")
    calls = _tool_calls(msg.get("tool_calls"), where) if role == "assistant" else []
    if content is None and role != "assistant":
        raise bad_request(f"{where}.content is required", where + ".content", "missing_required_parameter")
    out: dict[str, Any] = {"role": role, "content": "" if content is None else _content_text(content, where)}
    for key in ("name", "tool_call_id"):
        if msg.get(key) is not None:
            if not isinstance(msg[key], str):
                raise bad_request(f"{where}.{key} must be a string", f"{where}.{key}", "invalid_type")
            out[key] = msg[key]
    if calls:
        out["tool_calls"] = calls
    reasoning = _reasoning(msg, where) if role == "assistant" else None
    if reasoning is not None:
        out["reasoning_content"] = reasoning
    return out


def _reasoning(msg: dict[str, Any], where: str) -> str | None:
    """An assistant turn's earlier thinking, under either name a response gave it
    (`reasoning_content`, `reasoning`), handed to the template as `reasoning_content` (Qwen3's
    template keeps it for the turns after the last user message)."""
    for key in ("reasoning_content", "reasoning"):
        value = msg.get(key)
        if value is None:
            continue
        if not isinstance(value, str):
            raise bad_request(f"{where}.{key} must be a string", f"{where}.{key}", "invalid_type")
        return value
    return None


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"{where}.content: only text parts are supported", where + ".content",
                                  "invalid_type")
            texts.append(part["text"])
        return "".join(texts)
    raise bad_request(f"{where}.content must be a string or a list of text parts", where + ".content",
                      "invalid_type")


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant's earlier calls, normalized to OpenAI's shape with `arguments` as JSON text."""
    if calls is None:
        return []
    if not isinstance(calls, list):
        raise bad_request(f"{where}.tool_calls must be an array", where + ".tool_calls", "invalid_type")
    out = []
    for i, call in enumerate(calls):
        at = f"{where}.tool_calls[{i}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or call.get("type", "function") != "function":
            raise bad_request(f"{at} must be {{'type': 'function', 'function': {{name, arguments}}}}", at,
                              "invalid_type")
        name, args = fn.get("name"), fn.get("arguments", "{}")
        if not isinstance(name, str) or not name:
            raise bad_request(f"{at}.function.name must be a non-empty string", at + ".function.name",
                              "invalid_type")
        if isinstance(args, dict):
            args = json.dumps(args, ensure_ascii=False)
        if not isinstance(args, str):
            raise bad_request(f"{at}.function.arguments must be a JSON string", at + ".function.arguments",
                              "invalid_type")
        call_id = call.get("id")
        if call_id is not None and not isinstance(call_id, str):
            raise bad_request(f"{at}.id must be a string", at + ".id", "invalid_type")
        out.append({"id": call_id or f"call_{i}", "type": "function",
                    "function": {"name": name, "arguments": args}})
    return out


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
