"""The gateway names the serving engine (issue 40), with a scripted engine on a real Redis:
header and `system_fingerprint` of a whole response, `system_fingerprint` of stream chunks
(the new engine's after a resume elsewhere), old-style messages that name none, and the
per-engine served-requests counter."""

from __future__ import annotations

import asyncio

from prometheus_client.parser import text_string_to_metric_families

from common.protocol import REQUEST_FIELD, EngineRequest, OutputMessage, SeqOutput, Usage, encode_outputs
from gateway.text.tokenizer import ModelTokenizer
from tests.fixtures.gateway import MODEL, Gateway, gateway, parse_sse

__all__ = ["gateway"]

HEADER = "x-pagedserve-engine"


async def send(gw: Gateway, req: EngineRequest, seq: int, outputs: list[SeqOutput], engine: str | None,
               usage: Usage | None = None) -> None:
    message = OutputMessage(id=req.id, seq=seq, outputs=outputs, usage=usage, engine=engine)
    await gw.redis.xadd(gw.engine.keys.out(req.gateway), {REQUEST_FIELD: encode_outputs([message])})


def tokens(gw: Gateway, text: str) -> list[int]:
    return ModelTokenizer(gw.engine.tokenizer_dir).encode(text, add_special_tokens=False)


async def served(gw: Gateway, engine: str) -> float:
    text = await (await gw.client.get("/metrics")).text()
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == "pagedserve_gateway_served_requests_total"
               and sample.labels == {"model": MODEL, "engine": engine})


async def test_a_whole_response_names_its_engine(gateway: Gateway) -> None:
    before = await served(gateway, "engine-a")
    post = asyncio.create_task(gateway.client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi"}))
    req = await gateway.engine.next_request()
    ids = tokens(gateway, " there friend")
    await send(gateway, req, 0, [SeqOutput(index=0, token_ids=ids, offset=0,
                                           finish_reason="stop")], "engine-a", Usage(len(req.prompt_token_ids), 3))
    resp = await post
    assert resp.status == 200 and resp.headers[HEADER] == "engine-a"
    body = await resp.json()
    assert body["system_fingerprint"] == "pagedserve-engine-a" and body["choices"][0]["text"] == " there friend"
    assert await served(gateway, "engine-a") == before + 1


async def test_an_old_engine_that_names_none_is_answered_as_before(gateway: Gateway) -> None:
    post = asyncio.create_task(gateway.client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}))
    req = await gateway.engine.next_request()
    await gateway.engine.generate(req, ["Hello"])  # the scripted engine's messages carry no engine id
    resp = await post
    assert resp.status == 200 and HEADER not in resp.headers
    body = await resp.json()
    assert body["system_fingerprint"] is None and body["choices"][0]["message"]["content"] == "Hello"


async def test_stream_chunks_name_the_engine_and_the_new_one_after_a_resume(gateway: Gateway) -> None:
    payload = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "stream": True,
               "stream_options": {"include_usage": True}}
    post = asyncio.create_task(gateway.client.post("/v1/chat/completions", json=payload))
    req = await gateway.engine.next_request()
    first, second = tokens(gateway, "Hello"), tokens(gateway, " world")
    await send(gateway, req, 0, [SeqOutput(index=0, token_ids=first, offset=0)], "engine-a")
    resp = await post  # the stream starts with its first output: engine-a's is in
    assert resp.status == 200 and resp.headers[HEADER] == "engine-a"  # the engine as the stream started
    # engine-a went away; engine-b resumed from the checkpoint (seq and offsets go on)
    await send(gateway, req, 1, [SeqOutput(index=0, token_ids=second, offset=len(first),
                                           finish_reason="stop")], "engine-b",
               Usage(len(req.prompt_token_ids), len(first) + len(second)))
    chunks = parse_sse(await resp.text())[:-1]
    fingerprints = [c["system_fingerprint"] for c in chunks]
    assert fingerprints[0] == "pagedserve-engine-a"  # the role chunk goes out with the first output
    assert fingerprints[-1] == "pagedserve-engine-b" and chunks[-1]["choices"] == []  # the usage chunk
    assert set(fingerprints) == {"pagedserve-engine-a", "pagedserve-engine-b"}
    switch = fingerprints.index("pagedserve-engine-b")
    assert all(f == "pagedserve-engine-b" for f in fingerprints[switch:])
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == "Hello world"
