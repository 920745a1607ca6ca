"""Reading an OpenAI-style SSE response on the client side (`pagedserve bench` and `chat`)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp


async def sse_events(resp: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
    """The JSON object of every `data:` line, until `data: [DONE]`; comments are skipped."""
    async for raw in resp.content:
        line = raw.decode().strip()
        if line == "data: [DONE]":
            return
        if line.startswith("data: "):
            yield json.loads(line[6:])
