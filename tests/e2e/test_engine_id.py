"""Which engine served a request (issue 40), real processes: one Redis, two engines of one tiny
model with distinct `--engine-id`, an in-process gateway routing by prefix.

- a whole response names its engine in `x-pagedserve-engine` and `system_fingerprint`, a stream
  in every chunk's `system_fingerprint`; the engine named is the one whose own Prometheus
  counters show the tokens, the other's do not move;
- with routing, a conversation's second turn names the engine of its first (routed by prefix),
  and the gateway counts each finished request for its engine;
- a stream whose engine freezes past its heartbeat window resumes on the other engine, and the
  chunks from then on name that one."""

from __future__ import annotations

import asyncio
import json
import signal
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.launch.redis_server import RedisServer
from tests.e2e.support import EngineProcess, serve_gateway, start_engines

MODEL = "tiny"
IDS = ["eid-a", "eid-b"]
# no stealing within a test's time: an entry routed to an engine is served there
ENGINE_ARGS = ("--served-model-name", MODEL, "--kv-cache-memory", "8MiB", "--steal-after", "600")
HEADER = "x-pagedserve-engine"
WORDS = ["amber", "birch", "cedar", "delta", "ember", "fjord", "grove", "heron", "inlet", "juniper"]


@pytest.fixture(scope="module")
def stack(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, list[EngineProcess]]]:
    logs = tmp_path_factory.mktemp("engine-id")
    with RedisServer() as server:
        engines = start_engines(tiny_llama_dir, server.url, logs, IDS, *ENGINE_ARGS)
        try:
            announced(engines)
            yield server.url, engines
        finally:
            for engine in engines:
                engine.stop()


def announced(engines: list[EngineProcess], timeout: float = 60.0) -> None:
    """Both engines announce their routed streams before the gateway routes."""
    deadline = time.monotonic() + timeout
    while not all((b := e.heartbeat()) is not None and b.routed and b.block_size > 0 for e in engines):
        assert time.monotonic() < deadline, "engines never announced routed streams"
        time.sleep(0.1)


