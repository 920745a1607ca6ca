"""A gateway's drain (SIGTERM): by the time it starts the listener is closed (`gateway.serve`), so
what still reaches this gateway comes on a connection accepted before; it is served, and every
response says ``Connection: close``. The open requests run to their end for up to `timeout_s`;
what is left then fails with an error the client sees (an SSE error event and ``[DONE]`` on a
stream, an error body otherwise), never a cut connection.

The drain does not stop the watch task: the liveness key stays fresh until the app's cleanup,
so engines keep serving this gateway's requests while it drains."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator

from aiohttp import web
from redis.exceptions import RedisError

from common.log import get_logger
from common.protocol import ErrorInfo
from gateway.broker.broker import Broker

log = get_logger("gateway.drain")
DRAIN_CODE = "draining"
SETTLE_S = 10.0  # how long failed requests get to write their error and end, after the timeout


class Drain:
    """Open generation requests of one gateway, and whether it is draining."""

    def __init__(self) -> None:
        self.draining = False
        self.active = 0
        self._idle = asyncio.Event()
        self._idle.set()

    async def close_connections(self, request: web.Request, response: web.StreamResponse) -> None:
        """`on_response_prepare`: while draining every response says ``Connection: close``, so a
        keep-alive client reconnects: refused here, it goes to another gateway (or the new one on
        a shared port)."""
        if self.draining:  # aiohttp runs this hook after it chose the Connection header: set both
            response.force_close()
            response.headers["Connection"] = "close"

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        """Count one generation request as open while the block runs."""
        self.active += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.active -= 1
            if self.active == 0:
                self._idle.set()

    async def _wait_idle(self, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), max(0.0, timeout_s))
        except asyncio.TimeoutError:
            return False
        return True

    async def run(self, broker: Broker, timeout_s: float) -> int:
        """Drain: wait up to `timeout_s` for the open requests, then fail the rest on `broker`
        and give them SETTLE_S to answer. Returns how many were failed at the timeout."""
        self.draining = True
        start = time.monotonic()
        log.info("draining", open_requests=self.active, timeout_s=timeout_s)
        if await self._wait_idle(timeout_s):
            log.info("drained", seconds=round(time.monotonic() - start, 2))
            return 0
        failed = broker.fail_all(ErrorInfo(f"the gateway shut down before the request finished "
                                           f"(drain timeout {timeout_s:g} s); retry", "service_unavailable",
                                           DRAIN_CODE))
        log.warning("drain timeout: failing open requests", requests=len(failed), open_requests=self.active)
        try:
            await broker.forget(failed)
        except (RedisError, OSError) as exc:  # the engines abort them when this gateway's key lapses
            log.warning("could not delete the failed requests' entries", error=str(exc))
        if not await self._wait_idle(SETTLE_S):
            log.error("requests still open after the drain timeout", open_requests=self.active)
        return len(failed)
