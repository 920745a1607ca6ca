"""End-to-end test support: real engine processes (`python -m pagedserve.cli engine`), in-process
gateways on free ports, and reading an engine's figures from its heartbeat."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import redis
from aiohttp import web

from common.ports import free_port
from common.protocol import EngineHeartbeat, Keys
from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.state import BROKER

ROOT = Path(__file__).resolve().parents[2]


class ChildProcess:
    """A `pagedserve` command as a child process, logging to `log_path`."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([sys.executable, "-m", "pagedserve.cli", *args], cwd=ROOT, stdout=self._log,
                                     stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def kill(self) -> None:
        """SIGKILL: no cleanup at all."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


class EngineProcess(ChildProcess):
    """`pagedserve engine`; a kill -9 leaves its heartbeat to expire and its entries pending."""

    def __init__(self, model: Path, redis_url: str, engine_id: str, log_dir: Path, *extra: str) -> None:
        self.engine_id = engine_id
        self.redis_url = redis_url
        self.metrics_port = free_port()
        super().__init__(["engine", "--model", str(model), "--redis-url", redis_url, "--engine-id", engine_id,
                          "--metrics-port", str(self.metrics_port), "--metrics-host", "127.0.0.1",
                          "--heartbeat-interval", "0.5", "--dtype", "float32", *extra], log_dir / f"{engine_id}.log")

    def wait_ready(self, timeout: float = 120.0) -> EngineProcess:
        deadline = time.monotonic() + timeout
        while self.heartbeat() is None:
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine {self.engine_id} exited: {self.log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine {self.engine_id} not ready: {self.log_tail()}")
            time.sleep(0.1)
        return self

    def heartbeat(self) -> EngineHeartbeat | None:
        with redis.Redis.from_url(self.redis_url) as client:
            raw = client.hgetall(Keys().engine(self.engine_id))
        return EngineHeartbeat.from_hash(raw) if raw else None

    def stats(self) -> dict[str, float]:
        beat = self.heartbeat()
        assert beat is not None, f"engine {self.engine_id} has no heartbeat"
        return beat.stats

    def wait_drained(self, timeout: float = 30.0) -> dict[str, float]:
        """Wait until the engine runs nothing and holds no block; returns its figures. Only a
        heartbeat written after this call counts: an older one may predate the caller's requests."""
        since = time.time()
        deadline = time.monotonic() + timeout
        while True:
            beat = self.heartbeat()  # None for a moment after Redis lost its data: the next beat writes it
            if beat is not None:
                stats = beat.stats
                busy = stats["running"] + stats["waiting"] + stats["swapped"] + stats["in_flight"]
                if beat.time >= since and busy == 0 and stats["num_used_blocks"] == 0:
                    return stats
            if time.monotonic() > deadline:
                raise AssertionError(f"engine {self.engine_id} not drained: {beat.stats if beat else 'no heartbeat'}")
            time.sleep(0.1)


def pending_by_engine(redis_url: str, model: str) -> dict[str, int]:
    """Unacknowledged entries of `model`'s request streams (the shared one and every routed one)
    per consumer (engine id): the requests each engine holds right now, read from Redis rather
    than from a heartbeat that may lag."""
    keys = Keys()
    held: dict[str, int] = {}
    with redis.Redis.from_url(redis_url) as client:
        streams = [keys.requests(model), *sorted(m.decode() for m in client.smembers(keys.routed_streams(model)))]
        for stream in streams:
            if not client.exists(stream):
                continue
            for c in client.xpending(stream, keys.group)["consumers"]:
                held[c["name"].decode()] = held.get(c["name"].decode(), 0) + int(c["pending"])
    return held


def owner_of_most(redis_url: str, model: str, engines: list[EngineProcess]) -> EngineProcess:
    """The engine of `engines` holding the most requests of `model`; it must hold some, or the
    fault about to hit it tests nothing. Freeze the engines first (SIGSTOP) when nothing may end
    between this choice and the fault."""
    owners = pending_by_engine(redis_url, model)
    victim = max(engines, key=lambda e: owners.get(e.engine_id, 0))
    assert owners.get(victim.engine_id, 0) > 0, f"no {model} engine holds a request: {owners}"
    return victim


def start_engines(model: Path, redis_url: str, log_dir: Path, ids: list[str], *extra: str) -> list[EngineProcess]:
    """Start engines in parallel and wait for all heartbeats (stops them all on failure)."""
    engines = [EngineProcess(model, redis_url, engine_id, log_dir, *extra) for engine_id in ids]
    try:
        for engine in engines:
            engine.wait_ready()
    except BaseException:
        for engine in engines:
            engine.stop()
        raise
    return engines


@contextlib.asynccontextmanager
async def serve_gateway(redis_url: str, **overrides: Any) -> AsyncIterator[str]:
    """A gateway app on a free loopback port in this event loop; yields its base URL."""
    port = free_port()
    settings: dict[str, Any] = {"request_timeout_s": 120.0, "sse_ping_s": 1.0, **overrides}
    config = GatewayConfig(host="127.0.0.1", port=port, redis_url=redis_url, **settings)
    app = create_app(config)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", port).start()
        await asyncio.wait_for(app[BROKER].subscribed.wait(), 10)
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


class GatewayProcess(ChildProcess):
    """`pagedserve gateway` on a free loopback port."""

    def __init__(self, redis_url: str, gateway_id: str, log_dir: Path, *extra: str, port: int | None = None) -> None:
        self.gateway_id = gateway_id
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        super().__init__(["gateway", "--host", "127.0.0.1", "--port", str(self.port), "--gateway-id", gateway_id,
                          "--request-timeout", "300", "--drain-timeout", "5", *extra], log_dir / f"{gateway_id}.log",
                         {"PAGEDSERVE_REDIS_URL": redis_url})

    def wait_healthy(self, timeout: float = 120.0) -> GatewayProcess:
        import urllib.error
        import urllib.request

        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                    if resp.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"gateway {self.gateway_id} not healthy: {self.log_tail()}")
            time.sleep(0.2)