def metric(text: str, name: str, **labels: str) -> float:
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def generated(engine: EngineProcess) -> float:
    """Tokens the engine generated so far, from its own /metrics (updated before it publishes a step)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{engine.metrics_port}/metrics", timeout=10) as resp:
        return metric(resp.read().decode(), "pagedserve_generation_tokens_total")


def tokens_by_engine(engines: list[EngineProcess]) -> dict[str, float]:
    return {e.engine_id: generated(e) for e in engines}


def only_grew(before: dict[str, float], after: dict[str, float], engine_id: str, tokens: int) -> None:
    assert after[engine_id] - before[engine_id] >= tokens, (before, after)
    assert all(after[e] == before[e] for e in before if e != engine_id), (engine_id, before, after)


def chat_body(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 6,
            "temperature": 0, "ignore_eos": True, **extra}


async def whole(session: aiohttp.ClientSession, url: str, path: str,
                body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """POST a non-streaming request: the engine header and the body."""
    async with session.post(f"{url}{path}", json=body) as resp:
        payload: dict[str, Any] = await resp.json()
        assert resp.status == 200, payload
        return resp.headers[HEADER], payload


async def streamed(session: aiohttp.ClientSession, url: str, path: str,
                   body: dict[str, Any]) -> tuple[str | None, list[dict[str, Any]]]:
    """POST a streaming request: the engine header (if the stream had it) and every chunk."""
    chunks = []
    async with session.post(f"{url}{path}", json={**body, "stream": True,
                                                   "stream_options": {"include_usage": True}}) as resp:
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line.removeprefix("data: ")))
        return resp.headers.get(HEADER), chunks


async def test_a_whole_response_names_the_engine_that_generated_it(stack: tuple[str, list[EngineProcess]]) -> None:
    url, engines = stack
    async with aiohttp.ClientSession() as session, serve_gateway(url) as gateway:
        for path, body in [("/v1/chat/completions", chat_body("Which engine are you?")),
                           ("/v1/completions", {"model": MODEL, "prompt": "Name the engine", "max_tokens": 5,
                                                "temperature": 0, "ignore_eos": True})]:
            before = tokens_by_engine(engines)
            engine_id, payload = await whole(session, gateway, path, body)
            assert engine_id in IDS
            assert payload["system_fingerprint"] == f"pagedserve-{engine_id}"
            only_grew(before, tokens_by_engine(engines), engine_id, payload["usage"]["completion_tokens"])


async def test_every_stream_chunk_names_the_engine(stack: tuple[str, list[EngineProcess]]) -> None:
    url, engines = stack
    async with aiohttp.ClientSession() as session, serve_gateway(url) as gateway:
        before = tokens_by_engine(engines)
        header, chunks = await streamed(session, gateway, "/v1/chat/completions", chat_body("Stream it"))
        fingerprints = {c["system_fingerprint"] for c in chunks}
        assert len(fingerprints) == 1, fingerprints  # the role chunk too: the stream starts with the first output
        engine_id = fingerprints.pop().removeprefix("pagedserve-")
        assert engine_id in IDS and header == engine_id
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant" and chunks[-1]["choices"] == []
        only_grew(before, tokens_by_engine(engines), engine_id, chunks[-1]["usage"]["completion_tokens"])


def opening(i: int) -> str:
    """A first message of some 120 characters (tokens, with the byte tokenizer), distinct from its
    first character: with the chat template's header that is within the first KV block, so no
    two conversations share a cached block (a block every conversation shares is the router's
    to place, not this test's)."""
    return f"{i}: conversation " + " ".join(WORDS[(i * 3 + k * 7) % len(WORDS)] for k in range(18))


async def test_a_second_turn_names_the_engine_of_the_first(stack: tuple[str, list[EngineProcess]]) -> None:
    url, _ = stack
    async with aiohttp.ClientSession() as session, serve_gateway(url) as gateway:
        metrics_before = await (await session.get(f"{gateway}/metrics")).text()
        firsts = await asyncio.gather(*(whole(session, gateway, "/v1/chat/completions", chat_body(opening(i)))
                                        for i in range(4)))
        for i, (first_engine, first) in enumerate(firsts):
            messages = [{"role": "user", "content": opening(i)},
                        {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                        {"role": "user", "content": "And then?"}]
            header, chunks = await streamed(session, gateway, "/v1/chat/completions",
                                            {**chat_body(""), "messages": messages})
            assert {c["system_fingerprint"] for c in chunks} == {f"pagedserve-{first_engine}"}, (i, first_engine)
            assert header == first_engine
            assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # its history was there
        metrics_after = await (await session.get(f"{gateway}/metrics")).text()
    by_prefix = "pagedserve_gateway_routed_by_prefix_total"
    assert metric(metrics_after, by_prefix) - metric(metrics_before, by_prefix) >= 4
    served = "pagedserve_gateway_served_requests_total"
    for engine_id in IDS:  # a fresh gateway: its counter holds this test's 8 requests
        expected = 2 * sum(e == engine_id for e, _ in firsts)
        assert metric(metrics_after, served, model=MODEL, engine=engine_id) == expected


async def test_chunks_after_a_takeover_name_the_new_engine(stack: tuple[str, list[EngineProcess]]) -> None:
    url, engines = stack
    body = {"model": MODEL, "prompt": "Go on:", "max_tokens": 480, "temperature": 0, "ignore_eos": True,
            "stream": True}
    fingerprints: list[str] = []
    async with aiohttp.ClientSession() as session, serve_gateway(url) as gateway, \
            session.post(f"{gateway}/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        frozen: EngineProcess | None = None
        try:
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                fingerprints.append(json.loads(line.removeprefix("data: "))["system_fingerprint"])
                if frozen is None:  # the first output is in: freeze its engine, hundreds of tokens early
                    frozen = next(e for e in engines if fingerprints[0] == f"pagedserve-{e.engine_id}")
                    frozen.proc.send_signal(signal.SIGSTOP)
        finally:
            if frozen is not None:
                frozen.proc.send_signal(signal.SIGCONT)
    assert frozen is not None
    other = next(e for e in engines if e is not frozen)
    switch = fingerprints.index(f"pagedserve-{other.engine_id}")  # ValueError: it never resumed elsewhere
    assert set(fingerprints[:switch]) == {f"pagedserve-{frozen.engine_id}"}
    assert set(fingerprints[switch:]) == {f"pagedserve-{other.engine_id}"}
    assert "resuming request" in other.log_tail(400_000)
    announced(engines)  # the thawed engine is back for whatever runs next
