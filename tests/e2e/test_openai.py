"""End to end with the official `openai` client: gateway (in-process) → real Redis → a real
engine process (tiny random Llama). Also: errors map to openai exceptions, a burst of bad
requests and 50 dropped streams leave the engine serving and holding zero blocks."""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import openai
import pytest
from openai import AsyncOpenAI

from pagedserve.launch.redis_server import RedisServer
from tests.e2e.support import EngineProcess, serve_gateway, start_engines

MODEL = "tiny"
MSG = [{"role": "user", "content": "Tell me about paged attention."}]
LONG = {"ignore_eos": True}


@pytest.fixture(scope="module")
def stack(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, EngineProcess]]:
    """One redis-server and one engine for the whole module."""
    with RedisServer() as server:
        [engine] = start_engines(tiny_llama_dir, server.url, tmp_path_factory.mktemp("e2e-openai"), ["oa-0"],
                                 "--served-model-name", MODEL, "--kv-cache-memory", "4MiB")
        try:
            yield server.url, engine
        finally:
            engine.stop()


def _client(url: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


async def test_chat_and_completions(stack: tuple[str, EngineProcess]) -> None:
    redis_url, engine = stack
    async with serve_gateway(redis_url) as url, _client(url) as client:
        chat = await client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=8, temperature=0,
                                                    extra_body=LONG)
        assert chat.choices[0].finish_reason == "length"
        assert chat.choices[0].message.role == "assistant"
        assert chat.usage is not None and chat.usage.completion_tokens == 8
        again = await client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=8, temperature=0,
                                                     extra_body=LONG)
        assert again.choices[0].message.content == chat.choices[0].message.content  # greedy is deterministic
        comp = await client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, n=2,
                                               temperature=1.0, seed=7, extra_body=LONG)
        assert sorted(c.index for c in comp.choices) == [0, 1]
        assert comp.usage is not None and comp.usage.completion_tokens == 12
        models = await client.models.list()
        assert [m.id for m in models.data] == [MODEL]
    engine.wait_drained()


async def test_streaming_n2_with_usage(stack: tuple[str, EngineProcess]) -> None:
    redis_url, engine = stack
    async with serve_gateway(redis_url) as url, _client(url) as client:
        stream = await client.chat.completions.create(
            model=MODEL, messages=MSG, max_tokens=10, n=2, temperature=0.8, seed=3, stream=True,
            stream_options={"include_usage": True}, extra_body=LONG)
        texts, finish, usage = {0: "", 1: ""}, {}, None
        async for chunk in stream:
            if chunk.usage is not None:
                assert chunk.choices == []
                usage = chunk.usage
            for choice in chunk.choices:
                texts[choice.index] += choice.delta.content or ""
                if choice.finish_reason:
                    finish[choice.index] = choice.finish_reason
        assert finish == {0: "length", 1: "length"}
        assert usage is not None and usage.completion_tokens == 20
        assert all(texts.values())

        comp_stream = await client.completions.create(model=MODEL, prompt="abc", max_tokens=5, temperature=0,
                                                      stream=True, extra_body=LONG)
        pieces = [c.choices[0].text async for c in comp_stream if c.choices]
        assert "".join(pieces)
    engine.wait_drained()


async def test_bad_parameter_raises_bad_request(stack: tuple[str, EngineProcess]) -> None:
    redis_url, _ = stack
    async with serve_gateway(redis_url) as url, _client(url) as client:
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(model=MODEL, messages=MSG, temperature=-1)
        assert info.value.status_code == 400
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(model="no-such-model", messages=MSG)


BAD_BODIES: list[dict[str, object]] = [
    {"model": MODEL, "messages": MSG, "n": 0},
    {"model": MODEL, "messages": MSG, "max_tokens": -3},
    {"model": MODEL, "messages": MSG, "temperature": "hot"},
    {"model": MODEL, "messages": MSG, "top_p": 2},
    {"model": MODEL, "messages": []},
    {"model": MODEL},
    {"messages": MSG},
    {"model": MODEL, "messages": MSG, "max_tokens": 10**9},
    {"model": MODEL, "messages": MSG, "stream": "yes"},
    {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]},
]


