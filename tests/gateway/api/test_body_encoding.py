"""Issue 24's 500s, and a property-based check of the whole gateway-side path a body takes
(`parse_body` → `parse_request` → grammar check → prompt token ids → context fit → the msgpack
request the engine reads): whatever the bytes, it ends normally or with a 4xx OpenAIError.
Bodies: valid requests with fields replaced by numeric extremes (huge ints, 1e400, -0,
NaN/Infinity literals, huge int keys in logit_bias, nested numbers) or by strings holding lone
surrogate escapes (values and keys), then encoded as UTF-8, UTF-8 with a BOM, UTF-16/32 with
and without BOMs, or with invalid UTF-8 bytes spliced in."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.protocol import EngineRequest
from gateway.api.body import parse_body
from gateway.api.endpoint import Endpoint
from gateway.api.prompt import prompt_ids
from gateway.api.structured import check_structured
from gateway.api.validation import check_context, parse_request
from gateway.config import GatewayConfig
from gateway.errors import OpenAIError
from gateway.text.tokenizer import ModelTokenizer
from tests.fixtures.gateway import MODEL, Gateway, gateway

__all__ = ["gateway"]

CHAT, COMP = "/v1/chat/completions", "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "description": "d", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}
BASE: dict[str, dict[str, Any]] = {
    CHAT: {"model": MODEL, "messages": MSG, "max_tokens": 4, "tools": [TOOL], "stop": ["x"]},
    COMP: {"model": MODEL, "prompt": "hi", "max_tokens": 4, "logit_bias": {"5": 1}, "stop": ["x"]},
}
FIELDS = ["max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "typical_p", "n", "seed", "logprobs",
          "top_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
          "stop_token_ids", "prompt", "stop", "user", "tool_choice", "guided_json", "length_penalty"]
HUGE = "1" + "0" * 5000  # past int()'s 4300-digit limit
NUMBER_LITERALS = ["1e400", "-1e400", "-0", "-0.0", "NaN", "Infinity", "-Infinity", "1" + "0" * 30,
                   "-" + "9" * 40, "1e-400", "4.9e-324", "1.7976931348623157e308", "18446744073709551616",
                   "0.5", "3", "[1e400]", "[[1, NaN]]", '{"1": 1e400}', '{"' + HUGE + '": 1}',
                   '{"' + HUGE[:30] + '": 1}', '{"-1": 1}', '{"0": NaN}', '{"1.5": 1}']
SURROGATES = ["\\ud800", "a\\udfffb", "\\udbff\\udc00", "\\uDC00x", "\\ud83d"]  # JSON escapes
ENCODINGS = ["utf-8", "utf-8-sig", "utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le", "utf-32-be",
             "invalid"]


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


@st.composite
def bodies(draw: st.DrawFn) -> tuple[str, bytes]:
    """(path, raw bytes): a valid body with some fields' JSON text replaced, then encoded."""
    path = draw(st.sampled_from([CHAT, COMP]))
    parts = {k: _json(v) for k, v in BASE[path].items()}
    for name in draw(st.lists(st.sampled_from(FIELDS), max_size=3, unique=True)):
        kind = draw(st.sampled_from(["number", "surrogate", "surrogate key"]))
        if kind == "number":
            parts[name] = draw(st.sampled_from(NUMBER_LITERALS))
        elif kind == "surrogate":
            text = '"' + draw(st.sampled_from(SURROGATES)) + '"'
            parts[name] = draw(st.sampled_from([text, f"[{text}]", '{"k": ' + text + "}"]))
        else:
            parts[name] = '{"' + draw(st.sampled_from(SURROGATES)) + '": 1}'
    if path == CHAT and draw(st.booleans()):  # a surrogate inside a message or the tool schema
        where = draw(st.sampled_from(["content", "role", "key", "tool"]))
        esc = draw(st.sampled_from(SURROGATES))
        if where == "tool":
            parts["tools"] = parts["tools"].replace('"a"', f'"{esc}"', 1)
        else:
            msg = {"content": f'{{"role": "user", "content": "x{esc}"}}',
                   "role": f'{{"role": "{esc}", "content": "x"}}',
                   "key": f'{{"role": "user", "content": "x", "{esc}": 1}}'}[where]
            parts["messages"] = f"[{msg}]"
    text = "{" + ", ".join(f"{_json(k)}: {v}" for k, v in parts.items()) + "}"
    encoding = draw(st.sampled_from(ENCODINGS))
    if encoding == "invalid":
        raw = text.encode("utf-8")
        cut = draw(st.integers(0, len(raw)))
        bad = draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xf5\x80\x80\x80", b"\x80", b"\xc0\xaf"]))
        return path, raw[:cut] + bad + raw[cut:]
    return path, text.encode(encoding)


