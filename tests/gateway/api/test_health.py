"""/health, /v1/models, /metrics, Redis outages, and the gateway's torch-free import."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from pagedserve.launch.redis_server import RedisServer
from tests.fixtures.gateway import MODEL, Gateway, gateway, open_gateway

__all__ = ["gateway"]


async def test_health_503_without_engine(redis_server: str, tiny_tokenizer_dir: Path) -> None:
    async with open_gateway(redis_server, tiny_tokenizer_dir) as gw:
        resp = await gw.client.get("/health")
        assert resp.status == 503
        assert (await resp.json())["error"]["code"] == "no_engine"
        assert (await (await gw.client.get("/v1/models")).json())["data"] == []
        resp = await gw.client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
        assert resp.status == 503
        await gw.engine.beat()
        resp = await gw.client.get("/health")
        assert resp.status == 200
        body = await resp.json()  # who answered and which engines it sees (up's rolling restart waits on both)
        assert body["gateway"] == gw.config.gateway_id and body["engine_ids"] == [gw.engine.engine_id]


async def test_models_lists_live_engines_only(gateway: Gateway) -> None:
    data = (await (await gateway.client.get("/v1/models")).json())["data"]
    assert [(m["id"], m["object"], m["max_model_len"]) for m in data] == [(MODEL, "model", 512)]
    await gateway.redis.hset(gateway.engine.keys.engine("old"), mapping={  # stale heartbeat
        "engine_id": "old", "model": "stale", "tokenizer": "", "max_model_len": "1", "time": "1.0"})
    data = (await (await gateway.client.get("/v1/models")).json())["data"]
    assert [m["id"] for m in data] == [MODEL]


async def test_metrics_text(gateway: Gateway) -> None:
    post = asyncio.create_task(gateway.client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi"}))
    req = await gateway.engine.next_request()
    await gateway.engine.generate(req, ["Hello world"])
    assert (await post).status == 200
    resp = await gateway.client.get("/metrics")
    text = await resp.text()
    assert resp.status == 200 and resp.content_type == "text/plain"
    assert 'pagedserve_request_success_total{finished_reason="stop"} 1.0' in text
    assert "pagedserve_time_to_first_token_seconds_count 1.0" in text
    assert "pagedserve_e2e_request_latency_seconds_bucket" in text


async def test_redis_down_then_restarted(gateway: Gateway, redis_process: RedisServer,
                                         restart_redis: Callable[[], None]) -> None:
    redis_process.stop()
    resp = await gateway.client.get("/health")
    assert resp.status == 503
    assert (await resp.json())["error"]["code"] == "redis_unavailable"
    gateway.client.app[__import__("gateway.state").state.REGISTRY]._cached_at = -1e9  # type: ignore[index]
    resp = await gateway.client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi"})
    assert resp.status == 503
    assert set((await resp.json())["error"]) == {"message", "type", "param", "code"}
    await asyncio.to_thread(restart_redis)
    await gateway.redis.connection_pool.disconnect()  # the test's own client: drop dead sockets
    await gateway.engine.beat()
    await gateway.wait_subscribed(timeout=10)  # the reader reconnects on its own
    assert (await gateway.client.get("/health")).status == 200
    post = asyncio.create_task(gateway.client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi"}))
    gateway.engine.last_id = "0-0"
    req = await gateway.engine.next_request()
    await gateway.engine.generate(req, ["Hello again"])
    resp = await post
    assert resp.status == 200
    assert (await resp.json())["choices"][0]["text"] == "Hello again"


def test_gateway_never_imports_torch() -> None:
    code = ("import sys\n"
            "import gateway.app, gateway.cli, gateway.clients.bench, gateway.clients.chat, gateway.text.tokenizer\n"
            "from gateway.app import create_app\nfrom gateway.config import GatewayConfig\n"
            "create_app(GatewayConfig())\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n"
            "assert 'transformers' not in sys.modules, 'transformers imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True)
