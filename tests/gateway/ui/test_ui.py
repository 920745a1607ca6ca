"""The browser pages and `GET /v1/engines/stream`, through aiohttp's test client (no browser)."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

from aiohttp import ClientResponse

from common.engine_set import queue_beat
from common.protocol import EngineHeartbeat
from engine.kv.block_manager import BlockManager
from engine.kv.block_stats import SHARED, USED, block_tables, pool_snapshot
from gateway.clients.sse_reader import sse_data
from gateway.ui.routes import STATIC_DIR
from tests.fixtures.gateway import Gateway, gateway, open_gateway

__all__ = ["gateway"]
KEY = "sk-ui-test"


async def first_event(resp: ClientResponse) -> dict[str, Any]:
    """The first `data:` payload of an SSE response."""
    while True:
        line = await resp.content.readline()
        assert line, "stream ended before an event"
        if isinstance(payload := sse_data(line), dict):
            return payload


def busy_pool() -> tuple[list[list[int]], list[dict[str, Any]]]:
    """A real block manager with a forked request: shared and used blocks, two tables."""
    manager = BlockManager(32, 4, watermark=0.0)
    manager.allocate(7, list(range(9)))  # 3 blocks
    manager.fork(7, 8)
    manager.append_slot(8, 1)  # copy-on-write of the shared last block
    return pool_snapshot(manager), block_tables(manager, [("req-a", 0, 7), ("req-a", 1, 8), ("gone", 0, 99)])


async def test_pages_served_without_key(redis_server: str, tiny_tokenizer_dir: Path) -> None:
    async with open_gateway(redis_server, tiny_tokenizer_dir, api_keys=(KEY,)) as gw:
        for path, script in (("/", "/static/chat.js"), ("/kv", "/static/kv.js")):
            resp = await gw.client.get(path)
            assert resp.status == 200 and resp.content_type == "text/html"
            assert f'src="{script}"' in await resp.text()
            assert "default-src 'self'" in resp.headers["Content-Security-Policy"]
        for name in ("chat.js", "kv.js", "kvdraw.js", "api.js", "style.css"):
            resp = await gw.client.get(f"/static/{name}")
            assert resp.status == 200, name
        assert (await gw.client.get("/static/chat.js")).content_type in ("text/javascript", "application/javascript")
        assert (await gw.client.get("/static/../app.py")).status == 404


def test_static_files_reference_no_other_host() -> None:
    files = sorted(STATIC_DIR.iterdir())
    assert {f.name for f in files} >= {"index.html", "chat.js", "kv.html", "kv.js", "style.css"}
    for path in files:
        text = path.read_text()
        assert not re.search(r"https?://|url\(|@import", text), f"{path.name} reaches outside the gateway"


async def test_engines_stream_needs_the_key(redis_server: str, tiny_tokenizer_dir: Path) -> None:
    async with open_gateway(redis_server, tiny_tokenizer_dir, api_keys=(KEY,)) as gw:
        resp = await gw.client.get("/v1/engines/stream")
        assert resp.status == 401
        assert (await resp.json())["error"]["code"] == "missing_api_key"
        async with gw.client.get("/v1/engines/stream", headers={"Authorization": f"Bearer {KEY}"}) as resp:
            assert resp.status == 200 and resp.content_type == "text/event-stream"
            assert (await first_event(resp))["engines"] == []


async def test_engines_stream_relays_heartbeats(gateway: Gateway) -> None:
    pool, tables = busy_pool()
    beat = EngineHeartbeat(engine_id="kv-0", model="tiny", tokenizer="/tok", max_model_len=512, time=time.time(),
                           stats={"num_blocks": 32.0, "num_used_blocks": 4.0, "preemptions_swap": 1.0}, pool=pool,
                           tables=tables)
    async with gateway.redis.pipeline(transaction=True) as pipe:
        queue_beat(pipe, gateway.engine.keys, beat, 30_000)
        queue_beat(pipe, gateway.engine.keys, EngineHeartbeat(engine_id="old", model="tiny", tokenizer="/tok",
                                                              max_model_len=512, time=time.time() - 3600), 30_000)
        await pipe.execute()
    async with gateway.client.get("/v1/engines/stream?interval=0.25") as resp:
        event = await first_event(resp)
        second = await first_event(resp)
    assert second["time"] > event["time"]
    engines = {e["engine_id"]: e for e in event["engines"]}
    assert set(engines) == {"fake-0", "kv-0"}  # the stale heartbeat is left out
    kv = engines["kv-0"]
    assert kv["pool"] == [[SHARED, 2], [USED, 2], [0, 28]]
    assert sum(run for _, run in kv["pool"]) == 32
    assert kv["stats"]["preemptions_swap"] == 1.0 and kv["age_s"] < 60
    assert kv["tables"] == [
        {"id": "req-a", "index": 0, "host": False, "num_blocks": 3, "runs": [[0, 3]], "released": 0},
        {"id": "req-a", "index": 1, "host": False, "num_blocks": 3, "runs": [[0, 2], [3, 1]], "released": 0},
    ]
