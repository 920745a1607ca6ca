"""How streams reach clients: no comment frames unless asked for (a chunk-stripping client,
like vLLM's benchmark, loses the event after each one), an engine refusal before the first
token is a plain JSON 4xx, and a client that stops reading has its request aborted."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from common.protocol import ErrorInfo, SeqOutput
from gateway.text.tokenizer import ModelTokenizer
from tests.fixtures.gateway import MODEL, Gateway, gateway, open_live_gateway, watch_aborts
from tests.fixtures.sse_clients import StrippingSSEReader

__all__ = ["gateway"]

TEXT = "Paged attention stores blocks."
BODY = {"model": MODEL, "prompt": "Hi", "stream": True, "max_tokens": 100}


async def _read_stripping(gw: Gateway, engine_waits: asyncio.Event | None = None) -> StrippingSSEReader:
    """Stream TEXT through a stripping reader; the engine answers once `engine_waits` is set."""
    reader = StrippingSSEReader()
    first_chunk = asyncio.Event()

    async def client() -> None:
        async with gw.client.session.post(gw.client.make_url("/v1/completions"), json=BODY) as resp:
            assert resp.status == 200
            async for chunk in resp.content.iter_any():
                first_chunk.set()
                reader.feed(chunk)

    task = asyncio.create_task(client())
    req = await gw.engine.next_request()
    if engine_waits is None:
        await asyncio.sleep(1.0)  # five idle ticks: the old gateway pinged on each
    else:
        await asyncio.wait_for(first_chunk.wait(), 5)  # a keepalive went out before any token
    await gw.engine.generate(req, [TEXT])
    await task
    return reader


async def test_no_comment_frames_by_default(gateway: Gateway) -> None:
    reader = await _read_stripping(gateway)
    assert reader.done and reader.text() == TEXT


@pytest.fixture
async def keepalive_gateway(redis_server: str, tiny_tokenizer_dir: Path) -> AsyncIterator[Gateway]:
    async with open_live_gateway(redis_server, tiny_tokenizer_dir, sse_keepalive_s=0.05) as gw:
        yield gw


async def test_keepalive_comments_break_a_stripping_client(keepalive_gateway: Gateway) -> None:
    """Why keepalives are off by default: the reader above loses the event glued to a comment."""
    reader = await _read_stripping(keepalive_gateway, asyncio.Event())
    assert reader.text() != TEXT


async def test_engine_refusal_before_first_token_is_a_json_4xx(gateway: Gateway) -> None:
    post = asyncio.create_task(gateway.client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": True}))
    req = await gateway.engine.next_request()
    await gateway.engine.publish(req, [], error=ErrorInfo("n x length cannot fit the pool", "invalid_request_error",
                                                          "too_large"))
    resp = await post
    assert resp.status == 400 and resp.content_type == "application/json"
    assert (await resp.json())["error"]["code"] == "too_large"


async def test_error_after_tokens_stays_in_the_stream(gateway: Gateway) -> None:
    post = asyncio.create_task(gateway.client.post("/v1/completions", json=BODY))
    req = await gateway.engine.next_request()
    await gateway.engine.publish(req, [SeqOutput(index=0, token_ids=[72], offset=0)])
    await gateway.engine.publish(req, [], error=ErrorInfo("engine died", "server_error", "engine_error"))
    resp = await post
    assert resp.status == 200
    text = await resp.text()
    assert '"code":"engine_error"' in text and text.endswith("data: [DONE]\n\n")


@pytest.fixture
async def short_write_gateway(redis_server: str, tiny_tokenizer_dir: Path) -> AsyncIterator[Gateway]:
    async with open_live_gateway(redis_server, tiny_tokenizer_dir, write_timeout_s=0.5) as gw:
        yield gw


async def test_client_that_stops_reading_is_aborted(short_write_gateway: Gateway) -> None:
    gw = short_write_gateway
    aborted: list[str] = []
    watcher = await watch_aborts(gw.redis, gw.engine.keys, aborted)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: the gateway's writes back up
    sock.setblocking(False)
    url = gw.client.make_url("/v1/completions")
    await asyncio.get_running_loop().sock_connect(sock, (url.host, url.port))
    body = b'{"model": "tiny", "prompt": "Hi", "stream": true, "max_tokens": 400}'
    await asyncio.get_running_loop().sock_sendall(sock, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                                  b"Content-Type: application/json\r\nContent-Length: "
                                                  + str(len(body)).encode() + b"\r\n\r\n" + body)
    req = await gw.engine.next_request()
    block = ModelTokenizer(gw.engine.tokenizer_dir).encode("abcdefgh" * 500, add_special_tokens=False)
    sent = 0
    try:
        for _ in range(3000):  # never read: well past every buffer on the way
            await gw.engine.publish(req, [SeqOutput(index=0, token_ids=block, offset=sent)])
            sent += len(block)
            await asyncio.sleep(0.002)
            if req.id in aborted:
                break
        for _ in range(100):
            if req.id in aborted:
                break
            await asyncio.sleep(0.05)
    finally:
        watcher.cancel()
        sock.close()
    assert req.id in aborted, f"no abort after {sent} tokens"


async def test_client_gone_before_the_first_token_is_aborted(gateway: Gateway) -> None:
    aborted: list[str] = []
    watcher = await watch_aborts(gateway.redis, gateway.engine.keys, aborted)
    post = asyncio.create_task(gateway.client.post("/v1/completions", json=BODY))
    req = await gateway.engine.next_request()
    post.cancel()  # drops the connection while the response has not started
    try:
        for _ in range(100):
            if req.id in aborted:
                break
            await asyncio.sleep(0.05)
    finally:
        watcher.cancel()
    assert req.id in aborted
