"""The browser pages (`/` chat, `/kv` KV-cache view, their static files) and
`GET /v1/engines/stream`: SSE relaying every live engine's heartbeat figures, block-pool
snapshot and block tables. The pages need no key; the API calls they make carry one."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import Any

from aiohttp import web
from redis.exceptions import RedisError

from common.protocol import EngineHeartbeat
from gateway.api.sse import SSEStream
from gateway.broker.redis_errors import redis_error
from gateway.state import REGISTRY

STATIC_DIR = Path(__file__).resolve().parent / "static"
UI_STOP = web.AppKey("ui_stop", asyncio.Event)
DEFAULT_INTERVAL_S = 0.5
# Same-origin only: the pages never reach another host (no CDN, fonts or analytics).
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; connect-src 'self'; "
                               "base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "Cache-Control": "no-cache",
    "X-Content-Type-Options": "nosniff",
}


def _page(name: str) -> Any:
    async def handler(request: web.Request) -> web.FileResponse:
        return web.FileResponse(STATIC_DIR / name, headers=PAGE_HEADERS)

    return handler


def engine_event(beat: EngineHeartbeat, now: float) -> dict[str, Any]:
    """One engine in a stream event: its figures, pool runs and block tables."""
    return {"engine_id": beat.engine_id, "model": beat.model, "time": beat.time,
            "age_s": round(max(0.0, now - beat.time), 3), "stats": beat.stats,
            "pool": beat.pool, "tables": beat.tables}


def _interval(request: web.Request) -> float:
    try:
        value = float(request.query.get("interval", DEFAULT_INTERVAL_S))
    except ValueError:
        value = DEFAULT_INTERVAL_S
    return min(5.0, max(0.25, value))


async def _snapshot(request: web.Request) -> dict[str, Any]:
    now = time.time()
    try:
        beats = await request.app[REGISTRY].live_engines(refresh=True)
    except RedisError as exc:
        return {"time": now, "engines": [], "error": redis_error(exc)[0]}
    beats = sorted(beats, key=lambda b: b.engine_id)
    return {"time": now, "engines": [engine_event(b, now) for b in beats]}


async def engines_stream(request: web.Request) -> web.StreamResponse:
    """SSE: a snapshot of all live engines every `interval` seconds (0.25–5, default 0.5)
    until the client leaves or the gateway shuts down."""
    interval = _interval(request)
    stop = request.app[UI_STOP]
    stream = await SSEStream(request).start()
    with contextlib.suppress(ConnectionResetError):
        while not stop.is_set():
            await stream.send(await _snapshot(request))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), interval)
        await stream.done()
    return stream.response


async def _stop_streams(app: web.Application) -> None:
    app[UI_STOP].set()


def add_routes(app: web.Application) -> None:
    app[UI_STOP] = asyncio.Event()
    app.on_shutdown.append(_stop_streams)
    app.router.add_get("/", _page("index.html"))
    app.router.add_get("/kv", _page("kv.html"))
    app.router.add_static("/static/", STATIC_DIR, append_version=False)
    app.router.add_get("/v1/engines/stream", engines_stream)
