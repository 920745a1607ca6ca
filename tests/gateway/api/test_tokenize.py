"""POST /tokenize and /detokenize (vLLM's shapes) agree with the tokenizer and with what
/v1/chat/completions sends the engine for the same messages."""

from __future__ import annotations

import asyncio
from pathlib import Path

from gateway.text.tokenizer import ModelTokenizer
from tests.fixtures.gateway import MODEL, Gateway, gateway, open_live_gateway

__all__ = ["gateway"]

TEXT = "Hello world! 你好 😀"
MSG = [{"role": "user", "content": "Paged attention?"}]


async def test_tokenize_round_trip(gateway: Gateway) -> None:
    tok = ModelTokenizer(gateway.engine.tokenizer_dir)
    resp = await gateway.client.post("/tokenize", json={"model": MODEL, "prompt": TEXT, "return_token_strs": True})
    body = await resp.json()
    assert resp.status == 200
    assert body["tokens"] == tok.encode(TEXT) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == gateway.engine.max_model_len
    assert body["token_strs"] == [tok.token_text(t) for t in body["tokens"]]
    back = await (await gateway.client.post("/detokenize", json={"model": MODEL, "tokens": body["tokens"]})).json()
    assert back == {"prompt": TEXT}


async def test_tokenize_messages_matches_chat_prompt(gateway: Gateway) -> None:
    tools = [{"type": "function", "function": {"name": "f"}}]
    counted = await (await gateway.client.post("/tokenize", json={"model": MODEL, "messages": MSG,
                                                                   "tools": tools})).json()
    post = asyncio.create_task(gateway.client.post("/v1/chat/completions",
                                                   json={"model": MODEL, "messages": MSG, "tools": tools}))
    req = await gateway.engine.next_request()
    await gateway.engine.generate(req, ["ok"])
    await post
    assert counted["tokens"] == req.prompt_token_ids
    plain = await (await gateway.client.post("/tokenize", json={"model": MODEL, "messages": MSG,
                                                                 "add_generation_prompt": False})).json()
    assert plain["count"] < counted["count"]


async def test_tokenize_errors(gateway: Gateway) -> None:
    cases = [({"model": MODEL}, "prompt"), ({"model": MODEL, "prompt": "a", "messages": MSG}, "prompt"),
             ({"model": MODEL, "prompt": 5}, "prompt"), ({"prompt": "a"}, "model"),
             ({"model": MODEL, "messages": [{"role": 1}]}, "messages[0].role")]
    for body, param in cases:
        resp = await gateway.client.post("/tokenize", json=body)
        assert resp.status == 400 and (await resp.json())["error"]["param"] == param
    for tokens in ([10**9], [-1], [2**70], "abc", [1.5]):
        resp = await gateway.client.post("/detokenize", json={"model": MODEL, "tokens": tokens})
        assert resp.status == 400 and (await resp.json())["error"]["param"] == "tokens"
    resp = await gateway.client.post("/tokenize", json={"model": "nope", "prompt": "a"})
    assert resp.status == 404


async def test_tokenize_needs_the_api_key(redis_server: str, tiny_tokenizer_dir: Path) -> None:
    async with open_live_gateway(redis_server, tiny_tokenizer_dir, api_keys=("k",)) as gw:
        for path, body in (("/tokenize", {"model": MODEL, "prompt": "a"}), ("/detokenize", {"model": MODEL,
                                                                                             "tokens": [1]})):
            assert (await gw.client.post(path, json=body)).status == 401
            ok = await gw.client.post(path, json=body, headers={"Authorization": "Bearer k"})
            assert ok.status == 200
