"""Gateway generation through the wire protocol, with a scripted engine on a real Redis."""

from __future__ import annotations

import asyncio

from common.protocol import SeqOutput, TokenLogprob, Usage
from tests.fixtures.gateway import MODEL, Gateway, gateway, parse_sse, watch_aborts

__all__ = ["gateway"]

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}]}


async def test_chat_non_streaming(gateway: Gateway) -> None:
    post = asyncio.create_task(gateway.client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 20}))
    req = await gateway.engine.next_request()
    assert req.model == MODEL and req.params.max_tokens == 20 and req.gateway == gateway.config.gateway_id
    await gateway.engine.generate(req, ["Hello world! 😀"])
    resp = await post
    assert resp.status == 200
    body = await resp.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hello world! 😀", "refusal": None}
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["prompt_tokens"] == len(req.prompt_token_ids)
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]


async def test_chat_streaming_format(gateway: Gateway) -> None:
    payload = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    post = asyncio.create_task(gateway.client.post("/v1/chat/completions", json=payload))
    req = await gateway.engine.next_request()
    await gateway.engine.generate(req, ["你好世界 🚀 done"], finish="length")
    resp = await post
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    assert resp.headers["Cache-Control"] == "no-cache" and resp.headers["X-Accel-Buffering"] == "no"
    events = parse_sse(await resp.text())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == req.id for c in chunks)
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["prompt_tokens"] == len(req.prompt_token_ids)
    content = chunks[1:-1]
    assert all(c["usage"] is None for c in content)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in content)
    assert text == "你好世界 🚀 done"
    assert all("\ufffd" not in c["choices"][0]["delta"].get("content", "") for c in content)
    assert [c["choices"][0]["finish_reason"] for c in content][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in content[:-1])


async def test_completion_n2_streaming(gateway: Gateway) -> None:
    payload = {"model": MODEL, "prompt": "The quick", "n": 2, "stream": True, "max_tokens": 30}
    post = asyncio.create_task(gateway.client.post("/v1/completions", json=payload))
    req = await gateway.engine.next_request()
    assert req.params.n == 2
    await gateway.engine.generate(req, [" brown fox", " lazy dog jumps"], chunk=2)
    events = parse_sse(await (await post).text())
    assert events[-1] == "[DONE]"
    texts = {0: "", 1: ""}
    for c in events[:-1]:
        assert c["object"] == "text_completion" and "usage" not in c
        texts[c["choices"][0]["index"]] += c["choices"][0]["text"]
    assert texts == {0: " brown fox", 1: " lazy dog jumps"}


async def test_stop_string_aborts_engine(gateway: Gateway) -> None:
    aborted: list[str] = []
    task = await watch_aborts(gateway.redis, gateway.engine.keys, aborted)
    payload = {"model": MODEL, "prompt": "Paged", "stop": ["STOP"], "max_tokens": 50}
    post = asyncio.create_task(gateway.client.post("/v1/completions", json=payload))
    req = await gateway.engine.next_request()
    tok_text = " attention stores blocks. STOP here."
    from gateway.text.tokenizer import ModelTokenizer

    ids = ModelTokenizer(gateway.engine.tokenizer_dir).encode(tok_text, add_special_tokens=False)
    for i, token in enumerate(ids):  # one token per message, never finishing: the gateway must stop
        await gateway.engine.publish(req, [SeqOutput(index=0, token_ids=[token], offset=i)])
    body = await (await post).json()
    assert body["choices"][0]["text"] == " attention stores blocks. "
    assert body["choices"][0]["finish_reason"] == "stop"
    for _ in range(50):
        if req.id in aborted:
            break
        await asyncio.sleep(0.05)
    task.cancel()
    assert req.id in aborted


async def test_duplicate_tokens_are_dropped_and_gaps_reported(gateway: Gateway) -> None:
    post = asyncio.create_task(gateway.client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi"}))
    req = await gateway.engine.next_request()
    eng = gateway.engine
    from gateway.text.tokenizer import ModelTokenizer

    ids = ModelTokenizer(eng.tokenizer_dir).encode("Hello world", add_special_tokens=False)
    await eng.publish(req, [SeqOutput(index=0, token_ids=ids[:2], offset=0)])
    # a resuming engine repeats from token 0 with an old seq
    await eng.publish(req, [SeqOutput(index=0, token_ids=ids, offset=0, finish_reason="stop")], Usage(3, len(ids)),
                      seq=0)
    body = await (await post).json()
    assert body["choices"][0]["text"] == "Hello world"
    post = asyncio.create_task(gateway.client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi"}))
    req = await eng.next_request()
    await eng.publish(req, [SeqOutput(index=0, token_ids=ids[:1], offset=0)], seq=0)
    await eng.publish(req, [SeqOutput(index=0, token_ids=ids[1:], offset=1, finish_reason="stop")],
                      seq=2)  # message 1 lost
    resp = await post
    assert resp.status == 500
    assert (await resp.json())["error"]["code"] == "output_gap"


async def test_chat_logprobs(gateway: Gateway) -> None:
    payload = {**CHAT, "logprobs": True, "top_logprobs": 2}
    post = asyncio.create_task(gateway.client.post("/v1/chat/completions", json=payload))
    req = await gateway.engine.next_request()
    assert req.params.logprobs == 2
    lp = [TokenLogprob(-0.1, [(72, -0.1), (73, -2.5)]), TokenLogprob(-0.2, [(74, -0.2), (75, -3.0)])]
    await gateway.engine.publish(req, [SeqOutput(index=0, token_ids=[72, 74], offset=0, finish_reason="stop",
                                                 logprobs=lp)], Usage(5, 2))
    body = await (await post).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert [c["logprob"] for c in content] == [-0.1, -0.2]
    assert len(content[0]["top_logprobs"]) == 2 and content[0]["top_logprobs"][1]["logprob"] == -2.5
    assert content[0]["bytes"] == list(content[0]["token"].encode())


async def test_engine_error_is_an_openai_error(gateway: Gateway) -> None:
    from common.protocol import ErrorInfo

    post = asyncio.create_task(gateway.client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi"}))
    req = await gateway.engine.next_request()
    await gateway.engine.publish(req, [], error=ErrorInfo("prompt too long", "invalid_request_error", "too_long"))
    resp = await post
    assert resp.status == 400
    assert (await resp.json())["error"] == {"message": "prompt too long", "type": "invalid_request_error",
                                            "param": None, "code": "too_long"}


async def test_client_disconnect_aborts(gateway: Gateway) -> None:
    aborted: list[str] = []
    task = await watch_aborts(gateway.redis, gateway.engine.keys, aborted)
    resp = await gateway.client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "stream": True})
    req = await gateway.engine.next_request()
    await gateway.engine.publish(req, [SeqOutput(index=0, token_ids=[72], offset=0)])
    await resp.content.readline()
    resp.close()
    for _ in range(60):
        if req.id in aborted:
            break
        await asyncio.sleep(0.05)
    task.cancel()
    assert req.id in aborted
