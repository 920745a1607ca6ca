"""Issue 41: output constraints past `common.structured_limits` are a 400 naming the field,
before the grammar library sees them; what the library says reaches the client as one line."""

from __future__ import annotations

import json
from typing import Any

import pytest

from common.sampling_params import ParamError, SamplingParams
from common.structured_limits import (
    MAX_CHOICE_BYTES,
    MAX_CHOICES,
    MAX_GRAMMAR_BYTES,
    MAX_JSON_SCHEMA_BYTES,
    MAX_REGEX_BYTES,
    library_message,
)
from tests.fixtures.gateway import MODEL, Gateway, gateway

__all__ = ["gateway"]
COMP = "/v1/completions"
BIG_SCHEMA = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "d" * 200}
                                               for i in range(MAX_JSON_SCHEMA_BYTES // 200)}}


@pytest.mark.parametrize(("field", "value"), [
    ("guided_choice", [f"c{i}" for i in range(MAX_CHOICES + 1)]),
    ("guided_choice", ["x" * (MAX_CHOICE_BYTES // 4 + 1)] * 4),
    ("guided_regex", "a" * (MAX_REGEX_BYTES + 1)),
    ("guided_grammar", 'start: "a"\n' + "# pad\n" * (MAX_GRAMMAR_BYTES // 6)),
    ("guided_json", BIG_SCHEMA),
])
async def test_oversized_constraint_is_a_400_naming_the_field(gateway: Gateway, field: str, value: Any) -> None:
    resp = await gateway.client.post(COMP, json={"model": MODEL, "prompt": "x", field: value})
    body = await resp.json()
    assert resp.status == 400, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == field and error["code"] == "too_large" and field in error["message"]
    assert error["type"] == "invalid_request_error" and "at most" in error["message"]


async def test_response_format_schema_limit_names_its_path(gateway: Gateway) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "big", "schema": BIG_SCHEMA}}
    resp = await gateway.client.post(COMP, json={"model": MODEL, "prompt": "x", "response_format": fmt})
    error = (await resp.json())["error"]
    assert resp.status == 400 and error["param"] == "response_format.json_schema.schema"


async def test_library_error_is_one_line(gateway: Gateway) -> None:
    grammar = 'start: foo\nfoo: "a" | %json {"type": 3}'
    resp = await gateway.client.post(COMP, json={"model": MODEL, "prompt": "x", "guided_grammar": grammar})
    error = (await resp.json())["error"]
    assert resp.status == 400 and error["code"] == "unsupported_schema"
    assert "\n" not in error["message"] and "type must be a string" in error["message"]


def test_limits_hold_in_sampling_params_too() -> None:
    """The engine's backstop: a constraint built past the gateway (tools, another client)."""
    with pytest.raises(ParamError, match="choices"):
        SamplingParams(structured_output={"kind": "choice", "spec": ["a"] * (MAX_CHOICES + 1)})
    with pytest.raises(ParamError, match="bytes"):
        SamplingParams(structured_output={"kind": "json_schema", "spec": json.dumps(BIG_SCHEMA)})
    SamplingParams(structured_output={"kind": "choice", "spec": ["a"] * MAX_CHOICES})


def test_library_message_drops_backtraces() -> None:
    text = ("\n assertion failed: self.lexemes.len() < 0x10000\nstack backtrace:\n"
            "   0: rust_begin_unwind\n   1: core::panicking::panic_fmt\n")
    assert library_message(text) == "assertion failed: self.lexemes.len() < 0x10000"
    assert len(library_message("x" * 10_000)) <= 300 and library_message("") == "invalid"
    regex = "regex parse error:\n    (?=a)b\n    ^^^\nerror: look-around is not supported\n"
    assert library_message(regex) == "regex parse error: error: look-around is not supported"
