"""`tools`, `tool_choice` and `parallel_tool_calls` → a `ToolConfig`; for `required` and a
named function, the grammar that makes the output a valid call.

Calls use the Hermes/Qwen convention, one per ``<tool_call>`` block:
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``. The grammar (kind
``grammar``: Lark text in llguidance's dialect, each function's `parameters` schema embedded
with ``%json`` as its own root document, so its ``$ref``s resolve) fixes the name and the
arguments' schema; the same parser reads constrained and free output."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from gateway.errors import bad_request

MAX_TOOLS = 128
COMPACT_JSON = {"whitespace_flexible": False}  # llguidance option: no free whitespace between tokens
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True, slots=True)
class ToolConfig:
    """The request's tools (OpenAI's ``{"type": "function", "function": {...}}`` objects) and how
    they may be used: `choice` is none, auto, required or named (then `named` is the function)."""

    tools: list[dict[str, Any]] = field(default_factory=list)
    choice: str = "none"
    named: str | None = None
    parallel: bool = True

    @property
    def active(self) -> bool:
        """Whether the model is shown the tools and its output is parsed for calls."""
        return bool(self.tools) and self.choice != "none"

    @property
    def constrained(self) -> bool:
        """Whether a grammar makes the whole output calls (`required` and named)."""
        return self.active and self.choice in ("required", "named")

    @property
    def max_calls(self) -> int | None:
        """Calls one answer may make (OpenAI: a named function or `parallel_tool_calls: false`
        is one call); None for any number."""
        return 1 if self.choice == "named" or not self.parallel else None

    def structured_output(self) -> dict[str, Any] | None:
        """The grammar for `required` and named choices (None for auto and none): exactly one
        call when `max_calls` is 1, else one or more separated by a newline. The grammar is
        complete after each whole call, so the answer may end there (EOS is then allowed, and
        is the only token allowed once no further call can follow). Arguments follow
        `closed_schema`: only the declared properties."""
        if not self.constrained:
            return None
        fns = [t["function"] for t in self.tools if self.choice == "required" or t["function"]["name"] == self.named]
        calls = [f"call_{i}: {_literal(CALL_OPEN + chr(10) + _call_prefix(fn['name']))} %json "
                 f"{json.dumps(compact_schema(closed_schema(fn.get('parameters') or {'type': 'object'})))} "
                 f"{_literal('}' + chr(10) + CALL_CLOSE)}" for i, fn in enumerate(fns)]
        one = " | ".join(f"call_{i}" for i in range(len(fns)))
        start = f"start: {one}" if self.max_calls == 1 else f"start: one (\"\\n\" one)*\none: {one}"
        return {"kind": "grammar", "spec": "\n".join([start, *calls]), "dialect": "lark"}


def compact_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` with llguidance's compact-whitespace option unless it sets its own: small models
    otherwise fill the free whitespace between JSON tokens until max_tokens."""
    return schema if "x-guidance" in schema else {**schema, "x-guidance": COMPACT_JSON}


def closed_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` with ``"additionalProperties": false`` on every object that declares
    `properties` and says nothing about others (as OpenAI's strict mode requires): a small model
    otherwise invents properties with rambling values until max_tokens. What it allows is a
    subset of `schema`. Objects that compose (allOf/anyOf/oneOf/$ref beside them) and allOf
    branches are left open, where closing one would forbid its siblings' properties."""
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = dict(schema)
    composed = any(k in out for k in ("allOf", "anyOf", "oneOf", "$ref"))
    if isinstance(out.get("properties"), dict) and "additionalProperties" not in out and not composed:
        out["additionalProperties"] = False
    for key in ("properties", "$defs", "definitions", "patternProperties"):
        if isinstance(out.get(key), dict):
            out[key] = {k: closed_schema(v) for k, v in out[key].items()}
    for key in ("items", "additionalProperties", "not", "if", "then", "else"):
        if isinstance(out.get(key), dict):
            out[key] = closed_schema(out[key])
    for key in ("anyOf", "oneOf", "prefixItems"):
        if isinstance(out.get(key), list):
            out[key] = [closed_schema(v) for v in out[key]]
    return out


def _call_prefix(name: str) -> str:
    return '{"name":' + json.dumps(name) + ',"arguments":'


def _literal(text: str) -> str:
    """A Lark string literal (llguidance reads JSON string escapes)."""
    return json.dumps(text)


def parse_tools(body: dict[str, Any]) -> ToolConfig:
    """Validate the tool fields of a chat body."""
    tools = _tools(body.get("tools"))
    parallel = body.get("parallel_tool_calls", True)
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise bad_request("'parallel_tool_calls' must be a boolean", "parallel_tool_calls", "invalid_type")
    choice, named = _choice(body.get("tool_choice"), tools)
    return ToolConfig(tools, choice, named, parallel)


def _tools(value: Any) -> list[dict[str, Any]]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise bad_request("'tools' must be an array", "tools", "invalid_type")
    if len(value) > MAX_TOOLS:
        raise bad_request(f"'tools' accepts at most {MAX_TOOLS} functions", "tools")
    out, names = [], set()
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or tool.get("type", "function") != "function":
            raise bad_request(f"{where} must be {{'type': 'function', 'function': {{...}}}}", where, "invalid_type")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise bad_request(f"{where}.function.name must be 1-64 letters, digits, '_', '.' or '-'",
                              where + ".function.name", "invalid_value")
        if name in names:
            raise bad_request(f"{where}.function.name {name!r} is defined twice", where + ".function.name")
        names.add(name)
        params, desc = fn.get("parameters"), fn.get("description")
        if params is not None and not isinstance(params, dict):
            raise bad_request(f"{where}.function.parameters must be a JSON schema object",
                              where + ".function.parameters", "invalid_type")
        if desc is not None and not isinstance(desc, str):
            raise bad_request(f"{where}.function.description must be a string", where + ".function.description",
                              "invalid_type")
        clean = {"name": name, **({"description": desc} if desc else {}), **({"parameters": params} if params else {})}
        out.append({"type": "function", "function": clean})
    return out


def _choice(value: Any, tools: list[dict[str, Any]]) -> tuple[str, str | None]:
    if value is None:
        return ("auto" if tools else "none"), None
    if value in ("none", "auto", "required"):
        if value == "required" and not tools:
            raise bad_request("tool_choice 'required' needs 'tools'", "tool_choice")
        return str(value), None
    fn = value.get("function") if isinstance(value, dict) and value.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise bad_request("'tool_choice' must be 'none', 'auto', 'required' or "
                          "{'type': 'function', 'function': {'name': ...}}", "tool_choice", "invalid_value")
    if name not in {t["function"]["name"] for t in tools}:
        raise bad_request(f"tool_choice names {name[:64]!r}, which is not in 'tools'", "tool_choice")
    return "named", name
