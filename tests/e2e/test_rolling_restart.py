"""A rolling restart of a real `pagedserve up` under steady streaming load (issue 40): looping
clients stream greedy completions through up's port while SIGHUP makes `up` replace its engine
(replacement first, then SIGTERM: the old one drains and hands back what it still runs) and then
its gateway (a new one on the same port with --reuse-port, then SIGTERM: the old one drains its
streams to their end). Twice, so the second restart goes back to the first engine id. Every
request's outcome is counted: none may fail, and every one must be exactly the text the same
prompt produced before the restart. And a replacement that cannot start (its metrics port held)
leaves the old processes serving. Conditions are polled; no duration is asserted."""

from __future__ import annotations

import asyncio
import re
import signal
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from common.ports import free_port
from common.protocol import Keys
from pagedserve.launch.redis_server import RedisServer
from tests.e2e.faults import MODEL
from tests.e2e.up_support import Load, Up, same_answers

pytestmark = pytest.mark.slow
CLIENTS = 6
KEYS = Keys()
ENGINE_STOP = "stopping the old engine"
GATEWAY_STOP = "stopping the old gateway"


@pytest.fixture
def stack(tiny_llama_dir: Path, tmp_path: Path) -> Iterator[tuple[Up, str]]:
    with RedisServer() as server:
        up = Up(tiny_llama_dir, ["--redis-url", server.url], tmp_path / "up.log")
        try:
            up.wait_for("Ctrl-C stops everything")
            yield up, server.url
        finally:
            code = up.stop()
            assert code == 0, up.text()[-3000:]


async def _restart_under_load(up: Up, load: Load, restarts: int) -> dict[str, int]:
    """SIGHUP `restarts` times (each after the previous one is done) while `load` runs; returns
    the requests open at the moment each old process was told to stop (as seen in up's log)."""
    seen: dict[str, int] = {}
    for n in range(1, restarts + 1):
        up.proc.send_signal(signal.SIGHUP)
        while up.count("rolling restart: done") < n:
            assert up.proc.poll() is None, up.text()[-3000:]
            assert "rolling restart: failed" not in up.text(), up.text()[-3000:]
            for step in (ENGINE_STOP, GATEWAY_STOP):
                key = f"{step} #{n}"
                if key not in seen and up.count(step) >= n:
                    seen[key] = load.open_now
            await asyncio.sleep(0.05)
        await load.progress(2 * CLIENTS, [up])  # the restarted stack serves
    return seen


def _engine_ids(redis_url: str) -> list[str]:
    with redis.Redis.from_url(redis_url) as client:
        found = client.scan_iter(match=KEYS.engine_pattern)  # ps:{e:<id>}:engine
        return sorted(k.decode().split("{e:", 1)[1].rsplit("}:", 1)[0] for k in found)


async def test_rolling_restart_of_up_under_steady_load(stack: tuple[Up, str]) -> None:
    up, redis_url = stack
    reference = await same_answers(up.url)  # the undisturbed run
    assert _engine_ids(redis_url) == ["up-engine-0"]

    load = Load(up.url)
    clients = [asyncio.create_task(load.client(k)) for k in range(CLIENTS)]
    try:
        while len(load.results) < 2 * CLIENTS:
            await asyncio.sleep(0.05)
        in_flight = await _restart_under_load(up, load, restarts=2)
    finally:
        load.stop.set()
        await asyncio.gather(*clients)

    failed = load.failed(reference)
    print(f"\nrolling restart x2 under {CLIENTS} looping clients: {len(load.results)} requests, "
          f"{len(load.results) - len(failed)} identical to the undisturbed run, {len(failed)} not; "
          f"open when each old process was stopped: {in_flight}")
    assert failed == [], failed[:5]
    assert len(in_flight) == 4 and all(n > 0 for n in in_flight.values()), in_flight  # the restarts met load
    log = up.text()
    assert re.findall(r"engine replacement started.*?new='?engine (up-engine-\d)", log) == ["up-engine-1",
                                                                                          "up-engine-0"], log[-3000:]
    assert log.count("old engine exited") == 2 and log.count("old gateway exited") == 2, log[-3000:]
    assert _engine_ids(redis_url) == ["up-engine-0"]  # the old engine left; the second restart came back
    with redis.Redis.from_url(redis_url) as client:  # nothing left queued, pending or checkpointed
        assert client.xlen(KEYS.requests(MODEL)) == 0
        assert not list(client.scan_iter(match=KEYS.progress_pattern))


def _port_pair() -> tuple[int, socket.socket]:
    """A free port N and a socket listening on N+1 (the replacement engine's metrics port)."""
    while True:
        port = free_port()
        blocker = socket.socket()
        try:
            blocker.bind(("0.0.0.0", port + 1))
        except OSError:
            blocker.close()
            continue
        blocker.listen()
        return port, blocker


async def test_a_replacement_that_cannot_start_leaves_the_old_one_serving(tiny_llama_dir: Path,
                                                                         tmp_path: Path) -> None:
    """The replacement engine cannot bind its metrics port (N+1, held by this test): the restart
    stops, the old engine and gateway keep serving the same answers; once the port is free a
    second SIGHUP restarts everything."""
    metrics_port, blocker = _port_pair()
    with RedisServer() as server:
        up = Up(tiny_llama_dir, ["--redis-url", server.url], tmp_path / "up.log", "--metrics-port", str(metrics_port))
        try:
            up.wait_for("Ctrl-C stops everything")
            reference = await same_answers(up.url)
            up.proc.send_signal(signal.SIGHUP)
            await asyncio.to_thread(up.wait_for, "rolling restart: failed")
            log = up.text()
            assert "up-engine-1" in log and "exited with code 1" in log, log[-3000:]
            assert "old engine exited" not in log and "gateway replacement started" not in log, log[-3000:]
            assert _engine_ids(server.url) == ["up-engine-0"]
            await same_answers(up.url, reference)
            blocker.close()
            up.proc.send_signal(signal.SIGHUP)
            await asyncio.to_thread(up.wait_for, "rolling restart: done")
            assert _engine_ids(server.url) == ["up-engine-1"]
            await same_answers(up.url, reference)
        finally:
            blocker.close()
            code = up.stop()
        assert code == 0, up.text()[-3000:]
