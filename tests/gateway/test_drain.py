"""`Drain`: counting open requests and the drain's two endings (all done in time; the rest failed
on the broker at the timeout). New requests are refused at the TCP level (the listener is
closed, tests/e2e/test_gateway_drain.py), never by the drain."""

from __future__ import annotations

import asyncio
from typing import Any

from common.protocol import ErrorInfo
from gateway.drain import DRAIN_CODE, Drain


class _Broker:
    """What `Drain.run` uses of a broker: fail_all and forget, recorded."""

    def __init__(self, drain: Drain, release: asyncio.Event) -> None:
        self.failed: list[ErrorInfo] = []
        self.forgotten: list[Any] = []
        self.release = release

    def fail_all(self, error: ErrorInfo, model: str | None = None) -> list[str]:
        self.failed.append(error)
        self.release.set()  # the failed request's handler answers and ends
        return ["r1"]

    async def forget(self, collectors: list[Any]) -> None:
        self.forgotten.extend(collectors)


async def _one_open_request() -> tuple[Drain, asyncio.Event, asyncio.Task[None]]:
    """A Drain with one tracked request open until the returned event is set."""
    drain = Drain()
    release = asyncio.Event()

    async def request() -> None:
        with drain.track():
            await release.wait()

    task = asyncio.create_task(request())
    await asyncio.sleep(0)
    assert drain.active == 1
    return drain, release, task


async def test_an_idle_gateway_drains_at_once() -> None:
    drain = Drain()
    assert not drain.draining
    assert await drain.run(_Broker(drain, asyncio.Event()), 30.0) == 0  # type: ignore[arg-type]
    assert drain.draining


async def test_open_requests_finish_within_the_timeout() -> None:
    drain, release, task = await _one_open_request()
    broker = _Broker(drain, asyncio.Event())
    running = asyncio.create_task(drain.run(broker, 300.0))  # type: ignore[arg-type]
    await asyncio.sleep(0)
    assert drain.draining and not running.done()
    release.set()
    assert await running == 0 and broker.failed == []
    await task


async def test_the_timeout_fails_what_is_open() -> None:
    drain, release, task = await _one_open_request()
    broker = _Broker(drain, release)
    assert await drain.run(broker, 0.0) == 1  # type: ignore[arg-type]
    assert [e.code for e in broker.failed] == [DRAIN_CODE] and broker.failed[0].type == "service_unavailable"
    assert broker.forgotten == ["r1"] and drain.active == 0
    await task
