"""No stream may hang when its gateway loses Redis for a while (issue 41), with real processes:
redis-server, one engine (`--gateway-grace 20`), gateway processes, the tiny model.

Every fault is caused deterministically: the engine is frozen (SIGSTOP) while the gateway is
paused, and the engine's clock (monotonic, running while it is frozen) is what decides. The engine
runs free for a moment between a stream's first token and the pause, and once more while it
notices the gateway gone (up to a heartbeat interval, 0.25 s here): the requests a fault must
catch in flight ask for `LONG_TOKENS`, thousands of decode steps, and those that must also
complete for `MAX_TOKENS`, so no machine finishes them in those moments (with 200 tokens and 1 s
heartbeats a fast engine once did, and then never missed a gateway it no longer served). Each
test counts every request's outcome:

- a gateway paused for longer than the old window (3 s TTL + 3 s grace) but within the grace:
  every stream completes whole, equal to the greedy reference;
- a gateway paused past the grace: the engine ends each request with an error record on the
  gateway's output stream, so once the gateway is back each client stream ends with an error
  event and `[DONE]` (no hang); the engine holds no block after;
- the same with the error records lost too (the output stream deleted): the gateway's
  watchdog ends each stream with `request_lost`;
- kill -9 of a gateway and a restart under the same `--gateway-id`: its new token makes the
  engine stop the old process's requests at its next flush (counted by the engine, not timed),
  and the new process serves new requests."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis

from common.protocol import Keys
from pagedserve.launch.redis_server import RedisServer
from tests.e2e.faults import Outcome, prompt, stream_one
from tests.e2e.support import EngineProcess, GatewayProcess
from tests.fixtures.models import make_tiny_model_dir

pytestmark = pytest.mark.slow
MODEL = "tiny"
KEYS = Keys()
GRACE_S = 20.0
OLD_WINDOW_S = 6.0  # the liveness key's 3 s TTL and the engines' former 3 s grace
COUNT = 8
MAX_TOKENS = 1000  # a stream that must complete whole (the reference, within the grace)
LONG_TOKENS = 8_000  # a stream a fault must catch in flight (under the gateway's 8,192 limit)
CONTEXT = 16_384
HEARTBEAT_S = 0.25  # how long the engine runs free while the test waits to see it miss the gateway


class Stack:
    def __init__(self, model: Path, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.redis = RedisServer().start()
        self.engine = EngineProcess(model, self.redis.url, "live-eng", log_dir, "--served-model-name", MODEL,
                                    "--kv-cache-memory", "64MiB", "--gateway-grace", str(GRACE_S),
                                    "--heartbeat-interval", str(HEARTBEAT_S))
        self.engine.wait_ready()

    def gateway(self, gateway_id: str) -> GatewayProcess:
        return GatewayProcess(self.redis.url, gateway_id, self.log_dir).wait_healthy()

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.redis.url)

    def stop(self) -> None:
        self.engine.proc.send_signal(signal.SIGCONT)
        self.engine.stop()
        self.redis.stop()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    model = make_tiny_model_dir(tmp_path_factory.mktemp("liveness-model"), max_position_embeddings=CONTEXT)
    s = Stack(model, tmp_path_factory.mktemp("e2e-liveness"))
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def reference(stack: Stack) -> list[str]:
    gateway = stack.gateway("live-ref")
    try:
        outcomes = asyncio.run(_all(gateway.url))
    finally:
        gateway.stop()
    assert all(o.done and o.error is None and o.tokens == MAX_TOKENS for o in outcomes), outcomes[:2]
    return [o.text for o in outcomes]


async def _all(url: str) -> list[Outcome]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        return list(await asyncio.gather(*(stream_one(session, url, prompt(i), MAX_TOKENS) for i in range(COUNT))))


async def _until(condition: Callable[[], bool], what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


def _stat(engine: EngineProcess, name: str, since: float = 0.0) -> float | None:
    """A figure of the engine's heartbeat written after `since` (wall clock), else None."""
    beat = engine.heartbeat()
    return None if beat is None or beat.time < since else beat.stats.get(name, 0.0)


async def _streams_started(session: aiohttp.ClientSession, url: str,
                           max_tokens: int = LONG_TOKENS) -> list[asyncio.Task[Outcome]]:
    started = [asyncio.Event() for _ in range(COUNT)]
    tasks = [asyncio.create_task(stream_one(session, url, prompt(i), max_tokens, started[i])) for i in range(COUNT)]
    await asyncio.wait_for(asyncio.gather(*(s.wait() for s in started)), 120)
    return tasks


