"""The gateway's Redis side under trouble, on a real redis-server with the scripted engine:
the output reader's connection killed mid-request (nothing lost, nothing doubled), Redis
restarted without persistence (in-flight requests fail with a clear error, new ones work),
a full model queue (429 with Retry-After), and the pool figures on /metrics."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from common.protocol import SeqOutput, Usage
from gateway.broker.watch import Watch
from gateway.state import BROKER
from gateway.text.tokenizer import ModelTokenizer
from tests.fixtures.gateway import MODEL, Gateway, gateway, open_gateway, open_live_gateway, parse_sse

__all__ = ["gateway"]


async def _kill_reader(gw: Gateway) -> None:
    name = f"{gw.config.redis_prefix}-out-{gw.config.gateway_id}"
    for _ in range(100):
        ids = [c["id"] for c in await gw.redis.client_list() if c.get("name") == name]
        if ids:
            for client_id in ids:
                await gw.redis.client_kill_filter(_id=client_id)
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the output reader connection is not named")


async def _half_streamed(gw: Gateway) -> tuple[asyncio.Task[Any], Any, list[int], int]:
    """Start a streaming completion and publish the first half of its tokens: (the POST, the
    request as the engine saw it, all its token ids, how many were published)."""
    body = {"model": MODEL, "prompt": "Hi", "stream": True, "max_tokens": 64}
    post = asyncio.create_task(gw.client.post("/v1/completions", json=body))
    req = await gw.engine.next_request()
    ids = ModelTokenizer(gw.engine.tokenizer_dir).encode("Hello world! The quick brown fox", False)
    half = len(ids) // 2
    await gw.engine.publish(req, [SeqOutput(index=0, token_ids=ids[:half], offset=0)])
    return post, req, ids, half


async def test_output_written_while_the_reader_is_disconnected_arrives_once(gateway: Gateway) -> None:
    post, req, ids, half = await _half_streamed(gateway)
    await _kill_reader(gateway)
    await gateway.engine.publish(req, [SeqOutput(index=0, token_ids=ids[half:], offset=half,
                                                 finish_reason="stop")], Usage(2, len(ids)))
    resp = await post
    events = parse_sse(await resp.text())
    text = "".join(c["text"] for e in events if isinstance(e, dict) for c in e.get("choices", []))
    assert text == "Hello world! The quick brown fox"
    assert events[-1] == "[DONE]" and not any(isinstance(e, dict) and "error" in e for e in events)


async def test_redis_restart_without_persistence_fails_in_flight_then_serves(
        gateway: Gateway, restart_redis: Callable[[], None]) -> None:
    post = asyncio.create_task(gateway.client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi"}))
    await gateway.engine.next_request()
    await asyncio.to_thread(restart_redis)
    await gateway.redis.connection_pool.disconnect()
    resp = await post
    body = await resp.json()
    assert resp.status == 503 and body["error"]["code"] == "redis_restarted", body
    await gateway.engine.beat()
    post = asyncio.create_task(gateway.client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi"}))
    gateway.engine.last_id = "0-0"
    req = await gateway.engine.next_request(timeout=10)
    await gateway.engine.generate(req, ["Hello again"])
    resp = await post
    assert resp.status == 200 and (await resp.json())["choices"][0]["text"] == "Hello again"


async def test_a_full_model_queue_answers_429_with_retry_after(redis_server: str, tiny_tokenizer_dir: Path) -> None:
    async with open_live_gateway(redis_server, tiny_tokenizer_dir, max_queued_per_model=2) as gw:
        waiting = [asyncio.create_task(gw.client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi"}))
                   for _ in range(2)]
        reqs = [await gw.engine.next_request() for _ in range(2)]
        resp = await gw.client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi"})
        assert resp.status == 429 and resp.headers["Retry-After"] == "1"
        assert (await resp.json())["error"]["code"] == "overloaded"
        for req in reqs:
            await gw.engine.generate(req, ["ok"])
            await gw.redis.xdel(gw.engine.keys.requests(MODEL), gw.engine.last_id)  # what an engine's ack does
        assert [(await task).status for task in waiting] == [200, 200]
        metrics = await (await gw.client.get("/metrics")).text()
        for name in ("pagedserve_redis_pool_in_use", "pagedserve_redis_pool_waiting",
                     "pagedserve_redis_pool_wait_seconds_count",
                     'pagedserve_gateway_rejected_total{reason="QueueFull"}'):
            assert name in metrics, name


async def test_an_entry_that_breaks_dispatch_fails_its_request_and_the_reader_reads_on(
        gateway: Gateway, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug met while routing one output entry is logged and confined: that request sees the
    gap and fails cleanly, and the reader every other request depends on keeps reading."""
    broker = gateway.client.app[BROKER]  # type: ignore[index]
    dispatch = broker.dispatch
    calls = {"n": 0}

    def breaks_once(data: bytes) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("a bug in routing")
        dispatch(data)

    monkeypatch.setattr(broker, "dispatch", breaks_once)
    body = {"model": MODEL, "prompt": "Hi", "stream": True, "max_tokens": 64}
    post = asyncio.create_task(gateway.client.post("/v1/completions", json=body))
    req = await gateway.engine.next_request()
    ids = ModelTokenizer(gateway.engine.tokenizer_dir).encode("Hello world", False)
    await gateway.engine.publish(req, [SeqOutput(index=0, token_ids=ids[:1], offset=0)])  # lost to the bug
    await gateway.engine.publish(req, [SeqOutput(index=0, token_ids=ids[1:], offset=1,
                                                 finish_reason="stop")], Usage(2, len(ids)))
    resp = await post
    assert resp.status == 500 and (await resp.json())["error"]["code"] == "output_gap"  # a server fault
    post = asyncio.create_task(gateway.client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi"}))
    req = await gateway.engine.next_request()
    await gateway.engine.generate(req, ["still served"])
    resp = await post
    assert resp.status == 200 and (await resp.json())["choices"][0]["text"] == "still served"


async def test_a_wedged_reader_is_replaced_and_reads_on(redis_server: str, tiny_tokenizer_dir: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The reader loop hangs for good in the middle of a request, in a read that even ignores
    cancellation (the worst case; CI once saw a reader whose reply had arrived and whose loop
    never ran again): the supervisor starts a new loop on a new connection, which reads on from
    the last id handled, and the request completes whole."""
    async with open_live_gateway(redis_server, tiny_tokenizer_dir, request_timeout_s=120.0) as gw:
        broker = gw.client.app[BROKER]  # type: ignore[index]
        post, req, ids, half = await _half_streamed(gw)
        wedged = broker.reader

        release = asyncio.Event()  # set at the end, so the wedged task can finish at teardown

        async def never(*args: object, **kwargs: object) -> None:
            while not release.is_set():
                with contextlib.suppress(asyncio.CancelledError):
                    await release.wait()

        monkeypatch.setattr(wedged, "xread", never)  # this connection's next read hangs for good
        await asyncio.sleep(1.5)  # the loop is inside the hung read now
        await gw.engine.publish(req, [SeqOutput(index=0, token_ids=ids[half:], offset=half,
                                                finish_reason="stop")], Usage(2, len(ids)))
        resp = await asyncio.wait_for(post, 90)
        events = parse_sse(await resp.text())
        text = "".join(c["text"] for e in events if isinstance(e, dict) for c in e.get("choices", []))
        release.set()
        assert text == "Hello world! The quick brown fox" and events[-1] == "[DONE]", events
        assert broker.reader is not wedged


@pytest.mark.timeout(120)  # the old shutdown hung here for good, past the wait_for below
async def test_shutdown_ends_a_loop_that_swallows_its_cancellation_and_closes_the_pool(
        redis_server: str, tiny_tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The app's shutdown must end even when a background loop eats its cancellation (as a
    cancellation racing a finished read can in Python 3.11's `wait_for`), and must close the
    pooled connections too, not only the reader's."""
    swallowed = asyncio.Event()

    async def stubborn_tick(self: Watch) -> None:
        try:
            await asyncio.sleep(3600)  # each tick waits until it is cancelled, then goes on
        except asyncio.CancelledError:
            swallowed.set()

    monkeypatch.setattr(Watch, "tick", stubborn_tick)
    stack = contextlib.AsyncExitStack()
    gw = await stack.enter_async_context(open_gateway(redis_server, tiny_tokenizer_dir))
    await gw.engine.beat()
    assert (await gw.client.get("/health")).status == 200
    pool = gw.client.app[BROKER].client.connection_pool  # type: ignore[index]
    connections = [*pool._available_connections, *pool._in_use_connections]
    assert connections and any(c.is_connected for c in connections)
    await asyncio.wait_for(stack.aclose(), 60)  # hung forever before the loops had a stop flag
    assert swallowed.is_set()
    assert not any(c.is_connected for c in connections)


async def test_the_liveness_key_is_refreshed_while_every_pooled_connection_is_busy(
        redis_server: str, tiny_tokenizer_dir: Path) -> None:
    """A burst holds every pooled connection (a thousand streams on 8 connections did, in CI
    under load): the liveness key must still be refreshed within its TTL, else every engine
    drops every request of a gateway that is alive. Through the pool, this refresh waited."""
    async with open_live_gateway(redis_server, tiny_tokenizer_dir, redis_pool_size=2, watch_interval_s=0.2,
                                 redis_pool_timeout_s=60.0) as gw:
        pool = gw.client.app[BROKER].client.connection_pool  # type: ignore[index]
        held = [await pool.get_connection() for _ in range(2)]  # the whole pool, as a burst would hold it
        try:
            key = gw.engine.keys.gateway(gw.config.gateway_id)
            await gw.redis.delete(key)
            for _ in range(200):
                if await gw.redis.exists(key):
                    break
                await asyncio.sleep(0.05)
            assert await gw.redis.exists(key), "the liveness key was not refreshed while the pool was busy"
            assert 0 < await gw.redis.pttl(key) <= 600
        finally:
            for connection in held:
                await pool.release(connection)
