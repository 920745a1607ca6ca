"""Property-based fuzzing of every endpoint's request body against real processes (a gateway
process, an engine process with the tiny model, redis-server): whatever the body, the answer
is never a 5xx, an error is an OpenAI error body, the engine keeps running, and once the
traffic stops it holds zero KV blocks. Bodies are random JSON, or a valid request with some
fields replaced by random values or by known-hostile ones (huge integers, lone surrogates, deep
nesting, wrong types, numbers past int()'s digit limit), then sent as UTF-8 or, now and then, in
another encoding json.loads would guess (UTF-16/32, with and without BOM) or with invalid
UTF-8 bytes spliced in (both 400s: the gateway reads UTF-8 only)."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pagedserve.launch.redis_server import RedisServer
from tests.e2e.support import EngineProcess, GatewayProcess, start_engines

MODEL = "tiny"
ENDPOINTS = ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/tokenize", "/detokenize"]
MSG = [{"role": "user", "content": "hi"}]
BASE: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"model": MODEL, "messages": MSG, "max_tokens": 4},
    "/v1/completions": {"model": MODEL, "prompt": "hi", "max_tokens": 4},
    "/v1/responses": {"model": MODEL, "input": "hi", "max_output_tokens": 4},
    "/tokenize": {"model": MODEL, "prompt": "hi"},
    "/detokenize": {"model": MODEL, "tokens": [104, 105]},
}
FIELDS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "min_tokens", "temperature",
          "top_p", "top_k", "min_p", "typical_p", "n", "best_of", "seed", "stop", "stop_token_ids", "stream",
          "stream_options",
          "logprobs", "top_logprobs", "echo", "prompt_logprobs", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "logit_bias", "tools", "tool_choice", "parallel_tool_calls", "response_format",
          "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs", "ignore_eos",
          "use_beam_search", "length_penalty", "chat_template_kwargs", "tokens", "add_special_tokens",
          "add_generation_prompt", "return_tokens_as_token_ids", "suffix",
          # /v1/responses
          "input", "instructions", "max_output_tokens", "text", "store", "previous_response_id", "metadata",
          "truncation", "background"]
HOSTILE = [2**64, 2**70, -(2**63) - 1, 10**30, -1, 0, 1.5, float("inf"), float("nan"), "\ud800", "x\udfffy", [],
           {}, [None], [[1]], True, "", "a" * 300, [2**65], {"99999999": 1}, {"1": 1e300},
           {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}},
           [{"role": ["user"], "content": "x"}], {"messages": []}, [{"type": "function", "function": {}}],
           {"type": "function", "function": {"name": 5}}, "[a-", 'start: "a" b', ["a"] * 3,
           {"1" + "0" * 5000: 1}, {"1" + "0" * 25: 1}, {"\ud800": 1}, {"5": float("inf")}, -0.0, 1e308,
           [[1, float("nan")]], {"k": {"\udc00": [1]}}]
ENCODINGS = ["utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le", "utf-32-be", "utf-8-sig"]

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"]}
TOOL = {"type": "function", "function": {"name": "f", "parameters": SCHEMA}}
VALID: dict[str, list[Any]] = {
    "model": [MODEL], "messages": [MSG, [{"role": "system", "content": "s"}, *MSG],
                                   [*MSG, {"role": "assistant", "content": None, "tool_calls": [
                                       {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                                    {"role": "tool", "tool_call_id": "c", "content": "1"}]],
    "prompt": ["hi", [104, 105], ["once"]], "max_tokens": [1, 4, 16], "max_completion_tokens": [2, 8],
    "min_tokens": [0, 2], "temperature": [0, 0.7, 2], "top_p": [0.5, 1], "top_k": [-1, 0, 5], "min_p": [0, 0.2],
    "typical_p": [0.5, 1], "n": [1, 2, 4], "best_of": [2, 4], "seed": [0, 7, 2**63], "stop": ["a", ["x", "y"]],
    "stop_token_ids": [[], [104], [259]], "stream": [True, False], "stream_options": [{"include_usage": True}],
    "logprobs": [0, 2, True], "top_logprobs": [0, 3], "echo": [True], "prompt_logprobs": [0, 1],
    "presence_penalty": [0.5, -2], "frequency_penalty": [1.0], "repetition_penalty": [1.2],
    "logit_bias": [{"104": -100}, {"7": 5}], "tools": [[TOOL]], "tool_choice": ["auto", "none", "required"],
    "parallel_tool_calls": [False], "response_format": [{"type": "json_object"}, {"type": "text"}],
    "guided_json": [SCHEMA], "guided_regex": ["[a-c]{1,3}"], "guided_choice": [["yes", "no"]],
    "guided_grammar": ['start: "a"+'], "structured_outputs": [{"choice": ["a"]}], "ignore_eos": [True],
    "use_beam_search": [True], "length_penalty": [0.5], "chat_template_kwargs": [{"foo": 1}],
    "tokens": [[1, 2, 3], []], "add_special_tokens": [False], "add_generation_prompt": [False],
    "return_tokens_as_token_ids": [True], "suffix": ["z"],
    "input": ["hi", MSG, [*MSG, {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                          {"type": "function_call_output", "call_id": "c", "output": "1"}],
              [{"role": "assistant", "content": [{"type": "output_text", "text": "x"}]}, {"type": "reasoning"}]],
    "instructions": ["be brief"], "max_output_tokens": [1, 4, 16], "store": [True, False],
    "text": [{"format": {"type": "json_schema", "name": "s", "schema": SCHEMA}}, {"format": {"type": "json_object"}}],
    "previous_response_id": ["resp_nope"], "metadata": [{"k": "v"}], "truncation": ["disabled"],
    "background": [False],
}
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)


def field_value(draw: st.DrawFn, name: str) -> Any:
    """Mostly a plausible value (so requests reach the engine), else a hostile or random one."""
    roll = draw(st.integers(0, 9))
    if roll < 6:
        return draw(st.sampled_from(VALID[name]))
    return draw(st.sampled_from(HOSTILE)) if roll < 8 else draw(json_values)


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, bytes]:
    path = draw(st.sampled_from(ENDPOINTS))
    kind = draw(st.sampled_from(["random", "mutated", "mutated", "mutated", "mutated", "mutated", "deep"]))
    if kind == "random":
        body: Any = draw(json_values)
    elif kind == "deep":
        depth = draw(st.integers(60, 5000))
        return path, b'{"model": "tiny", "prompt": ' + b"[" * depth + b"]" * depth + b"}"
    else:
        body = dict(BASE[path])
        for name in draw(st.lists(st.sampled_from(FIELDS), max_size=4, unique=True)):
            body[name] = field_value(draw, name)
    text = json.dumps(body)  # NaN/Infinity go out as bare literals; surrogates as \\ud800
    encoding = draw(st.sampled_from(["utf-8"] * 12 + ENCODINGS + ["invalid"]))
    if encoding == "invalid":
        raw = text.encode()
        cut = draw(st.integers(0, len(raw)))
        return path, raw[:cut] + draw(st.sampled_from([b"\xff", b"\xed\xa0\x80", b"\xc0\xaf"])) + raw[cut:]
    return path, text.encode(encoding)


class FuzzGateway(GatewayProcess):
    """The gateway under fuzzing, with small limits, and one raw HTTP request at a time."""

    def __init__(self, redis_url: str, log_dir: Path) -> None:
        super().__init__(redis_url, "fuzz-gw", log_dir, "--max-tokens-limit", "16", "--max-n", "4",
                         "--request-timeout", "60")
        self.wait_healthy(60)

    def request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        try:
            conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()


@pytest.fixture(scope="module")
def fuzz_stack(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[tuple[FuzzGateway, EngineProcess]]:
    log_dir = tmp_path_factory.mktemp("fuzz")
    with RedisServer() as server:
        [engine] = start_engines(tiny_llama_dir, server.url, log_dir, ["fuzz-0"], "--served-model-name", MODEL,
                                 "--kv-cache-memory", "4MiB")
        try:
            gateway = FuzzGateway(server.url, log_dir)
            try:
                yield gateway, engine
            finally:
                gateway.stop()
        finally:
            engine.stop()


def _check(status: int, payload: bytes, path: str, body: bytes) -> None:
    where = f"{path} {body[:300]!r}"
    assert 0 < status < 500, f"{status} {payload[:300]!r} for {where}"
    if status >= 400:
        error = json.loads(payload)["error"]
        assert set(error) == {"message", "type", "param", "code"}, where
    elif payload.startswith(b"data: "):
        assert payload.endswith(b"data: [DONE]\n\n"), where
    elif payload.startswith(b"event: "):  # a Responses stream ends with its final event
        last = json.loads(payload.rstrip(b"\n").rsplit(b"\n", 1)[-1].removeprefix(b"data: "))
        assert last["type"] in ("response.completed", "response.incomplete", "response.failed"), where


@settings(max_examples=600, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                 HealthCheck.data_too_large])
@given(requests())
def test_fuzzed_bodies_never_5xx(fuzz_stack: tuple[FuzzGateway, EngineProcess], request: tuple[str, bytes]) -> None:
    gateway, engine = fuzz_stack
    path, body = request
    status, payload = gateway.request("POST", path, body)
    event(f"{path} {status}")  # --hypothesis-show-statistics: how many bodies got through to the engine
    _check(status, payload, path, body)
    assert engine.proc.poll() is None, f"engine died on {path} {body[:300]!r}: {engine.log_tail()}"


def test_engine_serves_and_holds_no_block_after_fuzzing(fuzz_stack: tuple[FuzzGateway, EngineProcess]) -> None:
    gateway, engine = fuzz_stack
    status, payload = gateway.request("POST", "/v1/completions", json.dumps(
        {"model": MODEL, "prompt": "ok", "max_tokens": 4, "temperature": 0, "ignore_eos": True}).encode())
    assert status == 200 and json.loads(payload)["usage"]["completion_tokens"] == 4
    assert engine.wait_drained(timeout=60)["num_used_blocks"] == 0
    assert gateway.proc.poll() is None
