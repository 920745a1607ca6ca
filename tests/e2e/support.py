"""End-to-end test support: real engine processes (`python -m engine.cli engine`), in-process
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

from engine.launch.redis_server import free_port
from engine.protocol import EngineHeartbeat, Keys
from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.state import BROKER

ROOT = Path(__file__).resolve().parents[2]


class EngineProcess:
    """`pagedserve engine` as a child process, logging to a file."""

    def __init__(self, model: Path, redis_url: str, engine_id: str, log_dir: Path, *extra: str) -> None:
        self.engine_id = engine_id
        self.redis_url = redis_url
        self.log_path = log_dir / f"{engine_id}.log"
        self.metrics_port = free_port()
        cmd = [sys.executable, "-m", "engine.cli", "engine", "--model", str(model), "--redis-url", redis_url,
               "--engine-id", engine_id, "--metrics-port", str(self.metrics_port), "--metrics-host", "127.0.0.1",
               "--heartbeat-interval", "0.5", *extra]
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})

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
            beat = self.heartbeat()
            assert beat is not None, f"engine {self.engine_id} has no heartbeat"
            stats = beat.stats
            busy = stats["running"] + stats["waiting"] + stats["swapped"] + stats["in_flight"]
            if beat.time >= since and busy == 0 and stats["num_used_blocks"] == 0:
                return stats
            if time.monotonic() > deadline:
                raise AssertionError(f"engine {self.engine_id} not drained: {stats}")
            time.sleep(0.1)

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def kill(self) -> None:
        """SIGKILL: no cleanup at all (its heartbeat expires, its entries stay pending)."""
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


class GatewayProcess:
    """`pagedserve gateway` as a child process on a free port, logging to a file."""

    def __init__(self, redis_url: str, gateway_id: str, log_dir: Path, *extra: str) -> None:
        self.gateway_id = gateway_id
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"{gateway_id}.log"
        cmd = [sys.executable, "-m", "engine.cli", "gateway", "--host", "127.0.0.1", "--port", str(self.port),
               "--gateway-id", gateway_id, "--request-timeout", "300", *extra]
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", "PAGEDSERVE_REDIS_URL": redis_url})

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

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def kill(self) -> None:
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
