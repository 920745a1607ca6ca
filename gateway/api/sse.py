"""Server-sent events as OpenAI sends them: ``data: {json}\\n\\n`` … ``data: [DONE]\\n\\n``."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "Connection": "keep-alive",
    "X-Accel-Buffering": "no",
}


class SSEStream:
    """A prepared streaming response with typed writes."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.response = web.StreamResponse(status=200, headers=SSE_HEADERS)

    async def start(self) -> SSEStream:
        await self.response.prepare(self.request)
        return self

    async def send(self, obj: dict[str, Any]) -> None:
        data = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
        await self.response.write(f"data: {data}\n\n".encode())

    async def ping(self) -> None:
        """An SSE comment: keeps proxies from timing out and detects a gone client."""
        await self.response.write(b": ping\n\n")

    async def done(self) -> None:
        await self.response.write(b"data: [DONE]\n\n")
        await self.response.write_eof()
