"""A gateway process stopped with SIGTERM drains: it closes its listener at once, so a new
connection is refused (ECONNREFUSED) and a balancer that retries refused connects sends it to a
peer gateway; a request on a connection it already holds is served normally (its response says
``Connection: close``); its open streams run to their end, whole and equal to an undisturbed greedy
run, while /health (on a held connection) says draining; past --drain-timeout what is still open
ends with an error event and [DONE] (an error body when not streaming), never a cut connection;
with --reuse-port a new gateway takes the port over under a steady request loop without one
connection error; behind a connect-retrying client two gateways lose no request when one is
stopped under load. The engine is made slow deterministically with SIGSTOP, never with sleeps."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import signal
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis

from common.ports import free_port
from common.protocol import Keys
from gateway.clients.sse_reader import SSE_DONE, sse_payloads
from pagedserve.launch.redis_server import RedisServer
from tests.e2e.support import EngineProcess, GatewayProcess, serve_gateway, start_engines

MODEL = "tiny"
STREAMS = 30


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, EngineProcess]]:
    """One engine running at most 4 sequences at a time: 30 streams stay open for a while."""
    with RedisServer() as server:
        [engine] = start_engines(tiny_llama_dir, server.url, tmp_path_factory.mktemp("e2e-drain"), ["dr-0"],
                                 "--served-model-name", MODEL, "--kv-cache-memory", "8MiB", "--max-num-seqs", "4")
        try:
            yield server.url, engine
        finally:
            engine.stop()


def _body(prompt: str, max_tokens: int, stream: bool) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream,
            "ignore_eos": True}


async def _stream(session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int,
                  first: asyncio.Event | None = None, headers: dict[str, str] | None = None) -> list[Any]:
    """Every SSE payload of a streamed completion, SSE_DONE included when it came (the response's
    headers into `headers`)."""
    payloads: list[Any] = []
    async with session.post(f"{url}/v1/completions", json=_body(prompt, max_tokens, True)) as resp:
        assert resp.status == 200, await resp.text()
        if headers is not None:
            headers.update(resp.headers)
        async for payload in sse_payloads(resp.content):
            payloads.append(payload)
            if first is not None:
                first.set()
    return payloads


def _text(payloads: list[Any]) -> str:
    return "".join(c["text"] for p in payloads if p != SSE_DONE and "choices" in p for c in p["choices"])


async def _in_flight(session: aiohttp.ClientSession, url: str) -> int:
    async with session.get(f"{url}/metrics") as resp:
        for line in (await resp.text()).splitlines():
            if line.startswith("pagedserve_gateway_requests_in_flight "):
                return int(float(line.split()[1]))
    raise AssertionError("no in-flight gauge")


async def _until(condition: Any, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not await condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def _exit_code(gateway: GatewayProcess, timeout: float = 120.0) -> int:
    code = await asyncio.get_running_loop().run_in_executor(None, gateway.proc.wait, timeout)
    return int(code)


@contextlib.contextmanager
def _frozen(engine: EngineProcess) -> Iterator[None]:
    engine.proc.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        engine.proc.send_signal(signal.SIGCONT)


@contextlib.asynccontextmanager
async def _held_connection(url: str) -> AsyncIterator[aiohttp.ClientSession]:
    """A session whose one keep-alive connection to `url` is open (and idle) on return."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1, keepalive_timeout=3600)) as session:
        async with session.get(f"{url}/health") as resp:
            assert resp.status == 200 and resp.headers.get("Connection", "").lower() != "close"
            await resp.read()
        yield session


def _queued(redis_url: str) -> int:
    """Entries on the model's request streams (shared and routed): requests not ended."""
    keys = Keys()
    with redis.Redis.from_url(redis_url) as client:
        streams = [keys.requests(MODEL), *client.smembers(keys.routed_streams(MODEL))]
        return sum(int(client.xlen(stream)) for stream in streams)


async def _refused(port: int) -> bool:
    """A new TCP connection to the port is refused (an accepted one is closed unused)."""
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except ConnectionRefusedError:
        return True
    writer.close()
    return False


