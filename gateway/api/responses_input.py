"""Responses `input` and `instructions` → chat messages, the shape `messages.parse_messages`
takes, so a /v1/responses request reaches the chat template exactly as a chat completion does.

`input` is a string (one user message) or a list of items: messages (`role` and `content`, a
string or `input_text` / `output_text` parts), `function_call` items (an assistant's earlier
call) and `function_call_output` items (its result, a `role: tool` message). `reasoning`
items are dropped: chat templates do not show earlier turns' reasoning. Consecutive calls, and
calls right after an assistant message, make one assistant turn, as a chat client sends them."""

from __future__ import annotations

import json
from typing import Any

from gateway.errors import bad_request

ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")


def input_items(value: Any) -> list[dict[str, Any]]:
    """`input` as a list of checked items (a string becomes one user message item)."""
    if value is None:
        raise bad_request("'input' is required", "input", "missing_required_parameter")
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": value}]}]
    if not isinstance(value, list):
        raise bad_request("'input' must be a string or an array of input items", "input", "invalid_type")
    return [_item(item, f"input[{i}]") for i, item in enumerate(value)]


def _item(item: Any, where: str) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise bad_request(f"{where} must be an object", where, "invalid_type")
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        role = item.get("role")
        if role not in ROLES:
            raise bad_request(f"{where}.role must be one of {list(ROLES)}", f"{where}.role", "invalid_value")
        return {"type": "message", "role": role, "content": _parts(item.get("content"), f"{where}.content")}
    if kind == "function_call":
        call_id, name, args = item.get("call_id"), item.get("name"), item.get("arguments")
        for key, value in (("call_id", call_id), ("name", name), ("arguments", args)):
            if not isinstance(value, str) or (key != "arguments" and not value):
                raise bad_request(f"{where}.{key} must be a{' non-empty' if key != 'arguments' else ''} string",
                                  f"{where}.{key}", "invalid_type")
        return {"type": "function_call", "call_id": call_id, "name": name, "arguments": args}
    if kind == "function_call_output":
        call_id, output = item.get("call_id"), item.get("output")
        if not isinstance(call_id, str) or not call_id:
            raise bad_request(f"{where}.call_id must be a non-empty string", f"{where}.call_id", "invalid_type")
        text = output if isinstance(output, str) else _text(_parts(output, f"{where}.output"))
        return {"type": "function_call_output", "call_id": call_id, "output": text}
    if kind == "reasoning":
        return {"type": "reasoning"}
    raise bad_request(f"{where}.type {_short(kind)} is not supported (message, function_call, "
                      "function_call_output and reasoning items are)", f"{where}.type", "unsupported_parameter")


def _parts(content: Any, where: str) -> list[dict[str, Any]]:
    """A message's content as text parts (a string is one part)."""
    if isinstance(content, str):
        return [{"type": "input_text", "text": content}]
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or an array of text parts", where, "invalid_type")
    out = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad_request(f"{where}[{i}]: only text parts ({', '.join(TEXT_PARTS[:2])}) are supported",
                              f"{where}[{i}]", "invalid_type")
        out.append({"type": kind, "text": part["text"]})
    return out


def _text(parts: list[dict[str, Any]]) -> str:
    return "".join(p["text"] for p in parts)


def chat_messages(instructions: str | None, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages of checked items (see the module docstring), `instructions` first."""
    out: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    for item in items:
        kind = item["type"]
        if kind == "message":
            out.append({"role": item["role"], "content": _text(item["content"])})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return out


def output_as_input(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the input items they are in the next turn."""
    out: list[dict[str, Any]] = []
    for item in output:
        if item["type"] == "message":
            parts = [{"type": "output_text", "text": p["text"]} for p in item["content"]]
            out.append({"type": "message", "role": "assistant", "content": parts})
        elif item["type"] == "function_call":
            out.append({k: item[k] for k in ("type", "call_id", "name", "arguments")})
    return out


def _short(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 40 else text[:37] + "..."
