"""Server-sent events as OpenAI sends them: ``data: {json}\\n\\n`` … ``data: [DONE]\\n\\n``.

Every write has a deadline: a client that stops reading fills the socket buffers, and a write
that cannot drain within `write_timeout_s` raises `SlowClient` instead of pinning the handler
(and the request's KV blocks) forever."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web

SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "Connection": "keep-alive",
    "X-Accel-Buffering": "no",
}


class SlowClient(ConnectionResetError):
    """A write did not drain within the write timeout: the client stopped reading. The
    connection is aborted, so callers treat it as any connection the client reset."""


class SSEStream:
    """A streaming response with typed writes, prepared by `start()`."""

    def __init__(self, request: web.Request, write_timeout_s: float = 30.0) -> None:
        self.request = request
        self.response = web.StreamResponse(status=200, headers=SSE_HEADERS)
        self.write_timeout_s = write_timeout_s
        self.started = False

    async def start(self) -> SSEStream:
        await self.response.prepare(self.request)
        self.started = True
        return self

    async def send(self, obj: dict[str, Any], event: str | None = None) -> None:
        """One event; `event` names it in an ``event:`` line (the Responses API's events do)."""
        data = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
        head = f"event: {event}\n" if event else ""
        await self._write(f"{head}data: {data}\n\n".encode())

    async def comment(self) -> None:
        """An SSE comment (``: keepalive``): for proxies that cut idle connections. Off by default,
        since clients that strip each chunk glue it to the next event and lose that event."""
        await self._write(b": keepalive\n\n")

    async def done(self) -> None:
        await self._write(b"data: [DONE]\n\n")
        await self.end()

    async def end(self) -> None:
        """End the stream without ``[DONE]`` (a Responses stream ends with its last event)."""
        await self.response.write_eof()

    async def _write(self, data: bytes) -> None:
        try:
            await asyncio.wait_for(self.response.write(data), self.write_timeout_s)
        except asyncio.TimeoutError as exc:
            if self.request.transport is not None:
                self.request.transport.abort()  # drop what is buffered: the client is not reading it
            raise SlowClient(f"client read nothing for {self.write_timeout_s} s") from exc