async def _pause_gateway(stack: Stack, gateway: GatewayProcess, paused: Callable[[], Awaitable[None]]) -> None:
    """Freeze the engine, then the gateway; once the gateway's liveness key has expired, let the
    engine see it gone (its heartbeat counts the missing gateway), freeze it again, run
    `paused()`, thaw the engine, then the gateway when `paused` returns."""
    engine = stack.engine
    engine.proc.send_signal(signal.SIGSTOP)
    gateway.proc.send_signal(signal.SIGSTOP)
    try:
        with stack.client() as client:
            await _until(lambda: not client.exists(KEYS.gateway(gateway.gateway_id)), "the liveness key to expire")
        engine.proc.send_signal(signal.SIGCONT)
        thawed = time.time()
        await _until(lambda: (_stat(engine, "gateways_missing", thawed) or 0) >= 1, "the engine to miss the gateway")
        engine.proc.send_signal(signal.SIGSTOP)
        await paused()
    finally:
        engine.proc.send_signal(signal.SIGCONT)
        gateway.proc.send_signal(signal.SIGCONT)


def _drained(engine: EngineProcess, since: float) -> bool:
    beat = engine.heartbeat()
    if beat is None or beat.time < since:
        return False
    s = beat.stats
    return s["running"] + s["waiting"] + s["swapped"] + s["in_flight"] == 0 and s["num_used_blocks"] == 0


async def test_a_pause_longer_than_the_old_window_within_the_grace_loses_nothing(stack: Stack,
                                                                                 reference: list[str]) -> None:
    gateway = stack.gateway("live-pause")
    gone_before = _stat(stack.engine, "gateway_gone_aborted") or 0.0
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            tasks = await _streams_started(session, gateway.url, MAX_TOKENS)

            async def past_the_old_window() -> None:
                await asyncio.sleep(OLD_WINDOW_S + 2)  # the engine is frozen: its clock runs on

            async def engine_saw_it() -> None:
                await past_the_old_window()
                stack.engine.proc.send_signal(signal.SIGCONT)
                thawed = time.time()  # the engine flushes (and probes) again before the gateway is back
                await _until(lambda: _stat(stack.engine, "generation_tokens", thawed) is not None, "a heartbeat")

            await _pause_gateway(stack, gateway, engine_saw_it)
            outcomes = list(await asyncio.gather(*tasks))
    finally:
        gateway.stop()
    whole = [o.done and o.error is None and o.tokens == MAX_TOKENS and o.text == ref
             for o, ref in zip(outcomes, reference, strict=True)]
    assert sum(whole) == COUNT, [(o.error, len(o.text)) for o in outcomes]
    since = time.time()
    await _until(lambda: _drained(stack.engine, since), "the engine to hold nothing")
    assert _stat(stack.engine, "gateway_gone_aborted") == gone_before


