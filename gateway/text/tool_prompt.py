"""Showing tools to the model. A chat template that reads `tools` renders them itself (the
messages are handed over as Hugging Face templates expect: tool-call arguments as objects).
Otherwise (SmolLM2's template, for one) the fallback below: the tool list and the calling
convention go into the system prompt (appended to the conversation's system message, or as a
new first one), earlier calls become ``<tool_call>`` blocks in the assistant's text and
``role: tool`` results become user turns wrapped in ``<tool_response>`` tags."""

from __future__ import annotations

import json
from typing import Any

FALLBACK_HEADER = (
    "# Tools\n\n"
    "You can call the functions below. Their signatures, as JSON Schema, one per line:\n<tools>\n{tools}\n</tools>\n\n"
    "To call a function, reply with a JSON object naming it and giving its arguments, inside "
    "<tool_call></tool_call> tags, one block per call:\n"
    '<tool_call>\n{{"name": "function_name", "arguments": {{"argument": "value"}}}}\n</tool_call>'
)


def call_block(name: str, arguments: str) -> str:
    """One call in the text convention the model is shown and the parser reads."""
    return f'<tool_call>\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": {arguments}}}\n</tool_call>'


def native_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages for a template that knows tools: arguments parsed to objects when they are JSON."""
    out = []
    for msg in messages:
        if "tool_calls" in msg:
            calls = [{**c, "function": {**c["function"], "arguments": _as_object(c["function"]["arguments"])}}
                     for c in msg["tool_calls"]]
            msg = {**msg, "tool_calls": calls}
        out.append(msg)
    return out


def fallback_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                      instruction: str = "") -> list[dict[str, Any]]:
    """Messages for a template that knows nothing of tools (see the module docstring). `tools`
    None: only earlier calls and results are rewritten (tool_choice none)."""
    out = []
    for msg in messages:
        if msg["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{msg['content']}\n</tool_response>"})
        elif "tool_calls" in msg:
            blocks = [call_block(c["function"]["name"], _as_json_text(c["function"]["arguments"]))
                      for c in msg["tool_calls"]]
            text = "\n".join(([msg["content"]] if msg["content"] else []) + blocks)
            out.append({"role": "assistant", "content": text})
        else:
            out.append(msg)
    if tools is None:
        return out
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    system = FALLBACK_HEADER.format(tools=listing) + (f"\n\n{instruction}" if instruction else "")
    if out and out[0]["role"] in ("system", "developer"):
        first = out[0]
        return [{**first, "content": f"{first['content']}\n\n{system}" if first["content"] else system}, *out[1:]]
    return [{"role": "system", "content": system}, *out]


def choice_instruction(choice: str, named: str | None, parallel: bool) -> str:
    """What the fallback prompt says about tool_choice and parallel_tool_calls."""
    parts = []
    if choice == "required":
        parts.append("You must call at least one function.")
    elif choice == "named":
        parts.append(f"You must call the function {named}.")
    if not parallel:
        parts.append("Call at most one function.")
    return " ".join(parts)


def _as_object(arguments: str) -> Any:
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments


def _as_json_text(arguments: str) -> str:
    try:
        return json.dumps(json.loads(arguments), ensure_ascii=False)
    except ValueError:
        return json.dumps(arguments, ensure_ascii=False)
