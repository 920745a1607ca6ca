"""Structured output: `response_format` (OpenAI) and vLLM's `guided_*` / `structured_outputs`
extras → `SamplingParams.structured_output` ``{"kind": K, "spec": S}``, checked with the same
library the engine compiles them with (llguidance), so an unsupported schema feature is a 400
that names it instead of an engine-side failure. Never compiles a token mask here.

What the engine compiles for each kind (`llguidance_grammar`): json_schema → S (JSON text,
with `tools.COMPACT_JSON` added unless S sets "x-guidance"), json_object → the schema
``{"type": "object"}`` with the same option, regex → S, grammar → S as Lark (llguidance's
dialect, ``%json`` allowed) or GBNF, as `dialect_of` decided once here (the request carries
it as "dialect"), choice → one of the strings."""

from __future__ import annotations

import functools
import json
from typing import Any

import llguidance
from llguidance import LLMatcher
from llguidance.gbnf_to_lark import is_lark_syntax

from common.sampling_params import grammar_dialect
from common.structured_limits import is_library_failure, library_message, limit_error
from gateway.api.tools import compact_schema
from gateway.errors import bad_request

JSON_OBJECT_SCHEMA = json.dumps(compact_schema({"type": "object"}))
_GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}
_STRUCTURED = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}


