"""`pagedserve bench` and `pagedserve chat` against a live gateway app (scripted engine)."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path

import aiohttp

from gateway.clients.bench import percentiles, run_bench
from gateway.clients.bench_trace import BenchRequest, load_trace, poisson_arrivals
from gateway.clients.chat import stream_reply
from tests.fixtures.gateway import MODEL, Gateway, gateway

__all__ = ["gateway"]


async def _serve(gw: Gateway, count: int, text: str) -> None:
    for _ in range(count):
        req = await gw.engine.next_request()
        await gw.engine.generate(req, [text], finish="length")


async def test_bench_reports_latencies(gateway: Gateway) -> None:
    engine = asyncio.create_task(_serve(gateway, 4, "Hello world! The quick"))
    base = str(gateway.client.make_url("/"))
    requests = [BenchRequest("Hi there", 8)] * 4
    report = await run_bench(base, MODEL, requests, rate=50.0, max_concurrency=2, progress=False)
    await engine
    assert report["completed"] == 4 and report["failed"] == 0 and report["errors"] == {}
    assert report["ttft_s"]["p50"] > 0 and report["e2e_s"]["p99"] >= report["ttft_s"]["p99"]
    assert report["output_throughput_tok_s"] > 0
    json.dumps(report)


async def test_bench_counts_errors(gateway: Gateway) -> None:
    base = str(gateway.client.make_url("/"))
    report = await run_bench(base, "no-such-model", [BenchRequest("x", 4)] * 2, float("inf"), None,
                             progress=False)
    assert report["failed"] == 2 and sum(report["errors"].values()) == 2


def test_trace_and_arrivals(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"prompt": "hello", "max_tokens": 3}\n{"arrival": 0.5, "prompt_len": 4, "output_len": 7}\n')
    reqs = load_trace(trace)
    assert reqs[0] == BenchRequest("hello", 3) and reqs[1].max_tokens == 7 and len(reqs[1].prompt.split()) == 4
    times = poisson_arrivals(2000, 100.0)
    assert times == sorted(times) and 15 < times[-1] < 25
    assert poisson_arrivals(3, float("inf")) == [0.0, 0.0, 0.0]
    assert percentiles([1.0, 2.0, 3.0, 4.0])["p50"] == 2.0


async def test_chat_client_streams(gateway: Gateway) -> None:
    engine = asyncio.create_task(_serve(gateway, 1, "你好 😀"))
    out = io.StringIO()
    async with aiohttp.ClientSession() as session:
        reply = await stream_reply(session, str(gateway.client.make_url("/v1/chat/completions")),
                                   {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                    "stream": True}, {}, out)
    await engine
    assert reply == "你好 😀" and out.getvalue() == "你好 😀\n"
