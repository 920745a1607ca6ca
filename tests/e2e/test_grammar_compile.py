"""Issue 41, caused end to end: an engine process (tiny random Llama) with a tiny grammar-compile
budget (`--grammar-compile-timeout 0.001`), an in-process gateway, real Redis. A plain greedy
stream is running when a request with the largest grammar the size limits allow arrives: that
request is refused with a 400 and an OpenAI error body (code `grammar_compile_timeout`, no
library backtrace) while the stream goes on to its last token (its compile, which cannot be
interrupted, runs beside it on a compile thread); the engine serves the next request and ends
with every KV block back on the free list."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from pagedserve.launch.redis_server import RedisServer
from tests.e2e.support import EngineProcess, serve_gateway, start_engines
from tests.engine.test_grammar_worker import flat_grammar

MODEL = "tiny"
PLAIN_TOKENS = 400  # long enough to be mid-stream when the refusal (milliseconds) comes back


@pytest.fixture(scope="module")
def stack(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, EngineProcess]]:
    with RedisServer() as server:
        [engine] = start_engines(tiny_llama_dir, server.url, tmp_path_factory.mktemp("e2e-grammar"), ["grammar-0"],
                                 "--served-model-name", MODEL, "--kv-cache-memory", "8MiB",
                                 "--grammar-compile-timeout", "0.001")
        try:
            yield server.url, engine
        finally:
            engine.stop()


async def _plain_stream(session: aiohttp.ClientSession, url: str, started: asyncio.Event) -> tuple[int, str | None]:
    """Stream a greedy completion; set `started` on its first token; (tokens, finish reason)."""
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": PLAIN_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    tokens, reason = 0, None
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if not line.startswith(b"data: "):
                continue
            event = line[len(b"data: "):].strip()
            if event == b"[DONE]":
                break
            chunk = json.loads(event)
            for choice in chunk.get("choices", []):
                if choice.get("text"):
                    started.set()
                reason = choice.get("finish_reason") or reason
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return tokens, reason


async def test_compile_over_budget_is_a_400_and_the_other_stream_goes_on(stack: tuple[str, EngineProcess]) -> None:
    redis_url, engine = stack
    spec = flat_grammar("e2e")
    async with serve_gateway(redis_url) as url, aiohttp.ClientSession() as session:
        started = asyncio.Event()
        plain = asyncio.create_task(_plain_stream(session, url, started))
        await asyncio.wait_for(started.wait(), 60)
        big = {"model": MODEL, "prompt": "Pick one:", "max_tokens": 16, "guided_grammar": spec["spec"]}
        async with session.post(f"{url}/v1/completions", json=big) as resp:
            status, text = resp.status, await resp.text()
        assert not plain.done(), "the plain stream was meant to be running when the grammar was refused"
        assert status == 400, text
        error = json.loads(text)["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == "grammar_compile_timeout"
        assert "--grammar-compile-timeout" in error["message"]
        assert "backtrace" not in text.lower() and "panicked" not in text and "\\n" not in error["message"]
        assert await asyncio.wait_for(plain, 120) == (PLAIN_TOKENS, "length")
        again = {"model": MODEL, "prompt": "After that", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        async with session.post(f"{url}/v1/completions", json=again) as resp:
            assert resp.status == 200, await resp.text()
            assert (await resp.json())["usage"]["completion_tokens"] == 8
    stats = engine.wait_drained()
    assert stats["num_used_blocks"] == 0 and stats["compiling"] == 0 and stats["grammar_timeouts"] == 1