async def test_sigterm_closes_the_listener_and_drains_every_open_stream_whole(
        cluster: tuple[str, EngineProcess], tmp_path: Path) -> None:
    redis_url, engine = cluster
    prompts = [f"drain stream {i} says" for i in range(STREAMS)]
    async with serve_gateway(redis_url) as ref_url, aiohttp.ClientSession() as session:
        reference = [_text(p) for p in await asyncio.gather(*(_stream(session, ref_url, q, 48)
                                                                for q in [*prompts, "late"]))]
    gateway = GatewayProcess(redis_url, "gw-drain", tmp_path, "--drain-timeout", "300").wait_healthy()
    try:
        async with aiohttp.ClientSession() as session:
            tasks = [asyncio.create_task(_stream(session, gateway.url, q, 48)) for q in prompts]

            async def all_submitted() -> bool:
                return await _in_flight(session, gateway.url) + sum(t.done() for t in tasks) == STREAMS

            await _until(all_submitted, "every stream submitted")
            async with _held_connection(gateway.url) as probe, _held_connection(gateway.url) as held:
                with _frozen(engine):
                    open_streams = await _in_flight(session, gateway.url)
                    gateway.proc.send_signal(signal.SIGTERM)

                    await _until(lambda: _refused(gateway.port), "the listener to close")
                    async with probe.get(f"{gateway.url}/health") as resp:  # on a connection opened before
                        assert resp.status == 503 and resp.headers["Connection"] == "close"
                        assert (await resp.json())["error"]["code"] == "draining"
                    # a request on a connection held from before is served, and the connection closed
                    queued = _queued(redis_url)
                    late_headers: dict[str, str] = {}
                    late = asyncio.create_task(_stream(held, gateway.url, "late", 48, headers=late_headers))

                    async def late_submitted() -> bool:
                        return _queued(redis_url) == queued + 1

                    await _until(late_submitted, "the late request submitted")
                results = await asyncio.gather(*tasks, late)
        assert open_streams > 0 and late_headers["Connection"] == "close"
        for payloads, want in zip(results, reference, strict=True):
            assert payloads[-1] == SSE_DONE and not any("error" in p for p in payloads if p != SSE_DONE)
            assert _text(payloads) == want
        assert await _exit_code(gateway) == 0, gateway.log_tail()
    finally:
        gateway.stop()
    engine.wait_drained()


async def test_drain_timeout_ends_open_requests_with_an_error(cluster: tuple[str, EngineProcess],
                                                             tmp_path: Path) -> None:
    redis_url, engine = cluster
    gateway = GatewayProcess(redis_url, "gw-timeout", tmp_path, "--drain-timeout", "1").wait_healthy()
    try:
        async with aiohttp.ClientSession() as session:
            firsts = [asyncio.Event() for _ in range(3)]
            streams = [asyncio.create_task(_stream(session, gateway.url, f"slow {i}", 400, first))
                       for i, first in enumerate(firsts)]

            async def plain() -> tuple[int, Any]:
                async with session.post(f"{gateway.url}/v1/completions", json=_body("slow plain", 400, False)) as r:
                    return r.status, await r.json()

            whole = asyncio.create_task(plain())
            await asyncio.wait_for(asyncio.gather(*(f.wait() for f in firsts)), 120)

            async def all_open() -> bool:
                return await _in_flight(session, gateway.url) == 4

            await _until(all_open, "four open requests")
            with _frozen(engine):  # nothing can finish now: the drain must time out
                gateway.proc.send_signal(signal.SIGTERM)
                results = await asyncio.gather(*streams)
                status, body = await whole
                assert await _exit_code(gateway) == 0, gateway.log_tail()
        for payloads in results:
            assert payloads[-1] == SSE_DONE, payloads[-3:]
            assert payloads[-2]["error"]["code"] == "draining", payloads[-3:]
            assert _text(payloads)  # it had started
        assert status == 503 and body["error"]["code"] == "draining"
    finally:
        gateway.stop()
    engine.wait_drained()  # the engine dropped the abandoned requests


async def test_reuse_port_hand_over_under_a_steady_loop(cluster: tuple[str, EngineProcess], tmp_path: Path) -> None:
    redis_url, _ = cluster
    port = free_port()
    old = GatewayProcess(redis_url, "gw-old", tmp_path, "--reuse-port", port=port).wait_healthy()
    new: GatewayProcess | None = None
    errors: list[str] = []
    done = 0
    stop = asyncio.Event()

    async def worker(k: int) -> None:
        nonlocal done
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
            i = 0
            while not stop.is_set():
                i += 1
                try:
                    if i % 2:
                        payloads = await _stream(session, old.url, f"loop {k} {i}", 8)
                        if payloads[-1] != SSE_DONE or any("error" in p for p in payloads if p != SSE_DONE):
                            errors.append(f"stream: {payloads[-2:]}")
                    else:
                        async with session.post(f"{old.url}/v1/completions",
                                                json=_body(f"loop {k} {i}", 8, False)) as resp:
                            if resp.status != 200:
                                errors.append(f"{resp.status}: {await resp.text()}")
                    done += 1
                except (aiohttp.ClientError, AssertionError, OSError) as exc:
                    errors.append(f"{type(exc).__name__}: {exc}")

    async def served(n: int) -> bool:
        return done >= n

    workers = [asyncio.create_task(worker(k)) for k in range(3)]
    try:
        await _until(lambda: served(10), "requests through the old gateway")
        new = GatewayProcess(redis_url, "gw-new", tmp_path, "--reuse-port", port=port)

        async def new_listening() -> bool:
            assert new is not None and new.proc.poll() is None, new.log_tail() if new else ""
            return "listening" in new.log_tail(100_000)

        await _until(new_listening, "the new gateway to listen")
        old.proc.send_signal(signal.SIGTERM)
        assert await _exit_code(old) == 0, old.log_tail()
        after = done
        await _until(lambda: served(after + 10), "requests through the new gateway")
    finally:
        stop.set()
        await asyncio.gather(*workers)
        old.stop()
        if new is not None:
            new.stop()
    assert errors == []