async def _plain(session: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    """A non-streaming request, long enough to be running when the engine is frozen."""
    body = {"model": MODEL, "prompt": "a plain request", "max_tokens": LONG_TOKENS, "temperature": 0,
            "ignore_eos": True}
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        return resp.status, await resp.json()


def _queued(stack: Stack) -> int:
    with stack.client() as client:
        return int(client.xlen(KEYS.requests(MODEL))) + sum(
            int(client.xlen(m)) for m in client.smembers(KEYS.routed_streams(MODEL)))


async def _past_the_grace(stack: Stack, gateway: GatewayProcess, lose_notices: bool,
                          plain: list[tuple[int, Any]] | None = None) -> tuple[list[Outcome], float]:
    """With `plain`, a non-streaming request runs along (submitted first) and its answer is appended."""
    engine = stack.engine
    gone_before = _stat(engine, "gateway_gone_aborted") or 0.0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        whole_task = None
        if plain is not None:
            whole_task = asyncio.create_task(_plain(session, gateway.url))
            await _until(lambda: _queued(stack) >= 1, "the plain request on the stream")
        tasks = await _streams_started(session, gateway.url)

        async def past_the_grace() -> None:
            await asyncio.sleep(GRACE_S + 2)  # the engine is frozen: its clock runs on
            engine.proc.send_signal(signal.SIGCONT)
            since = time.time()
            await _until(lambda: (_stat(engine, "gateway_gone_aborted", since) or 0) > gone_before,
                         "the engine to end the gone gateway's requests")
            await _until(lambda: _drained(engine, time.time()), "the engine to hold nothing")
            if lose_notices:
                with stack.client() as client:
                    client.delete(KEYS.out(gateway.gateway_id))

        await _pause_gateway(stack, gateway, past_the_grace)
        outcomes = list(await asyncio.gather(*tasks))
        if whole_task is not None and plain is not None:
            plain.append(await whole_task)
    return outcomes, (_stat(engine, "gateway_gone_aborted") or 0.0) - gone_before


def _same_start(text: str, ref: str) -> bool:
    """Greedy text cut at any length starts as the reference does; the last characters of the
    shorter may be an incomplete UTF-8 sequence (the byte tokenizer), so they are not compared."""
    n = max(0, min(len(text), len(ref)) - 3)
    return text[:n] == ref[:n]


def _count_errors(outcomes: list[Outcome], reference: list[str], code: str) -> tuple[int, int]:
    """(whole, ended with `code`); every outcome must be one of the two, ended with [DONE]."""
    whole = errors = 0
    for out, ref in zip(outcomes, reference, strict=True):
        assert out.done and not out.dropped, out  # [DONE] came: the stream ended, it did not hang
        assert _same_start(out.text, ref), (out.text[:80], ref[:80])
        if out.error is None:
            assert out.text == ref and out.tokens == MAX_TOKENS, out
            whole += 1
        else:
            assert out.error == code, out
            errors += 1
    return whole, errors


async def test_a_pause_past_the_grace_ends_each_stream_with_an_error_event(stack: Stack,
                                                                           reference: list[str]) -> None:
    gateway = stack.gateway("live-gone")
    try:
        plain: list[tuple[int, Any]] = []
        outcomes, aborted = await _past_the_grace(stack, gateway, lose_notices=False, plain=plain)
    finally:
        gateway.stop()
    whole, errors = _count_errors(outcomes, reference, "gateway_gone")
    [(status, body)] = plain
    print(f"past the grace: {whole} whole, {errors} gateway_gone, engine aborted {aborted:.0f}; plain {status}")
    assert status == 503 and body["error"]["code"] == "gateway_gone", (status, body)
    assert errors + 1 == aborted == COUNT + 1 and whole == 0, (whole, errors, aborted)
    since = time.time()
    await _until(lambda: _drained(stack.engine, since), "the engine's blocks back on the free list")


async def test_lost_abort_notices_end_each_stream_by_the_watchdog(stack: Stack, reference: list[str]) -> None:
    gateway = stack.gateway("live-lost")
    try:
        outcomes, aborted = await _past_the_grace(stack, gateway, lose_notices=True)
    finally:
        gateway.stop()
    whole, errors = _count_errors(outcomes, reference, "request_lost")
    print(f"notices lost: {whole} whole, {errors} request_lost, engine aborted {aborted:.0f}")
    assert errors == aborted == COUNT and whole == 0, (whole, errors, aborted)


async def test_a_gateway_restarted_under_its_id_stops_the_old_requests_at_once(stack: Stack,
                                                                             reference: list[str]) -> None:
    engine = stack.engine
    old = stack.gateway("live-restart")
    restarted_before = _stat(engine, "gateway_restart_aborted") or 0.0
    tokens_before = _stat(engine, "generation_tokens") or 0.0
    new: GatewayProcess | None = None
    key = KEYS.gateway(old.gateway_id)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            tasks = await _streams_started(session, old.url)
            engine.proc.send_signal(signal.SIGSTOP)  # nothing can finish while the gateway is replaced
            try:
                with stack.client() as client:
                    old_token = client.get(key)
                    old.kill()
                    new = GatewayProcess(stack.redis.url, old.gateway_id, stack.log_dir)
                    await _until(lambda: client.get(key) not in (None, old_token), "the new process's token")
            finally:
                engine.proc.send_signal(signal.SIGCONT)
            since = time.time()
            await _until(lambda: (_stat(engine, "gateway_restart_aborted", since) or 0) - restarted_before >= COUNT,
                         "the engine to stop the old process's requests")
            await _until(lambda: _drained(engine, time.time()), "the engine to hold nothing")
            generated = (_stat(engine, "generation_tokens") or 0.0) - tokens_before
            old_outcomes = list(await asyncio.gather(*tasks))
            new.wait_healthy()
            new_outcomes = await _all(new.url)
    finally:
        old.stop()
        if new is not None:
            new.stop()
    assert sum(o.dropped for o in old_outcomes) == COUNT, old_outcomes  # their gateway died under them
    print(f"restart: {sum(o.dropped for o in old_outcomes)} old streams dropped, {generated:.0f} tokens generated "
          f"for them (of {COUNT * LONG_TOKENS}), {len(new_outcomes)} new requests")
    assert generated < COUNT * LONG_TOKENS / 2, generated  # the old requests did not run on to max_tokens
    assert (_stat(engine, "gateway_restart_aborted") or 0.0) - restarted_before == COUNT
    assert [o.text for o in new_outcomes] == reference
    assert all(o.done and o.error is None and o.tokens == MAX_TOKENS for o in new_outcomes)
