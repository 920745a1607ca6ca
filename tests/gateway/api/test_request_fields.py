"""What the gateway puts on the wire for the newer request fields: penalties, logit_bias,
output constraints (response_format, vLLM's guided_* and structured_outputs), prompt logprobs."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from common.sampling_params import SamplingParams
from tests.fixtures.gateway import MODEL, Gateway, gateway

__all__ = ["gateway"]

MSG = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
COMPACT = {"whitespace_flexible": False}


async def _params(gw: Gateway, path: str, body: dict[str, Any]) -> dict[str, Any]:
    post = asyncio.create_task(gw.client.post(path, json={"model": MODEL, **body}))
    req = await gw.engine.next_request()
    await gw.engine.generate(req, ["{}"])
    resp = await post
    assert resp.status == 200, await resp.text()
    assert isinstance(req.params, SamplingParams)  # decoded and validated on the way in
    return req.params.to_dict()  # what travels on the wire


async def test_penalties_and_logit_bias_pass_through(gateway: Gateway) -> None:
    params = await _params(gateway, "/v1/completions", {
        "prompt": "x", "presence_penalty": 1.5, "frequency_penalty": -0.5, "repetition_penalty": 1.3,
        "logit_bias": {"65": -100, "66": 2.5}})
    assert params["presence_penalty"] == 1.5 and params["frequency_penalty"] == -0.5
    assert params["repetition_penalty"] == 1.3
    assert params["logit_bias"] == {65: -100.0, 66: 2.5}


async def test_typical_p_and_integral_numbers_pass_through(gateway: Gateway) -> None:
    params = await _params(gateway, "/v1/chat/completions", {
        "messages": MSG, "typical_p": 0.7, "seed": 3, "n": 1.0, "max_tokens": 4.0, "temperature": 1})
    assert params["typical_p"] == 0.7 and params["seed"] == 3
    assert params["n"] == 1 and isinstance(params["n"], int) and params["max_tokens"] == 4
    assert params["temperature"] == 1.0 and isinstance(params["temperature"], float)


CONSTRAINTS: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    ("json_object", {"response_format": {"type": "json_object"}}, {"kind": "json_object", "spec": None}),
    ("json_schema", {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA,
                                                                              "strict": True}}},
     {"kind": "json_schema", "spec": {**SCHEMA, "x-guidance": COMPACT}}),
    ("schema keeps its own x-guidance", {"guided_json": {**SCHEMA, "x-guidance": {"whitespace_flexible": True}}},
     {"kind": "json_schema", "spec": {**SCHEMA, "x-guidance": {"whitespace_flexible": True}}}),
    ("guided_json as text", {"guided_json": json.dumps(SCHEMA)},
     {"kind": "json_schema", "spec": {**SCHEMA, "x-guidance": COMPACT}}),
    ("guided_regex", {"guided_regex": "[0-9]{3}"}, {"kind": "regex", "spec": "[0-9]{3}"}),
    ("guided_choice", {"guided_choice": ["yes", "no"]}, {"kind": "choice", "spec": ["yes", "no"]}),
    ("guided_grammar", {"guided_grammar": 'start: "a"+'},
     {"kind": "grammar", "spec": 'start: "a"+', "dialect": "lark"}),
    ("structured_outputs json", {"structured_outputs": {"json": SCHEMA}},
     {"kind": "json_schema", "spec": {**SCHEMA, "x-guidance": COMPACT}}),
    ("structured_outputs choice", {"structured_outputs": {"choice": ["a", "b"]}}, {"kind": "choice",
                                                                                   "spec": ["a", "b"]}),
    ("structured_outputs json_object", {"structured_outputs": {"json_object": True}},
     {"kind": "json_object", "spec": None}),
    ("response_format text", {"response_format": {"type": "text"}}, {}),
]


@pytest.mark.parametrize(("name", "body", "expected"), CONSTRAINTS, ids=[c[0] for c in CONSTRAINTS])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_output_constraints(gateway: Gateway, path: str, name: str, body: dict[str, Any],
                                  expected: dict[str, Any]) -> None:
    prompt = {"messages": MSG} if "chat" in path else {"prompt": "x"}
    structured = (await _params(gateway, path, {**prompt, **body}))["structured_output"]
    if not expected:
        assert structured is None
        return
    if expected["kind"] == "json_schema":
        structured = {**structured, "spec": json.loads(structured["spec"])}
    assert structured == expected


async def test_prompt_logprobs_from_echo_or_extra(gateway: Gateway) -> None:
    params = await _params(gateway, "/v1/completions", {"prompt": "x", "echo": True, "logprobs": 3})
    assert params["prompt_logprobs"] == 3 and params["logprobs"] == 3
    params = await _params(gateway, "/v1/completions", {"prompt": "x", "echo": True})
    assert params["prompt_logprobs"] is None and params["logprobs"] is None
    params = await _params(gateway, "/v1/chat/completions", {"messages": MSG, "prompt_logprobs": 2})
    assert params["prompt_logprobs"] == 2