def run_gateway_path(path: str, raw: bytes, tok: ModelTokenizer, cfg: GatewayConfig) -> bytes:
    """What a POST does before it waits for the engine; raises OpenAIError for the client."""
    kind = Endpoint.CHAT if path == CHAT else Endpoint.COMPLETION
    req = parse_request(parse_body(raw), kind, cfg)
    if req.params.structured_output is not None:
        check_structured(req.params.structured_output, req.structured_param)
    ids = prompt_ids(req, tok)
    check_context(req, len(ids), 512, cfg)
    return EngineRequest(id="r", gateway="gw", model=req.model, prompt_token_ids=ids, params=req.params,
                         arrival=0.0).encode()


@pytest.fixture(scope="module")
def tok(tiny_tokenizer_dir: Path) -> ModelTokenizer:
    return ModelTokenizer(str(tiny_tokenizer_dir))


@settings(max_examples=400, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                 HealthCheck.data_too_large])
@given(bodies())
def test_any_body_ends_in_success_or_a_4xx(tok: ModelTokenizer, body: tuple[str, bytes]) -> None:
    path, raw = body
    try:
        run_gateway_path(path, raw, tok, GatewayConfig())
    except OpenAIError as exc:
        assert 400 <= exc.status < 500, (exc.status, exc.message)
        assert set(exc.body()["error"]) == {"message", "type", "param", "code"}
        json.dumps(exc.body(), ensure_ascii=False).encode("utf-8")  # the error itself is sendable


def _comp(extra: str) -> bytes:
    return ('{"model": "tiny", "prompt": "hi", "max_tokens": 2, ' + extra + "}").encode()


SURROGATE_UTF16 = b'{"model": "tiny", "prompt": "a' + "\ud800".encode("utf-16-le", "surrogatepass") + b'"}'
REFUSED: list[tuple[str, bytes, str | None, str]] = [
    ("logit_bias key of 5001 digits", _comp(f'"logit_bias": {{"{HUGE}": 1}}'), "logit_bias", "token_id_out_of_range"),
    ("logit_bias key of 21 digits", _comp('"logit_bias": {"1' + "0" * 20 + '": 1}'), "logit_bias",
     "token_id_out_of_range"),
    ("utf-16 with BOM", json.dumps({"model": MODEL, "prompt": "hi"}).encode("utf-16"), None, "invalid_encoding"),
    ("utf-16-le without BOM", json.dumps({"model": MODEL, "prompt": "hi"}).encode("utf-16-le"), None,
     "invalid_json"),
    ("utf-32 with BOM", json.dumps({"model": MODEL, "prompt": "hi"}).encode("utf-32"), None, "invalid_encoding"),
    ("utf-32-be without BOM", json.dumps({"model": MODEL, "prompt": "hi"}).encode("utf-32-be"), None,
     "invalid_json"),
    ("lone surrogate in utf-16 text", SURROGATE_UTF16.decode("latin-1").encode("utf-16-le", "surrogatepass"),
     None, "invalid_encoding"),
    ("surrogate encoded in utf-8 bytes", _comp('"user": "\xed\xa0\x80"'.encode("latin-1").decode("latin-1"))
     .replace(b"\xc3\xad\xc2\xa0\xc2\x80", b"\xed\xa0\x80"), None, "invalid_encoding"),
    ("invalid utf-8 byte", _comp('"user": "') + b'\xff"}', None, "invalid_encoding"),
    ("lone surrogate escape in a logit_bias key", _comp('"logit_bias": {"\\ud800": 1}'), "logit_bias",
     "invalid_unicode"),
    ("1e400 temperature", _comp('"temperature": 1e400'), "temperature", "invalid_type"),
    ("-Infinity penalty", _comp('"presence_penalty": -Infinity'), "presence_penalty", "invalid_type"),
]


@pytest.mark.parametrize(("name", "raw", "param", "code"), REFUSED, ids=[r[0] for r in REFUSED])
async def test_refused_bodies_are_400(gateway: Gateway, name: str, raw: bytes, param: str | None,
                                      code: str) -> None:
    resp = await gateway.client.post(COMP, data=raw, headers={"Content-Type": "application/json"})
    body = await resp.json()
    assert resp.status == 400, body
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == code and body["error"]["param"] == param, body
    assert await gateway.redis.xlen(gateway.engine.keys.requests(MODEL)) == 0


async def test_utf8_bom_and_minus_zero_are_accepted(gateway: Gateway) -> None:
    raw = b"\xef\xbb\xbf" + _comp('"temperature": -0.0, "presence_penalty": -0')
    post = asyncio.create_task(gateway.client.post(COMP, data=raw, headers={"Content-Type": "application/json"}))
    req = await gateway.engine.next_request()
    assert req.params.temperature == 0.0 and req.params.presence_penalty == 0.0
    await gateway.engine.generate(req, ["ok"])
    resp = await post
    assert resp.status == 200 and (await resp.json())["choices"][0]["text"] == "ok"