def parse_structured(body: dict[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
    """The request's output constraint and the field it came from; 400 when several are given."""
    found: list[tuple[dict[str, Any], str]] = []
    fmt = _response_format(body.get("response_format"))
    if fmt is not None:
        found.append((fmt, "response_format"))
    for name, kind in _GUIDED.items():
        if body.get(name) is not None:
            found.append((_spec(kind, body[name], name), name))
    extra = body.get("structured_outputs")
    if extra is not None:
        found.append((_structured_outputs(extra), "structured_outputs"))
    if len(found) > 1:
        raise bad_request(f"give one output constraint, not {' and '.join(p for _, p in found)}", found[1][1])
    return found[0] if found else (None, None)


def _response_format(fmt: Any) -> dict[str, Any] | None:
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise bad_request("response_format must be {'type': 'text' | 'json_object' | 'json_schema', ...}",
                          "response_format", "invalid_value")
    if fmt["type"] == "text":
        return None
    if fmt["type"] == "json_object":
        return {"kind": "json_object", "spec": None}
    wrapper = fmt.get("json_schema")
    if not isinstance(wrapper, dict) or not isinstance(wrapper.get("schema"), dict):
        raise bad_request("response_format json_schema needs 'json_schema': {'name': ..., 'schema': {...}}",
                          "response_format.json_schema", "invalid_value")
    for key, kind in (("name", str), ("strict", bool)):
        if wrapper.get(key) is not None and not isinstance(wrapper[key], kind):
            raise bad_request(f"response_format.json_schema.{key} must be a {kind.__name__}",
                              f"response_format.json_schema.{key}", "invalid_type")
    return _spec("json_schema", wrapper["schema"], "response_format.json_schema.schema")


def _structured_outputs(extra: Any) -> dict[str, Any]:
    """vLLM's ``{"json" | "regex" | "choice" | "grammar": ..., "json_object": true}``: exactly one."""
    if not isinstance(extra, dict):
        raise bad_request("'structured_outputs' must be an object", "structured_outputs", "invalid_type")
    given = [k for k in (*_STRUCTURED, "json_object") if extra.get(k) not in (None, False)]
    unknown = [k for k in ("structural_tag",) if extra.get(k) is not None]
    if unknown:
        raise bad_request(f"structured_outputs.{unknown[0]} is not supported", "structured_outputs",
                          "unsupported_parameter")
    if len(given) != 1:
        raise bad_request(f"'structured_outputs' needs exactly one of {[*_STRUCTURED, 'json_object']}",
                          "structured_outputs")
    if given[0] == "json_object":
        return {"kind": "json_object", "spec": None}
    return _spec(_STRUCTURED[given[0]], extra[given[0]], f"structured_outputs.{given[0]}")


def _spec(kind: str, value: Any, param: str) -> dict[str, Any]:
    if kind == "json_schema":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise bad_request(f"'{param}' is not valid JSON: {exc}", param, "invalid_value") from exc
        if not isinstance(value, dict):
            raise bad_request(f"'{param}' must be a JSON schema object", param, "invalid_type")
        return _fits({"kind": kind, "spec": json.dumps(compact_schema(value), ensure_ascii=False)}, param)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
            raise bad_request(f"'{param}' must be a non-empty list of non-empty strings", param, "invalid_type")
        return _fits({"kind": kind, "spec": list(value)}, param)
    if not isinstance(value, str) or not value:
        raise bad_request(f"'{param}' must be a non-empty string", param, "invalid_type")
    if kind == "grammar":
        return _fits({"kind": kind, "spec": value, "dialect": dialect_of(value)}, param)
    return _fits({"kind": kind, "spec": value}, param)


def dialect_of(grammar: str) -> str:
    """The one decision of a grammar's dialect (carried to the engine as "dialect"): Lark when
    it reads as Lark (a `start:` rule or `%llguidance`), else GBNF. A Lark string literal that
    holds `::=` stays Lark."""
    return "lark" if is_lark_syntax(grammar) else "gbnf"


def _fits(structured: dict[str, Any], param: str) -> dict[str, Any]:
    """`structured`, or a 400 naming `param` when it exceeds `common.structured_limits`."""
    error = limit_error(structured["kind"], structured["spec"], param)
    if error:
        raise bad_request(error, param, "too_large")
    return structured


def llguidance_grammar(structured: dict[str, Any]) -> str:
    """The llguidance grammar the engine builds its token masks from (see the module docstring)."""
    kind, spec = structured["kind"], structured["spec"]
    if kind == "json_schema":
        return str(LLMatcher.grammar_from_json_schema(spec))
    if kind == "json_object":
        return str(LLMatcher.grammar_from_json_schema(JSON_OBJECT_SCHEMA))
    if kind == "regex":
        return str(LLMatcher.grammar_from_regex(spec))
    if kind == "choice":
        return str(llguidance.grammar_from("choice", json.dumps(spec)))
    if grammar_dialect(structured) == "gbnf":
        return str(llguidance.grammar_from("gbnf", spec))  # llguidance converts it to Lark
    return str(LLMatcher.grammar_from_lark(spec))


def check_structured(structured: dict[str, Any], param: str | None) -> None:
    """400 naming what llguidance cannot compile (an unsupported schema keyword, a bad regex...).
    May take a while on a huge grammar: call it off the event loop. Verdicts are cached: agent
    loops send the same tools and schemas with every request."""
    spec = structured["spec"]
    error = _grammar_error(structured["kind"], tuple(spec) if isinstance(spec, list) else spec,
                           structured.get("dialect"))
    if error:
        what = {"json_schema": "JSON schema", "json_object": "JSON object", "regex": "regular expression",
                "grammar": "grammar", "choice": "choice list"}[structured["kind"]]
        raise bad_request(f"unsupported {what}: {library_message(error)}", param, "unsupported_schema")


@functools.lru_cache(maxsize=256)
def _grammar_error(kind: str, spec: str | tuple[str, ...] | None, dialect: str | None) -> str:
    """llguidance's complaint about a constraint, "" when it compiles."""
    structured = {"kind": kind, "spec": list(spec) if isinstance(spec, tuple) else spec}
    if dialect is not None:
        structured["dialect"] = dialect
    try:
        return str(LLMatcher.validate_grammar(llguidance_grammar(structured)))
    except BaseException as exc:  # ValueError, or a Rust panic (PanicException)
        if not is_library_failure(exc):
            raise
        return str(exc) or type(exc).__name__
