"""Reading an OpenAI-style SSE response on the client side: the one parser of `data:` lines that
`pagedserve bench`, `pagedserve chat`, the tests and the benchmarks share."""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator
from typing import Any

import aiohttp

SSE_DONE = "[DONE]"  # the payload of the stream's last line, `data: [DONE]`


def sse_data(line: bytes | str) -> Any | None:
    """The payload of one SSE line: the decoded JSON of a `data: ...` line, `SSE_DONE` for
    `data: [DONE]`, None for anything else (comments, blank lines, other fields)."""
    text = (line.decode() if isinstance(line, bytes) else line).strip()
    if not text.startswith("data:"):
        return None
    payload = text[5:].strip()
    return SSE_DONE if payload == SSE_DONE else json.loads(payload)


def parse_sse(text: str) -> list[Any]:
    """Every payload of a whole SSE body, `SSE_DONE` included, in order."""
    return [payload for line in text.splitlines() if (payload := sse_data(line)) is not None]


async def sse_payloads(lines: AsyncIterable[bytes]) -> AsyncIterator[Any]:
    """Every payload of a streamed SSE body (e.g. aiohttp's `resp.content`), ending with `SSE_DONE`
    when the server sent it."""
    async for raw in lines:
        payload = sse_data(raw)
        if payload is not None:
            yield payload
            if payload == SSE_DONE:
                return


async def sse_events(resp: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
    """The JSON object of every `data:` line, until `data: [DONE]`; comments are skipped."""
    async for payload in sse_payloads(resp.content):
        if payload == SSE_DONE:
            return
        yield payload
