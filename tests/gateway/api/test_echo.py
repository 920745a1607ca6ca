"""Completions with `echo` (and `logprobs`): the prompt comes back before the text with its
tokens' logprobs, the first null, as vLLM and evaluation harnesses expect; `prompt_logprobs`
(vLLM's extra) comes back at the top level."""

from __future__ import annotations

import asyncio

from common.protocol import SeqOutput, TokenLogprob, Usage
from gateway.text.tokenizer import ModelTokenizer
from tests.fixtures.gateway import MODEL, Gateway, gateway, parse_sse

__all__ = ["gateway"]


def _prompt_lps(n: int) -> list[TokenLogprob | None]:
    return [None] + [TokenLogprob(-0.5 * i, [(i, -0.5 * i), (i + 1, -9.0)]) for i in range(1, n)]


async def _answer(gw: Gateway, body: dict[str, object]) -> tuple[list[int], object]:
    post = asyncio.create_task(gw.client.post("/v1/completions", json={"model": MODEL, **body}))
    req = await gw.engine.next_request()
    ids = req.prompt_token_ids
    out = SeqOutput(index=0, token_ids=[72, 73], offset=0, finish_reason="length",
                    logprobs=[TokenLogprob(-0.1, [(72, -0.1)]), TokenLogprob(-0.2, [(73, -0.2)])])
    await gw.engine.publish(req, [out], Usage(len(ids), 2), prompt_logprobs=_prompt_lps(len(ids)))
    resp = await post
    assert resp.status == 200, await resp.text()
    return ids, await resp.json() if not body.get("stream") else parse_sse(await resp.text())


async def test_echo_with_logprobs(gateway: Gateway) -> None:
    tok = ModelTokenizer(gateway.engine.tokenizer_dir)
    ids, body = await _answer(gateway, {"prompt": "Hello world", "echo": True, "logprobs": 1, "max_tokens": 2})
    choice = body["choices"][0]  # type: ignore[index]
    assert choice["text"] == "Hello world" + tok.decode([72, 73])
    lp = choice["logprobs"]
    n = len(ids)
    assert lp["tokens"] == [tok.token_text(t) for t in [*ids, 72, 73]]
    assert lp["token_logprobs"] == [None] + [-0.5 * i for i in range(1, n)] + [-0.1, -0.2]
    assert lp["top_logprobs"][0] is None and lp["top_logprobs"][1] == {tok.token_text(1): -0.5}
    assert lp["text_offset"][0] == 0 and lp["text_offset"][n] == len("Hello world")


async def test_echo_streamed(gateway: Gateway) -> None:
    tok = ModelTokenizer(gateway.engine.tokenizer_dir)
    ids, events = await _answer(gateway, {"prompt": "Hello world", "echo": True, "logprobs": 0, "stream": True})
    chunks = [e for e in events if e != "[DONE]"]  # type: ignore[union-attr]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "Hello world" + tok.decode([72, 73])
    first = chunks[0]["choices"][0]["logprobs"]
    assert first["token_logprobs"][:len(ids)] == [None] + [-0.5 * i for i in range(1, len(ids))]


async def test_echo_without_logprobs_needs_nothing_from_the_engine(gateway: Gateway) -> None:
    _, body = await _answer(gateway, {"prompt": "Hi", "echo": True})
    assert body["choices"][0]["text"].startswith("Hi") and body["choices"][0]["logprobs"] is None  # type: ignore[index]


async def test_prompt_logprobs_extra(gateway: Gateway) -> None:
    tok = ModelTokenizer(gateway.engine.tokenizer_dir)
    ids, body = await _answer(gateway, {"prompt": "Hello world", "prompt_logprobs": 1})
    plp = body["prompt_logprobs"]  # type: ignore[index]
    assert len(plp) == len(ids) and plp[0] is None
    assert plp[1][str(ids[1])]["logprob"] == -0.5 and plp[1][str(ids[1])]["decoded_token"] == tok.token_text(ids[1])
    assert plp[1]["1"] == {"logprob": -0.5, "rank": 1, "decoded_token": tok.token_text(1)}
    assert body["choices"][0]["text"] == tok.decode([72, 73])  # type: ignore[index]


async def test_tokens_as_token_ids(gateway: Gateway) -> None:
    ids, body = await _answer(gateway, {"prompt": "Hi", "echo": True, "logprobs": 1,
                                        "return_tokens_as_token_ids": True})
    lp = body["choices"][0]["logprobs"]  # type: ignore[index]
    assert lp["tokens"] == [f"token_id:{t}" for t in [*ids, 72, 73]]
    assert lp["top_logprobs"][-1] == {"token_id:73": -0.2}