def _connect_refused(exc: BaseException) -> bool:
    """The connect itself was refused: the request never reached a gateway."""
    os_error = getattr(exc, "os_error", None)
    return isinstance(exc, aiohttp.ClientConnectorError) and getattr(os_error, "errno", None) == errno.ECONNREFUSED


@dataclass
class _Balancer:
    """A client like nginx in front of gateways: request number `turn` goes to gateway `turn` mod
    their number, and to the next one only when its connect is refused; any other error is a
    failure."""

    urls: list[str]
    refused: dict[str, int] = field(default_factory=dict)  # url -> connects refused there
    served: dict[str, int] = field(default_factory=dict)  # url -> requests answered there
    async def stream(self, session: aiohttp.ClientSession, turn: int, prompt: str, max_tokens: int) -> list[Any]:
        for i in range(len(self.urls)):
            url = self.urls[(turn + i) % len(self.urls)]
            try:
                payloads = await _stream(session, url, prompt, max_tokens)
            except aiohttp.ClientConnectorError as exc:
                if not _connect_refused(exc):
                    raise
                self.refused[url] = self.refused.get(url, 0) + 1
                continue
            self.served[url] = self.served.get(url, 0) + 1
            return payloads
        raise AssertionError("every gateway refused the connection")


async def test_a_stopped_gateway_behind_a_retrying_balancer_fails_nothing(
        cluster: tuple[str, EngineProcess], tmp_path: Path) -> None:
    """Two gateways, one engine; SIGTERM one under load: its in-flight streams end whole, new
    requests are refused at connect and land on the peer, it exits 0 by itself, no request fails."""
    redis_url, engine = cluster
    loops, held_prompts = [f"balanced loop {k}" for k in range(6)], [f"held stream {i}" for i in range(3)]
    async with serve_gateway(redis_url) as ref_url, aiohttp.ClientSession() as session:
        texts = [_text(p) for p in await asyncio.gather(*(_stream(session, ref_url, q, 16) for q in loops),
                                                         *(_stream(session, ref_url, q, 200) for q in held_prompts))]
    reference = dict(zip([*loops, *held_prompts], texts, strict=True))
    stopped = GatewayProcess(redis_url, "gw-stopped", tmp_path, "--drain-timeout", "300").wait_healthy()
    peer = GatewayProcess(redis_url, "gw-peer", tmp_path, "--drain-timeout", "300").wait_healthy()
    balancer = _Balancer([stopped.url, peer.url])
    errors: list[str] = []
    done = [0] * len(loops)
    stop = asyncio.Event()

    async def loop(k: int) -> None:  # half on keep-alive connections, half on a new one each time
        connector = aiohttp.TCPConnector(force_close=k % 2 == 1)
        async with aiohttp.ClientSession(connector=connector) as session:
            while not stop.is_set():
                try:
                    payloads = await balancer.stream(session, k + done[k], loops[k], 16)
                    if payloads[-1] != SSE_DONE or _text(payloads) != reference[loops[k]]:
                        errors.append(f"loop {k}: {payloads[-2:]}")
                except (aiohttp.ClientError, AssertionError, OSError) as exc:
                    errors.append(f"loop {k}: {type(exc).__name__}: {exc}")
                done[k] += 1

    async def each_loop_did(n: list[int]) -> bool:
        return all(d >= m for d, m in zip(done, n, strict=True))

    workers = [asyncio.create_task(loop(k)) for k in range(len(loops))]
    try:
        await _until(lambda: each_loop_did([2] * len(loops)), "requests through both gateways")
        async with aiohttp.ClientSession() as session:
            firsts = [asyncio.Event() for _ in held_prompts]
            held = [asyncio.create_task(_stream(session, stopped.url, q, 200, first))
                    for q, first in zip(held_prompts, firsts, strict=True)]
            await asyncio.wait_for(asyncio.gather(*(f.wait() for f in firsts)), 120)
            with _frozen(engine):  # the held streams cannot end: the stopped gateway must wait for them
                stopped.proc.send_signal(signal.SIGTERM)
                await _until(lambda: _refused(stopped.port), "the stopped gateway's listener to close")
                assert stopped.proc.poll() is None
            held_results = await asyncio.gather(*held)
        assert await _exit_code(stopped) == 0, stopped.log_tail()
        after = list(done)  # each loop's next two requests: one goes to the stopped gateway first
        await _until(lambda: each_loop_did([d + 2 for d in after]), "requests after the stop")
    finally:
        stop.set()
        await asyncio.gather(*workers)
        stopped.stop()
        peer.stop()
    assert errors == []
    for payloads, prompt in zip(held_results, held_prompts, strict=True):
        assert payloads[-1] == SSE_DONE and not any("error" in p for p in payloads if p != SSE_DONE)
        assert _text(payloads) == reference[prompt]
    assert balancer.refused.get(stopped.url, 0) >= len(loops) and balancer.served.get(peer.url, 0) > 0
    engine.wait_drained()