async def test_engine_clean_after_bad_request_burst(stack: tuple[str, EngineProcess]) -> None:
    """31 bad requests (each bad body three times, and a body that is a JSON string) each get a 4xx
    with an OpenAI error body; then the engine still serves."""
    redis_url, engine = stack
    async with serve_gateway(redis_url) as url, aiohttp.ClientSession() as session:
        async def bad(body: object) -> tuple[int, dict[str, object]]:
            async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
                return resp.status, await resp.json()

        results = await asyncio.gather(*(bad(b) for b in BAD_BODIES * 3), bad(b"{oops".decode()))
        assert len(results) == 3 * len(BAD_BODIES) + 1
        for status, body in results:
            assert 400 <= status < 500
            assert set(body["error"]) >= {"message", "type", "param", "code"}  # type: ignore[arg-type]
        async with session.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "ok", "max_tokens": 4,
                                                                 "temperature": 0, "ignore_eos": True}) as resp:
            assert resp.status == 200
            assert (await resp.json())["usage"]["completion_tokens"] == 4
    engine.wait_drained()


async def test_dropped_streams_free_every_block(stack: tuple[str, EngineProcess]) -> None:
    """50 clients leave mid-generation: the engine aborts them all and holds zero blocks."""
    redis_url, engine = stack
    aborted_before = engine.stats().get("finished_abort", 0.0)
    async with serve_gateway(redis_url) as url, aiohttp.ClientSession() as session:
        async def drop(i: int) -> None:
            body = {"model": MODEL, "prompt": f"client {i} says", "max_tokens": 400, "stream": True,
                    "temperature": 0, "ignore_eos": True}
            async with session.post(f"{url}/v1/completions", json=body) as resp:
                assert resp.status == 200
                seen = 0
                async for line in resp.content:
                    seen += line.startswith(b"data: {")
                    if seen >= 3:  # tokens are flowing: leave without reading the rest
                        resp.close()
                        return
                raise AssertionError("stream ended before the client left")

        await asyncio.wait_for(asyncio.gather(*(drop(i) for i in range(50))), 180)  # a hang fails, fast
        # in a thread: the gateway in this loop must keep running to see the clients go and abort
        stats = await asyncio.to_thread(engine.wait_drained, timeout=60)
    assert stats["finished_abort"] - aborted_before >= 45  # aborted, not run to the end


def test_metrics_and_heartbeat(stack: tuple[str, EngineProcess]) -> None:
    _, engine = stack
    with urllib.request.urlopen(f"http://127.0.0.1:{engine.metrics_port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    for name in ("pagedserve_kv_blocks_total{device=", "pagedserve_kv_blocks_free{device=",
                 "pagedserve_kv_cache_usage_ratio{device=", "pagedserve_kv_block_utilization_ratio",
                 "pagedserve_requests_running", "pagedserve_requests_waiting", "pagedserve_requests_swapped",
                 "pagedserve_preemptions_total{mode=", "pagedserve_cow_copies_total",
                 "pagedserve_prefix_cache_queries_total", "pagedserve_prefix_cache_hits_total",
                 "pagedserve_prompt_tokens_total", "pagedserve_generation_tokens_total",
                 "pagedserve_request_success_total{finished_reason=",
                 "pagedserve_time_to_first_token_seconds_bucket", "pagedserve_time_per_output_token_seconds_bucket",
                 "pagedserve_e2e_request_latency_seconds_bucket"):
        assert name in text, name
    beat = engine.heartbeat()
    assert beat is not None and beat.model == MODEL and beat.max_model_len == 512
    assert Path(beat.tokenizer, "tokenizer.json").is_file()
    assert sum(run for _, run in beat.pool) == beat.stats["num_blocks"]
