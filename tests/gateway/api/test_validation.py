"""Bad requests get the right 4xx and an OpenAI error body; nothing reaches the engine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.gateway import MODEL, Gateway, gateway, open_live_gateway

__all__ = ["gateway"]

MSG = [{"role": "user", "content": "hi"}]
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"

BAD: list[tuple[str, str, Any, int, str | None]] = [
    ("invalid json", CHAT, b"{not json", 400, None),
    ("body not an object", CHAT, [1, 2], 400, None),
    ("missing model", CHAT, {"messages": MSG}, 400, "model"),
    ("model not a string", CHAT, {"model": 3, "messages": MSG}, 400, "model"),
    ("missing messages", CHAT, {"model": MODEL}, 400, "messages"),
    ("messages not a list", CHAT, {"model": MODEL, "messages": "hi"}, 400, "messages"),
    ("empty messages", CHAT, {"model": MODEL, "messages": []}, 400, "messages"),
    ("message not an object", CHAT, {"model": MODEL, "messages": ["hi"]}, 400, "messages[0]"),
    ("unknown role", CHAT, {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages[0].role"),
    ("missing content", CHAT, {"model": MODEL, "messages": [{"role": "user"}]}, 400, "messages[0].content"),
    ("content wrong type", CHAT, {"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400,
     "messages[0].content"),
    ("image part", CHAT, {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400, "messages[0].content"),
    ("n = 0", CHAT, {"model": MODEL, "messages": MSG, "n": 0}, 400, "n"),
    ("n huge", CHAT, {"model": MODEL, "messages": MSG, "n": 10_000}, 400, "n"),
    ("n not int", CHAT, {"model": MODEL, "messages": MSG, "n": "2"}, 400, "n"),
    ("n bool", CHAT, {"model": MODEL, "messages": MSG, "n": True}, 400, "n"),
    ("negative max_tokens", CHAT, {"model": MODEL, "messages": MSG, "max_tokens": -1}, 400, "max_tokens"),
    ("huge max_tokens", CHAT, {"model": MODEL, "messages": MSG, "max_tokens": 10**9}, 400, "max_tokens"),
    ("zero max_completion_tokens", CHAT, {"model": MODEL, "messages": MSG, "max_completion_tokens": 0}, 400,
     "max_completion_tokens"),
    ("temperature < 0", CHAT, {"model": MODEL, "messages": MSG, "temperature": -0.5}, 400, "temperature"),
    ("temperature > 2", CHAT, {"model": MODEL, "messages": MSG, "temperature": 3}, 400, "temperature"),
    ("temperature string", CHAT, {"model": MODEL, "messages": MSG, "temperature": "hot"}, 400, "temperature"),
    ("top_p > 1", CHAT, {"model": MODEL, "messages": MSG, "top_p": 1.5}, 400, "top_p"),
    ("top_p = 0", CHAT, {"model": MODEL, "messages": MSG, "top_p": 0}, 400, "top_p"),
    ("top_k < -1", CHAT, {"model": MODEL, "messages": MSG, "top_k": -5}, 400, "top_k"),
    ("typical_p = 0", CHAT, {"model": MODEL, "messages": MSG, "typical_p": 0}, 400, "typical_p"),
    ("typical_p > 1", COMP, {"model": MODEL, "prompt": "x", "typical_p": 1.01}, 400, "typical_p"),
    ("typical_p string", COMP, {"model": MODEL, "prompt": "x", "typical_p": "0.5"}, 400, "typical_p"),
    ("typical_p with beam search", COMP, {"model": MODEL, "prompt": "x", "use_beam_search": True, "temperature": 0,
                                          "n": 2, "typical_p": 0.5}, 400, "typical_p"),
    ("seed not int", CHAT, {"model": MODEL, "messages": MSG, "seed": 1.5}, 400, "seed"),
    ("stop wrong type", CHAT, {"model": MODEL, "messages": MSG, "stop": 7}, 400, "stop"),
    ("too many stops", CHAT, {"model": MODEL, "messages": MSG, "stop": [str(i) for i in range(50)]}, 400, "stop"),
    ("empty stop", CHAT, {"model": MODEL, "messages": MSG, "stop": [""]}, 400, "stop"),
    ("stream not bool", CHAT, {"model": MODEL, "messages": MSG, "stream": "yes"}, 400, "stream"),
    ("stream_options without stream", CHAT, {"model": MODEL, "messages": MSG,
                                             "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("top_logprobs without logprobs", CHAT, {"model": MODEL, "messages": MSG, "top_logprobs": 2}, 400,
     "top_logprobs"),
    ("top_logprobs too big", CHAT, {"model": MODEL, "messages": MSG, "logprobs": True, "top_logprobs": 99}, 400,
     "top_logprobs"),
    ("presence_penalty > 2", CHAT, {"model": MODEL, "messages": MSG, "presence_penalty": 2.5}, 400,
     "presence_penalty"),
    ("tools without function", CHAT, {"model": MODEL, "messages": MSG, "tools": [{"type": "function"}]}, 400,
     "tools[0]"),
    ("min_tokens > max_tokens", CHAT, {"model": MODEL, "messages": MSG, "max_tokens": 2, "min_tokens": 5}, 400,
     "min_tokens"),
    ("missing prompt", COMP, {"model": MODEL}, 400, "prompt"),
    ("empty prompt", COMP, {"model": MODEL, "prompt": ""}, 400, "prompt"),
    ("prompt wrong type", COMP, {"model": MODEL, "prompt": {"a": 1}}, 400, "prompt"),
    ("batched prompts", COMP, {"model": MODEL, "prompt": ["a", "b"]}, 400, "prompt"),
    ("best_of < n", COMP, {"model": MODEL, "prompt": "x", "n": 3, "best_of": 2}, 400, "best_of"),
    ("best_of streamed", COMP, {"model": MODEL, "prompt": "x", "best_of": 3, "stream": True}, 400, "best_of"),
    ("logprobs too big", COMP, {"model": MODEL, "prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ("suffix", COMP, {"model": MODEL, "prompt": "x", "suffix": "y"}, 400, "suffix"),
    ("token id out of vocab", COMP, {"model": MODEL, "prompt": [1, 10**7]}, 400, "prompt"),
    ("prompt longer than context", COMP, {"model": MODEL, "prompt": "Hello world! " * 400}, 400, "prompt"),
    ("max_tokens past context", COMP, {"model": MODEL, "prompt": "x", "max_tokens": 600}, 400, "max_tokens"),
    ("unknown model", CHAT, {"model": "gpt-9", "messages": MSG}, 404, "model"),
]


def _check_error(body: dict[str, Any], param: str | None) -> None:
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str)
    if param is not None:
        assert error["param"] == param


@pytest.mark.parametrize(("name", "path", "payload", "status", "param"), BAD, ids=[b[0] for b in BAD])
async def test_bad_request(gateway: Gateway, name: str, path: str, payload: Any, status: int,
                           param: str | None) -> None:
    data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    resp = await gateway.client.post(path, data=data, headers={"Content-Type": "application/json"})
    assert resp.status == status, await resp.text()
    _check_error(await resp.json(), param)
    assert await gateway.redis.xlen(gateway.engine.keys.requests(MODEL)) == 0


async def test_oversized_body_is_413(redis_server: str, tiny_tokenizer_dir: Path) -> None:
    async with open_live_gateway(redis_server, tiny_tokenizer_dir, max_body_bytes=1000) as gw:
        resp = await gw.client.post(COMP, json={"model": MODEL, "prompt": "x" * 5000})
        assert resp.status == 413
        _check_error(await resp.json(), None)


async def test_api_keys(redis_server: str, tiny_tokenizer_dir: Path) -> None:
    async with open_live_gateway(redis_server, tiny_tokenizer_dir, api_keys=("k1", "k2")) as gw:
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic k1"}):
            resp = await gw.client.get("/v1/models", headers=headers)
            assert resp.status == 401
            _check_error(await resp.json(), None)
        resp = await gw.client.get("/v1/models", headers={"Authorization": "Bearer k2"})
        assert resp.status == 200
        assert [m["id"] for m in (await resp.json())["data"]] == [MODEL]
        assert (await gw.client.get("/health")).status == 200  # no key needed for probes


async def test_unknown_route_and_method(gateway: Gateway) -> None:
    resp = await gateway.client.get("/v1/nothing")
    assert resp.status == 404
    _check_error(await resp.json(), None)
    resp = await gateway.client.get(CHAT)
    assert resp.status == 405
    _check_error(await resp.json(), None)
